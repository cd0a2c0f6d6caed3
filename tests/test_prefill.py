"""The next turn of a long chat: a short chunk over a longer cached latent is
attended in the latent (``mlx_lm_mla/prefill.py``) with stock's logits, a
quantized latent read from its bytes, the expansion never computed; a long
chunk, a first prefill and other attentions keep stock's expansion."""

import importlib

import mlx.core as mx
import pytest
from conftest import left_padded_batch
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import KVCache, make_prompt_cache

import mlx_lm_mla
from mlx_lm_mla import decode, decode_cuda, mla, prefill, tiny
from mlx_lm_mla.cache import _PackedLatent

TOKENS = [(5 * i + 7) % 190 + 5 for i in range(400)]
CONVERSATION = 300
MESSAGE = 7  # fewer positions than the tiny widths' crossover (64)


def next_turn_logits(model, bits=None, message=MESSAGE):
    """Logits of a message after a conversation held in the cache, quantized
    after the conversation when ``bits`` is given."""
    cache = make_prompt_cache(model)
    model(mx.array([TOKENS[:CONVERSATION]]), cache=cache)
    if bits:
        maybe_quantize_kv_cache(
            cache, quantized_kv_start=0, kv_group_size=64, kv_bits=bits
        )
    return model(mx.array([TOKENS[CONVERSATION : CONVERSATION + message]]), cache=cache)


def stock_logits(model, **kwargs):
    mlx_lm_mla.uninstall()
    try:
        return next_turn_logits(model, **kwargs)
    finally:
        mlx_lm_mla.install()


def expanded_logits(model, monkeypatch, **kwargs):
    """The package with the chunk's latent expanded as stock does."""
    with monkeypatch.context() as m:
        m.setattr(prefill, "ENABLED", False)
        return next_turn_logits(model, **kwargs)


@pytest.fixture(autouse=True)
def portable_path(monkeypatch):
    monkeypatch.setattr(decode_cuda, "ENABLED", False)


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 64 positions, so the tiny models' chunks span several."""
    monkeypatch.setattr(decode, "CHUNK_BYTES", {"cpu": 1, "gpu": 1})


@pytest.fixture
def folded(monkeypatch):
    """Every chunk attended in the latent: whether it read a cache's bytes."""
    seen, original = [], prefill.folded_attention

    def recording(queries, latent, embed_q, unembed_out, scale, mask, cache):
        owner = decode.packed_cache(cache, latent)
        seen.append(owner is not None and owner.latent_reader(latent) is not None)
        return original(queries, latent, embed_q, unembed_out, scale, mask, cache)

    monkeypatch.setattr(prefill, "folded_attention", recording)
    return seen


# mistral4 hands its attention keys with the RoPE key joined on: not an
# expansion of the latent, so stock's attention serves it (mistral3's too).
FOLDED_TYPES = [
    t for t, module in mla.installed_model_types().items() if module != "mistral4"
]


@pytest.mark.parametrize("model_type", tiny.MLA_MODEL_TYPES)
def test_a_message_after_a_conversation_gives_stocks_logits(
    model_type, installed, small_chunks, folded
):
    model, _ = tiny.build_model(model_type)
    expected = stock_logits(model)
    got = next_turn_logits(model)
    assert bool(folded) == (model_type in FOLDED_TYPES)
    assert mx.allclose(got, expected, atol=1e-4, rtol=1e-4).item()


@pytest.mark.parametrize("model_type", ["glm4_moe_lite", "deepseek_v3"])
@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_latent_is_read_from_its_bytes_as_its_expansion_reads_it(
    model_type, bits, installed, small_chunks, folded, monkeypatch
):
    model, _ = tiny.build_model(model_type)
    got = next_turn_logits(model, bits=bits)
    assert folded and all(folded)
    expected = expanded_logits(model, monkeypatch, bits=bits)
    assert mx.allclose(got, expected, atol=1e-4, rtol=1e-4).item()
    # The bytes read a chunk at a time give what the dequantized latent gives.
    monkeypatch.setattr(_PackedLatent, "latent_reader", lambda self, latent: None)
    assert mx.allclose(got, next_turn_logits(model, bits=bits), atol=1e-5).item()


def test_a_bfloat16_message_is_as_close_to_float32_as_stocks(installed, folded):
    def model(dtype):
        m, _ = tiny.build_model("glm4_moe_lite", first_k_dense_replace=99)
        m.set_dtype(dtype)  # the same rounded weights
        return m

    half = model(mx.bfloat16)
    exact = stock_logits(model(mx.float32))
    stock = mx.abs(stock_logits(half).astype(mx.float32) - exact).max().item()
    got = mx.abs(next_turn_logits(half).astype(mx.float32) - exact).max().item()
    bound = stock + mx.finfo(mx.bfloat16).eps / 2 * mx.abs(exact).max().item()
    assert folded and got <= bound


def test_a_long_message_and_a_first_prompt_keep_stocks_expansion(installed, folded):
    model, _ = tiny.build_model("glm4_moe_lite")
    next_turn_logits(model, message=80)  # past the tiny widths' crossover, 64
    model(mx.array([TOKENS[:20]]), cache=make_prompt_cache(model))
    assert folded == []


def test_attending_in_the_latent_costs_less_up_to_the_crossover():
    # GLM-4.7-Flash: latent 512, nope 192, v 256: 512 * 448 / 576 = 398.2.
    assert prefill.folds(398, 512, 192, 256) and not prefill.folds(399, 512, 192, 256)
    # DeepSeek-V3: nope 128, v 128: 512 * 256 / 768 = 170.7.
    assert prefill.folds(170, 512, 128, 128) and not prefill.folds(171, 512, 128, 128)


def test_a_quantized_chunk_holds_less_than_one_expansion(installed):
    # One layer at GLM-4.7-Flash's widths over 16K positions, 4-bit.
    module = importlib.import_module("mlx_lm.models.glm4_moe_lite")
    embed_q = importlib.import_module("mlx_lm.models.mla").MultiLinear(192, 512, 20)
    unembed_out = importlib.import_module("mlx_lm.models.mla").MultiLinear(512, 256, 20)
    embed_q.set_dtype(mx.bfloat16)
    unembed_out.set_dtype(mx.bfloat16)
    cache, n, L = KVCache(), 1 << 14, 16
    for _ in range(n // 4096):
        cache.update_and_fetch(
            mx.random.normal((1, 1, 4096, 512)).astype(mx.bfloat16),
            mx.random.normal((1, 1, 4096, 64)).astype(mx.bfloat16),
        )
    cache = cache.to_quantized(group_size=64, bits=4)
    latent, _ = cache.update_and_fetch(
        mx.zeros((1, 1, L, 512), mx.bfloat16), mx.zeros((1, 1, L, 64), mx.bfloat16)
    )
    queries = mx.random.normal((1, 20, L, 192)).astype(mx.bfloat16)
    mask = mx.zeros((1, 20, L, n + L), mx.bfloat16)
    mx.eval(queries, mask, embed_q.parameters(), unembed_out.parameters())
    keys, values = embed_q(latent, transpose=False), unembed_out(latent)
    mx.synchronize()
    held = mx.get_active_memory()
    mx.reset_peak_memory()
    out = module.scaled_dot_product_attention(
        queries, keys, values, cache=cache, scale=0.1, mask=mask
    )
    mx.eval(out)
    assert out.shape == (1, 20, L, 256)
    assert mx.get_peak_memory() - held < keys.nbytes  # never evaluated


def test_uninstall_restores_the_multilinear_calls(installed):
    mla_module = importlib.import_module("mlx_lm.models.mla")
    classes = [mla_module.MultiLinear, mla_module.QuantizedMultiLinear]
    assert all(hasattr(c.__call__, "mlx_lm_mla_original") for c in classes)
    mlx_lm_mla.uninstall()
    assert not any(hasattr(c.__call__, "mlx_lm_mla_original") for c in classes)


def test_a_batch_with_left_padding_gives_stocks_logits(installed, small_chunks, folded):
    model, _ = tiny.build_model("glm4_moe_lite")
    prompts = [TOKENS[:190], TOKENS[20:120]]

    def batch_logits():
        batch = left_padded_batch(model, prompts)
        return model(mx.array([TOKENS[200:206], TOKENS[300:306]]), cache=batch)

    mlx_lm_mla.uninstall()
    expected = batch_logits()
    mlx_lm_mla.install()
    got = batch_logits()
    assert folded and mx.allclose(got, expected, atol=1e-4, rtol=1e-4).item()
