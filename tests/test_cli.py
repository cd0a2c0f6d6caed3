"""mlx-lm's own command line with the package active through its start-up
hook: ``mlx_lm cache_prompt --kv-bits`` saves a quantized latent, and
``mlx_lm generate --prompt-cache-file`` continues from it."""

import os
import subprocess
import sys

import pytest
from mlx_lm.models.cache import load_prompt_cache

from mlx_lm_mla import QuantizedLatentCache, tiny

WIDTHS = {
    "glm-widths": {"kv_lora_rank": 128, "qk_rope_head_dim": 64},
    "square": {"kv_lora_rank": 64, "qk_rope_head_dim": 64},  # latent as wide as its RoPE key
}
PROMPT = "Tell me about the weather in a small mountain village in winter."


def mlx_lm(*args, disabled=False):
    env = dict(os.environ)
    env.pop("MLX_LM_MLA_DISABLE", None)
    if disabled:
        env["MLX_LM_MLA_DISABLE"] = "1"
    command = [sys.executable, "-m", "mlx_lm", *map(str, args)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def cache_prompt(model, path, disabled=False):
    return mlx_lm(
        "cache_prompt", "--model", model, "--prompt", PROMPT, "--prompt-cache-file", path,
        "--kv-bits", 4, "--quantized-kv-start", 8, disabled=disabled,
    )


@pytest.fixture(scope="module", params=list(WIDTHS), ids=list(WIDTHS))
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "model"
    return tiny.save_model(path, "glm4_moe_lite", **WIDTHS[request.param])


def test_cache_prompt_with_kv_bits_saves_a_quantized_latent(model, tmp_path, installed):
    out = cache_prompt(model, tmp_path / "prompt.safetensors")
    assert out.returncode == 0, out.stderr
    cache = load_prompt_cache(str(tmp_path / "prompt.safetensors"))
    assert all(type(c) is QuantizedLatentCache and c.latent_bits == 4 for c in cache)
    assert cache[0].offset > 8


def test_generate_continues_from_a_saved_quantized_latent(model, tmp_path):
    assert cache_prompt(model, tmp_path / "prompt.safetensors").returncode == 0
    out = mlx_lm(
        "generate", "--model", model, "--prompt-cache-file", tmp_path / "prompt.safetensors",
        "--prompt", " And in summer?", "--max-tokens", 8, "--kv-bits", 4, "--verbose", "True",
    )
    assert out.returncode == 0, out.stderr
    assert "Generation: 8 tokens" in out.stdout


def test_generate_refuses_other_bits_than_the_saved_cache_by_name(model, tmp_path):
    assert cache_prompt(model, tmp_path / "prompt.safetensors").returncode == 0
    out = mlx_lm(
        "generate", "--model", model, "--prompt-cache-file", tmp_path / "prompt.safetensors",
        "--prompt", " And in summer?", "--max-tokens", 8, "--kv-bits", 8,
    )
    assert out.returncode != 0
    assert "quantized with group_size 64 and 4 bits; kv_bits 8 with kv_group_size 64 was asked for" in out.stderr


def test_stock_cache_prompt_with_kv_bits_fails(model, tmp_path):
    out = cache_prompt(model, tmp_path / "prompt.safetensors", disabled=True)
    assert out.returncode != 0 and "'list' object has no attribute 'swapaxes'" in out.stderr
