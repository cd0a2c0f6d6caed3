"""Patches on ``mlx_lm.models.cache`` for MLA models: stock's caches serve a plain
latent well, so these act where stock goes wrong, at quantization, and register
the quantized classes where ``load_prompt_cache`` looks them up by name.
"""

from mlx_lm.models.cache import BatchKVCache

from ..cache import (
    QUANTIZED_LATENT,
    BatchMixedLatentCache,
    _PackedLatent,
    extend_latent,
    merge_latent,
    quantize_latent,
    quantize_rows,
)
from ..mla import carry_mark, is_latent, leaves, mark_model_caches
from .table import QUANTIZE, Patch

CACHE = "mlx_lm.models.cache"


def table():
    rows = [
        (cls.__name__, "set", lambda _, c=cls: c) for cls in QUANTIZED_LATENT.values()
    ]
    rows += [
        ("make_prompt_cache", "rebind", marked_make_prompt_cache),
        ("KVCache.to_quantized", "wrap", latent_to_quantized),
        ("RotatingKVCache.to_quantized", "wrap", latent_to_quantized),
        ("BatchKVCache.merge", "classmethod", lambda f: latent_merge(f, BatchKVCache)),
        ("BatchKVCache.extend", "wrap", latent_extend),
        ("BatchKVCache.extract", "wrap", marked_extract),
        ("CacheList.to_quantized", "set", lambda _: property(cache_list_to_quantized)),
        ("CacheList.offset", "set", lambda _: property(cache_list_offset)),
        ("BatchRotatingKVCache.merge", "classmethod", refuse_quantized_merge),
    ]
    return [Patch(CACHE, *row, QUANTIZE) for row in rows]


# --- stock caches, fixed where they are quantized --------------------------


def latent_to_quantized(original):
    """``to_quantized`` that quantizes an MLA latent in place; else upstream's."""

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        if is_latent(self):
            # An empty latent cache has no widths to quantize yet.
            return (
                self if self.keys is None else quantize_latent(self, group_size, bits)
            )
        return original(self, group_size, bits)

    to_quantized.mlx_lm_mla_original = original
    return to_quantized


def latent_merge(original, owner):
    """``BatchKVCache.merge`` that batches quantized latents with exact ones."""

    def merge(cls, caches):
        batch = merge_latent(caches) if cls is owner else None
        if batch is not None:
            return batch
        batch = original(cls, caches)
        carry_mark(caches, batch)
        return batch

    merge.mlx_lm_mla_original = original
    return merge


def marked_extract(original):
    """``BatchKVCache.extract`` whose single cache is known as its batch was."""

    def extract(self, idx):
        cache = original(self, idx)
        carry_mark([self], cache)
        return cache

    extract.mlx_lm_mla_original = original
    return extract


def marked_make_prompt_cache(original):
    """``make_prompt_cache`` that marks a non-MLA model's caches."""

    def make_prompt_cache(model, *args, **kwargs):
        return mark_model_caches(model, original(model, *args, **kwargs))

    make_prompt_cache.mlx_lm_mla_original = original
    return make_prompt_cache


# --- CacheList models (DeepSeek-V3.2, GLM-5, LongCat-Flash) ----------------
# Stock's maybe_quantize_kv_cache skips a cache without ``to_quantized``: a
# CacheList that holds a latent shows one (and its offset); any other does not.


def _latent_members(cache_list):
    members = [c for c in cache_list.caches if is_latent(c)]
    if not members:
        raise AttributeError("a CacheList without an MLA latent is never quantized")
    return members


def cache_list_to_quantized(self):
    members = _latent_members(self)

    def to_quantized(group_size: int = 64, bits: int = 4):
        # Only the latent: the DSA indexer's keys choose the attended tokens.
        for c in members:
            if isinstance(c, _PackedLatent) or c.keys is not None:
                quantize_latent(c, group_size, bits)
        return self

    return to_quantized


def cache_list_offset(self):
    return _latent_members(self)[0].offset


def refuse_quantized_merge(original):
    """``BatchRotatingKVCache.merge``, which would hand a quantized window's bytes
    to the model."""

    def merge(cls, caches):
        if any(isinstance(c, _PackedLatent) for c in caches):
            raise ValueError(
                f"{cls.__name__}.merge: a quantized rolling window cannot be batched"
            )
        return original(cls, caches)

    merge.mlx_lm_mla_original = original
    return merge


def latent_extend(original):
    """``BatchKVCache.extend`` keeping its own rows exact (``extend_latent``)."""

    def extend(self, other):
        if isinstance(self, _PackedLatent):  # reached through its super()
            return original(self, other)
        return extend_latent(self, other, lambda o: original(self, o))

    extend.mlx_lm_mla_original = original
    return extend


# --- batches the server quantizes (patches/generate.py calls it) -----------


def quantize_batches(caches, group_size, bits, start):
    """Quantizes in place each batch row whose own length reached ``start``, not
    the longest row's (``BatchMixedLatentCache``)."""
    batches = [
        c
        for c in leaves(caches)
        if type(c) in (BatchKVCache, BatchMixedLatentCache)  # not a rotating batch
        and c.keys is not None
        and is_latent(c)
    ]
    if not batches:
        return
    # Every layer holds the same rows, quantized alike: read them once.
    first = batches[0]
    lengths = first.offset.tolist()
    done = (
        first.quantized.tolist()
        if isinstance(first, BatchMixedLatentCache)
        else [False] * len(lengths)
    )
    rows = [i for i, (n, q) in enumerate(zip(lengths, done)) if n >= start and not q]
    for c in batches:
        quantize_rows(c, rows, group_size, bits)
