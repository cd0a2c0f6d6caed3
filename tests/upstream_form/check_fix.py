"""The fix on its own: an mlx-lm tree with ``upstream/1-mla-latent-cache.patch``
applied (alone, or with the rest of the series), first on the path, with
this package switched off.

Run by ``tests/test_upstream.py`` as
``MLX_LM_MLA_DISABLE=1 PYTHONPATH=<patched tree> pytest -o python_files=check_*.py``.
Everything here is reached through mlx-lm alone; the models are tiny random
ones of every MLA architecture that the package finds in the tree
(``mlx_lm_mla.mla``), at the real latent widths (512, and a 64-wide RoPE key).
"""

import functools
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm.models.cache as cache
import pytest
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import make_prompt_cache

import mlx_lm_mla
from mlx_lm_mla import tiny
from mlx_lm_mla.testing import replay
from mlx_lm_mla.testing.replay import generated, requests

WIDE = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_head_dim": 64}
PROMPT = [(5 * i + 7) % 190 + 5 for i in range(23)]
START = 32  # quantized_kv_start: every request crosses it
serve = functools.partial(replay.serve, start=START)
# The MLA models whose released Model has no make_cache: windowed under max_kv_size.
RELEASED_WITHOUT_MAKE_CACHE = {
    "deepseek_v3",
    "glm4_moe_lite",
    "kimi_k25",
    "kimi_vl",
    "mistral3",
    "mistral4",
}


def leaves(caches):
    return [m for c in caches for m in getattr(c, "caches", [c])]


def latent_attention(model):
    """How many attention modules cache an MLA latent: those with a
    ``kv_lora_rank`` and the absorbed ``embed_q``."""
    return sum(
        isinstance(getattr(m, "kv_lora_rank", None), int) and hasattr(m, "embed_q")
        for layer in model.layers
        for _, m in layer.named_modules()
    )


def quantizing(caches):
    """The latent caches that kv_bits quantizes: those a layer holds itself.
    A CacheList (DeepSeek-V3.2's latent and indexer, LongCat's two latents)
    does not quantize, as released."""
    return [
        c
        for c in caches
        if isinstance(c, (cache.MLALatentCache, cache.QuantizedMLALatentCache))
    ]


def prefilled(model, tokens, **kwargs):
    caches = make_prompt_cache(model, **kwargs)
    model(mx.array([tokens]), cache=caches)
    return caches


def test_the_patched_tree_runs_alone():
    tree = Path(os.environ["PYTHONPATH"].split(os.pathsep)[0]).resolve()
    assert Path(cache.__file__).resolve().is_relative_to(tree)
    assert mlx_lm_mla.installed() == []


@pytest.mark.parametrize("model_type", tiny.MLA_MODEL_TYPES)
def test_every_latent_attention_gets_an_mla_latent_cache(model_type):
    model, _ = tiny.build_model(model_type)
    latent = [
        c for c in leaves(make_prompt_cache(model)) if type(c) is cache.MLALatentCache
    ]
    assert len(latent) == latent_attention(model) > 0


@pytest.mark.parametrize("model_type", tiny.MLA_MODEL_TYPES)
def test_reuse_under_kv_bits_serves_every_request(model_type):
    """The reported failure: requests that cross quantized_kv_start, then
    reuse the cache, at the real widths."""
    model, _ = tiny.build_model(model_type, **WIDE)
    caches = make_prompt_cache(model)
    history, _ = serve(model, caches, [], requests(1)[0] + list(range(5, 30)), 4)
    for prompt in requests(4):
        history, out = serve(model, caches, history, prompt, 4)
        assert len(out) == 12
    assert all(
        type(c) is cache.QuantizedMLALatentCache and c.bits == 4
        for c in quantizing(caches)
    )


class FakeQuantizedLatent(cache.MLALatentCache):
    """The reference: from ``to_quantized`` on, the latent it holds and each
    one written after it are quantized and dequantized where they lie."""

    bits = None

    def fake(self, latent):
        packed = mx.quantize(latent, group_size=32, bits=self.bits)
        return mx.dequantize(*packed, group_size=32, bits=self.bits)

    def to_quantized(self, group_size, bits):
        if self.bits is None:
            self.bits, n = bits, self.offset
            self.keys, self.values = (
                self.fake(self.keys[..., :n, :]),
                self.values[..., :n, :],
            )
        return self

    def update_and_fetch(self, latent, rope):
        return super().update_and_fetch(
            latent if self.bits is None else self.fake(latent), rope
        )


def decoded(model, caches, bits):
    """Logits of PROMPT: 10 tokens at once, then one at a time, the cache
    quantized after the first 10."""
    first = model(mx.array([PROMPT[:10]]), cache=caches)
    maybe_quantize_kv_cache(caches, 0, 32, bits)
    rest = [model(mx.array([[t]]), cache=caches) for t in PROMPT[10:]]
    return mx.concatenate([first] + rest, axis=1)


@pytest.mark.parametrize("model_type", tiny.MLA_MODEL_TYPES)
def test_logits_match_a_full_forward(model_type):
    model, _ = tiny.build_model(model_type)
    full = model(mx.array([PROMPT]))
    assert mx.allclose(
        decoded(model, make_prompt_cache(model), None), full, atol=1e-4, rtol=1e-4
    ).item()


@pytest.mark.parametrize("model_type", tiny.MLA_MODEL_TYPES)
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_logits_equal_a_fake_quantized_latent(model_type, bits):
    """Bit for bit: the model reads the latent quantized and dequantized, the
    RoPE key exact, from the tokens the cache held before it quantized on."""
    model, _ = tiny.build_model(model_type)
    fake = [
        FakeQuantizedLatent() if type(c) is cache.MLALatentCache else c
        for c in make_prompt_cache(model)
    ]
    caches = make_prompt_cache(model)
    assert mx.array_equal(decoded(model, caches, bits), decoded(model, fake, bits))
    held = [[getattr(c, "bits", None) for c in quantizing(x)] for x in (caches, fake)]
    assert held[0] == held[1] == [bits] * len(held[1])


@pytest.mark.parametrize("model_type", tiny.MLA_MODEL_TYPES)
def test_reuse_without_quantization_is_exact(model_type):
    model, _ = tiny.build_model(model_type)
    caches, history = make_prompt_cache(model), []
    for prompt in requests(4):
        history, out = serve(model, caches, history, prompt, None)
        assert out == serve(model, make_prompt_cache(model), [], prompt, None)[1]


@pytest.mark.parametrize("model_type", tiny.MLA_MODEL_TYPES)
def test_max_kv_size_windows_the_models_that_only_cache_latents(model_type):
    # They had no make_cache before the fix; hybrids and CacheLists keep theirs.
    model, _ = tiny.build_model(model_type)
    made, windowed = make_prompt_cache(model), make_prompt_cache(model, max_kv_size=16)
    only_latents = all(type(c) is cache.MLALatentCache for c in made)
    assert only_latents == (model_type in RELEASED_WITHOUT_MAKE_CACHE)
    for c, w in zip(made, windowed):
        if only_latents:
            assert type(w) is cache.RotatingKVCache and w.max_size == 16
        else:
            assert type(w) is type(c)
    caches = prefilled(model, PROMPT * 2, max_kv_size=16)
    assert all(
        c.keys.shape[2] <= 16 + len(PROMPT * 2) - 1
        for c in caches
        if type(c) is cache.RotatingKVCache
    )
    model(mx.array([[7]]), cache=caches)
    assert all(
        c.keys.shape[2] == 16 for c in caches if type(c) is cache.RotatingKVCache
    )


@pytest.mark.parametrize("model_type", ["glm4_moe_lite", "deepseek_v32", "kimi_linear"])
@pytest.mark.parametrize("bits", [None, 4])
def test_save_and_load_continue_exactly(model_type, bits, tmp_path):
    model, _ = tiny.build_model(model_type, **WIDE)
    caches = prefilled(model, PROMPT[:14])
    maybe_quantize_kv_cache(caches, 0, 64, bits)
    path = str(tmp_path / "c.safetensors")
    cache.save_prompt_cache(path, caches)
    loaded = cache.load_prompt_cache(path)
    assert [type(c) for c in leaves(loaded)] == [type(c) for c in leaves(caches)]
    step = mx.array([PROMPT[14:]])
    assert mx.array_equal(model(step, cache=loaded), model(step, cache=caches))


def test_an_empty_latent_cache_quantizes_to_an_empty_one():
    empty = cache.MLALatentCache().to_quantized(group_size=64, bits=4)
    assert (
        type(empty) is cache.QuantizedMLALatentCache
        and empty.empty()
        and empty.offset == 0
    )


def test_a_quantized_latent_is_not_requantized_to_another_format():
    latent = cache.MLALatentCache()
    latent.update_and_fetch(mx.ones((1, 1, 3, 512)), mx.ones((1, 1, 3, 64)))
    quantized = latent.to_quantized(group_size=64, bits=4)
    assert quantized.to_quantized(group_size=64, bits=4) is quantized
    with pytest.raises(
        ValueError, match="quantized to 4 bits in groups of 64; it cannot take 8 bits"
    ):
        quantized.to_quantized(group_size=64, bits=8)


@pytest.mark.parametrize("model_type", ["glm4_moe_lite", "kimi_linear"])
def test_a_hand_built_kv_cache_is_refused_under_kv_bits_and_served_without(model_type):
    model, _ = tiny.build_model(model_type, **WIDE)
    hand_built = [
        cache.KVCache() if type(c) is cache.MLALatentCache else c
        for c in make_prompt_cache(model)
    ]
    with pytest.raises(
        ValueError,
        match=r"caches an MLA latent \(MLALatentCache\), but the prompt cache holds a KVCache",
    ):
        generated(model, hand_built, PROMPT, 2, bits=4)
    alone = generated(model, None, PROMPT, 4)
    assert generated(model, hand_built, PROMPT, 4) == alone


def _generate(path, *flags):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mlx_lm.generate",
            "--model",
            str(path),
            "--prompt",
            "hi",
            "--max-tokens",
            "2",
            *map(str, flags),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_generate_refuses_a_prompt_cache_file_saved_by_the_release(tmp_path):
    """What mlx-lm 0.32.2 saves for GLM-4.7-Flash: a KVCache per layer, named
    so in the file. With --kv-bits it is refused by name, not with the
    reported AttributeError."""
    path = tiny.save_model(tmp_path / "m", "glm4_moe_lite", **WIDE)
    model, _ = tiny.build_model("glm4_moe_lite", **WIDE)
    released = [cache.KVCache() for _ in model.layers]
    model(mx.array([PROMPT]), cache=released)
    file = tmp_path / "c.safetensors"
    cache.save_prompt_cache(
        str(file), released, {"model": str(path), "tokenizer_config": "{}"}
    )
    out = _generate(
        path, "--prompt-cache-file", file, "--kv-bits", "4", "--quantized-kv-start", "0"
    )
    assert out.returncode != 0
    assert "A prompt cache saved by an earlier mlx-lm must be made again" in out.stderr
    assert "swapaxes" not in out.stderr


def test_generate_refuses_a_prompt_cache_file_quantized_otherwise(tmp_path):
    path = tiny.save_model(tmp_path / "m", "glm4_moe_lite", **WIDE)
    model, _ = tiny.build_model("glm4_moe_lite", **WIDE)
    caches = prefilled(model, PROMPT)
    maybe_quantize_kv_cache(caches, 0, 64, 4)
    file = tmp_path / "c.safetensors"
    cache.save_prompt_cache(
        str(file), caches, {"model": str(path), "tokenizer_config": "{}"}
    )
    out = _generate(
        path, "--prompt-cache-file", file, "--kv-bits", "8", "--quantized-kv-start", "0"
    )
    assert (
        out.returncode != 0
        and "quantized to 4 bits in groups of 64; it cannot take 8 bits" in out.stderr
    )
