"""How far a quantized latent moves the logits, against the unquantized cache.

Two claims. The quantized cache hands every MLA model exactly the latent that
``mx.quantize`` rounds to, so the logits move by the rounding alone. And that
rounding stays within the figures closed upstream attempts reported (about
0.01 at 8 bits and 0.21 at 4 bits), on a tiny GLM-4.7-Flash and on the DSA
models. The bounds are measured with dense layers only: in a random MoE a tiny
change can flip which expert a token goes to, and that jump would hide the
cache's own error.
"""

import mlx.core as mx
import pytest
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlx_lm_mla import QuantizedLatentCache
from mlx_lm_mla import tiny
from mlx_lm_mla.mla import leaves

TOKENS = [(5 * i + 7) % 190 + 5 for i in range(144)]
GROUP = 64


def rounded(x, bits):
    return mx.dequantize(
        *mx.quantize(x, group_size=GROUP, bits=bits), group_size=GROUP, bits=bits
    )


class RoundedLatent(KVCache):
    """The reference: stock's exact cache, holding the latent as mx.quantize
    rounds it (no ``bits`` attribute, so the model takes its exact path)."""

    def update_and_fetch(self, latent, rope):
        return super().update_and_fetch(rounded(latent, self.latent_bits), rope)


def round_in_place(cache, bits, width):
    # The latent caches are the ones kv_lora_rank wide (the indexer's and the
    # RoPE key's widths differ in every tiny config).
    for c in leaves(cache):
        if isinstance(c, KVCache) and c.keys is not None and c.keys.shape[-1] == width:
            c.keys[..., : c.offset, :] = rounded(c.keys[..., : c.offset, :], bits)
            c.__class__, c.latent_bits = RoundedLatent, bits


def decode_logits(model, bits, prefill=48, end=96, reference=None):
    """Prefill, then quantize as generate_step does (or round the latent, for
    ``reference`` = its width), then decode the rest one token at a time."""
    cache = make_prompt_cache(model)
    model(mx.array([TOKENS[:prefill]]), cache=cache)
    if reference:
        round_in_place(cache, bits, reference)
    else:
        maybe_quantize_kv_cache(
            cache, quantized_kv_start=0, kv_group_size=GROUP, kv_bits=bits
        )
    logits = mx.concatenate(
        [model(mx.array([[t]]), cache=cache) for t in TOKENS[prefill:end]], axis=1
    )
    return logits, cache


def max_logit_difference(model, bits, **span):
    reference, _ = decode_logits(model, None, **span)
    return mx.abs(decode_logits(model, bits, **span)[0] - reference).max().item()


def kv_lora_rank(config):
    return config.get("text_config", config)["kv_lora_rank"]


# --- every MLA model: the error is the rounding's alone ----------------------
@pytest.mark.parametrize("model_type", tiny.MLA_MODEL_TYPES)
@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_latent_gives_the_logits_of_its_rounded_values(
    model_type, bits, installed
):
    # The tiny models as configured, MoE layers, indexers and linear layers too.
    model, config = tiny.build_model(model_type)
    width = kv_lora_rank(config)
    logits, cache = decode_logits(model, bits)
    reference, rounded_cache = decode_logits(model, bits, reference=width)
    latent = [type(c) is QuantizedLatentCache for c in leaves(cache)]
    assert any(latent) and latent == [
        type(c) is RoundedLatent for c in leaves(rounded_cache)
    ]
    assert mx.array_equal(logits, reference) and not mx.array_equal(
        logits, decode_logits(model, None)[0]
    )


# --- the bounds: GLM-4.7-Flash -----------------------------------------------
@pytest.mark.parametrize("bits,bound", [(8, 0.01), (4, 0.21)])
def test_quantized_latent_logits_stay_within_upstream_figures(bits, bound, installed):
    model, _ = tiny.build_model("glm4_moe_lite", first_k_dense_replace=99)
    difference = max_logit_difference(model, bits)
    print(f"{bits}-bit latent: max |logit difference| = {difference:.4f}")
    assert 0 < difference <= bound


# --- the bounds: the DSA models (DeepSeek-V3.2, GLM-5) -----------------------
# Their attention reads only the index_topk positions the indexer picks, and
# each position's rounding weighs more the fewer are read: benchmarks/fidelity.py
# measures a median of 0.012-0.013 at 8 bits reading 16, 0.008 reading 96, as
# glm4_moe_lite's all. So the bounds are checked with the attention reading as
# many positions as glm4_moe_lite's does at its last step, 96 (of 97..144); the
# real models read 2,048. One dense layer: the indexer's input is then out of
# quantization's reach, and a near-tie of random scores in a later layer cannot
# flip a pick.
DSA = [t for t in ("deepseek_v32", "glm_moe_dsa") if t in tiny.MLA_MODEL_TYPES]
DSA_CONFIG = {"first_k_dense_replace": 99, "num_hidden_layers": 1, "index_topk": 96}
DSA_SPAN = {"prefill": 96, "end": 144}


def dsa_model(model_type, **overrides):
    # deepseek_v32's YaRN scaling off, as glm4_moe_lite's is.
    config = {
        **DSA_CONFIG,
        **({"rope_scaling": None} if model_type == "deepseek_v32" else {}),
        **overrides,
    }
    return tiny.build_model(model_type, **config)[0]


def indexer_picks(model, bits, monkeypatch):
    """The top-k positions the indexer picks at each decode step."""
    from mlx_lm.models.deepseek_v32 import Indexer

    picks, original = [], Indexer.__call__

    def recording(self, *args, **kwargs):
        chosen = original(self, *args, **kwargs)
        picks.append(None if chosen is None else mx.sort(chosen, axis=-1).tolist())
        return chosen

    with monkeypatch.context() as m:
        m.setattr(Indexer, "__call__", recording)
        decode_logits(model, bits, **DSA_SPAN)
    return picks


@pytest.mark.parametrize("model_type", DSA)
@pytest.mark.parametrize("bits,bound", [(8, 0.01), (4, 0.21)])
def test_a_dsa_models_quantized_latent_stays_within_upstream_figures(
    model_type, bits, bound, installed
):
    difference = max_logit_difference(dsa_model(model_type), bits, **DSA_SPAN)
    print(f"{model_type} {bits}-bit latent: max |logit difference| = {difference:.4f}")
    assert 0 < difference <= bound


@pytest.mark.parametrize("model_type", DSA)
@pytest.mark.parametrize("bits", [8, 4])
def test_a_dsa_models_indexer_picks_the_same_positions_from_a_quantized_latent(
    model_type, bits, installed, monkeypatch
):
    # The layer's indexer reads the embeddings and its own keys, so this holds
    # while those keys stay exact: quantizing them could change the picks.
    model = dsa_model(model_type)
    picks = indexer_picks(model, bits, monkeypatch)
    # Every decode step is sparse: 96 picked of 97..144.
    assert (
        picks == indexer_picks(model, None, monkeypatch)
        and sum(p is not None for p in picks) == 48
    )
