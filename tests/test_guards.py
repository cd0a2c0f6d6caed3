"""Guards on the cross-request path (LRUPromptCache), for any model type."""

import copy
import os
import resource
import socket
from argparse import Namespace
from queue import Queue

import mlx.core as mx
import pytest
import mlx_lm.models.cache as cache_module
from mlx_lm.models.cache import ArraysCache, KVCache
from mlx_lm.server import ResponseGenerator

from mlx_lm_mla.guards import cancellation
from mlx_lm_mla import tiny
from mlx_lm_mla.guards.recovery import TRIES
from mlx_lm_mla.guards.requests import _vocabulary, context_length
from mlx_lm_mla.guards.reuse import cache_problem, drafted_length

from conftest import latent_kv, mistral3_of

TOKENS = list(range(10, 30))


def kv_cache(n):
    c = KVCache()
    c.update_and_fetch(mx.zeros((1, 2, n, 8)), mx.zeros((1, 2, n, 8)))
    return [c]


def latent_cache(n):
    """A quantized latent cache of n tokens."""
    return [latent_kv(n).to_quantized(64, 8)]


def test_exact_hit_leaves_one_token_to_process(installed):
    store = cache_module.LRUPromptCache()
    store.insert_cache("m", TOKENS, latent_cache(len(TOKENS)))
    cache, rest = store.fetch_nearest_cache("m", TOKENS)
    assert rest == TOKENS[-1:] and cache[0].offset == len(TOKENS) - 1


def test_exact_hit_on_a_cache_that_cannot_trim_starts_fresh(installed):
    store = cache_module.LRUPromptCache()
    state = ArraysCache(size=1)
    state[0] = mx.zeros((1, 4))
    store.insert_cache("m", TOKENS, [state])
    cache, rest = store.fetch_nearest_cache("m", TOKENS)
    assert cache is None and rest == TOKENS


def test_upstream_exact_hit_gives_an_empty_remainder(stock):
    # what the guard prevents: mlx_lm.server's generation thread dies on this
    store = cache_module.LRUPromptCache()
    store.insert_cache("m", TOKENS, kv_cache(len(TOKENS)))
    assert store.fetch_nearest_cache("m", TOKENS)[1] == []


def test_entry_that_does_not_hold_its_key_is_evicted(installed, caplog):
    store = cache_module.LRUPromptCache()
    store.insert_cache("m", TOKENS[:10], latent_cache(10))
    store._trie.get("m", TOKENS[:10]).prompt_cache[0].trim(3)  # damaged in place
    cache, rest = store.fetch_nearest_cache("m", TOKENS)
    assert cache is None and rest == TOKENS
    assert len(store) == 0 and store.nbytes == 0
    assert (
        "evicted a bad prompt cache entry: layer 0: QuantizedLatentCache holds 7 tokens, expected 10"
        in caplog.text
    )


def test_a_partial_cache_is_never_stored(installed, caplog):
    store = cache_module.LRUPromptCache()
    store.insert_cache("m", TOKENS, kv_cache(len(TOKENS) - 4))
    assert len(store) == 0
    assert "refused to store a prompt cache" in caplog.text


def test_a_shorter_entry_is_reused_with_the_rest_to_process(installed):
    store = cache_module.LRUPromptCache()
    store.insert_cache("m", TOKENS[:12], latent_cache(12))
    cache, rest = store.fetch_nearest_cache("m", TOKENS)
    assert rest == TOKENS[12:] and cache[0].offset == 12


def test_cache_problem_names_a_list_where_an_array_belongs():
    c = kv_cache(3)[0]
    c.keys = [c.keys, c.keys, c.keys]  # the shape a half-done quantization leaves
    problem = cache_problem([c], 3)
    # mlx-lm 0.31's KVCache.state already trips over the list; 0.32's does not
    assert problem.startswith("layer 0: KVCache.") and "list" in problem


def test_cache_problem_accepts_a_good_cache(installed):
    assert cache_problem(latent_cache(5), 5) is None


class OtherLibraryCache:
    """A cache class mlx-lm does not define (mlx-vlm's, a custom one)."""

    def __init__(self, n):
        self.n = n

    @property
    def nbytes(self):
        return self.n

    def is_trimmable(self):
        return False


def test_a_cache_of_a_class_mlx_lm_does_not_define_is_stored(installed):
    store = cache_module.LRUPromptCache()
    store.insert_cache("m", TOKENS[:5], [OtherLibraryCache(5)])
    assert len(store) == 1 and store.nbytes == 5
    cache, rest = store.fetch_nearest_cache("m", TOKENS)
    assert cache[0].n == 5 and rest == TOKENS[5:]


def test_an_exact_hit_on_an_empty_prompt_gets_upstreams_answer(installed):
    store = cache_module.LRUPromptCache()
    store.insert_cache("m", [], kv_cache(0))
    cache, rest = store.fetch_nearest_cache("m", [])
    assert cache is not None and rest == []


class FailingProvider:
    """A model provider whose default model cannot load: every start of the
    generation loop fails the same way."""

    cli_args = Namespace()  # as mlx-lm's, which has the server's command line

    def __init__(self):
        self.tries = 0

    def load_default(self):
        self.tries += 1
        raise RuntimeError("cannot load the default model")


class LoadingProvider:
    cli_args = Namespace()

    def load_default(self):
        pass


def test_a_failing_request_is_answered_and_the_loop_goes_on(installed):
    generator = ResponseGenerator(LoadingProvider(), cache_module.LRUPromptCache())
    try:
        for _ in range(TRIES + 1):  # more than a repeating failure is given
            reply = Queue()
            generator.requests.put((reply, None, None))  # no arguments: it fails
            assert isinstance(reply.get(timeout=10), Exception)
        assert generator._generation_thread.is_alive()
    finally:
        generator.stop_and_join()


if hasattr(
    ResponseGenerator, "generation_available"
):  # mlx-lm 0.32 reports a dead thread

    def test_a_failure_that_repeats_ends_in_upstreams_dead_thread_state(installed):
        provider = FailingProvider()
        generator = ResponseGenerator(provider, cache_module.LRUPromptCache())
        generator._generation_thread.join(timeout=10)
        assert not generator._generation_thread.is_alive()
        assert provider.tries == TRIES and not generator.generation_available()


def test_a_no_store_request_s_tokens_neither_fetch_nor_store(installed):
    from mlx_lm_mla.guards.reuse import NoStore

    store = cache_module.LRUPromptCache()
    store.insert_cache("m", TOKENS, latent_cache(len(TOKENS)))
    tokens = NoStore(TOKENS + [40])
    assert store.fetch_nearest_cache("m", tokens) == (None, tokens)
    key = tokens[:]  # the server slices and extends the prompt into its keys
    key.append(41)
    store.insert_cache("m", key, latent_cache(len(key)))
    assert len(store) == 1 and store.fetch_nearest_cache("m", list(key))[1] == [40, 41]


def test_a_client_is_not_taken_for_gone_when_no_descriptor_is_left(high_descriptors):
    ours, peer = socket.socketpair()
    with ours, peer:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        lowest = next(fd for fd in range(soft) if not _open(fd))
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest, hard))
        try:  # no new descriptor can be made now
            gone = cancellation._closed(ours)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert gone is False


def _socket_at(fd_number, sock):
    """A socket for ``sock``'s connection at descriptor ``fd_number``."""
    os.dup2(sock.fileno(), fd_number)
    return socket.socket(fileno=fd_number)


def _open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


@pytest.fixture
def high_descriptors():
    # Descriptors from 1024 on: a busy server with a raised ulimit -n has them.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2048:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    yield next(fd for fd in range(1500, 2048) if not _open(fd))
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_client_at_a_descriptor_above_1024_is_not_taken_for_gone(high_descriptors):
    ours, peer = socket.socketpair()
    with ours, peer, _socket_at(high_descriptors, ours) as watched:
        assert not cancellation._closed(watched)


def test_a_client_at_a_descriptor_above_1024_that_leaves_is_gone(high_descriptors):
    ours, peer = socket.socketpair()
    with ours, _socket_at(high_descriptors, ours) as watched:
        peer.close()
        assert cancellation._closed(watched)


def _draft_lagging(tokens, main_lag, draft_lag):
    # Two layers of the model's, then one of a draft model's.
    return [
        latent_kv(tokens - main_lag),
        latent_kv(tokens - main_lag),
        latent_kv(tokens - draft_lag),
    ]


@pytest.mark.parametrize("behind", [1, 2])
def test_a_draft_models_cache_may_be_behind(behind, installed):
    assert cache_problem(_draft_lagging(6, 0, behind), 6, main=2) is None


def test_a_draft_models_cache_ahead_is_refused(installed):
    problem = cache_problem(_draft_lagging(6, 0, -1), 6, main=2)
    assert problem == "layer 2: KVCache holds 7 tokens, expected 6"


def test_a_drafting_servers_cache_a_token_short_is_kept_for_what_it_holds(installed):
    tokens = list(range(10, 16))
    assert drafted_length(_draft_lagging(6, 1, 1), tokens, 2) == 5
    assert drafted_length(_draft_lagging(6, 0, 1), tokens, 2) == 6
    assert drafted_length(_draft_lagging(6, 2, 2), tokens, 2) == 6  # refused after


def test_the_models_own_cache_may_not_be_behind_where_it_drafts(installed):
    problem = cache_problem(_draft_lagging(6, 1, 1), 6, main=2)
    assert problem == "layer 0: KVCache holds 5 tokens, expected 6"


def test_without_a_draft_model_every_cache_holds_every_token(installed):
    problem = cache_problem(_draft_lagging(6, 0, 1), 6)
    assert problem == "layer 2: KVCache holds 5 tokens, expected 6"


def _with_args(**args):
    return Namespace(args=Namespace(**args))


def test_a_yarn_context_kept_unscaled_in_the_config_counts_scaled():
    # Qwen's YaRN set-up: max_position_embeddings stays the unscaled length.
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
    model = _with_args(max_position_embeddings=512, rope_scaling=yarn)
    assert context_length(model) == 2048


def test_a_context_the_config_gives_scaled_is_taken_as_it_is():
    # DeepSeek-V3's: 4,096 positions stretched 40 times, and the result given.
    yarn = {"factor": 40, "original_max_position_embeddings": 4096}
    model = _with_args(max_position_embeddings=163840, rope_scaling=yarn)
    assert context_length(model) == 163840


def test_a_wrapped_language_models_settings_are_read_from_its_text_config():
    model, config = tiny.build_model("kimi_vl")
    text = config["text_config"]
    assert context_length(model) == text["max_position_embeddings"]
    provider = Namespace(model=model)
    assert _vocabulary(Namespace(model_provider=provider), None) == text["vocab_size"]


# mistral3 keeps its text_config a dict, whichever language model it builds.
MISTRAL3_TEXT = ["llama"] + (["mistral4"] if "mistral3" in tiny.MLA_MODEL_TYPES else [])


@pytest.mark.parametrize("text_type", MISTRAL3_TEXT)
def test_a_wrapped_language_models_settings_are_read_from_a_text_config_dict(
    text_type,
):
    model, config = mistral3_of(text_type)
    text = config["text_config"]
    assert isinstance(model.args.text_config, dict)
    assert context_length(model) == text["max_position_embeddings"]
    provider = Namespace(model=model)
    assert _vocabulary(Namespace(model_provider=provider), None) == text["vocab_size"]


def test_a_request_whose_watch_cannot_start_a_thread_runs_unwatched(monkeypatch):
    def no_thread(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(cancellation.threading.Thread, "start", no_thread)
    ours, peer = socket.socketpair()
    with ours, peer:
        with cancellation.Watch(ours, Namespace(client_gone=None), "r") as watch:
            assert watch.state.client_gone is None


@pytest.mark.skipif(
    "mistral3" not in tiny.MLA_MODEL_TYPES,
    reason="this mlx-lm's mistral3 builds no mistral4",
)
def test_a_wrapped_mistral4_counts_its_scaled_context_as_the_bare_one_does():
    text = tiny.tiny_config("mistral4")  # rope_parameters: 4 positions, x 8
    text["rope_parameters"] = dict(text["rope_parameters"], factor=8.0)
    bare, _ = tiny.build_model("mistral4", rope_parameters=text["rope_parameters"])
    wrapped, _ = tiny.build_model("mistral3", rope_parameters=text["rope_parameters"])
    assert context_length(bare) == context_length(wrapped) == 32


@pytest.mark.skipif(
    "mistral3" not in tiny.MLA_MODEL_TYPES,
    reason="this mlx-lm's mistral3 builds no mistral4",
)
def test_a_wrapped_mistral4_with_empty_rope_parameters_counts_the_context_it_reads():
    # mistral4 takes rope_parameters, even empty, over rope_scaling
    scaling = {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4}
    kw = dict(rope_parameters={}, rope_scaling=scaling)
    bare, _ = tiny.build_model("mistral4", **kw)
    wrapped, _ = tiny.build_model("mistral3", **kw)
    assert context_length(bare) == context_length(wrapped) == 16


MINISTRAL3 = dict(
    model_type="ministral3",
    hidden_size=64,
    num_hidden_layers=1,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    vocab_size=256,
    max_position_embeddings=4096,
    rope_parameters=dict(
        rope_type="yarn",
        factor=16.0,
        original_max_position_embeddings=1024,
        llama_4_scaling_beta=0.1,
        rope_theta=1e6,
        beta_fast=32,
        beta_slow=1,
        mscale=1,
        mscale_all_dim=1,
    ),
)


@pytest.mark.parametrize("wrapped", [False, True], ids=["bare", "in_mistral3"])
def test_a_ministral3_counts_the_context_its_rope_parameters_scale_to(wrapped):
    from mlx_lm.utils import _get_classes

    config = copy.deepcopy(MINISTRAL3)
    if wrapped:
        config = {"model_type": "mistral3", "text_config": config}
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(copy.deepcopy(config)))
    assert context_length(model) == 1024 * 16


def test_a_drafting_servers_cache_goes_to_disk_under_the_tokens_it_holds(installed):
    import mlx_lm.server as server
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lm_mla.guards import state as served

    model, _ = tiny.build_model("glm4_moe_lite")
    draft, _ = tiny.build_model("glm4_moe_lite", seed=1)
    key, tokens = ("model", None, "draft"), TOKENS
    cache = make_prompt_cache(model) + make_prompt_cache(draft)
    main = len(model.layers)
    model(mx.array([tokens[:-1]]), cache=cache[:main])  # the last token unread
    draft(mx.array([tokens[:-3]]), cache=cache[main:])  # the draft further behind
    stored = []
    tier = Namespace(store=lambda model_key, held, caches: stored.append(len(held)))
    provider = Namespace(draft_model=draft, model_key=key, model=model)
    with served.running(Namespace(provider=provider, tier=tier)):
        server.LRUPromptCache().insert_cache(key, list(tokens), cache)
    assert stored == [len(tokens) - 1]
