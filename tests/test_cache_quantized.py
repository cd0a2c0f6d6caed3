"""Quantized latent mode: in place, idempotent, and always arrays out."""

import mlx.core as mx
import pytest

from mlx_lm_mla import BatchMLALatentCache, MLALatentCache

from conftest import rows


def filled(n=10, seed=0):
    cache = MLALatentCache()
    cache.update_and_fetch(*rows(n, seed=seed))
    return cache


def test_to_quantized_returns_the_same_object():
    cache = filled()
    holders = [cache]
    sliced_copy = holders[:]  # LM Studio's engine replaces a slice copy
    sliced_copy[0] = cache.to_quantized(group_size=64, bits=4)
    assert sliced_copy[0] is cache and holders[0].quantized


def test_to_quantized_is_idempotent():
    cache = filled().to_quantized(bits=8)
    before = cache.state
    assert cache.to_quantized(bits=8) is cache
    assert cache.to_quantized(bits=4).latent_bits == 8  # never requantized
    assert all(mx.array_equal(a, b) for a, b in zip(before, cache.state))


def rounding_bound(x, bits, group_size=64):
    """Largest error of MLX's affine quantization: it keeps zero exact, so the
    error stays within one step of the group (not half a step)."""
    groups = x.reshape(*x.shape[:-1], -1, group_size)
    step = (groups.max(axis=-1) - groups.min(axis=-1)) / (2**bits - 1)
    return (step.max() * 1.01).item()


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_cache_returns_dequantized_arrays(bits):
    latent, rope = rows(20, seed=1)
    cache = MLALatentCache()
    cache.update_and_fetch(latent[:, :, :12], rope[:, :, :12])
    cache.to_quantized(bits=bits)
    got_latent, got_rope = cache.update_and_fetch(latent[:, :, 12:], rope[:, :, 12:])
    assert isinstance(got_latent, mx.array) and got_latent.dtype == latent.dtype
    assert mx.abs(got_latent - latent).max().item() <= rounding_bound(latent, bits)
    assert mx.array_equal(got_rope, rope)  # the RoPE key is never quantized


def test_quantization_shrinks_the_stored_latent():
    plain = filled(256)
    quantized = filled(256).to_quantized(bits=4)
    assert quantized.nbytes < plain.nbytes / 3


def test_quantized_cache_from_the_start():
    cache = MLALatentCache(bits=8)
    latent, _ = cache.update_and_fetch(*rows(3))
    assert cache.quantized and latent.shape == (1, 1, 3, 64)


def test_quantized_state_round_trips():
    cache = filled(9).to_quantized(group_size=32, bits=4)
    loaded = MLALatentCache.from_state(list(cache.state))
    assert (loaded.group_size, loaded.latent_bits, loaded.offset) == (32, 4, 9)
    a, _ = cache.update_and_fetch(*rows(1, seed=4))
    b, _ = loaded.update_and_fetch(*rows(1, seed=4))
    assert mx.array_equal(a, b)


def test_merge_keeps_each_rows_precision_and_leaves_inputs_alone():
    q = filled(4, seed=0).to_quantized(bits=8)
    p = filled(6, seed=1)
    batch = BatchMLALatentCache.merge([q, p])
    assert batch.latent_bits == 8 and not batch.quantized and not p.quantized
    assert batch.offset.tolist() == [4, 6]
    assert batch.extract(0).quantized and not batch.extract(1).quantized
    assert mx.array_equal(batch.extract(0).keys_and_values()[0], q.keys_and_values()[0])
    assert mx.array_equal(batch.extract(1).keys_and_values()[0], p.keys_and_values()[0])


def test_merge_of_differently_quantized_caches_is_an_error():
    a = filled(2).to_quantized(bits=8)
    b = filled(2).to_quantized(bits=4)
    with pytest.raises(ValueError, match="quantized differently"):
        BatchMLALatentCache.merge([a, b])


def test_batch_quantized_extract_filter_extend_trim():
    batch = BatchMLALatentCache.merge([filled(3, 0), filled(5, 1)]).to_quantized(bits=4)
    assert batch.to_quantized(bits=4) is batch
    out = batch.extract(1)
    assert out.quantized and out.latent_bits == 4 and out.offset == 5
    other = BatchMLALatentCache.merge([filled(2, 2)])  # a plain row joins, and stays plain
    batch.extend(other)
    assert batch.latent_bits == 4 and batch.offset.tolist() == [3, 5, 2]
    assert [batch.extract(i).quantized for i in range(3)] == [True, True, False]
    batch.filter([1, 2])
    assert batch.offset.tolist() == [5, 2]
    assert batch.trim(3) == 3 and batch.offset.tolist() == [2, 0]
    latent, _ = batch.update_and_fetch(*rows(1, B=2))
    assert latent.shape == (2, 1, 3, 64)


def test_a_single_cache_quantizes_itself_after_the_threshold():
    # as mlx-lm's quantized_kv_start: the step that reaches it runs exact
    cache = MLALatentCache(bits=8, quantize_after=10)
    cache.update_and_fetch(*rows(9, seed=0))
    assert not cache.quantized
    step = rows(1, seed=1)
    latent, _ = cache.update_and_fetch(*step)
    assert mx.array_equal(latent[:, :, -1:], step[0])
    assert cache.quantized and cache.latent_bits == 8 and cache.offset == 10


def test_batch_rows_are_quantized_one_by_one_as_each_crosses():
    short = MLALatentCache(bits=4, quantize_after=8)
    long = MLALatentCache(bits=4, quantize_after=8)
    short.update_and_fetch(*rows(3, seed=0))
    long.update_and_fetch(*rows(6, seed=1))
    batch = BatchMLALatentCache.merge([short, long])
    step = rows(2, B=2, seed=2)
    batch.update_and_fetch(*step)  # offsets become 5 and 8: row 1 crosses
    assert [batch.extract(i).quantized for i in range(2)] == [False, True]
    got, _ = batch.update_and_fetch(*rows(1, B=2, seed=3))
    exact = mx.concatenate([short.keys_and_values()[0], step[0][0:1]], axis=2)
    assert mx.array_equal(got[0:1, :, -6:-1], exact)  # the short row stays exact
    assert not mx.array_equal(got[1:2, :, -3:-1], step[0][1:2])  # the long one is rounded


def test_a_mixed_batch_round_trips_through_state():
    batch = BatchMLALatentCache.merge([filled(3, 0).to_quantized(bits=4), filled(5, 1)])
    loaded = BatchMLALatentCache.from_state(list(batch.state))
    assert [loaded.extract(i).quantized for i in range(2)] == [True, False]
    assert all(
        mx.array_equal(a, b) for a, b in zip(loaded.keys_and_values(), batch.keys_and_values())
    )


def test_the_threshold_carries_over_merge_and_extract():
    single = MLALatentCache(bits=4, quantize_after=16)
    single.update_and_fetch(*rows(3))
    batch = BatchMLALatentCache.merge([single, MLALatentCache(bits=4, quantize_after=16)])
    assert (batch.latent_bits, batch.quantize_after) == (4, 16)
    out = batch.extract(0)
    assert (out.quantize_bits, out.quantize_after, out.quantized) == (4, 16, False)
