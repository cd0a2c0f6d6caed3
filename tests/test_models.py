"""Every MLA architecture in the installed mlx-lm, with the fix active:
stock's caches until quantization, latent-quantized caches after."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from mlx_lm_mla import QuantizedLatentCache
from mlx_lm_mla import tiny
from mlx_lm_mla.mla import is_latent
from mlx_lm_mla.mla import latent_modules
from mlx_lm_mla.testing.replay import generated

from conftest import leaves

PROMPT = [(5 * i + 7) % 190 + 5 for i in range(23)]


def chunked_logits(model, cache, tokens, chunks=(9, 6)):
    """Logits from a prefill in chunks, then one token at a time."""
    out, start = [], 0
    for n in chunks:
        out.append(model(mx.array([tokens[start : start + n]]), cache=cache))
        start += n
    for t in tokens[start:]:
        out.append(model(mx.array([[t]]), cache=cache))
    return mx.concatenate(out, axis=1)


def latent_caches(caches):
    """The caches that hold a latent once the model ran."""
    return [c for c in leaves(caches) if is_latent(c)]


@pytest.mark.parametrize("model_type", tiny.MLA_MODEL_TYPES)
def test_every_latent_attention_keeps_the_stock_cache(
    model_type, installed, stock_caches
):
    model, _ = tiny.build_model(model_type)
    caches = make_prompt_cache(model)
    assert [type(c) for c in leaves(caches)] == stock_caches(model)
    model(mx.array([PROMPT[:5]]), cache=caches)
    expected = sum(len(latent_modules(layer)) for layer in model.layers)
    assert expected > 0 and len(latent_caches(caches)) == expected
    assert all(type(c) is KVCache for c in latent_caches(caches))


@pytest.mark.parametrize("model_type", tiny.MLA_MODEL_TYPES)
def test_logits_with_a_quantizable_cache_match_a_full_forward(model_type, installed):
    model, _ = tiny.build_model(model_type)
    full = model(mx.array([PROMPT]))
    cache = make_prompt_cache(model)
    got = chunked_logits(model, cache, PROMPT)
    assert mx.allclose(got, full, atol=1e-4, rtol=1e-4).item()
    assert all(c.offset == len(PROMPT) for c in latent_caches(cache))


@pytest.mark.parametrize("model_type", tiny.MLA_MODEL_TYPES)
def test_greedy_tokens_match_decoding_without_a_cache(model_type, installed):
    model, _ = tiny.build_model(model_type)
    expected, tokens = [], list(PROMPT[:12])
    for _ in range(8):
        nxt = mx.argmax(model(mx.array([tokens]))[0, -1]).item()
        expected.append(nxt)
        tokens.append(nxt)
    got = [t for t, _ in generate_step(mx.array(PROMPT[:12]), model, max_tokens=8)]
    assert got == expected


@pytest.mark.parametrize("model_type", tiny.MLA_MODEL_TYPES)
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_latent_cache_runs_every_architecture(model_type, bits, installed):
    model, _ = tiny.build_model(model_type)
    cache = make_prompt_cache(model)
    model(mx.array([PROMPT[:10]]), cache=cache)
    held = latent_caches(cache)
    for c in held:
        assert c.to_quantized(group_size=32, bits=bits) is c
    assert held and all(c.latent_bits == bits for c in held)
    logits = chunked_logits(model, cache, PROMPT[10:], chunks=(5,))
    assert logits.shape[1] == len(PROMPT) - 10
    assert mx.isfinite(logits).all().item()


WINDOWED = [
    t
    for t in ("glm4_moe_lite", "deepseek_v3", "mistral3", "mistral4")
    if t in tiny.MLA_MODEL_TYPES
]


@pytest.mark.parametrize("model_type", WINDOWED)
def test_a_window_keeps_the_stock_rotating_cache(model_type, installed, stock_caches):
    model, _ = tiny.build_model(model_type)
    cache = make_prompt_cache(model, max_kv_size=32)
    assert all(type(c) is RotatingKVCache for c in cache)
    assert [type(c) for c in cache] == stock_caches(model, 32)


@pytest.mark.parametrize("model_type", tiny.FULL_KV_MODEL_TYPES)
def test_full_kv_models_keep_upstream_caches(model_type, installed):
    model, _ = tiny.build_model(model_type)
    assert all(type(c) is KVCache for c in make_prompt_cache(model))
    rotating = make_prompt_cache(model, max_kv_size=32)
    assert all(type(c).__name__ == "RotatingKVCache" for c in rotating)


def test_a_loaded_model_quantizes_its_latent(installed, tmp_path):
    path = tiny.save_model(tmp_path / "glm", "glm4_moe_lite", quantize_bits=6)
    model, tokenizer = tiny.load(path)
    cache = make_prompt_cache(model)
    assert all(type(c) is KVCache for c in cache)
    prompt = tokenizer.encode("hello latent world")
    out = generated(model, cache, prompt, 4, bits=4)
    assert (
        len(out) == 4 and cache[0].offset == len(prompt) + 4
    )  # generate_step runs one step ahead
    assert all(type(c) is QuantizedLatentCache for c in cache)


class _FirstOfTwo:
    """Pipeline rank 0 of 2: the model keeps the last half of its layers."""

    def rank(self):
        return 0

    def size(self):
        return 2


def test_a_model_pipelined_after_its_first_use_gets_caches_for_its_layers(installed):
    model, _ = tiny.build_model("deepseek_v3")
    make_prompt_cache(model)  # what its layers are is found, and remembered
    model.model.pipeline(_FirstOfTwo())
    cache = make_prompt_cache(model)  # marked as the layer it keeps writes it
    assert len(cache) == len(model.layers) == 1 and is_latent(cache[0])
