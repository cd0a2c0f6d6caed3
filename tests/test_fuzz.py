"""Odd values in every field of both endpoints, each sent while three
streams are in flight: the odd request gets 200 or a 4xx, never a failure
of anyone's batch; the streams end with the text they give alone; and the
next sampled request is served (no random state left broken)."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from serving import (
    Server,
    Stream,
    questions,
    raw_post,
    status_lines,
)

NAN, INF = float("nan"), float("inf")
OUT_OF_VOCABULARY = 100_000  # the tiny model has 256 tokens
VALUES = ["x", NAN, INF, -INF, -1, 0, 10**12, OUT_OF_VOCABULARY, ""]
EMPTY = {str: "", list: [], dict: {}}

# field: the extra fields it needs to take effect (temperature for a sampler).
SAMPLED = {"temperature": 0.7}
FIELDS = {
    "temperature": {},
    "top_p": SAMPLED,
    "top_k": SAMPLED,
    "min_p": SAMPLED,
    "xtc_probability": SAMPLED,
    "xtc_threshold": {**SAMPLED, "xtc_probability": 0.5},
    "repetition_penalty": {},
    "repetition_context_size": {"repetition_penalty": 1.2},
    "presence_penalty": {},
    "presence_context_size": {"presence_penalty": 0.5},
    "frequency_penalty": {},
    "frequency_context_size": {"frequency_penalty": 0.5},
    "logit_bias": {},
    "logit_bias id": {},
    "max_tokens": {},
    "top_logprobs": {"logprobs": True},
    "logprobs": {},
    "seed": SAMPLED,
    "stop": {},
    "num_draft_tokens": {},
    "stream": {},
    "messages": {},  # /v1/chat/completions only
    "prompt": {},  # /v1/completions only
}


def stream_args(k):
    """Stream k: a text of its own, to the end of max_tokens."""
    return {"max_tokens": 240, "logit_bias": {"1": -100, str(40 + 20 * k): 2.0}}


# Every request here has a logits processor (a logit_bias on the end-of-text
# token): mlx-lm 0.31.2's BatchGenerator misaligns the rows' processors when
# rows with and without them share a batch, with or without this package
# (README, Known limits).
EOS = {"1": -100}
WAVE = 4  # odd requests at once: the server takes new requests every half second


def odd_request(i, field, value):
    """(path, body): case i alternates the endpoints and streaming."""
    chat = field == "messages" or (field != "prompt" and i % 2 == 0)
    body = {"max_tokens": 4, "stream": i % 4 < 2, "logit_bias": EOS, **FIELDS[field]}
    body.update(
        {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    )
    if field == "logit_bias":
        body["logit_bias"] = {**EOS, "5": value}
    elif field == "logit_bias id":
        body["logit_bias"] = {**EOS, str(value): 1.0}
    elif field in ("messages", "prompt") and value == "":
        body[field] = EMPTY[list] if field == "messages" else ""
    else:
        body[field] = value
    if field == "max_tokens":
        body["stream"] = True  # a huge one is hung up on; the server stops it
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


def answer(port, path, body):
    """(status, whether the reply carries an error)."""
    reply = raw_post(port, path, json.dumps(body).encode(), timeout=60, limit=4_000)
    status = int(status_lines(reply)[0].split()[1])
    return status, b'"error"' in reply.split(b"\r\n\r\n", 1)[-1]


def odd_then_sampled(port, i, field, value):
    """The odd request, then a sampled one: what went wrong, or None."""
    status, error = answer(port, *odd_request(i, field, value))
    if not (status == 200 and not error or 400 <= status < 500):
        return f"{field}={value!r}: HTTP {status}" + (" with an error" if error else "")
    sampled = {
        "prompt": "Alpha",
        "max_tokens": 2,
        "temperature": 0.7,
        "logit_bias": EOS,
    }
    status, error = answer(port, "/v1/completions", sampled)
    if status != 200 or error:
        return f"after {field}={value!r}: a sampled request got HTTP {status}"
    return None


@pytest.mark.soak
def test_odd_values_in_every_field_harm_no_stream_and_the_next_sampled_request_is_served(
    model_path,
):
    cases = [(field, v) for field in FIELDS for v in VALUES]
    problems, i = [], 0
    with (
        Server(model_path, "--decode-concurrency", 8) as server,
        ThreadPoolExecutor(WAVE) as pool,
    ):
        alone = [
            server.chat(q, **stream_args(k))[0] for k, q in enumerate(questions(3))
        ]
        while i < len(cases):
            streams = [
                Stream(server, q, **stream_args(k)) for k, q in enumerate(questions(3))
            ]
            for s in streams:
                s.start()
            for s in streams:
                s.started.wait()  # its first token, or its error: set either way
            sent = i
            # Waves of odd requests while all three streams are decoding.
            while i < len(cases) and all(s.is_alive() for s in streams):
                wave = [
                    (i + k, *cases[i + k]) for k in range(min(WAVE, len(cases) - i))
                ]
                problems += [
                    p
                    for p in pool.map(lambda c: odd_then_sampled(server.port, *c), wave)
                    if p
                ]
                i += len(wave)
            for s in streams:
                s.join()
            problems += [
                f"stream {k}: {s.error or 'not the text it gives alone'}"
                for k, s in enumerate(streams)
                if s.text != alone[k]
            ]
            if i == sent:  # the streams ended before a wave: they would again
                problems.append(f"the streams ended before odd request {i} was sent")
                break
    assert problems == []
