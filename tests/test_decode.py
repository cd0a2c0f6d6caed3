"""MLA decode attention reads the latent once: a decode step of every MLA
model gives stock's logits, a quantized latent is read from its bytes a
chunk at a time, and prefill and other models keep stock's attention."""

import importlib
import warnings

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

import mlx_lm_mla
from mlx_lm_mla import decode, decode_cuda, mla, patches
from mlx_lm_mla.cache import _PackedLatent
from mlx_lm_mla import tiny

from conftest import step_logits

TOKENS = [(5 * i + 7) % 190 + 5 for i in range(150)]
PREFILL = 70


def decode_logits(model, bits=None):
    return step_logits(model, TOKENS, PREFILL, bits)


def stock_logits(model, **kwargs):
    mlx_lm_mla.uninstall()
    try:
        return decode_logits(model, **kwargs)
    finally:
        mlx_lm_mla.install()


@pytest.fixture(autouse=True)
def portable_path(monkeypatch):
    """These tests are of the portable path; on MLX's CUDA backend the kernel
    has its own (tests/test_decode_cuda.py)."""
    monkeypatch.setattr(decode_cuda, "ENABLED", False)


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 64 positions, so the tiny models' steps span several."""
    monkeypatch.setattr(decode, "CHUNK_BYTES", {"cpu": 1, "gpu": 1})


@pytest.fixture
def calls(monkeypatch):
    """Every latent_attention call: whether it read a cache's bytes."""
    seen, original = [], decode.latent_attention

    def recording(queries, latent, scale, mask=None, read=None):
        seen.append(read is not None)
        return original(queries, latent, scale, mask, read)

    monkeypatch.setattr(decode, "latent_attention", recording)
    return seen


@pytest.mark.parametrize("model_type", tiny.MLA_MODEL_TYPES)
def test_decode_steps_give_stocks_logits(model_type, installed, small_chunks, calls):
    model, _ = tiny.build_model(model_type)
    expected = stock_logits(model)
    got = decode_logits(model)
    assert calls and mx.allclose(got, expected, atol=1e-4, rtol=1e-4).item()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_half_precision_decode_steps_are_as_close_to_float32_as_stocks(
    dtype, installed, small_chunks, calls
):
    def model(dtype_):
        m, _ = tiny.build_model("glm4_moe_lite", dtype=dtype, first_k_dense_replace=99)
        m.set_dtype(dtype_)  # the same rounded weights
        return m

    half = model(dtype)
    exact = stock_logits(model(mx.float32))
    stock = mx.abs(stock_logits(half).astype(mx.float32) - exact).max().item()
    got = mx.abs(decode_logits(half).astype(mx.float32) - exact).max().item()
    # Within one rounding of the largest logit (eps / 2, relative).
    bound = stock + mx.finfo(dtype).eps / 2 * mx.abs(exact).max().item()
    assert calls and got <= bound


@pytest.mark.parametrize("model_type", tiny.MLA_MODEL_TYPES)
@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_latent_is_read_from_its_bytes(
    model_type, bits, installed, small_chunks, calls, monkeypatch
):
    model, _ = tiny.build_model(model_type)
    got = decode_logits(model, bits)
    # DSA models gather the positions they attend: those are read as handed.
    assert any(calls) if model_type not in ("deepseek_v32", "glm_moe_dsa") else calls
    # The same steps attending the dequantized latent the cache hands back.
    monkeypatch.setattr(_PackedLatent, "latent_reader", lambda self, latent: None)
    assert mx.array_equal(got, decode_logits(model, bits)).item()


def test_a_batch_with_left_padding_decodes_as_stock(installed, small_chunks, calls):
    model, _ = tiny.build_model("glm4_moe_lite")
    prompts = [TOKENS[:90], TOKENS[20:60]]

    def batch_logits():
        caches = []
        for p in prompts:
            c = make_prompt_cache(model)
            model(mx.array([p]), cache=c)
            caches.append(c)
        batch = [
            BatchKVCache.merge([c[i] for c in caches]) for i in range(len(model.layers))
        ]
        return mx.concatenate(
            [model(mx.array([[t], [t + 1]]), cache=batch) for t in TOKENS[100:110]],
            axis=1,
        )

    mlx_lm_mla.uninstall()
    expected = batch_logits()
    mlx_lm_mla.install()
    got = batch_logits()
    assert calls and mx.allclose(got, expected, atol=1e-4, rtol=1e-4).item()


def test_prefill_keeps_stocks_attention(installed, calls):
    model, _ = tiny.build_model("glm4_moe_lite")
    model(mx.array([TOKENS[:20]]), cache=make_prompt_cache(model))
    assert calls == []


def test_models_without_mla_attention_keep_stocks_attention(installed):
    base = importlib.import_module("mlx_lm.models.base")
    for model_type in tiny.FULL_KV_MODEL_TYPES + ("llama", "qwen2"):
        module = importlib.import_module(f"mlx_lm.models.{model_type}")
        if hasattr(module, "scaled_dot_product_attention"):
            assert (
                module.scaled_dot_product_attention is base.scaled_dot_product_attention
            ), model_type


def test_uninstall_restores_each_modules_attention(installed):
    base = importlib.import_module("mlx_lm.models.base")
    modules = {importlib.import_module(c.__module__) for c in mla.ATTENTION}
    assert all(
        m.scaled_dot_product_attention is not base.scaled_dot_product_attention
        for m in modules
    )
    mlx_lm_mla.uninstall()
    assert all(
        m.scaled_dot_product_attention is base.scaled_dot_product_attention
        for m in modules
    )


def test_a_quantized_decode_step_holds_a_few_chunks_not_the_latent(installed):
    # One layer at the real widths: a 64K-position latent is 64 MiB in bf16.
    cache, n = KVCache(), 1 << 16
    for _ in range(n // 4096):
        cache.update_and_fetch(
            mx.random.normal((1, 1, 4096, 512)).astype(mx.bfloat16),
            mx.random.normal((1, 1, 4096, 64)).astype(mx.bfloat16),
        )
    cache.to_quantized(group_size=64, bits=4)
    latent, rope = cache.update_and_fetch(
        mx.zeros((1, 1, 1, 512), mx.bfloat16), mx.zeros((1, 1, 1, 64), mx.bfloat16)
    )
    q = mx.random.normal((1, 20, 1, 512)).astype(mx.bfloat16)
    pe = mx.random.normal((1, 20, 1, n + 1)).astype(mx.bfloat16)
    mx.eval(cache.state, q, pe)
    sdpa = importlib.import_module(
        "mlx_lm.models.glm4_moe_lite"
    ).scaled_dot_product_attention
    mx.synchronize()
    held = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(sdpa(q, latent, latent, cache=cache, scale=0.1, mask=pe))
    transient = mx.get_peak_memory() - held
    assert transient < (n * 512 * 2) / 4


def test_the_source_says_whether_an_attention_calls_a_function_by_name():
    class Calls:
        def __call__(self, q, k, v, cache=None):
            return scaled_dot_product_attention(  # noqa: F821
                q, k, v, cache=cache, scale=1.0, mask=None
            )

    class CallsOther:
        def __call__(self, q, k, v, cache=None):
            return q.attention(k, v)

    assert mla.calls(Calls, "scaled_dot_product_attention")
    assert not mla.calls(CallsOther, "scaled_dot_product_attention")


def test_an_attention_that_no_longer_calls_it_is_named_and_its_decode_is_off(
    stock, monkeypatch
):
    glm = importlib.import_module("mlx_lm.models.glm4_moe_lite")
    original = glm.scaled_dot_product_attention
    calls_ = mla.calls
    monkeypatch.setattr(
        mla,
        "calls",
        lambda cls, name: cls.__module__ != glm.__name__ and calls_(cls, name),
    )
    monkeypatch.setattr(patches, "_warned_missing", set())
    with pytest.warns(
        RuntimeWarning,
        match="switched off: MLA decode attention reading the latent once",
    ):
        mlx_lm_mla.install()
    assert (
        "mlx_lm.models.glm4_moe_lite.scaled_dot_product_attention (called by its MLA attention)"
        in patches.missing()
    )
    assert glm.scaled_dot_product_attention is original
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert (
            "mlx_lm.models.deepseek_v3.scaled_dot_product_attention"
            in mlx_lm_mla.installed()
        )
