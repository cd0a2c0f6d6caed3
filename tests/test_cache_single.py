"""MLALatentCache: the cache of one MLA layer for one sequence."""

import copy

import mlx.core as mx

from mlx_lm_mla import MLALatentCache

from conftest import LATENT, ROPE, rows


def test_update_returns_arrays_in_time_order():
    cache = MLALatentCache()
    a = rows(5, seed=0)
    b = rows(1, seed=1)
    cache.update_and_fetch(*a)
    latent, rope = cache.update_and_fetch(*b)
    assert isinstance(latent, mx.array) and isinstance(rope, mx.array)
    assert mx.array_equal(latent, mx.concatenate([a[0], b[0]], axis=2))
    assert mx.array_equal(rope, mx.concatenate([a[1], b[1]], axis=2))


def test_offset_counts_tokens_across_growth_steps():
    cache = MLALatentCache()
    for n in (100, 200, 1):
        cache.update_and_fetch(*rows(n))
    assert cache.offset == 301 and cache.size() == 301
    assert cache.keys.shape[2] == 512  # two steps of 256


def test_trim_returns_count_and_never_goes_negative():
    cache = MLALatentCache()
    cache.update_and_fetch(*rows(10))
    assert cache.trim(4) == 4 and cache.offset == 6
    assert cache.trim(100) == 6 and cache.offset == 0
    assert cache.trim(-3) == 0


def test_update_after_trim_overwrites_the_trimmed_tail():
    cache = MLALatentCache()
    first = rows(10, seed=0)
    cache.update_and_fetch(*first)
    cache.trim(3)
    new = rows(2, seed=1)
    latent, _ = cache.update_and_fetch(*new)
    expected = mx.concatenate([first[0][:, :, :7], new[0]], axis=2)
    assert mx.array_equal(latent, expected)


def test_mask_is_boolean_array_for_prefill_and_none_for_decode():
    cache = MLALatentCache()
    cache.update_and_fetch(*rows(3))
    mask = cache.make_mask(4, return_array=False)
    assert isinstance(mask, mx.array) and mask.dtype == mx.bool_
    assert mask.shape == (4, 7)
    assert cache.make_mask(1) is None


def test_empty_and_nbytes():
    cache = MLALatentCache()
    assert cache.empty() and cache.nbytes == 0
    cache.update_and_fetch(*rows(1))
    assert not cache.empty()
    assert cache.nbytes == 256 * (LATENT + ROPE) * 4


def test_deepcopy_is_independent():
    cache = MLALatentCache()
    cache.update_and_fetch(*rows(4, seed=0))
    clone = copy.deepcopy(cache)
    cache.trim(2)
    cache.update_and_fetch(*rows(2, seed=5))
    assert clone.offset == 4
    assert not mx.array_equal(clone.keys_and_values()[0], cache.keys_and_values()[0])


def test_state_round_trips_through_lists():
    cache = MLALatentCache()
    cache.update_and_fetch(*rows(7, seed=2))
    cache.trim(2)
    state = [s for s in cache.state]  # load_prompt_cache hands over lists
    loaded = MLALatentCache.from_state(state)
    assert loaded.offset == 5
    assert mx.array_equal(loaded.update_and_fetch(*rows(1, seed=3))[0][:, :, :5],
                          cache.keys_and_values()[0])


def test_from_state_accepts_the_old_meta_state_argument():
    cache = MLALatentCache()
    cache.update_and_fetch(*rows(3))
    loaded = MLALatentCache.from_state(cache.state, cache.meta_state)
    assert loaded.offset == 3


def test_merge_on_a_single_cache_makes_a_batch():
    a, b = MLALatentCache(), MLALatentCache()
    a.update_and_fetch(*rows(2))
    b.update_and_fetch(*rows(5))
    batch = a.merge([a, b])
    assert type(batch).__name__ == "BatchMLALatentCache"
    assert batch.offset.tolist() == [2, 5]


def test_cache_has_no_bits_attribute_even_when_quantized():
    # mlx-lm would switch the model to quantized SDPA, wrong for MLA prefill
    cache = MLALatentCache().to_quantized(bits=4)
    assert not hasattr(cache, "bits")
