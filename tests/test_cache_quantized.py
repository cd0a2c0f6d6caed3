"""The latent-quantized caches: stock caches turned, in place, into caches
that keep the latent packed and always hand the model arrays."""

import copy

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache, RotatingKVCache

from mlx_lm_mla import (
    BatchMixedLatentCache,
    BatchQuantizedLatentCache,
    QuantizedLatentCache,
    QuantizedRotatingLatentCache,
    quantize_latent,
)

from conftest import LATENT, ROPE, filled, latent_kv, rows

# One quantization step of a group of normal values, with margin.
STEP = {8: 0.05, 4: 0.8}


def test_quantizing_keeps_the_same_object(installed):
    cache = latent_kv(10)
    assert cache.to_quantized(group_size=64, bits=4) is cache
    assert type(cache) is QuantizedLatentCache


@pytest.mark.parametrize("bits", [4, 8])
def test_update_returns_arrays_close_to_what_went_in(bits, installed):
    cache, (latent, rope) = filled(KVCache(), 10)
    cache.to_quantized(64, bits)
    more = rows(3, seed=1)
    got_latent, got_rope = cache.update_and_fetch(*more)
    assert isinstance(got_latent, mx.array) and isinstance(got_rope, mx.array)
    assert got_latent.shape == (1, 1, 13, LATENT) and got_rope.shape == (1, 1, 13, ROPE)
    expected = mx.concatenate([latent, more[0]], axis=2)
    assert mx.abs(got_latent - expected).max().item() < STEP[bits]
    # the RoPE key stays exact
    assert mx.array_equal(got_rope, mx.concatenate([rope, more[1]], axis=2))


def test_no_bits_attribute_so_models_keep_their_own_attention(installed):
    cache = latent_kv(4).to_quantized(64, 4)
    assert not hasattr(cache, "bits") and cache.latent_bits == 4


def test_quantized_latent_is_smaller(installed):
    cache = latent_kv(256)
    exact = cache.nbytes
    cache.to_quantized(64, 4)
    assert cache.nbytes < exact / 3


def test_requantizing_with_the_same_settings_is_a_no_op(installed):
    cache = latent_kv(4).to_quantized(64, 8)
    before = cache.keys
    assert cache.to_quantized(64, 8) is cache and cache.keys is before


def test_requantizing_with_other_settings_is_refused(installed):
    cache = latent_kv(4).to_quantized(64, 8)
    with pytest.raises(
        ValueError, match="quantized with group_size 64 and 8 bits; refusing"
    ):
        cache.to_quantized(32, 4)


def test_other_dtypes_are_cast_like_kvcache(installed):
    cache = latent_kv(4, dtype=mx.float32).to_quantized(64, 8)
    latent, rope = cache.update_and_fetch(*rows(1, dtype=mx.bfloat16))
    assert latent.dtype == rope.dtype == mx.float32


def test_another_width_is_refused_by_name(installed):
    cache = latent_kv(4).to_quantized(64, 8)
    wide = mx.zeros((1, 1, 1, 2 * LATENT)), mx.zeros((1, 1, 1, ROPE))
    with pytest.raises(
        ValueError, match="latent of width 128 .* holds widths 64 and 16"
    ):
        cache.update_and_fetch(*wide)


def test_a_latent_width_that_groups_do_not_divide_is_refused(installed):
    cache = KVCache()
    cache.update_and_fetch(mx.zeros((1, 1, 2, 48)), mx.zeros((1, 1, 2, ROPE)))
    with pytest.raises(
        ValueError, match=r"no MLA latent in groups of 32: keys \(1, 1, 256, 48\)"
    ):
        cache.to_quantized(32, 4)


def test_per_head_keys_and_values_keep_stock_quantization(installed):
    from mlx_lm.models.cache import QuantizedKVCache

    cache = KVCache()
    cache.update_and_fetch(mx.zeros((1, 4, 3, 64)), mx.zeros((1, 4, 3, 64)))
    assert type(cache.to_quantized(64, 4)) is QuantizedKVCache


def test_a_lookalike_cache_still_gets_arrays(installed):
    # one head and keys wider than values, but not MLA: every model takes arrays
    cache = KVCache()
    keys, values = mx.random.normal((1, 1, 5, 128)), mx.random.normal((1, 1, 5, 64))
    cache.update_and_fetch(keys, values)
    cache.to_quantized(64, 8)
    got_keys, got_values = cache.update_and_fetch(keys[:, :, :1], values[:, :, :1])
    assert isinstance(got_keys, mx.array) and got_keys.shape == (1, 1, 6, 128)
    assert mx.array_equal(got_values[:, :, :5], values)


def test_deepcopy_is_independent(installed):
    cache = latent_kv(6).to_quantized(64, 4)
    twin = copy.deepcopy(cache)
    cache.update_and_fetch(*rows(2, seed=3))
    assert (twin.offset, cache.offset) == (6, 8) and type(twin) is QuantizedLatentCache


def test_trim_keeps_the_earlier_tokens(installed):
    cache = latent_kv(8).to_quantized(64, 8)
    full, _ = cache.update_and_fetch(*rows(1, seed=2))
    assert cache.trim(3) == 3 and cache.offset == 6
    latent, _ = cache.update_and_fetch(*rows(1, seed=4))
    assert mx.array_equal(latent[:, :, :6], full[:, :, :6])


def test_quantize_latent_refuses_what_it_cannot_quantize(installed):
    with pytest.raises(TypeError, match="cannot quantize a str"):
        quantize_latent("not a cache")
    empty = KVCache()
    with pytest.raises(ValueError, match="KVCache holds no MLA latent"):
        quantize_latent(empty)


def test_settings_mx_quantize_refuses_leave_the_cache_as_it_was(installed):
    cache, (latent, rope) = filled(KVCache(), 10)
    with pytest.raises(ValueError, match="bits"):
        quantize_latent(cache, 64, 7)
    assert type(cache) is KVCache and not hasattr(cache, "latent_bits")
    got_latent, _ = cache.update_and_fetch(*rows(1, seed=3))
    assert mx.array_equal(got_latent[:, :, :10], latent)


def test_a_rotating_window_quantizes_in_place_and_stays_bounded(installed):
    cache = RotatingKVCache(max_size=16, keep=4)
    cache.update_and_fetch(*rows(10))
    assert cache.to_quantized(64, 8) is cache
    assert type(cache) is QuantizedRotatingLatentCache
    for i in range(40):
        latent, rope = cache.update_and_fetch(*rows(1, seed=i))
    assert latent.shape == (1, 1, 16, LATENT) and rope.dtype == mx.float32
    assert cache.keys.shape[2] == 16 and cache.offset == 50


def test_a_quantized_window_cannot_be_batched(installed):
    cache = RotatingKVCache(max_size=16)
    cache.update_and_fetch(*rows(4))
    cache.to_quantized(64, 8)
    with pytest.raises(ValueError, match="cannot be batched"):
        cache.merge([cache, cache])
    plain = RotatingKVCache(max_size=16)
    plain.update_and_fetch(*rows(4))
    with pytest.raises(ValueError, match="quantized rolling window cannot be batched"):
        plain.merge([plain, cache])


# --- batches -----------------------------------------------------------------


def batch_of(lengths, bits=None):
    singles = [latent_kv(n, seed=i) if n else KVCache() for i, n in enumerate(lengths)]
    batch = BatchKVCache.merge(singles)
    if bits:
        batch = quantize_latent(batch, 64, bits)
    return batch


def test_a_batch_quantizes_in_place(installed):
    batch = batch_of([5, 9])
    assert quantize_latent(batch, 64, 8) is batch
    assert type(batch) is BatchQuantizedLatentCache
    latent, rope = batch.update_and_fetch(*rows(1, B=2))
    assert latent.shape == (2, 1, 10, LATENT) and batch.offset.tolist() == [6, 10]


def test_merge_of_exact_and_quantized_singles_keeps_each_row_s_precision(installed):
    exact, quantized = latent_kv(5, seed=1), latent_kv(9, seed=2).to_quantized(64, 8)
    for caches in ([exact, quantized], [quantized, exact]):
        batch = caches[0].merge(caches)
        assert type(batch) is BatchMixedLatentCache
        assert batch.offset.tolist() == [c.offset for c in caches]
        assert [type(batch.extract(i)) for i in range(2)] == [type(c) for c in caches]
    assert type(exact) is KVCache  # the inputs are left as they were


def test_a_quantized_row_of_no_positions_merges_with_an_exact_one(installed):
    empty = batch_of([5, 0], bits=8).extract(1)
    assert type(empty) is QuantizedLatentCache and empty.offset == 0
    batch = KVCache.merge([empty, latent_kv(3)])
    assert type(batch) is BatchMixedLatentCache and batch.offset.tolist() == [0, 3]


def test_merge_refuses_caches_quantized_differently(installed):
    a = latent_kv(5).to_quantized(64, 8)
    b = latent_kv(5).to_quantized(64, 4)
    with pytest.raises(ValueError, match="not quantized alike"):
        a.merge([a, b])


def _bf16_batch(lengths):
    singles = [filled(KVCache(), n, seed=9, dtype=mx.bfloat16)[0] for n in lengths]
    return BatchKVCache.merge(singles)


def test_a_mixed_batch_refusing_rows_of_another_kind_keeps_its_own(installed):
    from mlx_lm_mla.cache import quantize_rows

    batch = quantize_rows(batch_of([5, 9]), [1], 64, 4)
    keys, offset = batch.keys, batch.offset.tolist()
    with pytest.raises(ValueError, match="not quantized alike"):
        batch.extend(_bf16_batch([4]))
    assert batch.keys is keys and batch.offset.tolist() == offset
    assert batch.packed.offset.tolist() == offset and batch.quantized.size == 2


def test_a_plain_batch_refusing_quantized_rows_of_another_kind_stays_plain(installed):
    batch = batch_of([5, 9])
    keys = batch.keys
    with pytest.raises(ValueError, match="not quantized alike"):
        batch.extend(quantize_latent(_bf16_batch([4]), 64, 4))
    assert type(batch) is BatchKVCache and batch.keys is keys


def test_extract_gives_a_quantized_single_of_the_row(installed):
    batch = batch_of([3, 7], bits=8)
    row = batch.extract(0)
    assert type(row) is QuantizedLatentCache and row.offset == 3
    latent, _ = row.update_and_fetch(*rows(1))
    assert latent.shape == (1, 1, 4, LATENT)


def test_rows_that_join_a_quantized_batch_stay_exact(installed):
    batch = batch_of([4, 6], bits=8)
    batch.extend(batch_of([9]))
    assert type(batch) is BatchMixedLatentCache
    assert batch.offset.tolist() == [4, 6, 9] and batch.quantized.tolist() == [
        True,
        True,
        False,
    ]


def test_a_plain_batch_that_takes_quantized_rows_keeps_its_own_rows_exact(installed):
    batch, plain = batch_of([4, 6]), batch_of([4, 6])
    batch.extend(batch_of([9], bits=8))
    assert type(batch) is BatchMixedLatentCache
    assert batch.offset.tolist() == [4, 6, 9]
    update = rows(1, B=3, seed=5)
    latent, _ = batch.update_and_fetch(*update)
    exact, _ = plain.update_and_fetch(*(x[:2] for x in update))
    assert latent.shape == (3, 1, 10, LATENT)
    assert mx.array_equal(
        latent[:2, :, -5:], exact[:, :, -5:]
    )  # the exact rows' own tokens, exact


def test_a_row_of_a_mixed_batch_reads_what_it_reads_alone(installed):
    """The quantized row of a mixed batch, and the exact one, each read what
    the same row reads in a batch of its own kind."""
    quantized_alone, exact_alone = batch_of([6], bits=8), batch_of([4])
    mixed = batch_of([6], bits=8)
    mixed.extend(batch_of([4]))
    a, b = rows(3, B=1, seed=7), rows(3, B=1, seed=8)
    got, _ = mixed.update_and_fetch(*(mx.concatenate([x, y]) for x, y in zip(a, b)))
    alone_q, _ = quantized_alone.update_and_fetch(*a)
    alone_e, _ = exact_alone.update_and_fetch(*b)
    assert mx.array_equal(got[0], alone_q[0]) and mx.array_equal(
        got[1, :, 2:], alone_e[0]
    )


def test_a_mixed_batch_becomes_quantized_once_every_row_is(installed):
    from mlx_lm_mla.cache import quantize_rows

    batch = batch_of([4, 6, 9])
    quantize_rows(batch, [2], 64, 8)
    assert type(batch) is BatchMixedLatentCache and batch.quantized.tolist() == [
        False,
        False,
        True,
    ]
    quantize_rows(batch, [0, 1], 64, 8)
    assert type(batch) is BatchQuantizedLatentCache and batch.offset.tolist() == [
        4,
        6,
        9,
    ]


def _with_a_row_quantized(lengths):
    from mlx_lm_mla.cache import quantize_rows

    return quantize_rows(batch_of(lengths), [1], 64, 8)


def _extended(first, second, bits_first=None, bits_second=None):
    batch = batch_of(first, bits=bits_first)
    batch.extend(batch_of(second, bits=bits_second))
    return batch


def _mixed_then_extended():
    batch = _with_a_row_quantized([6, 9])
    batch.extend(batch_of([4]))
    return batch


# Each way a mixed batch of rows 6, 9 and 4 tokens long is made, beside the
# plain batch of the same rows made the same way.
MIXED_BATCHES = {
    "a row quantized": (
        lambda: _with_a_row_quantized([6, 9, 4]),
        lambda: batch_of([6, 9, 4]),
    ),
    "a quantized batch takes exact rows": (
        lambda: _extended([6], [9, 4], bits_first=8),
        lambda: _extended([6], [9, 4]),
    ),
    "an exact batch takes quantized rows": (
        lambda: _extended([6], [9, 4], bits_second=8),
        lambda: _extended([6], [9, 4]),
    ),
    "a mixed batch takes exact rows": (
        _mixed_then_extended,
        lambda: _extended([6, 9], [4]),
    ),
}


@pytest.mark.parametrize("made", MIXED_BATCHES.values(), ids=list(MIXED_BATCHES))
def test_a_mixed_batch_keeps_every_rows_tokens_through_a_right_padded_chunk(
    made, installed
):
    # BatchGenerator's prefill chunk of 4 positions, the first row's last 2 of
    # them padding: that padding is added once (stock adds it in place).
    mixed, plain = (make() for make in made)
    assert type(mixed) is BatchMixedLatentCache and type(plain) is BatchKVCache
    for batch in (mixed, plain):
        batch.prepare(lengths=[2, 4, 4], right_padding=[2, 0, 0])
        batch.update_and_fetch(*rows(4, B=3, seed=3))
        batch.finalize()
    offsets = [[b.extract(i).offset for i in range(3)] for b in (mixed, plain)]
    assert offsets == [[8, 13, 8]] * 2
    # The positions the model ropes at (mlx-lm 0.31 adds to offset in place).
    assert mixed.offset.tolist() == plain.offset.tolist()
    assert mixed.left_padding.tolist() == plain.left_padding.tolist()
    assert mixed.left_padding.tolist() == plain.left_padding.tolist()
    assert mx.array_equal(mixed.make_mask(1), plain.make_mask(1)).item()


def test_a_step_of_a_mixed_batch_moves_each_row_one_position(installed):
    from mlx_lm_mla.cache import quantize_rows

    batch = quantize_rows(batch_of([5, 9]), [1], 64, 4)
    batch.update_and_fetch(*rows(1, B=2, seed=5))
    assert batch.offset.tolist() == batch_of([6, 10]).offset.tolist()


def test_a_mixed_batch_whose_quantized_rows_leave_is_plain_again(installed):
    batch = batch_of([4, 6], bits=8)
    batch.extend(batch_of([9]))
    batch.filter([2])
    assert type(batch) is BatchKVCache and batch.offset.tolist() == [9]


def test_an_empty_batch_takes_quantized_rows(installed):
    empty = BatchKVCache([])
    empty.extend(batch_of([5], bits=4))
    assert type(empty) is BatchQuantizedLatentCache and empty.offset.tolist() == [5]
    # Its rows are the bytes it took, one row (mlx-lm 0.31 pads in floats).
    assert empty.keys.dtype == mx.uint8 and empty.keys.shape[0] == 1


def test_a_quantized_batch_taking_a_row_with_no_positions_keeps_its_bytes(installed):
    batch = batch_of([8, 5], bits=4)
    batch.extend(BatchKVCache([0]))  # a new request, nothing cached yet
    assert batch.packed.keys.dtype == mx.uint8 and batch.packed.keys.shape[0] == 3
    latent, _ = batch.update_and_fetch(*rows(1, B=3, seed=6))
    assert latent.shape[0] == 3 and batch.offset.tolist() == [9, 6, 1]


def test_batch_trim_is_per_row_and_keeps_masks(installed):
    batch = batch_of([3, 8], bits=8)
    assert batch.trim(2) == 2
    assert batch.offset.tolist() == [1, 6]
    mask = batch.make_mask(2)
    assert mask.shape == (2, 1, 2, 8)


def rebuilt(cache):
    """The cache rebuilt from its own state, as load_prompt_cache does."""
    if hasattr(cache, "meta_state"):
        return type(cache).from_state(cache.state, cache.meta_state)
    return type(cache).from_state(cache.state)


def _stock_empty_batch_rebuilds():
    try:  # mlx-lm 0.31's empty BatchKVCache has no state (it reads keys.shape)
        return rebuilt(BatchKVCache([0, 0])).empty()
    except AttributeError:
        return False


if _stock_empty_batch_rebuilds():  # defined where stock's empty batch rebuilds

    def test_an_empty_quantized_batch_rebuilds_from_its_own_state(installed):
        fmt = latent_kv(4).to_quantized(64, 4)._format
        empty = BatchQuantizedLatentCache([0, 0])  # rows, no tokens yet
        empty._set_format(*fmt)
        again = rebuilt(empty)
        assert (
            type(again) is BatchQuantizedLatentCache
            and again.empty()
            and again._format == fmt
        )
