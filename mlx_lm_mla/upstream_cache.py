"""The upstream form's cache code, on its own.

``upstream-patch`` appends everything below the marker line to
``mlx_lm/models/cache.py``, where the names imported here are that module's
own. The imports only let this file be read and linted as Python; the
run-time package does not use these classes (see ``cache.py``).
"""

from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import (
    CacheList,
    KVCache,
    RotatingKVCache,
    _BaseCache,
    create_attention_mask,
)

# --- upstream: appended to mlx_lm/models/cache.py by upstream-patch ---


def make_kv_cache(max_kv_size: Optional[int] = None):
    """A layer's cache: a ``RotatingKVCache`` of ``max_kv_size`` if given."""
    if max_kv_size is not None:
        return RotatingKVCache(max_size=max_kv_size, keep=4)
    return KVCache()


def make_latent_cache(max_kv_size: Optional[int] = None):
    """An MLA layer's cache. A window is a ``RotatingKVCache``, which refuses
    to quantize as it does for every model."""
    if max_kv_size is not None:
        return make_kv_cache(max_kv_size)
    return LatentKVCache()


class QuantizedLatentKVCache(_BaseCache):
    """The cache of a Multi-head Latent Attention (MLA) layer with the latent
    quantized. MLA models cache the latent in the keys and the RoPE key in the
    values, and attend with the latent itself, so the latent is fetched
    dequantized and the cache has no ``bits``: models keep their attention.

    The RoPE key is kept as it is: it is a small part of the cache (64 of 576
    values a token in DeepSeek-V3) and its error would reach every score.
    """

    step = 256

    def __init__(self, group_size: int = 64, bits: int = 4):
        self.keys = None
        self.values = None
        self.offset = 0
        self.group_size = group_size
        self.latent_bits = bits

    def _quantize(self, x):
        return mx.quantize(x, group_size=self.group_size, bits=self.latent_bits)

    def update_and_fetch(self, keys, values):
        prev = self.offset
        if self.keys is None or (prev + keys.shape[2]) > self.values.shape[2]:
            B, _, S, k_dim = keys.shape
            n = (self.step + S - 1) // self.step * self.step
            new_k = self._quantize(mx.zeros((B, 1, n, k_dim), keys.dtype))
            new_v = mx.zeros((B, 1, n, values.shape[3]), values.dtype)
            if self.keys is not None:
                self.keys = [
                    mx.concatenate([x[..., :prev, :], y], axis=2)
                    for x, y in zip(self.keys, new_k)
                ]
                new_v = mx.concatenate([self.values[..., :prev, :], new_v], axis=2)
            else:
                self.keys = new_k
            self.values = new_v

        self.offset += keys.shape[2]
        for x, q in zip(self.keys, self._quantize(keys)):
            x[..., prev : self.offset, :] = q
        self.values[..., prev : self.offset, :] = values
        latent = mx.dequantize(
            *(x[..., : self.offset, :] for x in self.keys),
            group_size=self.group_size,
            bits=self.latent_bits,
        )
        return latent, self.values[..., : self.offset, :]

    def size(self):
        return self.offset

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.group_size, self.latent_bits

    @state.setter
    def state(self, v):
        self.keys, self.values, self.offset, self.group_size, self.latent_bits = v

    def is_trimmable(self):
        return True

    def trim(self, n):
        n = min(self.offset, n)
        self.offset -= n
        return n

    def make_mask(self, *args, **kwargs):
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    def empty(self):
        return self.keys is None

    @property
    def nbytes(self):
        if self.keys is None:
            return 0
        return sum(x.nbytes for x in self.keys) + self.values.nbytes


class LatentKVCache(KVCache):
    """The cache of an MLA layer: a ``KVCache`` holding the latent and the
    RoPE key, which quantizes to a ``QuantizedLatentKVCache``."""

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        quant_cache = QuantizedLatentKVCache(group_size=group_size, bits=bits)
        if self.offset > 0:
            quant_cache.update_and_fetch(*self.keys_and_values())
        return quant_cache


class LatentCacheList(CacheList):
    """The caches of an MLA layer that has more than one: DeepSeek-V3.2's
    latent and indexer keys, LongCat-Flash's two attentions."""

    @property
    def offset(self):
        return self.caches[0].offset

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        # The latents quantize and a window refuses, as for any model. Other
        # members stay exact: the DSA indexer's keys pick the tokens attended,
        # and quantizing them could change which.
        quantize = (LatentKVCache, RotatingKVCache)
        if not any(isinstance(c, quantize) for c in self.caches):
            return self
        return LatentCacheList(
            *(
                (
                    c.to_quantized(group_size=group_size, bits=bits)
                    if isinstance(c, quantize)
                    else c
                )
                for c in self.caches
            )
        )
