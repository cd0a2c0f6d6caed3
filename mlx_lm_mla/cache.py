"""Quantized caches for Multi-head Latent Attention (MLA) layers.

An MLA layer (DeepSeek-V3, GLM-4.7-Flash, Kimi, LongCat, ...) caches a
latent ``(B, 1, L, kv_lora_rank)`` in the keys slot and the RoPE key
``(B, 1, L, qk_rope_head_dim)`` in the values slot of a ``KVCache``. Plain
caches serve them well; only quantization goes wrong, since
``QuantizedKVCache`` hands the model lists where it expects arrays.

Everything below the marker line is the upstream form of the fix: the
``upstream-patch`` command appends it to ``mlx_lm/models/cache.py``.
"""

import copy

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

# --- upstream: appended to mlx_lm/models/cache.py by upstream-patch ---


def is_latent_layout(cache):
    """True for a cache that holds an MLA latent: one head, and keys (the
    latent) of another width than values (the RoPE key). DeepSeek-V3.2's
    indexer keeps keys with empty values; that is not a latent."""
    k, v = getattr(cache, "keys", None), getattr(cache, "values", None)
    return (
        isinstance(k, mx.array)
        and isinstance(v, mx.array)
        and k.ndim == v.ndim == 4
        and k.shape[1] == v.shape[1] == 1
        and k.shape[-1] != v.shape[-1]
        and v.shape[-1] > 0
    )


def _ints(x):
    # Callers pass lists, tuples or mx.arrays; mlx 0.31 cannot index a list
    # with the 0-d arrays that iterating an mx.array gives.
    return x.tolist() if isinstance(x, mx.array) else [int(i) for i in x]


class _PackedLatent:
    """Keeps the latent quantized by storing bytes in the base cache.

    The keys are the bytes of ``mx.quantize``'s packed latent, scales and
    biases, one row per token; the values are the bytes of the RoPE key. So
    the base class's growth, rotation, padding, filter, merge and extract
    move whole tokens without knowing the layout, and ``update_and_fetch``
    hands the model the dequantized latent and the exact RoPE key. There is
    no ``bits`` attribute: it would switch the model to quantized attention,
    and MLA needs the latent itself.
    """

    # The format is plain values (dtype names), so deepcopy and save work.
    def _set_format(self, group_size, bits, width, dtype, rope_width, rope_dtype):
        self.group_size, self.latent_bits = group_size, bits
        self._format = (group_size, bits, width, dtype, rope_width, rope_dtype)

    def _encode(self, latent, rope):
        # Like KVCache, other dtypes are cast; other widths are refused.
        group_size, bits, width, dtype, rope_width, rope_dtype = self._format
        if (latent.shape[-1], rope.shape[-1]) != (width, rope_width):
            raise ValueError(
                f"{type(self).__name__}: got a latent of width {latent.shape[-1]} "
                f"and a RoPE key of width {rope.shape[-1]}; the cache holds "
                f"widths {width} and {rope_width}"
            )
        latent = latent.astype(getattr(mx, dtype))
        parts = mx.quantize(latent, group_size=group_size, bits=bits)
        packed = mx.concatenate([mx.view(p, mx.uint8) for p in parts], axis=-1)
        return packed, mx.view(rope.astype(getattr(mx, rope_dtype)), mx.uint8)

    def _decode(self, packed, rope):
        group_size, bits, width, dtype, _, rope_dtype = self._format
        dtype = getattr(mx, dtype)
        w = width * bits // 8
        s = width // group_size * dtype.size
        latent = mx.dequantize(
            mx.view(packed[..., :w], mx.uint32),
            mx.view(packed[..., w : w + s], dtype),
            mx.view(packed[..., w + s :], dtype),
            group_size=group_size,
            bits=bits,
        )
        return latent, mx.view(rope, getattr(mx, rope_dtype))

    def update_and_fetch(self, latent, rope):
        return self._decode(*super().update_and_fetch(*self._encode(latent, rope)))

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        """Returns ``self``, already quantized with these settings. Other
        settings are refused: requantizing would add error silently."""
        group_size, bits = int(group_size), int(bits)
        if (group_size, bits) != (self.group_size, self.latent_bits):
            raise ValueError(
                f"{type(self).__name__} is quantized with group_size "
                f"{self.group_size} and {self.latent_bits} bits; refusing to "
                f"requantize with group_size {group_size} and {bits} bits"
            )
        return self

    def trim(self, n):
        return super().trim(int(n))

    def make_mask(self, N, *args, **kwargs):
        return super().make_mask(int(N), *args, **kwargs)

    # The format travels in meta_state (mlx-lm 0.31) or in state (0.32).
    def _format_str(self):
        return ",".join(map(str, self._format))

    def _read_format(self, text):
        try:
            g, b, w, d, rw, rd = str(text).split(",")
            fmt = (int(g), int(b), int(w), d, int(rw), rd)
            getattr(mx, d), getattr(mx, rd)
        except (ValueError, AttributeError):
            raise ValueError(f"{type(self).__name__}: unreadable format {text!r}")
        self._set_format(*fmt)

    @property
    def state(self):
        state = tuple(super().state)
        return state if _META else state + (self._format_str(),)

    @state.setter
    def state(self, v):
        v = tuple(v)
        if not _META:
            self._read_format(v[-1])
            v = v[:-1]
        self._check_bytes(*v[:2])
        _base_property(self, "state").fset(self, v)

    def _check_bytes(self, keys, values):
        """Refuses saved arrays that do not hold this format's tokens."""
        group_size, bits, width, dtype, rope_width, rope_dtype = self._format
        key_bytes = width * bits // 8 + 2 * width // group_size * getattr(mx, dtype).size
        rope_bytes = rope_width * getattr(mx, rope_dtype).size
        for name, x, n in (("latent", keys, key_bytes), ("RoPE key", values, rope_bytes)):
            if not (isinstance(x, mx.array) and x.dtype == mx.uint8 and x.ndim == 4):
                raise ValueError(f"{type(self).__name__} state: the {name} is not packed bytes")
            if x.shape[1] != 1 or x.shape[-1] != n:
                raise ValueError(
                    f"{type(self).__name__} state: the {name} has shape {x.shape}, "
                    f"expected (B, 1, L, {n}) for {self._format_str()}"
                )
        if keys.shape[:3] != values.shape[:3]:
            raise ValueError(
                f"{type(self).__name__} state: the latent {keys.shape} and the RoPE "
                f"key {values.shape} disagree on batch or length"
            )

    @property
    def meta_state(self):
        base = _base_property(self, "meta_state").fget(self) if _META else ()
        base = tuple(base) if isinstance(base, (list, tuple)) else ()
        return base + (self._format_str(),)

    @meta_state.setter
    def meta_state(self, v):
        v = tuple(v)
        self._read_format(v[-1])
        if v[:-1]:
            _base_property(self, "meta_state").fset(self, v[:-1])

    @classmethod
    def from_state(cls, state, meta_state=None):
        obj = cls.__new__(cls)
        if _META:
            obj.meta_state = meta_state
        obj.state = state
        return obj


_META = hasattr(KVCache, "meta_state")  # mlx-lm 0.31 saves meta_state


def _base_property(obj, name):
    for base in type(obj).__mro__[2:]:
        if isinstance(vars(base).get(name), property):
            return vars(base)[name]
    raise AttributeError(name)


class QuantizedLatentCache(_PackedLatent, KVCache):
    """A ``KVCache`` whose latent is quantized. Made in place by
    ``quantize_latent``."""

    @classmethod
    def merge(cls, caches):
        return BatchQuantizedLatentCache.merge(caches)


class BatchQuantizedLatentCache(_PackedLatent, BatchKVCache):
    """A ``BatchKVCache`` whose latent is quantized: one precision for the
    whole batch, and rows that join it are quantized too."""

    def filter(self, batch_indices):
        super().filter(_ints(batch_indices))

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        args = (left_padding, lengths, right_padding)
        left_padding, lengths, right_padding = (
            None if a is None else _ints(a) for a in args
        )
        super().prepare(
            left_padding=left_padding, lengths=lengths, right_padding=right_padding
        )

    def extend(self, other):
        if not isinstance(other, _PackedLatent) and is_latent_layout(other):
            other = quantize_latent(copy.copy(other), self.group_size, self.latent_bits)
        _check_same_format([self, other], "extend")
        super().extend(other)

    def extract(self, idx):
        cache = super().extract(int(idx))
        cache.__class__ = QuantizedLatentCache
        cache._set_format(*self._format)
        return cache

    @classmethod
    def merge(cls, caches):
        """A quantized batch from single caches, exact ones quantized to match."""
        quantized = [c for c in caches if isinstance(c, _PackedLatent)]
        if not quantized:
            raise ValueError(f"{cls.__name__}.merge: no quantized cache to merge")
        group_size, bits = quantized[0].group_size, quantized[0].latent_bits
        caches = [
            c
            if isinstance(c, _PackedLatent) or c.empty()
            else quantize_latent(copy.copy(c), group_size, bits)
            for c in caches
        ]
        fmt = _check_same_format(caches, "merge")
        batch = super().merge(caches)
        if type(batch) is not cls:  # every cache was empty
            batch.__class__ = cls
        batch._set_format(*fmt)
        return batch


def _check_same_format(caches, op):
    formats = {c._format for c in caches if isinstance(c, _PackedLatent)}
    if len(formats) != 1:
        raise ValueError(
            f"BatchQuantizedLatentCache.{op}: the caches are not quantized alike "
            f"(group size, bits, widths, dtypes): {sorted(map(str, formats))}"
        )
    return formats.pop()


class LatentKVCache(KVCache):
    """The cache of an MLA layer: a ``KVCache`` that quantizes its latent
    in place."""

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        return quantize_latent(self, group_size, bits)

    @classmethod
    def merge(cls, caches):
        return BatchLatentKVCache.merge(caches)


class BatchLatentKVCache(BatchKVCache):
    """The batch form of ``LatentKVCache``."""

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        return quantize_latent(self, group_size, bits)

    def extend(self, other):
        extend_latent(self, other, super().extend)

    def extract(self, idx):
        cache = super().extract(idx)
        cache.__class__ = LatentKVCache
        return cache

    @classmethod
    def merge(cls, caches):
        if any(isinstance(c, _PackedLatent) for c in caches):
            return BatchQuantizedLatentCache.merge(caches)
        batch = super().merge(caches)
        batch.__class__ = cls
        return batch


def extend_latent(batch, other, extend):
    """Rows follow the batch, or the batch follows quantized rows."""
    if isinstance(other, _PackedLatent):
        quantize_latent(batch, other.group_size, other.latent_bits, like=other)
        return batch.extend(other)
    return extend(other)


def _dtype_name(dtype):
    return str(dtype).rsplit(".", 1)[-1]


# Which quantized class each cache class turns into.
QUANTIZED_LATENT = {KVCache: QuantizedLatentCache, BatchKVCache: BatchQuantizedLatentCache}


def quantize_latent(cache, group_size: int = 64, bits: int = 4, like=None):
    """Quantizes the latent of ``cache`` in place and returns it.

    The object stays the same, so a caller that quantized a copy of the cache
    list still sees it quantized. An empty cache takes its format from
    ``like``, a quantized cache it will be batched with.
    """
    group_size, bits = int(group_size), int(bits)
    if isinstance(cache, _PackedLatent):
        return cache.to_quantized(group_size, bits)
    target = next(
        (QUANTIZED_LATENT[c] for c in type(cache).__mro__ if c in QUANTIZED_LATENT),
        None,
    )
    if target is None:
        raise TypeError(f"quantize_latent: cannot quantize a {type(cache).__name__}")
    if like is not None and cache.keys is None:
        cache.__class__ = target
        cache._set_format(*like._format)
        return cache
    if not is_latent_layout(cache):
        raise ValueError(
            f"quantize_latent: the {type(cache).__name__} does not hold an MLA "
            "latent (one head, keys and values of different widths)"
        )
    width = cache.keys.shape[-1]
    if width % group_size:
        raise ValueError(
            f"quantize_latent: the latent width {width} is not a multiple of "
            f"group_size {group_size}"
        )
    cache.__class__ = target
    cache._set_format(
        group_size,
        bits,
        width,
        _dtype_name(cache.keys.dtype),
        cache.values.shape[-1],
        _dtype_name(cache.values.dtype),
    )
    cache.keys, cache.values = cache._encode(cache.keys, cache.values)
    return cache
