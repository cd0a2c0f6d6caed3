"""The reported failure: KV quantization plus a prompt cache reused across
requests on GLM-4.7-Flash (glm4_moe_lite)."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from mlx_lm_mla import QuantizedLatentCache
from mlx_lm_mla import tiny

START = 48  # quantized_kv_start
# Rope width 64, so stock quantization (group size 64) gets to the model code.
WIDE = {"kv_lora_rank": 128, "qk_rope_head_dim": 64}


def serve(model, cache, history, prompt, bits, max_tokens=12):
    """One request the way a server reuses its cache: trim to the common
    prefix, process the rest, remember what the cache now holds."""
    common = 0
    while (
        common < min(len(history), len(prompt) - 1)
        and history[common] == prompt[common]
    ):
        common += 1
    trim_prompt_cache(cache, cache[0].offset - common)
    out = [
        t
        for t, _ in generate_step(
            mx.array(prompt[common:]),
            model,
            prompt_cache=cache,
            max_tokens=max_tokens,
            kv_bits=bits,
            kv_group_size=64,
            quantized_kv_start=START,
        )
    ]
    return (prompt + out)[: cache[0].offset], out


def requests(n):
    prefix = [(3 * i + 11) % 190 + 5 for i in range(30)]
    return [
        prefix + [(7 * r + j) % 190 + 5 for j in range(2 + r % 9)] for r in range(n)
    ]


@pytest.mark.parametrize("bits", [4, 8])
def test_cache_crosses_the_threshold_and_serves_40_more_requests(bits, installed):
    model, _ = tiny.build_model("glm4_moe_lite", **WIDE)
    cache = make_prompt_cache(model)
    objects = list(cache)
    history, out = serve(model, cache, [], requests(1)[0] + list(range(5, 30)), bits)
    assert len(out) == 12 and all(type(c) is QuantizedLatentCache for c in cache)
    for prompt in requests(40):
        history, out = serve(model, cache, history, prompt, bits)
        assert len(out) == 12 and all(0 <= t < 256 for t in out)
    assert all(a is b for a, b in zip(cache, objects))  # quantized in place
    assert all(c.latent_bits == bits for c in cache)


def test_without_the_fix_the_same_scenario_fails(stock):
    model, _ = tiny.build_model("glm4_moe_lite", **WIDE)
    cache = make_prompt_cache(model)
    with pytest.raises(
        AttributeError, match="'list' object has no attribute 'swapaxes'"
    ):
        serve(model, cache, [], requests(1)[0] + list(range(5, 30)), 4)
    # and the damage is permanent: a short request fails the same way
    trim_prompt_cache(cache, cache[0].offset)
    with pytest.raises(AttributeError, match="swapaxes"):
        serve(model, cache, [], requests(1)[0][:8], 4)
