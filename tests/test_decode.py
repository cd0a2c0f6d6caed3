"""MLA decode attention reads the latent once: a decode step of every MLA
model gives stock's logits, a quantized latent is read from its bytes a
chunk at a time, and prefill and other models keep stock's attention."""

import importlib
import logging
import os
import subprocess
import sys
import warnings

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache

import mlx_lm_mla
from mlx_lm_mla import decode, decode_cuda, mla, patches
from mlx_lm_mla.cache import _PackedLatent
from mlx_lm_mla import tiny

from conftest import left_padded_batch, step_logits

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
    """These tests are of the fold, which every device then takes (the
    choice's tests below leave the choice to ``auto``); on MLX's CUDA backend
    the kernel has its own (tests/test_decode_cuda.py)."""
    monkeypatch.setattr(decode_cuda, "ENABLED", False)
    monkeypatch.setenv("MLX_LM_MLA_DECODE", "fold")


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


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_a_dsa_model_attending_every_position_reads_the_bytes(
    model_type, installed, small_chunks, calls
):
    # Below index_topk nothing is gathered: the latent the cache handed over
    # is attended, though the model rebinds the cache's keys after the fetch.
    model, _ = tiny.build_model(model_type, index_topk=len(TOKENS))
    decode_logits(model, 4)
    assert calls and all(calls)


def test_a_batch_with_left_padding_decodes_as_stock(installed, small_chunks, calls):
    model, _ = tiny.build_model("glm4_moe_lite")
    prompts = [TOKENS[:90], TOKENS[20:60]]

    def batch_logits():
        batch = left_padded_batch(model, prompts)
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


def fold_transient(columns, positions):
    """The bytes ``latent_attention`` holds beyond its inputs for ``columns``
    queries (heads times a chunk's positions) over ``positions`` rows."""
    q = mx.random.normal((1, columns, 1, 512))
    latent = mx.random.normal((1, 1, positions, 512))
    mx.eval(q, latent)
    mx.synchronize()
    held = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(decode.latent_attention(q, latent, 0.1, chunk=512))
    return mx.get_peak_memory() - held


def test_the_folds_transient_does_not_grow_with_the_positions_read():
    # Each chunk's float32 weights (500 columns x 512 rows: 1 MiB) are let go
    # as the next is read: 8,192 more positions would be 16 MiB of them.
    grown = fold_transient(500, 4096 + 8192) - fold_transient(500, 4096)
    assert grown < (500 * 8192 * 4) / 8


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


# The choice among stock, the fold and (on CUDA) the kernel.


TIMED = decode._seconds  # as imported, before a test patches it


@pytest.fixture
def auto(monkeypatch):
    """Steps choose their path afresh, by timing on every device (the CPU's
    rule off), the timing patched: ``seconds[path]`` is each path's time.
    Returns (seconds, the path names timed together at each choice)."""
    monkeypatch.delenv("MLX_LM_MLA_DECODE")
    for table in ("_CHOSEN", "_OFF", "_KERNEL_AGREES"):
        monkeypatch.setattr(decode, table, {})
    monkeypatch.setattr(decode, "rule", lambda key: None)
    seconds, timed = {}, []

    def measured(runs):
        timed.append(sorted(runs))
        return {name: seconds[name] for name in runs}

    monkeypatch.setattr(decode, "_seconds", measured)
    return seconds, timed


def short_logits(model, prefill=120, end=135):
    """Steps at 121 to 135 positions: two lengths to the next power of two."""
    cache = make_prompt_cache(model)
    model(mx.array([TOKENS[:prefill]]), cache=cache)
    steps = [model(mx.array([[t]]), cache=cache) for t in TOKENS[prefill:end]]
    return mx.concatenate(steps, axis=1)


def stock_short_logits(model):
    mlx_lm_mla.uninstall()
    try:
        return short_logits(model)
    finally:
        mlx_lm_mla.install()


def broken(monkeypatch, path, after=0):
    """``path`` raises from its ``after + 1``-th call on; returns its calls."""
    calls, original = [], decode._paths

    def paths(*args):
        runs = original(*args)
        run = runs[path]

        def failing():
            calls.append(1)
            if len(calls) > after:
                raise RuntimeError(f"{path} broke")
            return run()

        runs[path] = failing
        return runs

    monkeypatch.setattr(decode, "_paths", paths)
    return calls


def test_a_slower_fold_serves_no_step(installed, auto):
    seconds, timed = auto
    seconds.update(stock=1.0, fold=2.0)
    model, _ = tiny.build_model("glm4_moe_lite")
    got = short_logits(model)
    assert timed == [["fold", "stock"], ["fold", "stock"]]
    assert set(decode._CHOSEN.values()) == {"stock"}
    assert mx.array_equal(got, stock_short_logits(model)).item()


def _sdpa_step(queries, length):
    import mlx_lm.models.deepseek_v3 as deepseek_v3

    latent = mx.random.normal((1, 1, length, 64), key=mx.random.key(1))
    mask = mx.zeros((1, queries.shape[1], 1, length))
    return deepseek_v3.scaled_dot_product_attention(
        queries, latent, latent, cache=None, scale=0.1, mask=mask
    )


def test_a_step_under_mx_compile_is_stocks_and_chooses_nothing(installed, auto):
    seconds, timed = auto
    seconds.update(stock=2.0, fold=1.0)
    queries = mx.random.normal((1, 8, 1, 64), key=mx.random.key(0))
    compiled = mx.compile(lambda q: _sdpa_step(q, 300))
    got = compiled(queries)
    assert timed == [] and decode._CHOSEN == {} and decode._OFF == {}
    assert mx.allclose(got, _sdpa_step(queries, 300), atol=1e-5).item()


def test_a_step_that_is_not_finite_turns_no_path_off(installed, auto):
    seconds, timed = auto
    seconds.update(stock=2.0, fold=1.0)
    queries = mx.random.normal((1, 8, 1, 64), key=mx.random.key(0))
    poisoned = mx.where(mx.arange(64) == 0, mx.nan, queries)
    assert mx.isnan(_sdpa_step(poisoned, 300)).any().item()
    assert decode._CHOSEN == {} and not any(decode._OFF.values())
    _sdpa_step(queries, 300)  # a clean step of the same kind chooses the fold
    assert set(decode._CHOSEN.values()) == {"fold"}


def test_a_faster_fold_serves_every_step(installed, auto, calls):
    seconds, timed = auto
    seconds.update(stock=2.0, fold=1.0)
    model, _ = tiny.build_model("glm4_moe_lite")
    got = short_logits(model)
    assert len(timed) == 2 and set(decode._CHOSEN.values()) == {"fold"}
    # Each step a call; each choice also one for float32 attention.
    assert len(calls) == 15 * len(model.layers) + 2
    assert mx.allclose(got, stock_short_logits(model), atol=1e-4, rtol=1e-4).item()


def test_a_failing_fold_falls_back_to_stock_with_stocks_logits(
    installed, auto, monkeypatch, caplog
):
    seconds, _ = auto
    seconds.update(stock=2.0, fold=1.0)
    failed = broken(monkeypatch, "fold")
    model, _ = tiny.build_model("glm4_moe_lite")
    with caplog.at_level(logging.WARNING, logger="mlx_lm_mla.decode"):
        got = short_logits(model)
    assert len(failed) == 1  # tried once, then off for the kind
    assert "fold off" in caplog.text and "fold broke" in caplog.text
    assert mx.array_equal(got, stock_short_logits(model)).item()


@pytest.mark.parametrize(
    "wrong", [lambda out: out * 1.01, lambda out: out * mx.nan], ids=["1%", "nan"]
)
def test_a_fold_that_disagrees_with_float32_attention_serves_no_step(
    installed, auto, monkeypatch, wrong
):
    seconds, timed = auto
    seconds.update(stock=2.0, fold=1.0)
    original = decode._paths

    def paths(*args):
        runs = original(*args)
        run = runs["fold"]
        runs["fold"] = lambda: wrong(run())
        return runs

    monkeypatch.setattr(decode, "_paths", paths)
    model, _ = tiny.build_model("glm4_moe_lite")
    got = short_logits(model)
    assert timed == [] and set(decode._CHOSEN.values()) == {"stock"}
    assert mx.array_equal(got, stock_short_logits(model)).item()


def test_where_float32_attention_cannot_be_computed_stock_serves(
    installed, auto, monkeypatch, caplog
):
    seconds, timed = auto
    seconds.update(stock=2.0, fold=1.0)

    def unavailable(*args):
        raise RuntimeError("no CPU stream here")

    monkeypatch.setattr(decode, "reference_attention", unavailable)
    model, _ = tiny.build_model("glm4_moe_lite")
    with caplog.at_level(logging.WARNING, logger="mlx_lm_mla.decode"):
        got = short_logits(model)
    assert "no float32 reference" in caplog.text and timed == []
    assert mx.array_equal(got, stock_short_logits(model)).item()


def test_a_chosen_path_that_raises_later_is_turned_off_and_stock_serves(
    installed, auto, monkeypatch, caplog
):
    seconds, _ = auto
    seconds.update(stock=2.0, fold=1.0)
    # The check at 121 positions, then 4 steps of its 2 layers: the 5th call.
    failed = broken(monkeypatch, "fold", after=4)
    model, _ = tiny.build_model("glm4_moe_lite")
    with caplog.at_level(logging.WARNING, logger="mlx_lm_mla.decode"):
        got = short_logits(model)
    assert len(model.layers) == 2 and len(failed) == 5
    assert "fold off" in caplog.text and "stock serves the step" in caplog.text
    assert set(decode._CHOSEN.values()) == {"stock"}
    assert mx.allclose(got, stock_short_logits(model), atol=1e-4, rtol=1e-4).item()


@pytest.mark.parametrize("path", ["stock", "fold"])
def test_a_forced_path_serves_every_step_untimed(
    installed, auto, calls, monkeypatch, path
):
    seconds, timed = auto
    seconds.update(stock=1.0, fold=1.0)
    monkeypatch.setenv("MLX_LM_MLA_DECODE", path)
    model, _ = tiny.build_model("glm4_moe_lite")
    got = short_logits(model)
    assert timed == [] and decode._CHOSEN == {}
    assert len(calls) == (15 * len(model.layers) if path == "fold" else 0)
    expected = stock_short_logits(model)
    if path == "stock":
        assert mx.array_equal(got, expected).item()


def test_an_invalid_forced_path_is_named_in_the_error(installed, monkeypatch):
    monkeypatch.setenv("MLX_LM_MLA_DECODE", "fastest")
    model, _ = tiny.build_model("glm4_moe_lite")
    with pytest.raises(ValueError, match="MLX_LM_MLA_DECODE='fastest' is not a"):
        short_logits(model)


def test_a_forced_kernel_where_there_is_none_says_so(installed, monkeypatch):
    monkeypatch.setenv("MLX_LM_MLA_DECODE", "kernel")
    monkeypatch.setattr(decode_cuda, "ENABLED", True)
    monkeypatch.setattr(decode_cuda, "available", lambda: False)
    model, _ = tiny.build_model("glm4_moe_lite")
    with pytest.raises(RuntimeError, match="kernel: no decode kernel on this device"):
        short_logits(model)


def attention_step(batch, length, dtype=mx.bfloat16, width=512):
    """A decode step's attention at GLM-4.7-Flash's widths (20 heads, 512)."""
    k = mx.random.split(mx.random.key(batch * length), 3)
    q = mx.random.normal((batch, 20, 1, width), key=k[0]).astype(dtype)
    x = mx.random.normal((batch, 1, length, width), key=k[1]).astype(dtype)
    mask = mx.random.normal((batch, 20, 1, length), key=k[2]).astype(dtype)
    sdpa = importlib.import_module("mlx_lm.models.base").scaled_dot_product_attention
    return decode.attend(sdpa, q, x, None, 0.1, mask)


def test_each_batch_size_and_length_is_chosen_once(auto, caplog):
    seconds, timed = auto
    seconds.update(stock=2.0, fold=1.0)
    with caplog.at_level(logging.INFO, logger="mlx_lm_mla.decode"):
        for batch, length in [(1, 40), (2, 40), (1, 50), (1, 70), (2, 60)]:
            attention_step(batch, length)
    kind = (20, 512, mx.bfloat16, mx.bfloat16, mx.bfloat16)
    assert sorted(k[:3] for k in decode._CHOSEN) == [
        (kind, 1, 6),
        (kind, 1, 7),
        (kind, 2, 6),
    ]
    # One INFO line a choice, naming the path and what it serves.
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(lines) == len(timed) == 3
    assert lines[1].startswith("MLA decode: fold serves 20 heads of width 512")
    assert "batch 2, 32 to 63 positions" in lines[1]


def test_a_path_off_at_one_length_serves_no_other_length_of_its_kind(auto, monkeypatch):
    seconds, _ = auto
    seconds.update(stock=2.0, fold=1.0)
    # The fold serves 32 to 63 positions, then raises in its check at 70.
    failed = broken(monkeypatch, "fold", after=1)
    attention_step(1, 40)
    assert list(decode._CHOSEN.values()) == ["fold"]
    attention_step(1, 70)
    got = attention_step(1, 40)
    assert len(failed) == 2 and set(decode._CHOSEN.values()) == {"stock"}
    with monkeypatch.context() as m:
        m.setenv("MLX_LM_MLA_DECODE", "stock")
        assert mx.array_equal(got, attention_step(1, 40)).item()


def test_a_path_that_raises_while_timed_serves_no_step(auto, monkeypatch, caplog):
    # Timed for real: the fold passes its check, then raises in its first run.
    monkeypatch.setattr(decode, "_seconds", TIMED)
    failed = broken(monkeypatch, "fold", after=1)
    with caplog.at_level(logging.WARNING, logger="mlx_lm_mla.decode"):
        got = attention_step(1, 40)
        attention_step(1, 40)
    assert len(failed) == 2 and list(decode._CHOSEN.values()) == ["stock"]
    assert "fold off" in caplog.text and "raised while timed" in caplog.text
    with monkeypatch.context() as m:
        m.setenv("MLX_LM_MLA_DECODE", "stock")
        assert mx.array_equal(got, attention_step(1, 40)).item()


def test_a_choice_holds_only_on_the_device_it_was_made_on(auto, monkeypatch):
    seconds, timed = auto
    seconds.update(stock=2.0, fold=1.0)
    attention_step(1, 40)
    gpu = mx.Device(mx.gpu)
    monkeypatch.setattr(decode.mx, "default_device", lambda: gpu)
    attention_step(1, 40)
    assert len(timed) == 2
    assert sorted(k[3] for k in decode._CHOSEN) == sorted([str(gpu), "Device(cpu, 0)"])


def test_on_the_cpu_the_fold_serves_from_16_positions_by_rule(monkeypatch, calls):
    monkeypatch.delenv("MLX_LM_MLA_DECODE")
    monkeypatch.setattr(decode, "_CHOSEN", {})
    monkeypatch.setattr(decode, "_OFF", {})
    monkeypatch.setattr(decode, "_seconds", lambda runs: pytest.fail("timed"))
    with mx.stream(mx.cpu):
        for length in (1, 15, 16, 1000):
            attention_step(1, length)
    assert sorted(decode._CHOSEN.values()) == ["fold", "fold", "stock", "stock"]
    assert len(calls) == 2


def test_on_the_cpu_a_latent_of_a_width_the_rule_was_not_measured_at_is_stock(
    monkeypatch, calls
):
    monkeypatch.delenv("MLX_LM_MLA_DECODE")
    monkeypatch.setattr(decode, "_CHOSEN", {})
    monkeypatch.setattr(decode, "_OFF", {})
    monkeypatch.setattr(decode, "_seconds", lambda runs: pytest.fail("timed"))
    with mx.stream(mx.cpu):
        for width in (64, 128, 1024):
            attention_step(1, 1000, dtype=mx.float32, width=width)
    assert list(decode._CHOSEN.values()) == ["stock"] * 3 and calls == []


# Run where MLX's float32 matmuls take their default precision (TF32 on CUDA
# and Apple M5; the suite pins full float32 in conftest): the largest
# difference of the reference from float64 attention.
REFERENCE_ERROR = """
import mlx.core as mx, numpy as np
from mlx_lm_mla import decode
q, x = (
    mx.random.normal(shape, key=mx.random.key(i))
    for i, shape in enumerate([(2, 20, 1, 512), (2, 1, 300, 512)])
)
got = decode.reference_attention(q, x, 0.1)
q64, x64 = (np.array(a, dtype=np.float64) for a in (q, x))
scores = 0.1 * q64[:, :, 0] @ x64[:, 0].transpose(0, 2, 1)
weights = np.exp(scores - scores.max(-1, keepdims=True))
exact = (weights / weights.sum(-1, keepdims=True)) @ x64[:, 0]
assert got.dtype == mx.float32
print(np.abs(np.array(got)[:, :, 0] - exact).max())
"""


def test_the_float32_reference_is_float32_at_the_devices_default_precision():
    # TF32 (a GPU's float32 matmul by default) lands about 1e-3 away here.
    env = {k: v for k, v in os.environ.items() if k != "MLX_ENABLE_TF32"}
    out = subprocess.run(
        [sys.executable, "-c", REFERENCE_ERROR],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) < 1e-5


def test_timing_interleaves_the_paths_in_a_rotating_order(monkeypatch):
    order = []

    def run(name):
        return lambda: order.append(name) or mx.array(0.0)

    seconds = decode._seconds({n: run(n) for n in "abc"}, repeats=3)
    assert order == list("abcbcacab") and sorted(seconds) == ["a", "b", "c"]
