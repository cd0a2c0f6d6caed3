"""The upstream form of the fix on its own: an mlx-lm tree with
``upstream/mla-latent-cache.patch`` applied, first on the path, with this
package switched off.

Run by ``tests/test_upstream.py`` as
``MLX_LM_MLA_DISABLE=1 PYTHONPATH=<patched tree> pytest -o python_files=check_*.py``.
Everything here is reached through mlx-lm alone.
"""

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import mlx.core as mx
import mlx_lm.models.cache as cache
import pytest
from mlx_lm.generate import BatchGenerator, generate_step, maybe_quantize_kv_cache
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

import mlx_lm_mla
from mlx_lm_mla import tiny

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from serving import Server  # noqa: E402  (tests/serving.py)

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
    latent = [c for c in leaves(make_prompt_cache(model)) if type(c) is cache.MLALatentCache]
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
        quantized = [c for c in leaves(caches) if type(c) is cache.QuantizedMLALatentCache]
        assert len(quantized) == latent_attention(model)
        assert all(c.bits == bits and c.offset == len(PROMPT) for c in quantized)
        assert mx.isfinite(got).all().item()


@pytest.mark.parametrize("model_type", tiny.MLA_MODEL_TYPES)
def test_the_reported_failure_is_gone(model_type):
    model, _ = tiny.build_model(model_type, **WIDE)
    caches = make_prompt_cache(model)
    history, out = serve(model, caches, [], requests(1)[0] + list(range(5, 30)), 4)
    for prompt in requests(6):
        history, out = serve(model, caches, history, prompt, 4)
        assert len(out) == 12
    assert not any(isinstance(c, cache.MLALatentCache) for c in leaves(caches))
    assert any(isinstance(c, cache.QuantizedMLALatentCache) for c in leaves(caches))


@pytest.mark.parametrize("model_type", tiny.MLA_MODEL_TYPES)
def test_reuse_without_quantization_is_exact(model_type):
    model, _ = tiny.build_model(model_type)
    caches, history = make_prompt_cache(model), []
    for prompt in requests(6):
        history, out = serve(model, caches, history, prompt, None)
        assert out == serve(model, make_prompt_cache(model), [], prompt, None)[1]


@pytest.mark.parametrize("model_type", tiny.MLA_MODEL_TYPES)
def test_max_kv_size_keeps_the_released_behaviour(model_type):
    # A model without make_cache gets windows; one with it ignores the size.
    model, _ = tiny.build_model(model_type)
    windows = [c for c in leaves(make_prompt_cache(model, max_kv_size=16)) if type(c) is cache.RotatingKVCache]
    if hasattr(model, "make_cache"):
        assert windows == []
    else:
        assert len(windows) == len(model.layers) and all(c.max_size == 16 for c in windows)


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
    empty = cache.MLALatentCache().to_quantized(group_size=64, bits=4)
    assert type(empty) is cache.QuantizedMLALatentCache and empty.empty() and empty.offset == 0


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


@pytest.mark.parametrize("model_type", tiny.MLA_MODEL_TYPES)
def test_merged_rows_decode_with_a_quantized_latent(model_type):
    """Three caches made, filled, merged with ``type(c).merge``, extracted,
    then decoded with kv_bits 4 from position 0: the latent is quantized."""
    model, _ = tiny.build_model(model_type)
    caches = [prefilled(model, PROMPT[:n]) for n in (5, 9, 3)]
    batch = [type(layer[0]).merge(list(layer)) for layer in zip(*caches)]
    for i in range(3):
        row = [c.extract(i) for c in batch]
        steps = generate_step(mx.array([7]), model, prompt_cache=row, max_tokens=3,
                              kv_bits=4, kv_group_size=32, quantized_kv_start=0)
        assert len(list(steps)) == 3
        quantized = [c for c in leaves(row) if type(c) is cache.QuantizedMLALatentCache]
        assert len(quantized) == latent_attention(model)


def _stream(port, prompt, times, together):
    body = {"prompt": prompt, "max_tokens": 400, "temperature": 0.0, "stream": True,
            "logit_bias": {str(tiny.EOS_TOKEN_ID): -100}}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    together.wait()
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            if line.startswith(b"data: {"):
                times.setdefault(prompt, []).append(time.monotonic())


def test_the_server_batches_concurrent_requests_under_kv_bits(tmp_path):
    """``mlx_lm.server --kv-bits 4 --decode-concurrency 4``: four requests sent
    together all stream their first token before any streams its last."""
    model = tiny.save_model(tmp_path / "glm", "glm4_moe_lite")
    flags = ["--kv-bits", "4", "--quantized-kv-start", "0", "--decode-concurrency", "4"]
    with Server(model, *flags, disabled=True) as server:
        times, together = {}, threading.Barrier(4)
        args = [(server.port, f"request {i} says", times, together) for i in range(4)]
        threads = [threading.Thread(target=_stream, args=a) for a in args]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(times) == 4 and all(len(t) > 5 for t in times.values())
    assert max(t[0] for t in times.values()) < min(t[-1] for t in times.values())


@pytest.mark.parametrize("model_type", ["glm4_moe_lite", "deepseek_v32"])
def test_generate_refuses_a_prompt_cache_file_quantized_otherwise(model_type, tmp_path):
    """``mlx_lm.generate --prompt-cache-file`` with other ``--kv-bits`` than
    the file's quantized latent: refused by name, as for QuantizedKVCache."""
    path = tiny.save_model(tmp_path / "m", model_type)
    model, _ = tiny.build_model(model_type)
    caches = prefilled(model, PROMPT[:9])
    maybe_quantize_kv_cache(caches, 0, 32, 4)
    cache.save_prompt_cache(str(tmp_path / "c.safetensors"), caches)
    out = subprocess.run(
        [sys.executable, "-m", "mlx_lm.generate", "--model", str(path), "--prompt", "hi", "--max-tokens", "2",
         "--prompt-cache-file", str(tmp_path / "c.safetensors"), "--kv-bits", "8", "--kv-group-size", "32"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode != 0 and "--kv-bits does not match" in out.stderr


def _latent(n, bits=None, group_size=32):
    c = cache.MLALatentCache()
    c.update_and_fetch(mx.ones((1, 1, n, 64)), mx.ones((1, 1, n, 16)))
    return c if bits is None else c.to_quantized(group_size=group_size, bits=bits)


def test_rows_quantized_two_ways_are_refused_by_name_in_any_order():
    rows = [_latent(0, 8, 64), _latent(5), _latent(3, 4, 32), _latent(2, 8, 64)]
    for order in (rows, rows[::-1]):
        with pytest.raises(ValueError, match="MLA latent caches quantized differently"):
            cache.MLALatentCache.merge(order)
    batch = cache.MLALatentCache.merge(rows[:3])  # the empty row takes the others' format
    assert (batch.group_size, batch.bits, batch.offset.tolist()) == (32, 4, [0, 5, 3])


def test_a_cache_list_refuses_to_requantize_like_a_single_cache():
    listed = cache.MLACacheList(_latent(3), cache.KVCache()).to_quantized(group_size=32, bits=4)
    assert listed.to_quantized(group_size=32, bits=4) is listed
    with pytest.raises(ValueError, match="quantized once"):
        listed.to_quantized(group_size=64, bits=8)
