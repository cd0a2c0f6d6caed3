"""Which caches hold an MLA latent: known from the attention that writes
them, on every path a cache takes, whatever its widths."""

import copy

import mlx.core as mx
import pytest
import mlx_lm.models.cache as cache_module
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from mlx_lm_mla import QuantizedLatentCache, mla
from mlx_lm_mla import tiny
from mlx_lm_mla.testing.replay import generated

from conftest import mistral3_of

PROMPT = [(5 * i + 7) % 190 + 5 for i in range(40)]
SQUARE = {"kv_lora_rank": 64, "qk_rope_head_dim": 64}  # latent as wide as its RoPE key
# A model that caches full K/V with one head: keys 64 wide, values 32.
LOOKALIKE = {"num_attention_heads": 1, "num_key_value_heads": 1, "qk_nope_head_dim": 48}


def generate(model, cache, prompt, bits, group_size=64, start=16):
    return generated(model, cache, prompt, 6, bits, start, group_size)


def test_the_attention_classes_are_read_from_the_installed_models(installed):
    names = {f"{c.__module__.rsplit('.', 1)[-1]}.{c.__name__}" for c in mla.ATTENTION}
    assert {
        "deepseek_v3.DeepseekV3Attention",
        "glm4_moe_lite.Glm4MoeLiteAttention",
    } <= names
    dsa = next(c for c in mla.ATTENTION if c.__name__ == "DeepseekV32Attention")
    assert mla.ATTENTION[dsa] == 0  # it writes the first member of its CacheList


def test_the_source_says_which_cache_an_attention_writes():
    source = """
class Sparse:
    def __init__(self):
        self.kv_lora_rank, self.embed_q = 8, None
    def __call__(self, x, cache=None):
        return cache[1].update_and_fetch(x, x)

class Expanding:  # DeepSeek-V2 style: no absorbed projection, full K/V
    def __init__(self):
        self.kv_lora_rank = 8
    def __call__(self, x, cache=None):
        return cache.update_and_fetch(x, x)

class Twice:
    def __init__(self):
        self.kv_lora_rank, self.embed_q = 8, None
    def __call__(self, x, cache=None):
        cache[0].update_and_fetch(x, x)
        return cache[1].update_and_fetch(x, x)
"""
    assert mla.scan_source(source) == ({"Sparse": 1}, ["Twice"])


def test_a_model_that_imports_an_mla_model_is_an_mla_model_type(tmp_path):
    attention = """
class Attention:
    def __init__(self):
        self.kv_lora_rank, self.embed_q = 8, None
    def __call__(self, x, cache=None):
        return cache.update_and_fetch(x, x)
"""
    sources = {
        "latent.py": attention,
        "plain.py": "class Attention:\n    pass\n",
        "by_name.py": "from .latent import Attention\n",
        "by_module.py": "from . import plain, latent\n",  # mistral3's form
        "plain_wrapper.py": "from . import plain\nfrom .plain import Attention\n",
    }
    for name, source in sources.items():
        (tmp_path / name).write_text(source)
    assert mla.model_types(tmp_path) == {
        "by_module": "latent",
        "by_name": "latent",
        "latent": "latent",
    }


def assert_left_to_stock(model):
    """``model`` under kv_bits gets stock's QuantizedKVCache and stock's tokens."""
    from mlx_lm_mla import install, uninstall

    cache = make_prompt_cache(model)
    got = generate(model, cache, PROMPT, bits=4, group_size=32)
    assert all(type(c) is QuantizedKVCache for c in cache)
    uninstall()
    try:
        expected = generate(
            model, make_prompt_cache(model), PROMPT, bits=4, group_size=32
        )
    finally:
        install()
    assert got == expected


def test_a_mistral3_around_a_model_without_mla_is_left_to_stock(installed):
    model, _ = mistral3_of("llama")
    assert not mla.has_latent_attention(model)
    assert_left_to_stock(model)


def test_a_latent_as_wide_as_its_rope_key_is_quantized_across_requests(installed):
    model, _ = tiny.build_model("glm4_moe_lite", **SQUARE)
    cache = make_prompt_cache(model)
    first = generate(model, cache, PROMPT, bits=4)
    assert all(type(c) is QuantizedLatentCache for c in cache)
    for k in range(3):  # reuse: each request continues the cross-request cache
        assert len(generate(model, cache, [7 + k, 9, 11], bits=4)) == 6
    assert len(first) == 6 and all(c.latent_bits == 4 for c in cache)


def test_stock_fails_a_latent_as_wide_as_its_rope_key(stock):
    model, _ = tiny.build_model("glm4_moe_lite", **SQUARE)
    cache = make_prompt_cache(model)
    with pytest.raises(AttributeError, match="swapaxes"):
        generate(model, cache, PROMPT, bits=4)
        generate(model, cache, [7, 9, 11], bits=4)


@pytest.mark.parametrize(
    "model_type,overrides",
    [
        ("llama", {}),  # one KV head, keys as wide as values
        ("deepseek_v2", LOOKALIKE),  # one head, keys wider than values
    ],
)
def test_a_one_head_model_without_mla_keeps_stocks_quantized_cache(
    model_type, overrides, installed
):
    model, _ = tiny.build_model(model_type, **overrides)
    assert_left_to_stock(model)


def test_a_restored_cache_of_a_model_without_mla_keeps_stocks_quantized_cache(
    installed,
):
    model, _ = tiny.build_model("deepseek_v2", **LOOKALIKE)
    cache = make_prompt_cache(model)
    model(mx.array([PROMPT[:20]]), cache=cache)
    restored = [getattr(cache_module, type(c).__name__)() for c in cache]
    for c, r in zip(cache, restored):
        r.state = c.state  # what load_prompt_cache does: the class by name, then state
    generate(model, restored, PROMPT[20:], bits=4, group_size=32, start=0)
    assert all(type(c) is QuantizedKVCache for c in restored)


def written(model_type="glm4_moe_lite", **overrides):
    model, _ = tiny.build_model(model_type, **overrides)
    cache = make_prompt_cache(model)
    model(mx.array([PROMPT[:20]]), cache=cache)
    return model, cache


@pytest.mark.parametrize("model_type", tiny.MLA_MODEL_TYPES)
def test_a_cache_quantized_before_its_first_token_serves_its_model(
    model_type, installed
):
    # quantized_kv_start=0, as LM Studio's default, before any prompt.
    model, _ = tiny.build_model(model_type)
    cache = make_prompt_cache(model)
    maybe_quantize_kv_cache(cache, 0, 32, 4)
    assert not any(isinstance(c, QuantizedKVCache) for c in mla.leaves(cache))
    mx.eval(model(mx.array([PROMPT[:20]]), cache=cache))


def test_copies_and_deepcopies_stay_known(installed):
    _, cache = written(**SQUARE)
    for c in (copy.copy(cache[0]), copy.deepcopy(cache[0])):
        assert (
            c.to_quantized(group_size=64, bits=4) is c
            and type(c) is QuantizedLatentCache
        )


def test_merge_and_extract_stay_known(installed):
    _, a = written(**SQUARE)
    _, b = written(**SQUARE)
    batch = KVCache.merge([a[0], b[0]])
    assert mla.is_latent(batch)
    batch.filter([1])
    single = batch.extract(0)
    assert mla.is_latent(single)
    assert single.to_quantized(group_size=64, bits=4) is single


def test_a_restored_cache_is_known_again_once_its_model_writes_it(installed):
    model, cache = written(**SQUARE)
    restored = [cache_module.KVCache() for _ in cache]
    for c, r in zip(cache, restored):
        r.state = c.state
    assert not mla.is_latent(restored[0])  # no model has written it yet: square widths
    generate(model, restored, PROMPT[20:], bits=4, start=0)
    assert all(type(c) is QuantizedLatentCache for c in restored)


def test_a_caller_quantizing_a_copy_of_the_list_quantizes_the_live_cache(installed):
    _, cache = written(**SQUARE)
    live = list(cache)
    maybe_quantize_kv_cache(list(cache), 0, 64, 8)
    assert all(type(c) is QuantizedLatentCache for c in live)


def test_a_bare_cache_follows_the_shape_rule(installed):
    wide, square = KVCache(), KVCache()
    wide.update_and_fetch(mx.zeros((1, 1, 4, 64)), mx.zeros((1, 1, 4, 16)))
    square.update_and_fetch(mx.zeros((1, 1, 4, 64)), mx.zeros((1, 1, 4, 64)))
    assert type(wide.to_quantized(64, 4)) is QuantizedLatentCache
    assert type(square.to_quantized(64, 4)) is QuantizedKVCache


def test_uninstall_forgets_the_attention_classes(stock):
    from mlx_lm_mla import install, uninstall

    install()
    attention = next(iter(mla.ATTENTION))
    assert "mlx_lm_mla_original" in dir(attention.__call__)
    uninstall()
    assert mla.ATTENTION == {} and not hasattr(
        attention.__call__, "mlx_lm_mla_original"
    )
