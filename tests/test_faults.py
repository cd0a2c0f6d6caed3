"""A fault in any cache operation, a prefill chunk, a decode step or one
request's sampler ends the request it hits with a clear error, and the
server then serves the next requests exactly as a fresh server does:
greedy, sampled without a seed and sampled with a seed, streamed and not
(see mlx_lm_mla/testing/faults.py)."""

import threading
import time

import pytest

from serving import (
    RequestFailed,
    Server,
    questions,
    served_as_fresh,
    server_supports,
)

BATCHED = ["--decode-concurrency", 4]
QUANTIZED = ["--kv-bits", 4, "--quantized-kv-start", 64]
POINTS = [
    ("update_and_fetch", BATCHED),
    ("prefill", BATCHED),
    ("decode", BATCHED),
    ("trim", BATCHED),
    ("merge", BATCHED),
    ("extract", BATCHED),
    ("filter", BATCHED),
    ("extend", BATCHED),
    ("sample", BATCHED),
]
if server_supports("--kv-bits"):
    POINTS.append(("to_quantized", QUANTIZED))

CHECKS = questions(30)[-5:]  # the five requests after the fault


@pytest.fixture(scope="module")
def expected(model_path):
    """What a server without faults answers to the five check requests."""
    answers = {}
    for flags in (BATCHED, QUANTIZED if server_supports("--kv-bits") else None):
        if flags is not None:
            with Server(model_path, *flags) as server:
                answers[tuple(flags)] = (
                    [server.chat(q, max_tokens=24)[0] for q in CHECKS],
                    served_as_fresh(server, CHECKS),
                )
    return answers


def pairs_until_a_failure(server, **extra):
    """Two requests at a time: a long one, and a short one that joins its
    running batch (extend) and finishes first (filter)."""
    failures = []

    def run(q, n):
        try:
            server.chat(q, max_tokens=n, stream=n > 20, **extra)
        except RequestFailed as e:
            failures.append(str(e))

    for k in range(4):
        long = threading.Thread(target=run, args=(questions(8)[2 * k], 200))
        short = threading.Thread(target=run, args=(questions(8)[2 * k + 1], 8))
        long.start()
        time.sleep(0.1)
        short.start()
        long.join()
        short.join()
        if failures:
            break
    return failures


@pytest.mark.parametrize("point,flags", POINTS, ids=[p for p, _ in POINTS])
def test_a_fault_fails_one_request_and_the_next_are_served_as_on_a_fresh_server(
    point, flags, model_path, expected
):
    with Server(model_path, *flags, faults=f"{point}:1") as server:
        # A request's own sampler (greedy is one shared sampler for all rows).
        failures = pairs_until_a_failure(
            server, **({"temperature": 0.8} if point == "sample" else {})
        )
        after = (
            [server.chat(q, max_tokens=24)[0] for q in CHECKS],
            served_as_fresh(server, CHECKS),
        )
    assert failures and all("InjectedFault" in f for f in failures), failures
    assert after == expected[tuple(flags)]
