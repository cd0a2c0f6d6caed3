"""How far a quantized latent moves the logits, against the unquantized cache.

Measured on a tiny GLM-4.7-Flash (glm4_moe_lite) with dense layers only: in a
random MoE a tiny change can flip which expert a token goes to, and that jump
would hide the cache's own error. The bounds are the figures closed upstream
attempts reported (about 0.01 at 8 bits and 0.21 at 4 bits).
"""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_lm_mla import tiny

TOKENS = [(5 * i + 7) % 190 + 5 for i in range(96)]


def decode_logits(model, bits):
    """Prefill half the tokens, optionally quantize, decode the rest."""
    cache = make_prompt_cache(model)
    model(mx.array([TOKENS[:48]]), cache=cache)
    if bits:
        for c in cache:
            c.to_quantized(group_size=64, bits=bits)
    return mx.concatenate([model(mx.array([[t]]), cache=cache) for t in TOKENS[48:]], axis=1)


def max_logit_difference(bits):
    model, _ = tiny.build_model("glm4_moe_lite", first_k_dense_replace=99)
    reference = decode_logits(model, None)
    return mx.abs(decode_logits(model, bits) - reference).max().item()


@pytest.mark.parametrize("bits,bound", [(8, 0.01), (4, 0.21)])
def test_quantized_latent_logits_stay_within_upstream_figures(bits, bound, installed):
    difference = max_logit_difference(bits)
    print(f"{bits}-bit latent: max |logit difference| = {difference:.4f}")
    assert 0 < difference <= bound


# --- the DSA models (DeepSeek-V3.2, GLM-5): latent in a CacheList ------------
# One dense layer, so the indexer's input is what quantization cannot reach
# and a top-k tie in a later random layer cannot flip. Its attention reads 16
# of 48..96 positions, so each latent's error weighs more than in glm4_moe_lite's
# dense attention over all of them: measured 0.011-0.014 (8 bits) and
# 0.16-0.25 (4 bits) over seeds 0-3, against glm4_moe_lite's 0.007-0.009 / 0.13-0.15.
DSA = [t for t in ("deepseek_v32", "glm_moe_dsa") if t in tiny.MLA_MODEL_TYPES]
DSA_CONFIG = {"first_k_dense_replace": 99, "num_hidden_layers": 1, "index_topk": 16, "rope_scaling": None}


def dsa_run(model, bits):
    """Decode logits and the top-k positions the indexer picks at each step."""
    from mlx_lm.models.deepseek_v32 import Indexer

    picks, original = [], Indexer.__call__

    def recording(self, *args, **kwargs):
        chosen = original(self, *args, **kwargs)
        picks.append(None if chosen is None else mx.sort(chosen, axis=-1).tolist())
        return chosen

    Indexer.__call__ = recording
    try:
        return decode_logits(model, bits), picks
    finally:
        Indexer.__call__ = original


@pytest.mark.parametrize("model_type", DSA)
@pytest.mark.parametrize("bits,bound", [(8, 0.02), (4, 0.3)])
def test_a_dsa_models_quantized_latent_keeps_logits_close_and_its_top_k(model_type, bits, bound, installed):
    config = {k: v for k, v in DSA_CONFIG.items() if k != "rope_scaling" or model_type == "deepseek_v32"}
    model, _ = tiny.build_model(model_type, **config)
    reference, reference_picks = dsa_run(model, None)
    logits, picks = dsa_run(model, bits)
    difference = mx.abs(logits - reference).max().item()
    print(f"{model_type} {bits}-bit latent: max |logit difference| = {difference:.4f}")
    assert 0 < difference <= bound
    assert picks == reference_picks and sum(p is not None for p in picks) > 40
