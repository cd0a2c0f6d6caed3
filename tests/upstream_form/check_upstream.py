"""The upstream form of the fix on its own: an mlx-lm tree rewritten by
``upstream-patch``, first on the path, with this package switched off.

Run by ``tests/test_upstream.py`` as
``MLX_LM_MLA_DISABLE=1 PYTHONPATH=<patched tree> pytest -o python_files=check_*.py``.
Everything here is reached through mlx-lm alone.
"""

import os
from pathlib import Path

import mlx.core as mx
import mlx_lm.models.cache as cache
import pytest
from mlx_lm.generate import BatchGenerator, generate_step, maybe_quantize_kv_cache
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

import mlx_lm_mla
from mlx_lm_mla.testing import tiny

# Rope width 64: stock quantizes it in groups of 64 and fails in the model.
WIDE = {"kv_lora_rank": 128, "qk_rope_head_dim": 64, "index_head_dim": 64}
PROMPT = [(5 * i + 7) % 190 + 5 for i in range(23)]
START = 48  # quantized_kv_start


def leaves(caches):
    return [m for c in caches for m in getattr(c, "caches", [c])]


def offset(caches):
    return next(c.offset for c in leaves(caches) if hasattr(c, "offset"))


def latent_attention(model):
    """How many attention modules cache an MLA latent: those with a
    ``kv_lora_rank`` and the absorbed ``embed_q``."""
    return sum(
        isinstance(getattr(m, "kv_lora_rank", None), int) and hasattr(m, "embed_q")
        for layer in model.layers
        for _, m in layer.named_modules()
    )


def serve(model, caches, history, prompt, bits, max_tokens=12):
    """One request the way a server reuses its cache: trim to the common
    prefix, process the rest, remember what the cache now holds."""
    common = 0
    while common < min(len(history), len(prompt) - 1) and history[common] == prompt[common]:
        common += 1
    if can_trim_prompt_cache(caches):
        trim_prompt_cache(caches, offset(caches) - common)
    elif common < len(history):  # a hybrid's state cannot be trimmed: start afresh
        caches[:], common = make_prompt_cache(model), 0
    steps = generate_step(
        mx.array(prompt[common:]), model, prompt_cache=caches, max_tokens=max_tokens,
        kv_bits=bits, kv_group_size=64, quantized_kv_start=START,
    )
    out = [t for t, _ in steps]
    return (prompt + out)[: offset(caches)], out


def requests(n):
    prefix = [(3 * i + 11) % 190 + 5 for i in range(30)]
    return [prefix + [(7 * r + j) % 190 + 5 for j in range(2 + r % 9)] for r in range(n)]


def prefilled(model, tokens, **kwargs):
    caches = make_prompt_cache(model, **kwargs)
    model(mx.array([tokens]), cache=caches)
    return caches


def test_the_patched_tree_runs_alone():
    tree = Path(os.environ["PYTHONPATH"].split(os.pathsep)[0]).resolve()
    assert Path(cache.__file__).resolve().is_relative_to(tree)
    assert mlx_lm_mla.installed() == []


@pytest.mark.parametrize("model_type", tiny.MLA_MODEL_TYPES)
def test_every_latent_attention_gets_a_latent_kv_cache(model_type):
    model, _ = tiny.build_model(model_type)
    latent = [c for c in leaves(make_prompt_cache(model)) if type(c) is cache.LatentKVCache]
    assert len(latent) == latent_attention(model) > 0


@pytest.mark.parametrize("model_type", tiny.MLA_MODEL_TYPES)
@pytest.mark.parametrize("bits", [None, 8, 4])
def test_logits_match_a_full_forward_and_the_latent_quantizes(model_type, bits):
    model, _ = tiny.build_model(model_type)
    full = model(mx.array([PROMPT]))
    caches = make_prompt_cache(model)
    first = model(mx.array([PROMPT[:10]]), cache=caches)
    maybe_quantize_kv_cache(caches, 0, 32, bits)
    rest = [model(mx.array([[t]]), cache=caches) for t in PROMPT[10:]]
    got = mx.concatenate([first] + rest, axis=1)
    if bits is None:
        assert mx.allclose(got, full, atol=1e-4, rtol=1e-4).item()
    else:
        quantized = [c for c in leaves(caches) if type(c) is cache.QuantizedLatentKVCache]
        assert len(quantized) == latent_attention(model)
        assert all(c.latent_bits == bits and c.offset == len(PROMPT) for c in quantized)
        assert mx.isfinite(got).all().item()


@pytest.mark.parametrize("model_type", tiny.MLA_MODEL_TYPES)
def test_the_reported_failure_is_gone(model_type):
    model, _ = tiny.build_model(model_type, **WIDE)
    caches = make_prompt_cache(model)
    history, out = serve(model, caches, [], requests(1)[0] + list(range(5, 30)), 4)
    for prompt in requests(6):
        history, out = serve(model, caches, history, prompt, 4)
        assert len(out) == 12
    assert not any(isinstance(c, cache.LatentKVCache) for c in leaves(caches))
    assert any(isinstance(c, cache.QuantizedLatentKVCache) for c in leaves(caches))


@pytest.mark.parametrize("model_type", tiny.MLA_MODEL_TYPES)
def test_reuse_without_quantization_is_exact(model_type):
    model, _ = tiny.build_model(model_type)
    caches, history = make_prompt_cache(model), []
    for prompt in requests(6):
        history, out = serve(model, caches, history, prompt, None)
        assert out == serve(model, make_prompt_cache(model), [], prompt, None)[1]


@pytest.mark.parametrize("model_type", tiny.MLA_MODEL_TYPES)
def test_max_kv_size_holds_at_most_that_many_tokens(model_type):
    model, _ = tiny.build_model(model_type)
    caches = prefilled(model, PROMPT, max_kv_size=16)
    for t in PROMPT[:3]:
        model(mx.array([[t]]), cache=caches)
    windows = [c for c in leaves(caches) if hasattr(c, "keys")]
    assert len(windows) >= latent_attention(model)
    for c in windows:
        assert type(c) is cache.RotatingKVCache and (c.max_size, c.keep) == (16, 4)
        assert c.keys.shape[2] == 16 and c.offset == len(PROMPT) + 3
    with pytest.raises(NotImplementedError, match="RotatingKVCache Quantization NYI"):
        maybe_quantize_kv_cache(caches, 0, 64, 4)


@pytest.mark.parametrize("model_type", ["glm4_moe_lite", "deepseek_v32", "longcat_flash_ngram"])
@pytest.mark.parametrize("bits", [None, 4])
def test_save_and_load_continue_exactly(model_type, bits, tmp_path):
    model, _ = tiny.build_model(model_type)
    caches = prefilled(model, PROMPT[:14])
    maybe_quantize_kv_cache(caches, 0, 32, bits)
    path = str(tmp_path / "c.safetensors")
    cache.save_prompt_cache(path, caches)
    loaded = cache.load_prompt_cache(path)
    assert [type(c) for c in leaves(loaded)] == [type(c) for c in leaves(caches)]
    step = mx.array([PROMPT[14:]])
    assert mx.array_equal(model(step, cache=loaded), model(step, cache=caches))


def test_an_empty_latent_cache_quantizes_to_an_empty_one():
    empty = cache.LatentKVCache().to_quantized(group_size=64, bits=4)
    assert type(empty) is cache.QuantizedLatentKVCache and empty.empty() and empty.offset == 0


@pytest.mark.parametrize("model_type", ["glm4_moe_lite", "deepseek_v32"])
def test_batching_without_kv_bits_still_works(model_type):
    model, _ = tiny.build_model(model_type)
    alone = [[t for t, _ in generate_step(mx.array(p), model, max_tokens=4)] for p in (PROMPT[:7], PROMPT[:7])]
    gen = BatchGenerator(model, max_tokens=4, completion_batch_size=2, prefill_batch_size=2)
    uids = gen.insert([PROMPT[:7], PROMPT[:7]], [4, 4])
    tokens = {uid: [] for uid in uids}
    while responses := gen.next_generated():
        for r in responses:
            tokens[r.uid].append(r.token)
    gen.close()
    assert list(tokens.values()) == alone
