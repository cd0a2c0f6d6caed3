"""The call sequences of LM Studio's MLX engines, replayed without their code.

Both engine builds (the old one on mlx-lm 0.31.2-dev and mlx 0.31.1, the
current one on mlx-lm 0.31.3-dev and mlx 0.32.0) drive mlx-lm through public
calls only: ``make_prompt_cache(model, max_kv_size)``, a common-prefix
``trim_prompt_cache``, a chunked prefill that quantizes a *copy* of the cache
list, ``generate_step`` (that sequential path is ``engine_sequence.py``),
``BatchGenerator`` with ``mx.array`` filters, and a disk cache that records
each layer by class name. Each replay runs with and
without a window and with and without kv_bits, as the engines do (they drop
the window whenever kv_bits is set, but the window quantizes here too).
"""

import mlx.core as mx
import pytest
import mlx_lm.models.cache as cache_module
from mlx_lm.generate import BatchGenerator, GenerationBatch
from mlx_lm.models.cache import KVCache, RotatingKVCache

import mlx_lm_mla
from mlx_lm_mla import tiny

from engine_sequence import SequentialEngine, chat
from test_batching import drain, serving_kv_bits

WIDE = {"kv_lora_rank": 128, "qk_rope_head_dim": 64}
WINDOW = 48
SETTINGS = [(None, None), (WINDOW, None), (None, 4), (WINDOW, 4)]
IDS = ["plain", "window", "kv_bits", "window+kv_bits"]


@pytest.fixture(scope="module")
def model():
    return tiny.build_model("glm4_moe_lite", **WIDE)[0]


def replay(model, window, bits, n=6):
    engine = SequentialEngine(model, window, bits)
    return engine, [engine.request(p) for p in chat(n)]


@pytest.mark.parametrize("window,bits", SETTINGS[:2], ids=IDS[:2])
def test_sequential_replay_gives_stocks_tokens_and_classes(window, bits, model, stock):
    stock_engine, expected = replay(model, window, bits)
    mlx_lm_mla.install()
    engine, got = replay(model, window, bits)
    assert got == expected
    assert [type(c) for c in engine.cache] == [type(c) for c in stock_engine.cache]
    assert type(engine.cache[0]) is (RotatingKVCache if window else KVCache)


@pytest.mark.parametrize("window,bits", SETTINGS[2:], ids=IDS[2:])
def test_sequential_replay_with_kv_bits_quantizes_the_live_cache(
    window, bits, model, installed
):
    engine = SequentialEngine(model, window, bits)
    live = list(engine.cache)
    engine.request(chat(1)[0])
    # the engine quantized a copy of the list: the live objects are quantized
    assert all(c.latent_bits == bits for c in live)
    assert all(a is b for a, b in zip(engine.cache, live))
    for prompt in chat(6)[1:]:
        assert len(engine.request(prompt)) == 6
    assert all(c.latent_bits == bits for c in engine.cache)
    if window:
        assert all(c.keys.shape[2] <= WINDOW for c in engine.cache)


@pytest.mark.parametrize("window,bits", SETTINGS[2:], ids=IDS[2:])
def test_stock_fails_the_sequential_replay_with_kv_bits(window, bits, model, stock):
    with pytest.raises(
        (AttributeError, NotImplementedError), match="swapaxes|Quantization NYI"
    ):
        replay(model, window, bits)


# --- batched -----------------------------------------------------------------


@pytest.fixture
def array_filters(monkeypatch):
    """The old engine's BatchGenerator: ``cache.filter(mx.array(keep_idx))``."""
    original = GenerationBatch.filter

    def filter(self, keep):
        caches, self.prompt_cache = self.prompt_cache, []
        original(self, keep)
        self.prompt_cache = caches
        if keep:
            for c in caches:
                c.filter(mx.array(keep))
        else:
            caches.clear()

    monkeypatch.setattr(GenerationBatch, "filter", filter)


def batched(model, window, lengths=(3, 9, 5, 12)):
    prompts = [chat(3)[i % 3][: 20 + 3 * i] for i in range(4)]
    gen = BatchGenerator(
        model,
        max_tokens=12,
        completion_batch_size=4,
        prefill_batch_size=4,
        max_kv_size=window,
    )
    return drain(
        gen, gen.insert(prompts, list(lengths))
    )  # rows finish at different steps


@pytest.mark.parametrize("window", [None, WINDOW], ids=["plain", "window"])
def test_batched_replay_with_array_filters_gives_stocks_tokens(
    window, model, array_filters, stock
):
    expected, stock_caches = batched(model, window)
    mlx_lm_mla.install()
    got, caches = batched(model, window)
    assert got == expected and [len(t) for t in got] == [3, 9, 5, 12]
    assert [type(c) for c in caches[0]] == [type(c) for c in stock_caches[0]]


def test_batched_replay_with_kv_bits_and_array_filters(model, array_filters, installed):
    with serving_kv_bits(bits=4, start=16):  # crossed by the prompts themselves
        got, caches = batched(model, None)
    assert [len(t) for t in got] == [3, 9, 5, 12]
    assert all(c.latent_bits == 4 for row in caches for c in row)


def test_a_batched_window_with_kv_bits_stays_exact_and_bounded(
    model, array_filters, stock
):
    # The engines drop the window under kv_bits; a batched window never
    # quantizes (see the README's limits), and gives stock's tokens.
    expected, _ = batched(model, WINDOW)
    mlx_lm_mla.install()
    with serving_kv_bits(bits=4, start=16):
        got, caches = batched(model, WINDOW)
    assert got == expected
    assert all(
        type(c) is RotatingKVCache and c.keys.shape[2] <= WINDOW for c in caches[3]
    )


# --- the disk prompt cache, by class name ------------------------------------


def restore(layer):
    """A layer saved as (class name, state, meta_state) and restored by name."""
    name, state = type(layer).__name__, layer.state
    cls = getattr(cache_module, name)
    if hasattr(cache_module.KVCache, "meta_state"):  # mlx-lm 0.31
        return cls.from_state(state, layer.meta_state)
    return cls.from_state(state)


@pytest.mark.parametrize("window,bits", SETTINGS, ids=IDS)
def test_disk_records_restore_by_class_name(window, bits, model, installed):
    engine = SequentialEngine(model, window, bits)
    engine.request(chat(1)[0])
    names = {type(c).__name__ for c in engine.cache}
    if bits is None:  # the engine stores these two as per-chunk deltas
        assert names == {"RotatingKVCache" if window else "KVCache"}
    restored = [restore(c) for c in engine.cache]
    step = mx.array([[7, 8]])
    assert mx.array_equal(model(step, cache=restored), model(step, cache=engine.cache))
