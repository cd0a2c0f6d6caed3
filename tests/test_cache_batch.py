"""BatchMLALatentCache: one MLA layer, many sequences, left padded."""

import mlx.core as mx
import pytest

from mlx_lm_mla import BatchMLALatentCache, MLALatentCache

from conftest import rows


def single(n, seed):
    cache = MLALatentCache()
    if n:
        cache.update_and_fetch(*rows(n, seed=seed))
    return cache


def row_tokens(batch, i):
    """The latent rows that batch row i holds, without padding."""
    return batch.extract(i).keys_and_values()[0]


def test_merge_left_pads_to_the_longest():
    caches = [single(3, 0), single(7, 1), single(0, 2)]
    batch = BatchMLALatentCache.merge(caches)
    assert batch.offset.tolist() == [3, 7, 0]
    assert batch.left_padding.tolist() == [4, 0, 7]
    for i in (0, 1):
        assert mx.array_equal(row_tokens(batch, i), caches[i].keys_and_values()[0])


def test_merge_of_empty_caches_is_an_empty_batch():
    batch = BatchMLALatentCache.merge([MLALatentCache(), MLALatentCache()])
    assert batch.empty() and batch.offset.tolist() == [0, 0]


def test_update_appends_to_every_row():
    batch = BatchMLALatentCache.merge([single(2, 0), single(4, 1)])
    new = rows(1, B=2, seed=3)
    latent, rope = batch.update_and_fetch(*new)
    assert latent.shape == (2, 1, 5, 64) and rope.shape == (2, 1, 5, 16)
    assert batch.offset.tolist() == [3, 5]
    assert mx.array_equal(row_tokens(batch, 0)[:, :, -1], new[0][0:1, :, 0])


def test_trim_is_correct_per_row():
    # upstream BatchKVCache.trim gives the short row a negative offset
    batch = BatchMLALatentCache.merge([single(2, 0), single(6, 1)])
    assert batch.trim(4) == 4
    assert batch.offset.tolist() == [0, 2]
    assert row_tokens(batch, 1).shape[2] == 2
    assert batch.extract(0).offset == 0


def test_trim_keeps_tokens_of_rows_that_are_long_enough():
    a, b = single(5, 0), single(8, 1)
    batch = BatchMLALatentCache.merge([a, b])
    batch.trim(3)
    assert mx.array_equal(row_tokens(batch, 0), a.keys_and_values()[0][:, :, :2])
    assert mx.array_equal(row_tokens(batch, 1), b.keys_and_values()[0][:, :, :5])


def test_trim_more_than_the_longest_row_empties_every_row():
    batch = BatchMLALatentCache.merge([single(2, 0), single(3, 1)])
    assert batch.trim(10) == 3
    assert batch.offset.tolist() == [0, 0]


def test_mask_hides_left_padding():
    batch = BatchMLALatentCache.merge([single(1, 0), single(3, 1)])
    mask = batch.make_mask(1)
    assert mask.dtype == mx.bool_ and mask.shape == (2, 1, 1, 4)
    assert mask[0, 0, 0].tolist() == [False, False, True, True]
    assert mask[1, 0, 0].tolist() == [True, True, True, True]


def test_filter_keeps_rows_and_drops_unneeded_padding():
    caches = [single(2, 0), single(6, 1), single(4, 2)]
    batch = BatchMLALatentCache.merge(caches)
    batch.filter([0, 2])
    assert batch.offset.tolist() == [2, 4]
    assert batch.size() == 4  # padding for the removed long row is gone
    assert mx.array_equal(row_tokens(batch, 1), caches[2].keys_and_values()[0])


def test_extend_right_aligns_both_sides():
    a = BatchMLALatentCache.merge([single(2, 0)])
    b = BatchMLALatentCache.merge([single(5, 1), single(1, 2)])
    a.extend(b)
    assert a.offset.tolist() == [2, 5, 1]
    assert a.size() == 5
    assert mx.array_equal(row_tokens(a, 0), single(2, 0).keys_and_values()[0])


@pytest.mark.parametrize("empty_side", ["self", "other"])
def test_extend_with_an_empty_side(empty_side):
    full = BatchMLALatentCache.merge([single(3, 0)])
    empty = BatchMLALatentCache([0])
    first, second = (empty, full) if empty_side == "self" else (full, empty)
    first.extend(second)
    assert sorted(first.offset.tolist()) == [0, 3]
    latent, _ = first.update_and_fetch(*rows(1, B=2))
    assert latent.shape[0] == 2


def test_extract_returns_a_single_cache_of_the_row():
    caches = [single(3, 0), single(5, 1)]
    batch = BatchMLALatentCache.merge(caches)
    out = batch.extract(0)
    assert isinstance(out, MLALatentCache) and out.offset == 3
    assert mx.array_equal(out.keys_and_values()[1], caches[0].keys_and_values()[1])


def test_prepare_and_finalize_turn_right_padding_into_left_padding():
    # two prompts of lengths 2 and 4, right padded to 4 as BatchGenerator does
    batch = BatchMLALatentCache([0, 0])
    batch.prepare(lengths=[2, 4], right_padding=[2, 0])
    latent, rope = rows(4, B=2, seed=7)
    batch.update_and_fetch(latent, rope)
    batch.finalize()
    assert batch.offset.tolist() == [2, 4]
    assert mx.array_equal(row_tokens(batch, 0), latent[0:1, :, :2])
    assert mx.array_equal(row_tokens(batch, 1), latent[1:2])


def test_prepare_left_padding_only_on_an_empty_cache():
    batch = BatchMLALatentCache([0])
    batch.prepare(left_padding=[2])
    assert batch.left_padding.tolist() == [2]
    batch.update_and_fetch(*rows(3))
    with pytest.raises(ValueError, match="empty cache"):
        batch.prepare(left_padding=[1])


def test_state_round_trips():
    batch = BatchMLALatentCache.merge([single(2, 0), single(4, 1)])
    loaded = BatchMLALatentCache.from_state(list(batch.state))
    assert loaded.offset.tolist() == [2, 4]
    assert mx.array_equal(loaded.keys_and_values()[1], batch.keys_and_values()[1])
