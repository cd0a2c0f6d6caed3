"""Quantized caches for Multi-head Latent Attention (MLA) layers.

An MLA layer caches a latent ``(B, 1, L, kv_lora_rank)`` as keys and the RoPE key
as values. Stock's ``QuantizedKVCache`` hands the model lists where it expects
arrays; these caches subclass stock's and keep the quantized latent as bytes.
"""

import copy
import weakref

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, RotatingKVCache


def _one_head(cache):
    # The structure every MLA latent cache has: one head, non-zero widths.
    k, v = getattr(cache, "keys", None), getattr(cache, "values", None)
    if not (isinstance(k, mx.array) and isinstance(v, mx.array) and k.ndim == 4):
        return False
    return k.shape[1] == v.shape[1] == 1 and k.shape[-1] > 0 and v.shape[-1] > 0


def is_latent_layout(cache):
    """One head; keys (latent) and values (RoPE key) of different non-zero widths."""
    return _one_head(cache) and cache.keys.shape[-1] != cache.values.shape[-1]


def _ints(x):
    # mlx 0.31 cannot index a list with the 0-d arrays an mx.array yields.
    return x.tolist() if isinstance(x, mx.array) else [int(i) for i in x]


_META = hasattr(KVCache, "meta_state")  # mlx-lm 0.31 saves a meta_state


def dequantize_bytes(packed, scales, biases, group_size, bits, dtype=None):
    """``mx.dequantize`` of a latent packed as bytes, in ``dtype`` (default: the
    scales'). On the CPU, for 2, 4 and 8 bits, elementwise ops instead: MLX's CPU
    kernel is slower and peaks higher (``benchmarks/peak_memory.py``)."""
    if bits not in (2, 4, 8) or mx.default_device().type != mx.cpu:
        latent = mx.dequantize(
            mx.view(packed, mx.uint32), scales, biases, group_size=group_size, bits=bits
        )
        return latent if dtype is None else latent.astype(dtype)
    if dtype is not None:
        scales, biases = scales.astype(dtype), biases.astype(dtype)
    # Widths given, not inferred: a row of no positions has nothing to infer from.
    lead, groups = packed.shape[:-1], scales.shape[-1]
    q = packed.reshape(*lead, groups, packed.shape[-1] // groups)  # each group's bytes
    if bits < 8:  # unpack in one broadcast op, the low bits first
        shifts = mx.array(list(range(0, 8, bits)), dtype=mx.uint8)
        q = ((q[..., None] >> shifts) & ((1 << bits) - 1)).reshape(
            *lead, groups, group_size
        )
    # uint8 times the scales' dtype: no separate cast, one intermediate fewer.
    return (q * scales[..., None] + biases[..., None]).reshape(
        *lead, groups * group_size
    )


LAYOUT = "packed-keys"


class _PackedLatent:
    """Keeps the quantized latent as bytes in the base cache, one row per token, so
    the base class's ops move whole tokens: keys hold the packed latent (read in
    place by decode), values the RoPE key, scales and biases. No ``bits``
    attribute: models would take quantized attention, MLA needs the latent."""

    def _set_format(self, group_size, bits, width, dtype, rope_width, rope_dtype):
        # Plain values (dtype names), so deepcopy and save work.
        self.group_size, self.latent_bits = group_size, bits
        self._format = (group_size, bits, width, dtype, rope_width, rope_dtype)

    def _sizes(self):
        """Bytes per token: packed latent, scales (as many as biases), RoPE key."""
        g, b, w, d, rw, rd = self._format
        scales = w // g * getattr(mx, d).size
        return w * b // 8, scales, rw * getattr(mx, rd).size

    def _encode(self, latent, rope):
        g, b, w, d, rw, rd = self._format
        if (latent.shape[-1], rope.shape[-1]) != (w, rw):
            raise ValueError(
                f"{type(self).__name__}: got a latent of width {latent.shape[-1]} "
                f"and a RoPE key of width {rope.shape[-1]}; the cache holds "
                f"widths {w} and {rw}"
            )
        # Other dtypes are cast, as KVCache does.
        packed, scales, biases = mx.quantize(
            latent.astype(getattr(mx, d)), group_size=g, bits=b
        )
        rope = rope.astype(getattr(mx, rd))
        values = mx.concatenate(
            [mx.view(x, mx.uint8) for x in (rope, scales, biases)], axis=-1
        )
        return mx.view(packed, mx.uint8), values

    def _decode(self, keys, values):
        _, _, r = self._sizes()
        rope = mx.view(values[..., :r], getattr(mx, self._format[5]))
        return self._latent(keys, values), rope

    def _latent(self, keys, values, dtype=None):
        g, b, _, d, _, _ = self._format
        _, s, r = self._sizes()
        scales, biases = (
            mx.view(x, getattr(mx, d))
            for x in (values[..., r : r + s], values[..., r + s :])
        )
        return dequantize_bytes(keys, scales, biases, g, b, dtype)

    def update_and_fetch(self, latent, rope):
        latent, rope = self._decode(
            *super().update_and_fetch(*self._encode(latent, rope))
        )
        # Known by identity, so decode attention can read the bytes instead.
        self._fetched = weakref.ref(latent)
        return latent, rope

    def latent_bytes(self, latent):
        """``(keys, values, format)``: the rows ``latent`` is decoded from, if it
        is what this cache last fetched (never evaluated then: decode attention
        reads the bytes instead). The rows are the cache's own as they are now:
        DeepSeek-V3.2 rebinds ``keys`` to itself with a dependency after the
        fetch, and nothing writes rows below the fetched length in between."""
        fetched = vars(self).get("_fetched")
        if fetched is None or fetched() is not latent or self.keys is None:
            return None
        n = latent.shape[2]
        if self.keys.shape[-2] < n:
            return None
        return self.keys[..., :n, :], self.values[..., :n, :], self._format

    def latent_reader(self, latent):
        """``read(start, stop, dtype, after)``: rows of ``latent`` decoded from
        this cache's bytes (see ``latent_bytes``), or None."""
        packed = self.latent_bytes(latent)
        if packed is None:
            return None
        keys, values, _ = packed

        def read(start, stop, dtype, after=None):
            rows = keys[..., start:stop, :], values[..., start:stop, :]
            if after is not None:
                rows = mx.depends(list(rows), after)
            return self._latent(*rows, dtype)

        return read

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        """``self``; other settings are refused: requantizing adds error silently."""
        if (int(group_size), int(bits)) != (self.group_size, self.latent_bits):
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

    # The format travels in meta_state (mlx-lm 0.31) or at the end of state.
    @property
    def state(self):
        state = tuple(super().state)
        return state if _META else state + (self._format_text(),)

    @state.setter
    def state(self, v):
        v = tuple(v)
        if not _META:
            self._read_format(v[-1])
        super(_PackedLatent, type(self)).state.fset(self, v if _META else v[:-1])
        if not _META:
            self._check_bytes()

    if _META:

        @property
        def meta_state(self):
            base = super().meta_state
            base = tuple(base) if isinstance(base, (list, tuple)) else ()
            return base + (self._format_text(),)

        @meta_state.setter
        def meta_state(self, v):
            *base, text = v or ("",)
            self._read_format(text)
            if base:
                super(_PackedLatent, type(self)).meta_state.fset(self, base)
            self._check_bytes()  # from_state sets the state first

    def _format_text(self):
        return ",".join(map(str, (LAYOUT, *self._format)))

    def _read_format(self, text):
        layout, *fields = str(text).split(",")
        try:
            if layout != LAYOUT:
                raise ValueError(layout)
            g, b, w, d, rw, rd = fields
            getattr(mx, d), getattr(mx, rd)
            self._set_format(int(g), int(b), int(w), d, int(rw), rd)
        except (ValueError, AttributeError):
            raise ValueError(f"{type(self).__name__}: no quantization format: {text!r}")

    def _check_bytes(self):
        (w, s, r), keys, values = self._sizes(), self.keys, self.values
        if keys is None and values is None:
            return
        shapes = [getattr(x, "shape", type(x).__name__) for x in (keys, values)]
        if not (
            all(isinstance(x, mx.array) and x.dtype == mx.uint8 for x in (keys, values))
            and keys.ndim == 4
            and shapes == [(*keys.shape[:3], w), (*keys.shape[:3], r + 2 * s)]
            and keys.shape[1] == 1
        ):
            raise ValueError(
                f"{type(self).__name__} state: expected uint8 arrays (B, 1, L, "
                f"{w}) and (B, 1, L, {r + 2 * s}), got {shapes}"
            )
        self.keys, self.values = keys, values


class QuantizedLatentCache(_PackedLatent, KVCache):
    """A ``KVCache`` whose latent is quantized (see ``quantize_latent``)."""

    @classmethod
    def merge(cls, caches):
        return merge_latent(caches)


class BatchQuantizedLatentCache(_PackedLatent, BatchKVCache):
    """A ``BatchKVCache`` whose latent is quantized, every row."""

    def filter(self, batch_indices):
        super().filter(_ints(batch_indices))

    def extend(self, other):
        # Rows that are not quantized keep their precision: a mixed batch.
        if not isinstance(other, _PackedLatent):
            if other.offset.size == 0:
                return
            packed = _twin(self)
            self.keys, self.values = _decoded_rows(self)
            _drop_format(self)
            return _mixed(self, packed, True).extend(other)
        _same_format([self, other], "extend")
        for side, like in ((self, other), (other, self)):
            _rows_like(side, like)
        super().extend(other)

    def extract(self, idx):
        cache = _built(QuantizedLatentCache, super().extract(int(idx)))
        cache._set_format(*self._format)
        return cache

    @classmethod
    def merge(cls, caches):
        """A quantized batch of single caches, exact ones quantized to match."""
        first = next((c for c in caches if isinstance(c, _PackedLatent)), None)
        if first is None:
            raise ValueError(f"{cls.__name__}.merge: no quantized cache to merge")
        caches = [
            (
                c
                if isinstance(c, _PackedLatent) or c.empty()
                else quantize_latent(copy.copy(c), first.group_size, first.latent_bits)
            )
            for c in caches
        ]
        fmt = _same_format(caches, "merge")
        batch = super().merge(caches)
        if type(batch) is not cls:  # stock makes its own class when all are empty
            batch = _built(cls, batch)
        batch._set_format(*fmt)
        return batch


def _rows_like(batch, like):
    """Gives a side of an extend that holds no rows yet zero-length rows of its
    own count and ``like``'s dtype: mlx-lm 0.31 makes them float32 (a packed
    latent's bytes became floats) and as many as the other side's."""
    if batch.keys is None and like.keys is not None:
        n = batch.offset.size
        batch.keys, batch.values = (
            mx.zeros((n, x.shape[1], 0, x.shape[3]), x.dtype)
            for x in (like.keys, like.values)
        )


def _same_format(caches, op):
    formats = {c._format for c in caches if isinstance(c, _PackedLatent)}
    if len(formats) != 1:
        raise ValueError(
            f"BatchQuantizedLatentCache.{op}: the caches are not quantized alike "
            f"(group size, bits, widths, dtypes): {sorted(map(str, formats))}"
        )
    return formats.pop()


def extend_latent(batch, other, extend):
    """A plain batch that takes quantized rows: its own rows stay exact (a
    ``BatchMixedLatentCache``), unless it has none."""
    if isinstance(other, (_PackedLatent, BatchMixedLatentCache)):
        if batch.offset.size == 0:  # no rows: it takes the other's kind
            quantize_latent(batch, *_settings(other), like=_packed(other))
        else:
            packed = quantize_latent(
                _twin(batch), *_settings(other), like=_packed(other)
            )
            _same_format([packed, _packed(other)], "extend")  # before batch changes
            _mixed(batch, packed, False)
        return batch.extend(other)
    return extend(other)


def merge_latent(caches):
    """A batch of single caches some of which are quantized: each row keeps
    its own precision. None where none is quantized (stock merges those)."""
    if not any(isinstance(c, _PackedLatent) for c in caches):
        return None
    if all(isinstance(c, _PackedLatent) for c in caches):
        return BatchQuantizedLatentCache.merge(caches)
    return BatchMixedLatentCache.merge(caches)


def _settings(cache):
    packed = _packed(cache)
    return packed.group_size, packed.latent_bits


def _packed(cache):
    return cache.packed if isinstance(cache, BatchMixedLatentCache) else cache


def _retype(cache, cls):
    """``cache`` becomes a ``cls`` in place: the package's one class change of a
    live cache. Callers keep the object: LM Studio's engine quantizes a copy of
    the cache list, and stock's batch ``extend`` and ``filter`` change the cache
    they are called on, so the object itself must become the new kind."""
    cache.__class__ = cls
    return cache


def _twin(batch):
    """A shallow copy of ``batch`` with arrays of its own beside its rows: stock
    adds to ``left_padding`` in place (``prepare``, ``finalize``, ``filter``),
    and mlx-lm 0.31 to ``offset`` too, so a mixed batch and its packed rows,
    each updated, must not share them."""
    twin = copy.copy(batch)
    for name, value in vars(batch).items():
        if isinstance(value, mx.array) and name not in ("keys", "values"):
            setattr(twin, name, mx.array(value))
    return twin


def _built(cls, cache):
    """A new ``cls`` with the fields of ``cache``, a cache stock just made as its
    own class (as ``copy.copy`` makes an object, of another class)."""
    made = cls.__new__(cls)
    vars(made).update(vars(cache))
    return made


_FORMAT = ("_format", "group_size", "latent_bits", "_fetched")


def _drop_format(cache):
    for name in _FORMAT:
        vars(cache).pop(name, None)


def _decoded_rows(cache):
    # (keys, values) as a quantized cache's rows read them: the latent decoded.
    if cache.keys is None:
        return cache.keys, cache.values
    return cache._decode(cache.keys, cache.values)


def _decoded(cache, cls):
    """A new ``cls`` holding what a quantized cache's rows read."""
    plain = _built(cls, cache)
    _drop_format(plain)
    plain.keys, plain.values = _decoded_rows(cache)
    return plain


def _plain(mixed):
    # A mixed batch's latent as its rows read it, as a new plain batch.
    plain = _built(BatchKVCache, mixed)
    del plain.packed, plain.quantized
    return plain


def _mixed(batch, packed, quantized):
    """Turns ``batch`` (the latent as its rows read it) into a
    ``BatchMixedLatentCache`` in place, beside ``packed``, the same rows' bytes;
    ``quantized`` flags every row alike."""
    _retype(batch, BatchMixedLatentCache)
    batch.packed, batch.quantized = packed, _flags([quantized] * batch.offset.size)
    return batch


def _flags(values):
    return mx.array(values, dtype=mx.bool_)


def quantize_rows(batch, rows, group_size: int = 64, bits: int = 4):
    """Quantizes the latent of ``rows`` of a batch in place, each then reading what
    it would read alone; the batch becomes a ``BatchQuantizedLatentCache`` once
    all its rows are."""
    if isinstance(batch, BatchQuantizedLatentCache) or not rows:
        return batch
    if not isinstance(batch, BatchMixedLatentCache):
        if len(set(rows)) == batch.offset.size:
            return quantize_latent(batch, group_size, bits)
        _mixed(batch, quantize_latent(_twin(batch), group_size, bits), False)
    batch._quantize(rows)
    return batch


class BatchMixedLatentCache(BatchKVCache):
    """A batch whose rows are quantized each on its own, so a row's precision
    depends on that row alone: ``--kv-bits`` gives a request the same text
    whatever requests share its batch.

    It holds the latent as each row reads it beside every row's bytes
    (``packed``, a ``BatchQuantizedLatentCache``); ``quantized`` flags the rows
    that read their bytes. It becomes ``packed`` once every row is quantized, a
    plain ``BatchKVCache`` once none is.
    """

    def update_and_fetch(self, latent, rope):
        keys, values = self.packed._encode(latent, rope)
        BatchKVCache.update_and_fetch(self.packed, keys, values)  # bytes, not decoded
        decoded, _ = self.packed._decode(keys, values)
        latent = mx.where(
            self.quantized[:, None, None, None], decoded, latent.astype(decoded.dtype)
        )
        return super().update_and_fetch(latent, rope)

    def _quantize(self, rows):
        flags = self.quantized.tolist()
        for r in rows:
            flags[int(r)] = True
        self.quantized = _flags(flags)
        if self._settle():
            return
        decoded, _ = self.packed._decode(self.packed.keys, self.packed.values)
        self.keys = mx.where(self.quantized[:, None, None, None], decoded, self.keys)

    def _settle(self):
        """Becomes ``packed`` if every row is quantized, plain if none; True if so."""
        flags = self.quantized.tolist()
        every, none = bool(flags) and all(flags), not any(flags)
        if not (every or none):
            return False
        packed = self.packed
        del self.packed, self.quantized
        if every:  # its rows are packed's: it takes packed's fields
            vars(self).update(vars(packed))
            _retype(self, type(packed))
        else:
            _retype(self, BatchKVCache)
        return True

    def prepare(self, **kwargs):
        super().prepare(**kwargs)
        self.packed.prepare(**kwargs)

    def finalize(self):
        super().finalize()
        self.packed.finalize()

    def trim(self, n):
        n = super().trim(n)
        self.packed.trim(n)
        return n

    def filter(self, batch_indices):
        indices = _ints(batch_indices)
        super().filter(indices)
        self.packed.filter(indices)
        self.quantized = (
            self.quantized[mx.array(indices, dtype=mx.int32)] if indices else _flags([])
        )
        self._settle()

    def extend(self, other):
        if isinstance(other, BatchMixedLatentCache):
            plain, packed, flags = _plain(other), other.packed, other.quantized
        elif isinstance(other, _PackedLatent):
            plain, packed, flags = (
                _decoded(other, BatchKVCache),
                other,
                _flags([True] * other.offset.size),
            )
        else:
            packed = quantize_latent(_twin(other), *_settings(self), like=self.packed)
            plain, flags = other, _flags([False] * other.offset.size)
        _same_format([self.packed, packed], "extend")  # before any row moves
        for side, like in ((self, plain), (plain, self)):
            _rows_like(side, like)  # as the packed rows: mlx-lm 0.31's count
        BatchKVCache.extend(self, plain)
        self.packed.extend(packed)
        self.quantized = mx.concatenate([self.quantized, flags])
        self._settle()

    def extract(self, idx):
        if self.quantized[int(idx)].item():
            return self.packed.extract(idx)
        return BatchKVCache.extract(self, idx)

    @classmethod
    def merge(cls, caches):
        packed = BatchQuantizedLatentCache.merge(caches)
        plain = [
            _decoded(c, KVCache) if isinstance(c, _PackedLatent) else c for c in caches
        ]
        batch = _built(cls, BatchKVCache.merge(plain))
        batch.packed = packed
        batch.quantized = _flags([isinstance(c, _PackedLatent) for c in caches])
        return batch

    @property
    def nbytes(self):
        return super().nbytes + self.packed.nbytes


class QuantizedRotatingLatentCache(_PackedLatent, RotatingKVCache):
    """A ``RotatingKVCache`` whose latent is quantized: the base class rotates the
    latent's bytes like any keys (stock cannot quantize a window). One sequence
    only: ``BatchRotatingKVCache.merge`` refuses it (patches/quantize.py). The
    upstream form refuses to quantize a window, as stock does."""


QUANTIZED_LATENT = {
    KVCache: QuantizedLatentCache,
    BatchKVCache: BatchQuantizedLatentCache,
    RotatingKVCache: QuantizedRotatingLatentCache,
}


def quantize_latent(cache, group_size: int = 64, bits: int = 4, like=None):
    """Quantizes the latent of ``cache`` in place and returns it: the same
    object, so a caller that quantized a copy of the cache list still sees
    it quantized. An empty cache takes the format of ``like``."""
    if isinstance(cache, _PackedLatent):
        return cache.to_quantized(group_size, bits)
    target, group_size, bits = (
        QUANTIZED_LATENT.get(type(cache)),
        int(group_size),
        int(bits),
    )
    if target is None:
        raise TypeError(f"quantize_latent: cannot quantize a {type(cache).__name__}")
    if like is not None and cache.keys is None:
        _retype(cache, target)
        cache._set_format(*like._format)
        return cache
    keys, values = cache.keys, cache.values
    if not _one_head(cache) or keys.shape[-1] % group_size:
        raise ValueError(
            f"quantize_latent: the {type(cache).__name__} holds no MLA latent in "
            f"groups of {group_size}: keys {getattr(keys, 'shape', None)}, values "
            f"{getattr(values, 'shape', None)} (expected one head)"
        )
    before = type(cache)
    _retype(cache, target)
    d, rd = (str(x.dtype).rsplit(".", 1)[-1] for x in (keys, values))
    try:
        cache._set_format(group_size, bits, keys.shape[-1], d, values.shape[-1], rd)
        cache.keys, cache.values = cache._encode(keys, values)
    except BaseException:
        # Settings mx.quantize refuses (bits=7) leave the cache as it was.
        _drop_format(cache)
        _retype(cache, before)
        raise
    return cache
