"""MLA models that keep their latent in a CacheList (DeepSeek-V3.2, GLM-5,
LongCat-Flash): the latent quantizes under kv_bits, in place, like the other
MLA models; the DSA indexer's keys stay at the model's dtype."""

import mlx.core as mx
import pytest
import mlx_lm.models.cache as cache_module
from mlx_lm.generate import BatchGenerator, maybe_quantize_kv_cache
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    make_prompt_cache,
    save_prompt_cache,
    trim_prompt_cache,
)

from mlx_lm_mla import QuantizedLatentCache
from mlx_lm_mla import tiny
from mlx_lm_mla.checksum import CHECKSUM
from mlx_lm_mla.patches import mlx_lm_version
from mlx_lm_mla.testing.replay import generated

from serving import Server, cached_tokens, four_clients, questions, server_supports
from test_batching import drain, serving_kv_bits

TYPES = [
    t
    for t in ("deepseek_v32", "glm_moe_dsa", "longcat_flash", "longcat_flash_ngram")
    if t in tiny.MLA_MODEL_TYPES
]
DSA = [t for t in ("deepseek_v32", "glm_moe_dsa") if t in TYPES]
PROMPT = [(5 * i + 7) % 190 + 5 for i in range(60)]
# mlx-lm 0.31's DSA indexer stores an empty values array, which mlx cannot
# write to a file; stock cannot save a DSA cache there, the package can.
STOCK_SAVES_DSA = mlx_lm_version() >= (0, 32, 0)


def lists(cache):
    return [c for c in cache if isinstance(c, CacheList)]


def generate(model, cache, prompt, bits=4):
    return generated(model, cache, prompt, 6, bits, start=16)


def run(model_type, bits):
    model, _ = tiny.build_model(model_type)
    cache = make_prompt_cache(model)
    generate(model, cache, PROMPT, bits)
    return model, cache


@pytest.mark.parametrize("model_type", TYPES)
def test_kv_bits_quantize_the_latent_in_place(model_type, installed):
    model = tiny.build_model(model_type)[0]
    cache = make_prompt_cache(model)
    members = [m for c in lists(cache) for m in c.caches]
    generate(model, cache, PROMPT)
    latent = [c.caches[0] for c in lists(cache)] + (
        [] if model_type in DSA else [c.caches[1] for c in lists(cache)]
    )
    assert all(type(m) is QuantizedLatentCache and m.latent_bits == 4 for m in latent)
    assert [m for c in lists(cache) for m in c.caches] == members  # the same objects


@pytest.mark.parametrize("model_type", TYPES)
def test_a_quantized_cache_list_holds_well_under_its_unquantized_bytes(
    model_type, installed
):
    exact = sum(c.nbytes for c in run(model_type, None)[1])
    quantized = sum(c.nbytes for c in run(model_type, 4)[1])
    assert quantized < 0.7 * exact


@pytest.mark.parametrize("model_type", TYPES)
def test_stock_never_quantizes_a_cache_list(model_type, stock):
    assert sum(c.nbytes for c in run(model_type, 4)[1]) == sum(
        c.nbytes for c in run(model_type, None)[1]
    )


@pytest.mark.parametrize("model_type", DSA)
def test_the_dsa_indexer_keys_stay_at_the_models_dtype(model_type, installed):
    _, cache = run(model_type, 4)
    for c in lists(cache):
        assert type(c.caches[1]) is KVCache and c.caches[1].keys.dtype == mx.float32


@pytest.mark.parametrize("model_type", TYPES)
def test_quantizing_a_copy_of_the_list_quantizes_the_live_cache(model_type, installed):
    model = tiny.build_model(model_type)[0]
    cache = make_prompt_cache(model)
    model(mx.array([PROMPT[:20]]), cache=cache)
    maybe_quantize_kv_cache(list(cache), 0, 64, 8)
    assert all(type(c.caches[0]) is QuantizedLatentCache for c in lists(cache))


# longcat_flash_ngram's n-gram context (an ArraysCache) cannot be trimmed, on stock too.
@pytest.mark.parametrize("model_type", [t for t in TYPES if t != "longcat_flash_ngram"])
def test_a_reused_cache_serves_later_requests_with_trims(model_type, installed):
    model, cache = run(model_type, 4)
    held = lists(cache)[0].caches[0].offset
    for k in range(3):
        assert trim_prompt_cache(cache, 4) == 4
        assert all(m.offset == held - 4 for c in lists(cache) for m in c.caches)
        assert len(generate(model, cache, [9 + k, 11, 13])) == 6
        held = lists(cache)[0].caches[0].offset
    assert all(type(c.caches[0]) is QuantizedLatentCache for c in lists(cache))


@pytest.mark.parametrize("model_type", TYPES)
def test_a_saved_quantized_cache_list_continues_exactly(
    model_type, installed, tmp_path
):
    model, cache = run(model_type, 4)
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, cache)
    assert any(
        CHECKSUM in k for k in mx.load(path, return_metadata=True)[1]
    )  # checksummed: it holds a latent
    loaded = cache_module.load_prompt_cache(path)
    assert [type(m) for c in lists(loaded) for m in c.caches] == [
        type(m) for c in lists(cache) for m in c.caches
    ]
    assert generate(model, loaded, [7, 8, 9]) == generate(model, cache, [7, 8, 9])


if not STOCK_SAVES_DSA:

    @pytest.mark.parametrize("model_type", DSA)
    def test_stock_mlx_lm_0_31_cannot_save_a_dsa_cache(model_type, stock, tmp_path):
        _, cache = run(model_type, None)
        with pytest.raises(ValueError, match="(?i)cannot serialize an empty array"):
            cache_module.save_prompt_cache(str(tmp_path / "cache.safetensors"), cache)


@pytest.mark.parametrize("model_type", TYPES)
def test_a_batch_under_kv_bits_quantizes_its_latent(model_type, installed):
    model = tiny.build_model(model_type)[0]
    gen = BatchGenerator(
        model, max_tokens=8, completion_batch_size=3, prefill_batch_size=3
    )
    with serving_kv_bits(bits=4, start=16):
        got, caches = drain(
            gen, gen.insert([PROMPT[:30], PROMPT[5:25], PROMPT[:40]], [3, 8, 5])
        )
    assert [len(t) for t in got] == [3, 8, 5]
    assert all(
        type(c.caches[0]) is QuantizedLatentCache for row in caches for c in lists(row)
    )


def test_a_cache_list_without_a_latent_is_never_quantized(installed):
    heads = KVCache()
    heads.update_and_fetch(mx.zeros((1, 4, 8, 32)), mx.zeros((1, 4, 8, 32)))
    cache = [CacheList(ArraysCache(size=1), heads)]
    maybe_quantize_kv_cache(cache, 0, 32, 4)
    assert not hasattr(cache[0], "to_quantized") and type(cache[0].caches[1]) is KVCache


if server_supports("--kv-bits"):  # mlx-lm 0.31.2's server has no --kv-bits

    def test_a_dsa_model_is_served_with_kv_bits_and_continuous_batching(tmp_path):
        path = tiny.save_model(tmp_path / "dsv32", "deepseek_v32", quantize_bits=6)
        with Server(
            path, "--decode-concurrency", 4, "--kv-bits", 4, "--quantized-kv-start", 32
        ) as server:
            served, errors = four_clients(server, per_client=3, max_tokens=40)
            text, usage = server.chat(questions(1)[0], max_tokens=40)
        assert errors == [] and len(served) == 12
        assert cached_tokens(usage) > 0  # the quantized prompt cache was reused
