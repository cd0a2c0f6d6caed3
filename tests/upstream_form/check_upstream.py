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
from mlx_lm.generate import BatchGenerator, maybe_quantize_kv_cache
from mlx_lm.models.cache import make_prompt_cache

import mlx_lm_mla
from mlx_lm_mla import tiny
from mlx_lm_mla.hooks import count_latent_attention
from test_regression import requests, serve  # the server's reuse, on mlx-lm alone

WIDE = {"kv_lora_rank": 128, "qk_rope_head_dim": 64}
PROMPT = [(5 * i + 7) % 190 + 5 for i in range(23)]
# mlx-lm never quantizes a CacheList, so these models keep their caches.
CACHE_LIST = {"deepseek_v32", "glm_moe_dsa", "longcat_flash", "longcat_flash_ngram"}
LATENT_TYPES = [t for t in tiny.MLA_MODEL_TYPES if t not in CACHE_LIST]


def test_the_patched_tree_runs_alone():
    tree = Path(os.environ["PYTHONPATH"].split(os.pathsep)[0]).resolve()
    assert Path(cache.__file__).resolve().is_relative_to(tree)
    assert mlx_lm_mla.installed() == []


@pytest.mark.parametrize("model_type", LATENT_TYPES)
def test_every_latent_attention_gets_a_latent_kv_cache(model_type):
    model, _ = tiny.build_model(model_type)
    caches = make_prompt_cache(model)
    latent = [c for c in caches if type(c) is cache.LatentKVCache]
    assert len(latent) == sum(count_latent_attention(layer) for layer in model.layers) > 0


@pytest.mark.parametrize("model_type", LATENT_TYPES)
@pytest.mark.parametrize("bits", [None, 8, 4])
def test_logits_match_a_full_forward_and_quantize_in_place(model_type, bits):
    model, _ = tiny.build_model(model_type)
    full = model(mx.array([PROMPT]))
    caches = make_prompt_cache(model)
    first = model(mx.array([PROMPT[:10]]), cache=caches)
    live = list(caches)
    maybe_quantize_kv_cache(list(caches), 0, 32, bits)  # a copy of the list
    rest = [model(mx.array([[t]]), cache=caches) for t in PROMPT[10:]]
    got = mx.concatenate([first] + rest, axis=1)
    if bits is None:
        assert mx.allclose(got, full, atol=1e-4, rtol=1e-4).item()
    else:
        assert all(c is l for c, l in zip(caches, live))
        latent = [c for c in caches if isinstance(c, cache.QuantizedLatentCache)]
        assert latent and all(c.latent_bits == bits for c in latent)
        assert mx.isfinite(got).all().item()


@pytest.mark.parametrize("model_type", ["glm4_moe_lite", "deepseek_v3"])
@pytest.mark.parametrize("bits", [4, 8])
def test_the_reported_failure_is_gone(model_type, bits):
    model, _ = tiny.build_model(model_type, **WIDE)
    caches = make_prompt_cache(model)
    history, out = serve(model, caches, [], requests(1)[0] + list(range(5, 30)), bits)
    for prompt in requests(20):
        history, out = serve(model, caches, history, prompt, bits)
        assert len(out) == 12
    assert all(type(c) is cache.QuantizedLatentCache and c.latent_bits == bits for c in caches)


@pytest.mark.parametrize("model_type", ["glm4_moe_lite", "deepseek_v3"])
def test_reuse_without_quantization_is_exact(model_type):
    model, _ = tiny.build_model(model_type)
    caches, history = make_prompt_cache(model), []
    for prompt in requests(8):
        history, out = serve(model, caches, history, prompt, None)
        fresh = serve(model, make_prompt_cache(model), [], prompt, None)[1]
        assert out == fresh


def prefilled(model, tokens):
    caches = make_prompt_cache(model)
    model(mx.array([tokens]), cache=caches)
    return caches


def test_merged_extracted_then_quantized_still_hands_arrays():
    model, _ = tiny.build_model("glm4_moe_lite")
    a, b = prefilled(model, PROMPT[:7]), prefilled(model, PROMPT[:13])
    batch = [x.merge([x, y]) for x, y in zip(a, b)]
    assert all(type(c) is cache.BatchLatentKVCache for c in batch)
    single = [c.extract(1) for c in batch]
    assert all(type(c) is cache.LatentKVCache and c.offset == 13 for c in single)
    maybe_quantize_kv_cache(single, 0, 64, 4)
    latent, rope = single[0].update_and_fetch(mx.zeros((1, 1, 1, 64)), mx.zeros((1, 1, 1, 16)))
    assert isinstance(latent, mx.array) and latent.shape == (1, 1, 14, 64)
    single[0].trim(1)
    assert mx.isfinite(model(mx.array([[9]]), cache=single)).all().item()


def test_a_batch_of_exact_and_quantized_caches_is_quantized():
    model, _ = tiny.build_model("glm4_moe_lite")
    exact, quantized = prefilled(model, PROMPT[:7]), prefilled(model, PROMPT[:13])
    maybe_quantize_kv_cache(quantized, 0, 32, 8)
    gen = BatchGenerator(model, max_tokens=5, completion_batch_size=2, prefill_batch_size=2)
    uids = gen.insert([PROMPT[7:9], PROMPT[13:15]], [3, 5], caches=[exact, quantized])
    done = {}
    while responses := gen.next_generated():
        for r in responses:
            if r.finish_reason is not None:
                done[r.uid] = r.prompt_cache
    gen.close()
    assert set(done) == set(uids)
    assert all(type(c) is cache.QuantizedLatentCache for row in done.values() for c in row)


def test_a_quantized_batch_takes_array_and_tuple_indices():
    model, _ = tiny.build_model("glm4_moe_lite")
    rows = [prefilled(model, PROMPT[:n])[0] for n in (4, 9, 6)]
    batch = rows[0].merge(rows)
    batch.to_quantized(64, 8)
    batch.filter(mx.array([2, 0], dtype=mx.uint32))
    batch.filter((1, 0))
    assert batch.offset.tolist() == [4, 6]
    assert batch.extract(mx.array(1)).offset == 6


@pytest.mark.parametrize("bits", [None, 4])
def test_save_and_load_continue_exactly(bits, tmp_path):
    model, _ = tiny.build_model("glm4_moe_lite")
    caches = prefilled(model, PROMPT[:14])
    maybe_quantize_kv_cache(caches, 0, 32, bits)
    path = str(tmp_path / "c.safetensors")
    cache.save_prompt_cache(path, caches)
    loaded = cache.load_prompt_cache(path)
    assert [type(c) for c in loaded] == [type(c) for c in caches]
    step = mx.array([PROMPT[14:]])
    assert mx.array_equal(model(step, cache=loaded), model(step, cache=caches))


def test_requantizing_with_other_settings_is_refused():
    model, _ = tiny.build_model("glm4_moe_lite")
    caches = prefilled(model, PROMPT[:5])
    caches[0].to_quantized(64, 8)
    with pytest.raises(ValueError, match="refusing to requantize"):
        caches[0].to_quantized(64, 4)
