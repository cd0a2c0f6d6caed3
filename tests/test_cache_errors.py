"""Bad input is refused at the boundary with an error that names it."""

import mlx.core as mx
import pytest

from mlx_lm_mla import BatchMLALatentCache, MLALatentCache
from mlx_lm.models.cache import KVCache

from conftest import rows


def test_list_input_is_a_type_error_naming_the_field():
    latent, rope = rows(1)
    with pytest.raises(TypeError, match="MLALatentCache.update_and_fetch: the rope key must be an mx.array, got list"):
        MLALatentCache().update_and_fetch(latent, [rope])


def test_per_head_keys_are_refused():
    with pytest.raises(ValueError, match=r"shape \(B, 1, L, D\), got \(1, 8, 2, 64\)"):
        MLALatentCache().update_and_fetch(mx.zeros((1, 8, 2, 64)), mx.zeros((1, 8, 2, 16)))


def test_integer_latent_is_refused():
    with pytest.raises(TypeError, match="floating point"):
        MLALatentCache().update_and_fetch(mx.zeros((1, 1, 2, 64), mx.int32), mx.zeros((1, 1, 2, 16)))


def test_length_mismatch_between_latent_and_rope():
    with pytest.raises(ValueError, match="must agree on batch and length"):
        MLALatentCache().update_and_fetch(mx.zeros((1, 1, 2, 64)), mx.zeros((1, 1, 3, 16)))


def test_width_change_is_refused():
    cache = MLALatentCache()
    cache.update_and_fetch(*rows(2))
    with pytest.raises(ValueError, match="the latent is mlx.core.float32 of width 32, but the cache holds"):
        cache.update_and_fetch(mx.zeros((1, 1, 1, 32)), mx.zeros((1, 1, 1, 16)))


def test_dtype_change_is_refused():
    cache = MLALatentCache()
    cache.update_and_fetch(*rows(2))
    latent, rope = rows(1, dtype=mx.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        cache.update_and_fetch(latent, rope)


def test_batch_size_mismatch_is_refused():
    batch = BatchMLALatentCache([0, 0])
    with pytest.raises(ValueError, match="expected a batch of 2, got 3"):
        batch.update_and_fetch(*rows(1, B=3))


@pytest.mark.parametrize("bits,group_size,match", [(7, 64, "bits must be one of"), (4, 48, "group_size must be one of")])
def test_bad_quantization_settings(bits, group_size, match):
    with pytest.raises(ValueError, match=match):
        MLALatentCache().to_quantized(group_size=group_size, bits=bits)


def test_latent_not_divisible_by_group_size():
    cache = MLALatentCache()
    cache.update_and_fetch(mx.zeros((1, 1, 1, 96)), mx.zeros((1, 1, 1, 16)))
    with pytest.raises(ValueError, match="latent width 96 is not a multiple of group_size 64"):
        cache.to_quantized(group_size=64, bits=4)


def test_kvcache_state_into_latent_cache_is_refused():
    kv = KVCache()
    kv.update_and_fetch(mx.zeros((1, 1, 2, 64)), mx.zeros((1, 1, 2, 16)))
    with pytest.raises(ValueError, match="config array"):
        MLALatentCache.from_state(list(kv.state))


def test_state_with_wrong_number_of_arrays_is_refused():
    state = MLALatentCache(bits=4).state + [mx.zeros((1, 1, 2, 64))]
    with pytest.raises(ValueError, match="expected 4 arrays for a quantized latent cache, got 1"):
        MLALatentCache.from_state(state)


def test_state_with_inconsistent_lengths_is_refused():
    config, plain = mx.array([64, 0, -1]), mx.array(0)
    state = [config, plain, mx.zeros((1, 1, 3, 64)), mx.zeros((1, 1, 2, 16))]
    with pytest.raises(ValueError, match="disagree on batch or length"):
        MLALatentCache.from_state(state)


def test_merge_of_a_foreign_cache_is_a_type_error():
    with pytest.raises(TypeError, match="cache 1 is a KVCache, expected MLALatentCache"):
        BatchMLALatentCache.merge([MLALatentCache(), KVCache()])


def test_extend_with_a_foreign_cache_is_a_type_error():
    with pytest.raises(TypeError, match="expected a BatchMLALatentCache, got KVCache"):
        BatchMLALatentCache([0]).extend(KVCache())


def test_a_failed_update_leaves_the_cache_unchanged():
    cache = MLALatentCache()
    cache.update_and_fetch(*rows(3, seed=0))
    before = cache.state
    with pytest.raises(ValueError):
        cache.update_and_fetch(mx.zeros((1, 1, 1, 32)), mx.zeros((1, 1, 1, 16)))
    assert cache.offset == 3
    assert all(mx.array_equal(a, b) for a, b in zip(before, cache.state))
