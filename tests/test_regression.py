"""The reported failure: KV quantization plus a prompt cache reused across
requests on GLM-4.7-Flash (glm4_moe_lite)."""

import functools
import re

import pytest
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from mlx_lm_mla import QuantizedLatentCache
from mlx_lm_mla import tiny
from mlx_lm_mla.testing import replay
from mlx_lm_mla.testing.replay import requests

from conftest import SWAPAXES

START = 48  # quantized_kv_start
serve = functools.partial(replay.serve, start=START)
# Rope width 64, so stock quantization (group size 64) gets to the model code.
WIDE = {"kv_lora_rank": 128, "qk_rope_head_dim": 64}


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
    with pytest.raises(AttributeError, match=re.escape(SWAPAXES)):
        serve(model, cache, [], requests(1)[0] + list(range(5, 30)), 4)
    # and the damage is permanent: a short request fails the same way
    trim_prompt_cache(cache, cache[0].offset)
    with pytest.raises(AttributeError, match=re.escape(SWAPAXES)):
        serve(model, cache, [], requests(1)[0][:8], 4)
