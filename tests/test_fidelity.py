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
