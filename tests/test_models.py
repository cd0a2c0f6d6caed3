"""Every MLA architecture in the installed mlx-lm, with the hooks active."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import CacheList, KVCache, make_prompt_cache

from mlx_lm_mla import MLALatentCache, tiny
from mlx_lm_mla.hooks import count_latent_attention

PROMPT = [(5 * i + 7) % 190 + 5 for i in range(23)]


def leaves(caches):
    for c in caches:
        if isinstance(c, CacheList):
            yield from leaves(c.caches)
        else:
            yield c


def chunked_logits(model, cache, tokens, chunks=(9, 6)):
    """Logits from a prefill in chunks, then one token at a time."""
    out, start = [], 0
    for n in chunks:
        out.append(model(mx.array([tokens[start : start + n]]), cache=cache))
        start += n
    for t in tokens[start:]:
        out.append(model(mx.array([[t]]), cache=cache))
    return mx.concatenate(out, axis=1)


@pytest.mark.parametrize("model_type", tiny.MLA_MODEL_TYPES)
def test_every_latent_attention_gets_a_latent_cache(model_type, installed):
    model, _ = tiny.build_model(model_type)
    caches = make_prompt_cache(model)
    expected = sum(count_latent_attention(layer) for layer in model.layers)
    latent = [c for c in leaves(caches) if isinstance(c, MLALatentCache)]
    assert expected > 0 and len(latent) == expected


@pytest.mark.parametrize("model_type", tiny.MLA_MODEL_TYPES)
def test_logits_with_latent_cache_match_a_full_forward(model_type, installed):
    model, _ = tiny.build_model(model_type)
    full = model(mx.array([PROMPT]))
    cache = make_prompt_cache(model)
    got = chunked_logits(model, cache, PROMPT)
    assert mx.allclose(got, full, atol=1e-4, rtol=1e-4).item()
    stored = [c for c in leaves(cache) if isinstance(c, MLALatentCache)]
    assert all(c.offset == len(PROMPT) for c in stored)


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
    for c in leaves(cache):
        if isinstance(c, MLALatentCache):
            assert c.to_quantized(group_size=32, bits=bits) is c
    logits = chunked_logits(model, cache, PROMPT[10:], chunks=(5,))
    assert logits.shape[1] == len(PROMPT) - 10
    assert mx.isfinite(logits).all().item()


def test_dsa_indexer_keeps_its_plain_cache(installed):
    model, _ = tiny.build_model("deepseek_v32")
    cache = make_prompt_cache(model)
    assert all(isinstance(c, CacheList) for c in cache)
    assert all(type(c.caches[0]) is MLALatentCache for c in cache)
    assert all(type(c.caches[1]) is KVCache for c in cache)


@pytest.mark.parametrize("model_type", tiny.FULL_KV_MODEL_TYPES)
def test_full_kv_models_keep_upstream_caches(model_type, installed):
    model, _ = tiny.build_model(model_type)
    assert all(type(c) is KVCache for c in make_prompt_cache(model))
    rotating = make_prompt_cache(model, max_kv_size=32)
    assert all(type(c).__name__ == "RotatingKVCache" for c in rotating)


def test_loaded_model_gets_latent_caches(installed, tmp_path):
    path = tiny.save_model(tmp_path / "glm", "glm4_moe_lite", quantize_bits=6)
    model, tokenizer = tiny.load(path)
    cache = make_prompt_cache(model)
    assert all(isinstance(c, MLALatentCache) for c in cache)
    prompt = tokenizer.encode("hello latent world")
    out = [t for t, _ in generate_step(mx.array(prompt), model, prompt_cache=cache, max_tokens=4)]
    assert len(out) == 4 and cache[0].offset == len(prompt) + 4  # generate_step runs one step ahead
