"""mlx-lm's own command line with the package active through its start-up
hook: ``mlx_lm cache_prompt --kv-bits`` saves a quantized latent, and
``mlx_lm generate --prompt-cache-file`` continues from it."""

import os
import subprocess
import sys

import pytest
import mlx_lm.models.cache as cache_module

from mlx_lm_mla import QuantizedLatentCache
from mlx_lm_mla import tiny
from mlx_lm_mla.mla import leaves

from conftest import SWAPAXES

MODELS = {
    "glm-widths": ("glm4_moe_lite", {"kv_lora_rank": 128, "qk_rope_head_dim": 64}),
    "square": (
        "glm4_moe_lite",
        {"kv_lora_rank": 64, "qk_rope_head_dim": 64},
    ),  # latent as wide as its RoPE key
    "deepseek_v32": (
        "deepseek_v32",
        {},
    ),  # a CacheList; mlx-lm 0.31's indexer holds an empty array
}
GLM = ["glm-widths", "square"]
PROMPT = "Tell me about the weather in a small mountain village in winter."


def mlx_lm(*args, disabled=False, module="mlx_lm"):
    """``python -m mlx_lm COMMAND ...``, or with ``module`` another entry point
    (``mlx_lm.generate`` takes the arguments after the command's name)."""
    env = dict(os.environ)
    env.pop("MLX_LM_MLA_DISABLE", None)
    if disabled:
        env["MLX_LM_MLA_DISABLE"] = "1"
    args = args if module == "mlx_lm" else args[1:]
    command = [sys.executable, "-m", module, *map(str, args)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def cache_prompt(model, path, disabled=False):
    return mlx_lm(
        "cache_prompt",
        "--model",
        model,
        "--prompt",
        PROMPT,
        "--prompt-cache-file",
        path,
        "--kv-bits",
        4,
        "--quantized-kv-start",
        8,
        disabled=disabled,
    )


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


def saved(name, folder):
    # Each model is written once for the module, whichever fixture asks.
    if not (folder / name / "config.json").exists():
        model_type, overrides = MODELS[name]
        tiny.save_model(folder / name, model_type, **overrides)
    return folder / name


@pytest.fixture(scope="module", params=list(MODELS))
def model(request, folder):
    return saved(request.param, folder)


@pytest.fixture(scope="module", params=GLM)
def glm_model(request, folder):
    return saved(request.param, folder)


@pytest.fixture(scope="module")
def saved_prompt(model, tmp_path_factory):
    """``mlx_lm cache_prompt --kv-bits 4`` run once per model: (file, result)."""
    path = tmp_path_factory.mktemp("prompt") / "prompt.safetensors"
    return path, cache_prompt(model, path)


def test_cache_prompt_with_kv_bits_saves_a_quantized_latent(saved_prompt, installed):
    path, out = saved_prompt
    assert out.returncode == 0, out.stderr
    cache = cache_module.load_prompt_cache(str(path))  # as patched now
    latent = [m for c in cache for m in leaves([c]) if type(m) is QuantizedLatentCache]
    assert len(latent) == len(cache) and all(
        m.latent_bits == 4 and m.offset > 8 for m in latent
    )


def continue_from(model, path, bits, module="mlx_lm"):
    return mlx_lm(
        "generate",
        "--model",
        model,
        "--prompt-cache-file",
        path,
        "--prompt",
        " And in summer?",
        "--max-tokens",
        8,
        "--kv-bits",
        bits,
        "--verbose",
        "True",
        module=module,
    )


def test_generate_continues_from_a_saved_quantized_latent(model, saved_prompt):
    out = continue_from(model, saved_prompt[0], 4)
    assert out.returncode == 0, out.stderr
    assert "Generation: 8 tokens" in out.stdout


OTHER_BITS = (
    "quantized with group_size 64 and 4 bits; kv_bits 8 with kv_group_size 64 was "
    "asked for"
)


def test_generate_refuses_other_bits_than_the_saved_cache_by_name(model, saved_prompt):
    out = continue_from(model, saved_prompt[0], 8)
    assert out.returncode != 0 and OTHER_BITS in out.stderr


@pytest.mark.parametrize("model", ["glm-widths"], indirect=True)
def test_python_m_mlx_lm_generate_is_checked_as_the_mlx_lm_command_is(
    model, saved_prompt
):
    # runpy's __main__ copy of generate.py would define a generate_step of its own.
    out = continue_from(model, saved_prompt[0], 8, module="mlx_lm.generate")
    assert out.returncode != 0 and OTHER_BITS in out.stderr


def test_stock_cache_prompt_with_kv_bits_fails(glm_model, tmp_path):
    out = cache_prompt(glm_model, tmp_path / "prompt.safetensors", disabled=True)
    assert out.returncode != 0 and SWAPAXES in out.stderr
