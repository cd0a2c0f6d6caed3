"""The workload that broke, against a real ``python -m mlx_lm.server``.

The server runs as a separate process on 127.0.0.1 and gets the fix only
through the package's start-up hook, as a user's server would. mlx-lm 0.31.2
has no ``--kv-bits`` server flag, so there the quantized scenarios are not
defined: that server never quantizes.
"""

import json
import re
import threading
import time

from concurrent.futures import ThreadPoolExecutor

import pytest

from mlx_lm_mla import tiny

from conftest import SWAPAXES
from serving import (
    SYSTEM,
    RequestFailed,
    Server,
    Stream,
    cached_tokens,
    chat_body,
    four_clients,
    hang_up,
    post_json,
    questions,
    raw_post,
    served_as_fresh,
    server_supports,
    status_lines,
)

NAN, INF = float("nan"), float("inf")
# Streams whose texts differ from each other and run to max_tokens.
DISTINCT = {"presence_penalty": 2.0, "logit_bias": {"1": -100}}
# A sampler of the request's own that samples as greedy does (greedy itself
# is one sampler shared by every row of a batch).
OWN_SAMPLER = {"temperature": 1e-4}

KV_BITS = [4, 8] if server_supports("--kv-bits") else []
START = 64  # --quantized-kv-start, crossed by every request below


def kv_flags(bits):
    return ["--kv-bits", bits, "--quantized-kv-start", START] if bits else []


def serve_sequentially(server, n, max_tokens):
    """n requests one after another, every third one streamed."""
    results = []
    for i, q in enumerate(questions(n)):
        results.append(server.chat(q, max_tokens=max_tokens, stream=i % 3 == 0))
    return results


if KV_BITS:  # defined only where the server has the flag, not skipped

    @pytest.mark.soak
    @pytest.mark.parametrize("bits", KV_BITS)
    def test_sixty_sequential_requests_with_kv_quantization_all_succeed(
        bits, model_path
    ):
        with Server(model_path, "--decode-concurrency", 4, *kv_flags(bits)) as server:
            results = serve_sequentially(server, 60, max_tokens=200)
        assert all(len(text) > 0 for text, _ in results)
        assert all(cached_tokens(usage) > 0 for _, usage in results[1:])

    @pytest.mark.parametrize("bits", KV_BITS)
    def test_without_the_package_the_server_fails_the_same_workload(bits, model_path):
        with Server(
            model_path, "--decode-concurrency", 4, *kv_flags(bits), disabled=True
        ) as server:
            failures = 0
            for q in questions(3):
                try:
                    server.chat(q, max_tokens=20)
                except RequestFailed:
                    failures += 1
            log = server.output(tail=None)
        # each request fails, and with the reported error
        assert failures == 3 and log.count(SWAPAXES) >= 3, log[-3000:]


def test_prompt_cache_and_batching_do_not_change_greedy_outputs(model_path):
    with Server(model_path, "--decode-concurrency", 4) as server:
        cached = serve_sequentially(server, 8, max_tokens=60)
    with Server(
        model_path, "--decode-concurrency", 4, "--prompt-cache-size", 0
    ) as server:
        fresh = serve_sequentially(server, 8, max_tokens=60)
    assert [t for t, _ in cached] == [t for t, _ in fresh]
    assert all(cached_tokens(u) > 0 for _, u in cached[1:])
    assert all(cached_tokens(u) == 0 for _, u in fresh)


@pytest.mark.parametrize("bits", [None, *KV_BITS[:1]])
def test_four_concurrent_clients_are_all_served(bits, model_path):
    with Server(model_path, "--decode-concurrency", 4, *kv_flags(bits)) as server:
        served, errors = four_clients(server, per_client=4, max_tokens=80)
    assert errors == [] and len(served) == 16


def test_cache_prompt_false_neither_reuses_nor_stores(model_path):
    q0, q1 = "Alpha: name three sorting algorithms.", "Zulu: what is a hash map?"
    with Server(model_path, "--decode-concurrency", 4) as server:
        server.chat(q0, max_tokens=20)
        _, skipped = server.chat(q1, max_tokens=20, cache_prompt=False)
        _, after = server.chat(q1, max_tokens=20)
        _, again = server.chat(q1, max_tokens=20)
    assert cached_tokens(skipped) == 0
    # had the skipped request been stored, `after` would reuse all of it
    assert 0 < cached_tokens(after) < cached_tokens(again)


def test_a_client_that_disconnects_mid_stream_leaves_nothing_corrupted(model_path):
    checks = questions(12)[-3:]
    with Server(
        model_path, "--decode-concurrency", 4, "--prompt-cache-size", 0
    ) as server:
        expected = [server.chat(q, max_tokens=40)[0] for q in checks]
    with Server(model_path, "--decode-concurrency", 4) as server:
        for q in questions(3):
            server.abandon_stream(q, max_tokens=400, after_bytes=300)
        got = [server.chat(q, max_tokens=40)[0] for q in checks]
    assert got == expected


def completion(server, prompt, **extra):
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0.0, **extra}
    status, reply = post_json(server.port, "/v1/completions", body)
    assert status == 200, reply
    return reply


HI = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    ("/v1/completions", {"prompt": ""}, "prompt"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "stop": [5]},
        "stop",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "stop": 5},
        "stop",
    ),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"999999": 5}}, "logit_bias"),
    # Values only the sampler itself refuses, and values that are not numbers.
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "temperature": 0.7,
            "top_k": 1000000,
        },
        "top_k",
    ),
    (
        "/v1/completions",
        {
            "prompt": "hi",
            "temperature": 0.7,
            "xtc_probability": 0.5,
            "xtc_threshold": 0.6,
        },
        "xtc_",
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "temperature": 0.7,
            "min_p": NAN,
        },
        "min_p",
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "xtc_probability": 0.5, "xtc_threshold": NAN},
        "xtc_threshold",
    ),
    ("/v1/completions", {"prompt": "hi", "temperature": INF}, "temperature"),
    (
        "/v1/completions",
        {"prompt": "hi", "repetition_penalty": -INF},
        "repetition_penalty",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": NAN}},
        "logit_bias",
    ),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 1e39}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "temperature": 0.7, "seed": -1}, "seed"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": {"text": "hi"}}]},
        "messages[0].content",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"text": "hi"}]}]},
        "messages[0].content[0]",
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 2**70},
        "max_tokens must be at most",
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 163840},
        "max_tokens must be at most",
    ),  # the context
    # Fields upstream reads as objects or lists: it fails later on others.
    (
        "/v1/chat/completions",
        {"messages": HI, "stream": True, "stream_options": "usage"},
        "stream_options must be an object, not a string",
    ),
    (
        "/v1/chat/completions",
        {"messages": HI, "stream": True, "stream_options": {"include_usage": 1}},
        "stream_options.include_usage must be true or false, not int",
    ),
    ("/v1/chat/completions", {"messages": HI, "tools": "abc"}, "tools must be a list"),
    (
        "/v1/chat/completions",
        {"messages": HI, "chat_template_kwargs": "x"},
        "chat_template_kwargs must be an object, not a string",
    ),
    (
        "/v1/chat/completions",
        {"messages": HI, "chat_template_kwargs": {"tokenize": False}},
        "chat_template_kwargs must not set tokenize: the server sets it",
    ),
    (
        "/v1/chat/completions",
        {"messages": HI, "chat_template_kwargs": {"conversation": HI}},
        "chat_template_kwargs must not set conversation: the server sets it",
    ),
    (
        "/v1/chat/completions",
        {"messages": HI, "chat_template_kwargs": {"continue_final_message": True}},
        "chat_template_kwargs.continue_final_message cannot be true",
    ),
    # A JSON bool where mlx-lm reads an integer: its check takes it for one.
    (
        "/v1/chat/completions",
        {"messages": HI, "logprobs": True, "top_logprobs": True},
        "top_logprobs must be an integer",
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": True},
        "max_tokens must be an integer",
    ),
    (
        "/v1/chat/completions",
        {"messages": HI, "max_completion_tokens": True},
        "max_completion_tokens must be an integer",
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "temperature": 0.7, "top_k": True},
        "top_k must be an integer",
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "num_draft_tokens": True},
        "num_draft_tokens must be an integer",
    ),
    (
        "/v1/chat/completions",
        {"messages": HI, "repetition_penalty": 1.2, "repetition_context_size": True},
        "repetition_context_size must be an integer",
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "presence_penalty": 0.5, "presence_context_size": True},
        "presence_context_size must be an integer",
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "frequency_penalty": 0.5, "frequency_context_size": True},
        "frequency_context_size must be an integer",
    ),
    (
        "/v1/chat/completions",
        {"messages": HI, "temperature": 0.7, "seed": True},
        "seed must be an integer",
    ),
    # Values float() cannot take: upstream's TypeError was a 500.
    (
        "/v1/completions",
        {"prompt": "hi", "logit_bias": {"5": None}},
        'logit_bias["5"] must be a number',
    ),
    (
        "/v1/chat/completions",
        {"messages": HI, "logit_bias": {"5": [1]}},
        'logit_bias["5"] must be a number',
    ),
]


@pytest.fixture(scope="module")
def refused(model_path):
    """The answers to BAD_REQUESTS and to a body that is not UTF-8, sent while
    three streams decode; and those streams, and what they decode alone."""
    long = {"max_tokens": 300, "cache_prompt": False, **DISTINCT}  # greedy
    with Server(model_path, "--decode-concurrency", 4) as server:
        expected = [server.chat(q, **long)[0] for q in questions(3)]
        streams = [Stream(server, q, **long) for q in questions(3)]
        for s in streams:
            s.start()
        for s in streams:
            s.started.wait()  # its first token: it is decoding
        # All at once, so that every one arrives while the streams decode.
        with ThreadPoolExecutor(len(BAD_REQUESTS) + 1) as pool:
            utf8 = pool.submit(
                raw_post, server.port, "/v1/completions", b'{"prompt": "\xff\xfe"}'
            )
            answers = list(
                pool.map(lambda r: post_json(server.port, r[0], r[1]), BAD_REQUESTS)
            )
            not_utf8 = utf8.result()
        # Valid JSON nested deeper than json's decoder can follow.
        deep = b'{"prompt": "hi", "metadata": ' + b"[" * 5000 + b"]" * 5000 + b"}"
        too_deep = raw_post(server.port, "/v1/completions", deep)
        for s in streams:
            s.join()
    return dict(
        answers=answers,
        not_utf8=not_utf8,
        too_deep=too_deep,
        served=[s.text for s in streams],
        errors=[s.error for s in streams if s.error],
        expected=expected,
    )


@pytest.mark.parametrize(
    "i", range(len(BAD_REQUESTS)), ids=[f for _, _, f in BAD_REQUESTS]
)
def test_a_bad_field_gets_400_naming_it_in_mlx_lms_error_body(i, refused):
    status, reply = refused["answers"][i]
    assert status == 400 and list(reply) == ["error"], reply
    assert BAD_REQUESTS[i][2] in reply["error"]


def test_a_body_that_is_not_utf8_gets_400(refused):
    reply = refused["not_utf8"]
    assert status_lines(reply) == ["HTTP/1.0 400 Bad Request"]
    body = json.loads(reply.split(b"\r\n\r\n", 1)[1])
    assert list(body) == ["error"] and body["error"].startswith(
        "request body is not valid UTF-8"
    )


def test_a_refusal_carries_the_cors_headers_stock_gives_its_replies(refused):
    # --allowed-origins defaults to "*": a browser client can read the 400.
    head = refused["not_utf8"].split(b"\r\n\r\n", 1)[0].decode()
    assert "\r\nAccess-Control-Allow-Origin: *\r\n" in head + "\r\n"
    assert "\r\nContent-type: application/json\r\n" in head + "\r\n"


def test_a_body_nested_too_deeply_to_parse_gets_400(refused):
    reply = refused["too_deep"]
    assert status_lines(reply) == ["HTTP/1.0 400 Bad Request"]
    body = json.loads(reply.split(b"\r\n\r\n", 1)[1])
    assert body == {"error": "request body is nested too deeply to parse"}


def test_stream_options_without_include_usage_streams_without_usage(model_path):
    body = chat_body("hi", max_tokens=8, stream=True)
    unset = [{}, {"include_usage": None}]
    with Server(model_path) as server:
        replies = [
            raw_post(server.port, "/v1/chat/completions", json.dumps(b).encode())
            for b in [dict(body, stream_options=o) for o in unset] + [body]
        ]
        # Upstream reads stream_options only when streaming.
        unread = dict(body, stream=False, stream_options="x")
        status, _ = post_json(server.port, "/v1/chat/completions", unread)
    streams = [r.split(b"\r\n\r\n", 1)[1].decode() for r in replies]
    for stream in streams[:2]:
        assert stream.rstrip().endswith("data: [DONE]") and '"error"' not in stream
        assert _texts(stream) == _texts(streams[2])
    assert status == 200


def _texts(stream):
    return [
        c["delta"].get("content")
        for line in stream.splitlines()
        if line.startswith("data: {")
        for c in json.loads(line[6:])["choices"]
    ]


def test_requests_in_flight_beside_bad_ones_complete_as_alone(refused):
    assert refused["errors"] == [] and sorted(refused["served"]) == sorted(
        refused["expected"]
    )


@pytest.fixture(scope="module")
def fresh(model_path):
    """What a fresh server answers: three streams alone, and the requests
    a failure must not change (greedy, sampled, seeded; streamed and not)."""
    with Server(model_path, "--decode-concurrency", 4) as server:
        solo = [
            server.chat(q, max_tokens=60, **DISTINCT, **OWN_SAMPLER)[0]
            for q in questions(3)
        ]
        return {"solo": solo, "served": served_as_fresh(server, questions(2))}


REFUSED_INSIDE_A_SAMPLER = [  # mlx-lm raises these inside a compiled sampler
    {"temperature": 0.7, "top_k": 1000000},
    {"temperature": 0.7, "xtc_probability": 0.5, "xtc_threshold": 0.6},
]


def test_after_a_refused_sampling_value_the_next_requests_are_served_as_on_a_fresh_server(
    model_path, fresh
):
    with Server(model_path, "--decode-concurrency", 4) as server:
        after = []
        for bad in REFUSED_INSIDE_A_SAMPLER:
            for path in ("/v1/completions", "/v1/chat/completions"):
                body = {
                    "prompt": "hi",
                    "messages": [{"role": "user", "content": "hi"}],
                    **bad,
                }
                status, _ = post_json(server.port, path, body)
                after.append((status, served_as_fresh(server, questions(2))))
    assert after == [(400, fresh["served"])] * len(after)


def test_a_request_whose_sampler_fails_in_a_batch_ends_alone_and_the_others_decode_as_alone(
    model_path, fresh
):
    # One row's sampler, ~13 steps in.
    with Server(model_path, "--decode-concurrency", 4, faults="sample:40") as server:
        streams = [
            Stream(server, q, max_tokens=60, **DISTINCT, **OWN_SAMPLER)
            for q in questions(3)
        ]
        for s in streams:
            s.start()
        for s in streams:
            s.join()
        after = served_as_fresh(server, questions(2))
    failed = [s for s in streams if s.error is not None]
    assert len(failed) == 1 and "InjectedFault" in failed[0].error, [
        s.error for s in streams
    ]
    assert all(
        s.text == fresh["solo"][i] for i, s in enumerate(streams) if s.error is None
    )
    assert after == fresh["served"]


def test_a_bool_top_logprobs_beside_a_decoding_request_leaves_its_answer_as_alone(
    model_path,
):
    # Upstream takes the bool for an int; the batch it joined failed at its
    # first reply, every request in it with the same error.
    q = questions(1)[0]
    long = {"max_tokens": 400, "cache_prompt": False, **DISTINCT}  # greedy
    bad = {"messages": HI, "max_tokens": 4, "logprobs": True, "top_logprobs": True}
    with Server(model_path, "--decode-concurrency", 4) as server:
        alone = server.chat(q, **long)[0]
        beside = Stream(server, q, **long)
        beside.start()
        beside.started.wait()  # its first token: it is decoding
        post_json(server.port, "/v1/chat/completions", bad)
        beside.join()
    assert beside.error is None and beside.text == alone


def test_an_out_of_vocabulary_logit_bias_changes_no_later_answer(model_path):
    with Server(model_path, "--decode-concurrency", 4) as server:
        before = completion(server, "Alpha beta gamma", cache_prompt=False)
        post_json(
            server.port,
            "/v1/completions",
            {"prompt": "x", "logit_bias": {"200000": 100}},
        )
        after = completion(server, "Alpha beta gamma", cache_prompt=False)
    assert after["choices"][0]["text"] == before["choices"][0]["text"]


def test_cache_prompt_false_is_honoured_on_text_completions(model_path):
    prompt = SYSTEM + " Zulu: what is a hash map?"
    with Server(model_path, "--decode-concurrency", 4) as server:
        skipped = completion(server, prompt, cache_prompt=False)
        after = completion(server, prompt)
    assert cached_tokens(skipped["usage"]) == 0
    assert cached_tokens(after["usage"]) == 0  # nothing of the skipped one was stored


def test_cache_prompt_false_marks_its_own_request_only(model_path):
    # Two requests sharing the system prompt, one of them not to be stored.
    a, b = "Alpha: name three sorting algorithms.", "Bravo: what is a hash map?"
    with Server(model_path, "--decode-concurrency", 4) as server:
        results = {}
        threads = [
            threading.Thread(
                target=lambda: results.update(
                    a=server.chat(a, max_tokens=30, cache_prompt=False)
                )
            ),
            threading.Thread(
                target=lambda: results.update(b=server.chat(b, max_tokens=30))
            ),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        _, a_again = server.chat(a, max_tokens=30)
        _, b_again = server.chat(b, max_tokens=30)
    assert cached_tokens(results["a"][1]) == 0
    # b was stored whole; of a, only what it shares with b (the system prompt)
    assert cached_tokens(a_again) < cached_tokens(b_again)
    assert cached_tokens(b_again) >= b_again["prompt_tokens"] - 1


def test_a_failure_in_a_non_streamed_request_gets_one_http_status(model_path):
    body = {"prompt": "Alpha beta gamma", "max_tokens": 20, "temperature": 0.0}
    with Server(model_path, "--decode-concurrency", 4, faults="decode:3") as server:
        failed = raw_post(server.port, "/v1/completions", json.dumps(body).encode())
        status, after = post_json(server.port, "/v1/completions", body)
    assert status_lines(failed) == ["HTTP/1.0 500 Internal Server Error"]
    assert b"InjectedFault" in failed
    assert status == 200 and after["choices"][0]["text"]


def test_a_request_whose_client_leaves_stops_and_the_others_decode_as_alone(
    model_path, fresh, tmp_path
):
    log = tmp_path / "server.log"
    huge = {  # never ends by itself: end of text is never sampled
        "messages": [{"role": "user", "content": questions(5)[4]}],
        "max_tokens": 100000,
        "temperature": 0.0,
        "logit_bias": {"1": -100},
    }
    with Server(model_path, "--decode-concurrency", 4, log=log) as server:
        streams = [
            Stream(server, q, max_tokens=60, **DISTINCT, **OWN_SAMPLER)
            for q in questions(3)
        ]
        for s in streams:
            s.start()
        # Each client leaves once its request is generating.
        hang_up(
            server.port, huge, linger=1.0
        )  # not streamed: nothing is written until the end
        hang_up(server.port, {**huge, "stream": True}, after_bytes=300, linger=1.0)
        closed = time.time()
        for s in streams:
            s.join()
        while (
            time.time() - closed < 20
            and log.read_text().count("its client is gone") < 2
        ):
            time.sleep(0.2)
        after = served_as_fresh(server, questions(2))
    cancelled = re.findall(
        r"cancelled the request (\S+) from \S+ after (\d+) tokens: its client is gone",
        log.read_text(),
    )
    assert [path for path, _ in cancelled] == ["/v1/chat/completions"] * 2
    assert all(int(n) < 2000 for _, n in cancelled), cancelled  # of 100000 asked for
    assert [s.text for s in streams] == fresh["solo"] and after == fresh["served"]


if KV_BITS:  # defined only where the server has the flag, not skipped

    def test_a_request_for_a_model_not_loaded_is_served_as_its_own_server_serves_it(
        model_path, tmp_path
    ):
        # --kv-bits quantizes a per-head model's cache only served alone: a
        # request naming it while an MLA model is batched is checked again
        # once its model is loaded (the loop queues it anew), and served alone.
        other = tiny.save_model(tmp_path / "qwen2", "qwen2")
        flags = ["--kv-bits", 4, "--quantized-kv-start", 0]
        body = {
            "prompt": "Name three rivers of the north and of the south. " * 4,
            "max_tokens": 8,
            "temperature": 0.0,
            "logprobs": True,  # the cache's precision shows in them
        }

        def logprobs(port, **fields):
            status, reply = post_json(port, "/v1/completions", {**body, **fields})
            assert status == 200, reply
            return [t["logprob"] for t in reply["choices"][0]["logprobs"]["content"]]

        with Server(other, *flags) as server:
            alone = logprobs(server.port)
        with Server(model_path, *flags) as server:
            logprobs(server.port)  # the MLA model, loaded first
            switched = logprobs(server.port, model=str(other))
        assert len(switched) == len(alone) == 8
        assert max(abs(a - b) for a, b in zip(alone, switched)) < 1e-4

    def short_chat(server, user):
        """A greedy request short enough to stay below --quantized-kv-start alone."""
        body = {
            "messages": [{"role": "user", "content": user}],
            "max_tokens": 40,
            "temperature": 0.0,
            "logit_bias": {"1": -100},  # runs to max_tokens
        }
        status, reply = post_json(server.port, "/v1/chat/completions", body)
        assert status == 200, reply
        return reply["choices"][0]["message"]["content"], reply["usage"][
            "prompt_tokens"
        ]

    def test_a_long_prompt_beside_short_streams_changes_none_of_their_texts(model_path):
        flags = [
            "--kv-bits",
            4,
            "--quantized-kv-start",
            START,
            "--decode-concurrency",
            4,
            "--prompt-cache-size",
            0,
        ]
        shorts = ["A", "B", "C"]
        long_text = (SYSTEM * 40)[:4096]
        with Server(model_path, *flags) as server:
            alone = [short_chat(server, q) for q in shorts]
            # The long one is generating, its row quantized, when the short ones join.
            long = Stream(server, long_text, max_tokens=120, logit_bias={"1": -100})
            long.start()
            long.started.wait()  # its first token, or its error: set either way
            assert long.error is None, long.error  # it decodes as the others join
            beside = [None] * len(shorts)

            def run(i):
                beside[i] = short_chat(server, shorts[i])

            threads = [
                threading.Thread(target=run, args=(i,)) for i in range(len(shorts))
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            long.join()
        assert all(n + 40 < START for _, n in alone)  # alone, they stay exact
        assert long.error is None and beside == alone


def test_a_request_served_alone_whose_client_leaves_stops(model_path, tmp_path):
    # A seed takes the request out of the batch: the server serves it alone.
    log = tmp_path / "server.log"
    body = {
        "messages": [{"role": "user", "content": questions(1)[0]}],
        "max_tokens": 100000,
        "temperature": 0.7,
        "seed": 3,
        "logit_bias": {"1": -100},
    }
    with Server(model_path, log=log) as server:
        hang_up(server.port, body, linger=1.0)
        text, _ = server.chat(questions(2)[1], max_tokens=8, timeout=60)
    cancelled = re.findall(
        r"cancelled the request \S+ from \S+ after (\d+) tokens", log.read_text()
    )
    assert len(cancelled) == 1 and int(cancelled[0]) < 2000 and text


def test_a_drafting_server_reuses_its_prompt_caches_and_answers_as_without(
    model_path,
):
    # Speculative decoding leaves the draft model's caches behind, and the
    # model's a token short where it hands out its last token unread.
    drafting = ("--draft-model", model_path, "--num-draft-tokens", 3)
    again = SYSTEM + " Again."
    asks = [(SYSTEM, 10)] * 2 + [(again, 12)] * 2 + [(again, 5)] * 2
    runs = {
        "uncached": (("--prompt-cache-size", 0), False),
        "stock": ((), True),
        "package": ((), False),
    }
    texts, cached = {}, {}
    for name, (flags, disabled) in runs.items():
        with Server(model_path, *drafting, *flags, disabled=disabled) as server:
            got = [server.chat(q, max_tokens=n) for q, n in asks]
        texts[name] = [text for text, _ in got]
        cached[name] = [cached_tokens(usage) for _, usage in got]
    assert texts["package"] == texts["uncached"]
    assert cached["package"] == cached["stock"] and min(cached["package"][1:]) > 0


def test_the_servers_own_max_tokens_past_the_context_is_served_as_stock_serves_it(
    tmp_path,
):
    # A 64-token context: the prompt leaves fewer than the server's 60 tokens.
    path = tiny.save_model(
        tmp_path / "short", "glm4_moe_lite", max_position_embeddings=64
    )
    body = chat_body("hi")  # no max_tokens: the server's --max-tokens applies
    answers = {}
    for disabled in (True, False):
        with Server(path, "--max-tokens", 60, disabled=disabled) as server:
            answers[disabled] = post_json(server.port, "/v1/chat/completions", body)
            refused = post_json(
                server.port, "/v1/chat/completions", dict(body, max_tokens=60)
            )
    status, reply = answers[False]
    assert status == 200 and reply["usage"]["prompt_tokens"] + 60 > 64
    assert reply["choices"] == answers[True][1]["choices"]
    # The client's own max_tokens past the context is still refused.
    assert refused[0] == 400 and "max_tokens must be at most" in refused[1]["error"]
