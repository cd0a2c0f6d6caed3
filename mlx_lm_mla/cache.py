"""Caches for Multi-head Latent Attention (MLA) layers.

An MLA layer (DeepSeek-V3, GLM-4.7-Flash, Kimi, LongCat, ...) does not cache
per-head keys and values. It caches two tensors per token:

    latent  (B, 1, L, kv_lora_rank)      the compressed KV
    rope    (B, 1, L, qk_rope_head_dim)  the RoPE part of the key

mlx-lm stores them in a plain ``KVCache``, so generic cache features written
for per-head K/V (KV quantization above all) break these models. The caches
here know the two tensors apart:

- ``update_and_fetch`` always returns two ``mx.array``s, also when quantized;
- quantization (``to_quantized``) packs the latent in place and returns the
  same object, so every holder of a reference sees the quantized cache;
- the RoPE key stays in the model dtype (it is small, and position
  information is what 4-bit rounding hurts most);
- with ``quantize_after``, each sequence is quantized once it holds that
  many tokens, so a batch can hold quantized and exact rows side by side;
- batch ``trim`` is correct per row.

The quantized cache has no ``bits`` attribute on purpose: models switch to
``quantized_scaled_dot_product_attention`` when a cache has ``bits``, and the
MLA prefill path needs the dequantized latent instead.
"""

from typing import List, Optional

import mlx.core as mx

__all__ = ["MLALatentCache", "BatchMLALatentCache"]

QUANT_BITS = (2, 3, 4, 5, 6, 8)
QUANT_GROUP_SIZES = (32, 64, 128)


def _shape(x):
    return tuple(x.shape) if isinstance(x, mx.array) else type(x).__name__


def _check_quant_params(name, group_size, bits, width=None):
    if bits not in QUANT_BITS:
        raise ValueError(f"{name}: bits must be one of {QUANT_BITS}, got {bits!r}")
    if group_size not in QUANT_GROUP_SIZES:
        raise ValueError(
            f"{name}: group_size must be one of {QUANT_GROUP_SIZES}, got {group_size!r}"
        )
    if width is not None and width % group_size != 0:
        raise ValueError(
            f"{name}: the latent width {width} is not a multiple of "
            f"group_size {group_size}, so it cannot be quantized"
        )


def _check_pair(name, latent, rope, batch_size=None):
    """Checks one (latent, rope) update at the boundary, with errors that say
    what was expected instead of failing deep inside the model."""
    for field, x in (("latent", latent), ("rope key", rope)):
        if not isinstance(x, mx.array):
            raise TypeError(
                f"{name}.update_and_fetch: the {field} must be an mx.array, "
                f"got {type(x).__name__}"
            )
        if x.ndim != 4 or x.shape[1] != 1:
            raise ValueError(
                f"{name}.update_and_fetch: the {field} must have shape "
                f"(B, 1, L, D), got {_shape(x)}. Per-head keys and values "
                "belong in a KVCache, not an MLA latent cache."
            )
        if not mx.issubdtype(x.dtype, mx.floating):
            raise TypeError(
                f"{name}.update_and_fetch: the {field} must be floating point, "
                f"got {x.dtype}"
            )
    if latent.shape[:3] != rope.shape[:3]:
        raise ValueError(
            f"{name}.update_and_fetch: latent {_shape(latent)} and rope key "
            f"{_shape(rope)} must agree on batch and length"
        )
    if batch_size is not None and latent.shape[0] != batch_size:
        raise ValueError(
            f"{name}.update_and_fetch: expected a batch of {batch_size}, "
            f"got {latent.shape[0]}"
        )


def _causal_mask(N, offset, left_padding=None, window_size=None):
    """Boolean mask of N queries at positions offset.. over offset + N keys;
    (B, 1, N, offset + N) when rows have left padding to hide."""
    queries = mx.arange(offset, offset + N)[:, None]
    keys = mx.arange(offset + N)[None]
    mask = queries >= keys
    if window_size is not None:
        mask = mask & (queries < keys + window_size)
    if left_padding is not None:
        mask = mask & (keys >= left_padding[:, None, None, None])
    return mask


def _quantize(x, group_size, bits):
    return list(mx.quantize(x, group_size=group_size, bits=bits))


def _roll_rows(x, shifts):
    """Rolls each row of x right along the sequence axis by its own shift."""
    n = x.shape[2]
    idx = (mx.arange(n)[None] - shifts[:, None]) % n
    return mx.take_along_axis(x, idx[:, None, :, None], axis=2)


def _config(group_size, bits, quantize_after):
    # An int array, not scalars, so both mlx-lm save formats (0.31 and 0.32)
    # can store it.
    after = -1 if quantize_after is None else quantize_after
    return mx.array([group_size, bits or 0, after], dtype=mx.int32)


def _read_config(name, config):
    if not isinstance(config, mx.array) or config.shape != (3,):
        raise ValueError(
            f"{name} state: the first entry must be the config array "
            f"[group_size, bits, quantize_after], got {_shape(config)}; this is "
            f"not a state saved by {name}"
        )
    group_size, bits, after = (int(v) for v in config.tolist())
    bits = bits or None
    if bits is not None:
        _check_quant_params(name, group_size, bits)
    return group_size, bits, (None if after < 0 else after)


class _Store:
    """The arrays that hold latents and RoPE keys along the sequence axis, in
    one precision: the latent plain, or packed with scales and biases."""

    step = 256

    def _init_store(self, group_size, bits):
        self.keys = None  # latent, or packed latent when quantized
        self.values = None  # RoPE key, always in the model dtype
        self.scales = None
        self.biases = None
        self.group_size = group_size
        self.latent_bits = bits

    @property
    def quantized(self):
        return self.latent_bits is not None

    def _parts(self):
        if self.keys is None:
            return []
        if self.quantized:
            return [self.keys, self.scales, self.biases, self.values]
        return [self.keys, self.values]

    def _set_parts(self, parts):
        if not parts:
            self.keys = self.values = self.scales = self.biases = None
        elif self.quantized:
            self.keys, self.scales, self.biases, self.values = parts
        else:
            self.keys, self.values = parts

    def _encode(self, latent, rope):
        if self.quantized:
            return _quantize(latent, self.group_size, self.latent_bits) + [rope]
        return [latent, rope]

    def _write(self, start, latent, rope):
        """Writes (latent, rope) at [start, start + L), growing by whole steps."""
        end = start + latent.shape[2]
        new = self._encode(latent, rope)
        if self.keys is None or end > self.values.shape[2]:
            capacity = (end + self.step - 1) // self.step * self.step
            old = [p[..., :start, :] for p in self._parts()] or [
                mx.zeros((*x.shape[:2], start, x.shape[3]), x.dtype) for x in new
            ]
            self._set_parts(
                [
                    mx.concatenate(
                        [
                            o,
                            mx.zeros(
                                (*o.shape[:2], capacity - start, o.shape[3]), o.dtype
                            ),
                        ],
                        axis=2,
                    )
                    for o in old
                ]
            )
        for buf, x in zip(self._parts(), new):
            buf[..., start:end, :] = x

    def _read(self, end):
        """The latent and the RoPE key for positions [0, end), as arrays."""
        if self.quantized and end == 0:  # mx.dequantize refuses empty input
            (width, dtype), _ = self._specs()
            latent = mx.zeros((*self.keys.shape[:2], 0, width), dtype)
        elif self.quantized:
            latent = mx.dequantize(
                self.keys[..., :end, :],
                self.scales[..., :end, :],
                self.biases[..., :end, :],
                group_size=self.group_size,
                bits=self.latent_bits,
            )
        else:
            latent = self.keys[..., :end, :]
        return latent, self.values[..., :end, :]

    def _quantize_parts(self, parts, group_size, bits):
        """Parts of this store's precision as parts quantized with bits."""
        if self.quantized or not parts:
            return parts
        return _quantize(parts[0], group_size, bits) + [parts[1]]

    def _specs(self):
        """(width of the latent, its dtype), (width of the RoPE key, its dtype)."""
        if self.quantized:
            latent = (self.scales.shape[-1] * self.group_size, self.scales.dtype)
        else:
            latent = (self.keys.shape[-1], self.keys.dtype)
        return latent, (self.values.shape[-1], self.values.dtype)

    @property
    def _store_nbytes(self):
        return sum(p.nbytes for p in self._parts())

    def _load_parts(self, name, parts):
        """Checks arrays read from a saved state and takes them."""
        expected = 4 if self.quantized else 2
        if len(parts) != expected:
            kind = "quantized" if self.quantized else "plain"
            raise ValueError(
                f"{name} state: expected {expected} arrays for a {kind} latent "
                f"cache, got {len(parts)}"
            )
        for p in parts:
            if not isinstance(p, mx.array) or p.ndim != 4 or p.shape[1] != 1:
                raise ValueError(
                    f"{name} state: every array must have shape (B, 1, L, D), "
                    f"got {_shape(p)}"
                )
        if len({p.shape[:3] for p in parts}) != 1:
            raise ValueError(
                f"{name} state: the arrays disagree on batch or length: "
                f"{[_shape(p) for p in parts]}"
            )
        if self.quantized:
            packed, scales, biases, _ = parts
            if packed.dtype != mx.uint32 or scales.shape != biases.shape:
                raise ValueError(f"{name} state: the packed latent is malformed")
            if (
                packed.shape[-1] * 32 // self.latent_bits
                != scales.shape[-1] * self.group_size
            ):
                raise ValueError(
                    f"{name} state: packed width {packed.shape[-1]} does not match "
                    f"{scales.shape[-1]} groups of {self.group_size} at "
                    f"{self.latent_bits} bits"
                )
        self._set_parts(list(parts))


def _zero_parts(rows, length, specs, group_size, bits):
    """Zero parts, plain (bits None) or quantized, for rows with no tokens."""
    (width, dtype), (rope_width, rope_dtype) = specs
    if bits is None:
        shapes = [(width, dtype)]
    else:
        groups = width // group_size
        shapes = [(width * bits // 32, mx.uint32), (groups, dtype), (groups, dtype)]
    shapes.append((rope_width, rope_dtype))
    return [mx.zeros((rows, 1, length, w), t) for w, t in shapes]


def _check_widths(name, latent, rope, specs):
    for field, x, (width, dtype) in zip(("latent", "rope key"), (latent, rope), specs):
        if x.shape[-1] != width or x.dtype != dtype:
            raise ValueError(
                f"{name}.update_and_fetch: the {field} is {x.dtype} of width "
                f"{x.shape[-1]}, but the cache holds {dtype} of width {width}"
            )


class _Protocol:
    """What mlx-lm's cache protocol asks of every cache besides the data."""

    def is_trimmable(self):
        return True

    @property
    def meta_state(self):
        return ""

    @meta_state.setter
    def meta_state(self, v):
        pass

    @classmethod
    def from_state(cls, state, meta_state=None):
        # mlx-lm 0.31 passes meta_state too; everything needed is in state.
        obj = cls.__new__(cls)
        obj.state = state
        return obj


class MLALatentCache(_Store, _Protocol):
    """The cache of one MLA layer for one sequence (B is usually 1).

    Args:
        group_size (int): Group size for latent quantization. Default: ``64``.
        bits (int, optional): Quantize the latent with this many bits: from
            the start, or once ``quantize_after`` tokens are held. Default:
            ``None`` (model dtype until ``to_quantized``).
        quantize_after (int, optional): The token count at which the latent
            is quantized (like mlx-lm's ``quantized_kv_start``).
    """

    def __init__(
        self,
        group_size: int = 64,
        bits: Optional[int] = None,
        quantize_after: Optional[int] = None,
    ):
        if bits is not None:
            _check_quant_params("MLALatentCache", group_size, bits)
        self._init_store(group_size, bits if quantize_after is None else None)
        self.quantize_bits = bits
        self.quantize_after = quantize_after if bits is not None else None
        self.offset = 0

    def update_and_fetch(self, latent, rope):
        name = "MLALatentCache"
        _check_pair(
            name, latent, rope, self.keys.shape[0] if self.keys is not None else None
        )
        if self._bits() is not None:
            _check_quant_params(name, self.group_size, self._bits(), latent.shape[-1])
        if self.keys is not None:
            _check_widths(name, latent, rope, self._specs())
        self._write(self.offset, latent, rope)
        self.offset += latent.shape[2]
        result = self._read(self.offset)
        # Like quantized_kv_start: this step ran exact, the next ones do not.
        if self.quantize_after is not None and self.offset >= self.quantize_after:
            self.to_quantized(self.group_size, self.quantize_bits)
        return result

    def size(self):
        return self.offset

    def empty(self):
        return self.keys is None

    @property
    def nbytes(self):
        return self._store_nbytes

    def trim(self, n):
        n = max(0, min(self.offset, n))
        self.offset -= n
        return n

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        """Quantizes the latent in place and returns ``self``. Idempotent: a
        quantized cache stays as it is, since requantizing only adds error."""
        if self.quantized:
            return self
        width = self.keys.shape[-1] if self.keys is not None else None
        _check_quant_params("MLALatentCache", group_size, bits, width)
        parts = [p[..., : self.offset, :] for p in self._parts()]
        self.group_size, self.latent_bits = group_size, bits
        self._set_parts(
            _quantize(parts[0], group_size, bits) + [parts[1]] if parts else []
        )
        return self

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        # MLA models combine the mask with mx.where, so it is always an array.
        if N == 1 and window_size is None:
            return None
        return _causal_mask(N, self.offset, window_size=window_size)

    def keys_and_values(self):
        """The latent and the RoPE key held, as arrays (like KVCache's)."""
        return self._read(self.offset)

    def _bits(self):
        """The bits it is, or will be, quantized with."""
        return self.latent_bits or self.quantize_bits

    def _quant_setting(self):
        return (self.group_size, self._bits()) if self._bits() is not None else None

    @property
    def state(self):
        config = _config(self.group_size, self._bits(), self.quantize_after)
        # An emptied cache saves no arrays: mlx 0.31 cannot write empty ones.
        return [config, mx.array(int(self.quantized))] + [
            p[..., : self.offset, :] for p in self._parts() if self.offset
        ]

    @state.setter
    def state(self, v):
        name = "MLALatentCache"
        if not isinstance(v, (list, tuple)) or len(v) < 2:
            raise ValueError(
                f"{name} state must be a list of [config, quantized, arrays...], got {_shape(v)}"
            )
        group_size, bits, after = _read_config(name, v[0])
        quantized = bool(int(v[1].item())) if isinstance(v[1], mx.array) else None
        if quantized is None or (quantized and bits is None):
            raise ValueError(
                f"{name} state: the second entry must be the quantized flag"
            )
        self.__init__(group_size, bits, after)
        self.latent_bits = bits if quantized else None
        if len(v) > 2:
            self._load_parts(name, list(v[2:]))
        self.offset = self.values.shape[2] if self.values is not None else 0

    @classmethod
    def merge(cls, caches):
        return BatchMLALatentCache.merge(caches)


class _Rows(_Store):
    """The rows of a batch that share one precision."""

    def __init__(self, group_size, bits, count=0):
        self._init_store(group_size, bits)
        self.count = count


class BatchMLALatentCache(_Protocol):
    """The cache of one MLA layer for a batch of sequences.

    Rows are left padded, so every row ends at the same index; ``offset`` is
    each row's own length, which is what RoPE needs. Each row is plain or
    quantized on its own: exact rows and quantized rows live in two stores
    that share the sequence layout.

    Args:
        left_padding (List[int]): Padding before each row's first token.
        group_size (int): Group size for latent quantization. Default: ``64``.
        bits (int, optional): Quantize rows with this many bits: from the
            start, or once a row holds ``quantize_after`` tokens.
        quantize_after (int, optional): Per-row quantization threshold.
    """

    def __init__(
        self,
        left_padding: List[int],
        group_size: int = 64,
        bits: Optional[int] = None,
        quantize_after: Optional[int] = None,
    ):
        if bits is not None:
            _check_quant_params("BatchMLALatentCache", group_size, bits)
        self.group_size, self.latent_bits = group_size, bits
        self.quantize_after = quantize_after if bits is not None else None
        self.left_padding = mx.array(left_padding, dtype=mx.int32)
        start_quantized = bits is not None and quantize_after is None
        self._in_quant = [start_quantized] * len(left_padding)
        self._groups = (_Rows(group_size, None), _Rows(group_size, bits))
        self._groups[start_quantized].count = len(left_padding)
        self._idx = 0
        self._right_padding = None

    # --- rows and their stores ---------------------------------------------

    @property
    def offset(self):
        return self._idx - self.left_padding

    @property
    def quantized(self):
        """True when every row is quantized."""
        return self.latent_bits is not None and all(self._in_quant)

    def _rows(self):
        return len(self._in_quant)

    # Models tie work to the cache with ``cache.keys = mx.depends(cache.keys,
    # ...)`` (DeepSeek-V3.2's indexer, pipeline parallel): keys and values
    # are those of the store that holds the first rows.
    def _primary(self):
        return next((g for g in self._groups if g.keys is not None and g.count), None)

    @property
    def keys(self):
        g = self._primary()
        return g.keys if g is not None else None

    @keys.setter
    def keys(self, value):
        self._primary().keys = value

    @property
    def values(self):
        g = self._primary()
        return g.values if g is not None else None

    @values.setter
    def values(self, value):
        self._primary().values = value

    def _members(self, quantized):
        return [b for b, q in enumerate(self._in_quant) if q == quantized]

    def _local(self, b):
        """Row b's index inside its store."""
        q = self._in_quant[b]
        return sum(1 for x in self._in_quant[:b] if x == q)

    def _template(self):
        """The (latent, rope) specs of the data held, or None when empty."""
        for g in self._groups:
            if g.keys is not None:
                return g._specs()
        return None

    def _row_parts(self, b, quantized):
        """Row b's parts over [0, _idx), in the given precision."""
        g = self._groups[self._in_quant[b]]
        if g.keys is None:
            bits = self.latent_bits if quantized else None
            return _zero_parts(1, self._idx, self._template(), self.group_size, bits)
        i = self._local(b)
        parts = [p[i : i + 1, :, : self._idx] for p in g._parts()]
        if quantized:
            parts = g._quantize_parts(parts, self.group_size, self.latent_bits)
        return parts

    def _assemble(self, rows, in_quant, length):
        """Sets both stores from rows given in batch order as (parts, left):
        a row's parts land at [left, left + L) of zeroed buffers of the
        given length, so each byte is copied once."""
        self._in_quant = list(in_quant)
        for q, g in enumerate(self._groups):
            mine = [r for r, flag in zip(rows, in_quant) if flag == q]
            g.count = len(mine)
            if not mine:
                g._set_parts([])
                continue
            buffers = [
                mx.zeros((len(mine), 1, length, p.shape[3]), p.dtype)
                for p in mine[0][0]
            ]
            for i, (parts, left) in enumerate(mine):
                n = parts[0].shape[2]
                for buffer, p in zip(buffers, parts if n else []):
                    buffer[i : i + 1, :, left : left + n] = p
            g._set_parts(buffers)

    def _regroup(self, in_quant):
        """Moves rows between the stores (plain rows become quantized)."""
        if self._template() is None:
            self._in_quant = list(in_quant)
            for q, g in enumerate(self._groups):
                g.count = sum(1 for x in in_quant if x == q)
            return
        rows = [(self._row_parts(b, q), 0) for b, q in enumerate(in_quant)]
        self._assemble(rows, in_quant, self._idx)

    # --- the cache protocol ------------------------------------------------

    def update_and_fetch(self, latent, rope):
        name = "BatchMLALatentCache"
        _check_pair(name, latent, rope, self._rows())
        if self.latent_bits is not None:
            _check_quant_params(
                name, self.group_size, self.latent_bits, latent.shape[-1]
            )
        specs = self._template()
        if specs is not None:
            _check_widths(name, latent, rope, specs)
        mixed = 0 < sum(self._in_quant) < self._rows()
        for q, g in enumerate(self._groups):
            if g.count == 0:
                continue
            rows = mx.array(self._members(q)) if mixed else slice(None)
            g._write(self._idx, latent[rows], rope[rows])
        self._idx += latent.shape[2]
        result = self._read()
        # Like quantized_kv_start: this step ran exact, the next ones do not.
        if self.quantize_after is not None and not all(self._in_quant):
            held = self.offset
            if self._right_padding is not None:  # a ragged prompt: junk is not held
                held = held - self._right_padding
            crossed = [n >= self.quantize_after for n in held.tolist()]
            self.quantize_rows([b for b, q in enumerate(crossed) if q])
        return result

    def _read(self):
        if not (0 < sum(self._in_quant) < self._rows()):
            return self._groups[self._in_quant[0] if self._in_quant else 0]._read(
                self._idx
            )
        plain, quant = (g._read(self._idx) for g in self._groups)
        # Back to batch order: plain rows first in the concatenation.
        order, counts = [], [0, 0]
        for q in self._in_quant:
            order.append(counts[q] + (self._groups[0].count if q else 0))
            counts[q] += 1
        order = mx.array(order)
        return tuple(
            mx.concatenate([a, b], axis=0)[order] for a, b in zip(plain, quant)
        )

    def size(self):
        return self._idx

    def empty(self):
        return self._template() is None

    @property
    def nbytes(self):
        return sum(g._store_nbytes for g in self._groups)

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        if left_padding is not None:
            if not self.empty():
                raise ValueError(
                    "BatchMLALatentCache.prepare: left padding can only be added "
                    "to an empty cache"
                )
            self.left_padding = self.left_padding + mx.array(left_padding, mx.int32)
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding, dtype=mx.int32)

    def finalize(self):
        # Right padded prompts leave junk at the end of short rows; rolling it
        # to the front turns it into left padding.
        if self._right_padding is None or self.empty():
            self._right_padding = None
            return
        shifts = self._right_padding
        for q, g in enumerate(self._groups):
            if g.keys is not None and g.count:
                mine = shifts[mx.array(self._members(q))]
                g._set_parts(
                    [_roll_rows(p[..., : self._idx, :], mine) for p in g._parts()]
                )
        self.left_padding = self.left_padding + shifts
        self._right_padding = None

    def trim(self, n):
        """Drops the last n tokens of every row. A row shorter than n becomes
        empty; no row ever gets a negative length."""
        longest = self._idx - (min(self.left_padding.tolist()) if self._idx else 0)
        n = max(0, min(n, longest))
        self._idx -= n
        self.left_padding = mx.minimum(self.left_padding, self._idx)
        return n

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        """Quantizes every row in place and returns ``self``. Rows already
        quantized stay as they are."""
        if self.latent_bits is None:
            specs = self._template()
            width = specs[0][0] if specs else None
            _check_quant_params("BatchMLALatentCache", group_size, bits, width)
            self._set_settings(group_size, bits, self.quantize_after)
        self.quantize_rows(range(self._rows()))
        return self

    def quantize_rows(self, rows):
        """Quantizes the latent of the given rows in place (once per row)."""
        if self.latent_bits is None:
            raise ValueError(
                "BatchMLALatentCache.quantize_rows: no bits set; use "
                "to_quantized(group_size, bits) or create the cache with bits"
            )
        in_quant = list(self._in_quant)
        for b in rows:
            in_quant[b] = True
        if in_quant != self._in_quant:
            self._regroup(in_quant)

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        return _causal_mask(N, self._idx, self.left_padding, window_size)

    def filter(self, batch_indices):
        """Keeps only the given rows, then drops padding no row needs."""
        batch_indices = list(batch_indices)
        in_quant = [self._in_quant[b] for b in batch_indices]
        local = [self._local(b) for b in batch_indices]
        for q, g in enumerate(self._groups):
            keep = [i for i, flag in zip(local, in_quant) if flag == q]
            g.count = len(keep)
            if g.keys is not None:
                keep = mx.array(keep, dtype=mx.int32)
                g._set_parts([p[keep] for p in g._parts()] if g.count else [])
        self._in_quant = in_quant
        idx = mx.array(batch_indices, dtype=mx.int32)
        self.left_padding = self.left_padding[idx]
        if self._right_padding is not None:
            self._right_padding = self._right_padding[idx]
        shift = min(min(self.left_padding.tolist(), default=0), self._idx)
        if shift > 0:
            for g in self._groups:
                g._set_parts([p[..., shift:, :] for p in g._parts()])
            self._idx -= shift
            self.left_padding = self.left_padding - shift

    def extend(self, other):
        """Appends the rows of another batch cache, right aligning both."""
        if not isinstance(other, BatchMLALatentCache):
            raise TypeError(
                "BatchMLALatentCache.extend: expected a BatchMLALatentCache, "
                f"got {type(other).__name__}"
            )
        group_size, bits, after = _batch_settings(
            [self, other], "BatchMLALatentCache.extend"
        )
        idx = max(self._idx, other._idx)
        template = self._template() or other._template()
        rows = []
        if template is not None:
            for c in (self, other):
                for b, q in enumerate(c._in_quant):
                    if c._template() is None:
                        parts = _zero_parts(
                            1, c._idx, template, group_size, bits if q else None
                        )
                    else:
                        parts = c._row_parts(b, q)
                    rows.append((parts, idx - c._idx))
        in_quant = self._in_quant + other._in_quant
        self._set_settings(group_size, bits, after)
        if template is None:
            self._regroup(in_quant)
        else:
            self._assemble(rows, in_quant, idx)
        self.left_padding = mx.concatenate(
            [self.left_padding + idx - self._idx, other.left_padding + idx - other._idx]
        )
        self._idx = idx

    def _set_settings(self, group_size, bits, quantize_after):
        self.group_size, self.latent_bits, self.quantize_after = (
            group_size,
            bits,
            quantize_after,
        )
        self._groups[1].group_size, self._groups[1].latent_bits = group_size, bits

    def _quant_setting(self):
        return (
            (self.group_size, self.latent_bits)
            if self.latent_bits is not None
            else None
        )

    def keys_and_values(self):
        """The latents and RoPE keys of all rows, left padded, as arrays."""
        return self._read()

    def extract(self, idx):
        """Row idx as a single-sequence cache, in its own precision."""
        q = self._in_quant[idx]
        cache = MLALatentCache(self.group_size, self.latent_bits, self.quantize_after)
        cache.latent_bits = self.latent_bits if q else None
        if self._template() is not None:
            start = self.left_padding[idx].item()
            parts = self._row_parts(idx, q)
            cache._set_parts([mx.contiguous(p[..., start:, :]) for p in parts])
            cache.offset = self._idx - start
        return cache

    @classmethod
    def merge(cls, caches):
        """A batch cache from single-sequence caches, left padded to the
        longest. Each row keeps the precision its cache had."""
        for i, c in enumerate(caches):
            if not isinstance(c, MLALatentCache):
                raise TypeError(
                    f"BatchMLALatentCache.merge: cache {i} is a "
                    f"{type(c).__name__}, expected MLALatentCache"
                )
            if c.keys is not None and c.keys.shape[0] != 1:
                raise ValueError(
                    f"BatchMLALatentCache.merge: cache {i} holds {c.keys.shape[0]} "
                    "sequences, expected 1"
                )
        group_size, bits, after = _batch_settings(caches, "BatchMLALatentCache.merge")
        lengths = [c.offset if c.keys is not None else 0 for c in caches]
        longest = max(lengths, default=0)
        batch = cls([longest - n for n in lengths], group_size, bits, after)
        in_quant = [c.quantized for c in caches]
        template = next((c._specs() for c in caches if c.keys is not None), None)
        if template is None or longest == 0:
            batch.left_padding = mx.zeros((len(caches),), mx.int32)
            batch._regroup(in_quant)
            return batch
        rows = []
        for c, n in zip(caches, lengths):
            if c.keys is None or n == 0:
                parts = _zero_parts(
                    1, 0, template, group_size, bits if c.quantized else None
                )
            else:
                parts = [p[..., :n, :] for p in c._parts()]
            rows.append((parts, longest - n))
        batch._assemble(rows, in_quant, longest)
        batch._idx = longest
        return batch

    @property
    def state(self):
        config = _config(self.group_size, self.latent_bits, self.quantize_after)
        in_quant = mx.array([int(q) for q in self._in_quant], dtype=mx.int32)
        parts = []
        if self._template() is not None and self._idx:
            for g in self._groups:
                if g.count:
                    parts += [p[..., : self._idx, :] for p in g._parts()]
        return [config, self.left_padding, in_quant] + parts

    @state.setter
    def state(self, v):
        name = "BatchMLALatentCache"
        if not isinstance(v, (list, tuple)) or len(v) < 3:
            raise ValueError(
                f"{name} state must be a list of at least [config, left_padding, "
                f"row_precision], got {_shape(v)}"
            )
        config, left_padding, in_quant, parts = v[0], v[1], v[2], list(v[3:])
        group_size, bits, after = _read_config(name, config)
        for field, x in (("left_padding", left_padding), ("row_precision", in_quant)):
            if not isinstance(x, mx.array) or x.ndim != 1:
                raise ValueError(
                    f"{name} state: {field} must be a 1-D mx.array, got {_shape(x)}"
                )
        if left_padding.shape != in_quant.shape:
            raise ValueError(
                f"{name} state: left_padding and row_precision disagree in length"
            )
        self.__init__(left_padding.tolist(), group_size, bits, after)
        flags = [bool(x) for x in in_quant.tolist()]
        if any(flags) and bits is None:
            raise ValueError(f"{name} state: quantized rows without bits")
        self._in_quant = flags
        idx = 0
        for q, g in enumerate(self._groups):
            g.count = sum(1 for f in flags if f == q)
            if not parts or not g.count:
                continue
            n = 4 if q else 2
            mine, parts = parts[:n], parts[n:]
            g._load_parts(name, mine)
            if g.keys.shape[0] != g.count:
                raise ValueError(
                    f"{name} state: {g.keys.shape[0]} rows stored for {g.count} rows"
                )
            idx = g.values.shape[2]
        if parts:
            raise ValueError(f"{name} state: {len(parts)} arrays too many")
        self._idx = idx


def _batch_settings(caches, where):
    """(group_size, bits, quantize_after) of a batch made from these caches.
    Their quantization must agree (requantizing would add error silently),
    and so must the widths of their latents."""
    specs = {t for t in (_held_specs(c) for c in caches) if t is not None}
    if len(specs) > 1:
        raise ValueError(f"{where}: caches hold latents of different widths or dtypes")
    settings = {s for s in (c._quant_setting() for c in caches) if s is not None}
    if len(settings) > 1:
        raise ValueError(
            f"{where}: caches are quantized differently: {sorted(settings)}"
        )
    policies = {c.quantize_after for c in caches if c.quantize_after is not None}
    if len(policies) > 1:
        raise ValueError(
            f"{where}: caches quantize after different lengths: {sorted(policies)}"
        )
    group_size, bits = (
        settings.pop() if settings else (caches[0].group_size if caches else 64, None)
    )
    return group_size, bits, (policies.pop() if policies else None)


def _held_specs(cache):
    if isinstance(cache, BatchMLALatentCache):
        return cache._template()
    return cache._specs() if cache.keys is not None else None
