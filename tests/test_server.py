"""The workload that broke, against a real ``python -m mlx_lm.server``.

The server runs as a separate process on 127.0.0.1 and gets the fix only
through the package's start-up hook, as a user's server would. mlx-lm 0.31.2
has no ``--kv-bits`` server flag, so there the quantized scenarios are not
defined: that server never quantizes.
"""

import threading

import pytest

from serving import RequestFailed, Server, cached_tokens, questions, save_served_model, server_supports

KV_BITS = [4, 8] if server_supports("--kv-bits") else []
START = 64  # --quantized-kv-start, crossed by every request below


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return save_served_model(tmp_path_factory.mktemp("served") / "glm")


def kv_flags(bits):
    return ["--kv-bits", bits, "--quantized-kv-start", START] if bits else []


def serve_sequentially(server, n, max_tokens):
    """n requests one after another, every third one streamed."""
    results = []
    for i, q in enumerate(questions(n)):
        results.append(server.chat(q, max_tokens=max_tokens, stream=i % 3 == 0))
    return results


if KV_BITS:  # defined only where the server has the flag, not skipped

    @pytest.mark.parametrize("bits", KV_BITS)
    def test_sixty_sequential_requests_with_kv_quantization_all_succeed(bits, model_path):
        with Server(model_path, "--decode-concurrency", 4, *kv_flags(bits)) as server:
            results = serve_sequentially(server, 60, max_tokens=200)
        assert all(len(text) > 0 for text, _ in results)
        assert all(cached_tokens(usage) > 0 for _, usage in results[1:])

    @pytest.mark.parametrize("bits", KV_BITS)
    def test_without_the_package_the_server_fails_the_same_workload(bits, model_path):
        with Server(model_path, "--decode-concurrency", 4, *kv_flags(bits), disabled=True) as server:
            failures = 0
            for q in questions(3):
                try:
                    server.chat(q, max_tokens=20)
                except RequestFailed:
                    failures += 1
        assert failures == 3


def test_prompt_cache_and_batching_do_not_change_greedy_outputs(model_path):
    with Server(model_path, "--decode-concurrency", 4) as server:
        cached = serve_sequentially(server, 8, max_tokens=60)
    with Server(model_path, "--decode-concurrency", 4, "--prompt-cache-size", 0) as server:
        fresh = serve_sequentially(server, 8, max_tokens=60)
    assert [t for t, _ in cached] == [t for t, _ in fresh]
    assert all(cached_tokens(u) > 0 for _, u in cached[1:])
    assert all(cached_tokens(u) == 0 for _, u in fresh)


@pytest.mark.parametrize("bits", [None, *KV_BITS[:1]])
def test_four_concurrent_clients_are_all_served(bits, model_path):
    errors, served = [], []

    def client(k):
        for q in questions(4 * k + 4)[4 * k :]:
            try:
                served.append(server.chat(q, max_tokens=80, stream=k % 2 == 0))
            except RequestFailed as e:
                errors.append(str(e))

    with Server(model_path, "--decode-concurrency", 4, *kv_flags(bits)) as server:
        threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
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
    with Server(model_path, "--decode-concurrency", 4, "--prompt-cache-size", 0) as server:
        expected = [server.chat(q, max_tokens=40)[0] for q in checks]
    with Server(model_path, "--decode-concurrency", 4) as server:
        for q in questions(3):
            server.abandon_stream(q, max_tokens=400, after_bytes=300)
        got = [server.chat(q, max_tokens=40)[0] for q in checks]
    assert got == expected
