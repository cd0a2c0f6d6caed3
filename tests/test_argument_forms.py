"""Every argument form a supported caller passes, on every method of the
quantized caches: indices as a list, a tuple or an mx.array of any integer
dtype; counts as a Python int or a 0-d array. CI runs this at both ends of
the range (mlx 0.31.1, where a 0-d array cannot index a list, and the newest
mlx)."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache, RotatingKVCache

from mlx_lm_mla import quantize_latent

from conftest import latent_kv, rows

INT_DTYPES = [
    mx.int8,
    mx.int16,
    mx.int32,
    mx.int64,
    mx.uint8,
    mx.uint16,
    mx.uint32,
    mx.uint64,
]
INDEX_FORMS = [("list", list), ("tuple", tuple)] + [
    (f"array-{str(d).rsplit('.', 1)[-1]}", lambda x, d=d: mx.array(x, dtype=d))
    for d in INT_DTYPES
]
COUNT_FORMS = [("int", int)] + [
    (f"0d-{str(d).rsplit('.', 1)[-1]}", lambda x, d=d: mx.array(x, dtype=d))
    for d in INT_DTYPES
]


def quantized_batch(lengths=(3, 7, 5)):
    batch = BatchKVCache.merge([latent_kv(n, seed=i) for i, n in enumerate(lengths)])
    return quantize_latent(batch, 64, 8)


def single(kind):
    if kind == "rotating":
        cache = RotatingKVCache(max_size=32)
        cache.update_and_fetch(*rows(9))
    else:
        cache = latent_kv(9)
    return cache.to_quantized(64, 8)


@pytest.mark.parametrize("name,form", INDEX_FORMS, ids=[n for n, _ in INDEX_FORMS])
def test_filter_takes_every_index_form(name, form, installed):
    batch = quantized_batch()
    batch.filter(form([2, 0]))
    assert batch.offset.tolist() == [5, 3]
    latent, _ = batch.update_and_fetch(*rows(1, B=2))
    assert latent.shape[0] == 2


@pytest.mark.parametrize("name,form", COUNT_FORMS, ids=[n for n, _ in COUNT_FORMS])
def test_extract_takes_every_count_form(name, form, installed):
    assert quantized_batch().extract(form(1)).offset == 7


@pytest.mark.parametrize("kind", ["single", "rotating", "batch"])
@pytest.mark.parametrize("name,form", COUNT_FORMS, ids=[n for n, _ in COUNT_FORMS])
def test_trim_takes_every_count_form(kind, name, form, installed):
    cache = quantized_batch() if kind == "batch" else single(kind)
    n = cache.trim(form(2))
    assert n == 2 and isinstance(n, int)
    cache.update_and_fetch(*rows(1, B=3 if kind == "batch" else 1))


@pytest.mark.parametrize("kind", ["single", "rotating", "batch"])
@pytest.mark.parametrize("name,form", COUNT_FORMS, ids=[n for n, _ in COUNT_FORMS])
def test_make_mask_takes_every_count_form(kind, name, form, installed):
    cache = quantized_batch() if kind == "batch" else single(kind)
    mask = cache.make_mask(form(3), return_array=True, window_size=None)
    assert mask.shape[-2:] == (3, 3 + 7 if kind == "batch" else 3 + 9)


@pytest.mark.parametrize("name,form", INDEX_FORMS, ids=[n for n, _ in INDEX_FORMS])
def test_prepare_takes_every_index_form(name, form, installed):
    batch = quantize_latent(BatchKVCache([0, 0]), like=quantized_batch())
    batch.prepare(
        left_padding=form([1, 0]), lengths=form([2, 4]), right_padding=form([1, 0])
    )
    batch.update_and_fetch(*rows(4, B=2))
    batch.finalize()
    assert batch.offset.tolist() == [
        2,
        4,
    ]  # 4 written, less 1 left and 1 right of padding


@pytest.mark.parametrize("name,form", COUNT_FORMS, ids=[n for n, _ in COUNT_FORMS])
def test_to_quantized_takes_every_count_form(name, form, installed):
    cache = latent_kv(4)
    assert cache.to_quantized(form(64), form(8)) is cache
    assert cache.to_quantized(form(64), form(8)) is cache
    assert (cache.group_size, cache.latent_bits) == (64, 8)


@pytest.mark.parametrize("container", [list, tuple])
def test_merge_takes_a_list_or_a_tuple(container, installed):
    caches = container([latent_kv(3).to_quantized(64, 8), latent_kv(6)])
    assert KVCache.merge(caches).offset.tolist() == [3, 6]


@pytest.mark.parametrize(
    "name,form", INDEX_FORMS[2:], ids=[n for n, _ in INDEX_FORMS[2:]]
)
def test_a_stock_latent_batch_takes_array_filters(name, form, installed):
    # what LM Studio's BatchGenerator passes: cache.filter(mx.array(keep_idx))
    batch = BatchKVCache.merge([latent_kv(n, seed=n) for n in (3, 7, 5)])
    batch.filter(form([2, 0]))
    assert batch.offset.tolist() == [5, 3]
