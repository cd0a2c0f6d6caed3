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


def _pad_seq(x, left, right=0):
    if left == 0 and right == 0:
        return x
    return mx.pad(x, [(0, 0), (0, 0), (left, right), (0, 0)])


def _roll_rows(x, shifts):
    """Rolls each row of x right along the sequence axis by its own shift."""
    n = x.shape[2]
    idx = (mx.arange(n)[None] - shifts[:, None]) % n
    return mx.take_along_axis(x, idx[:, None, :, None], axis=2)


class _LatentStore:
    """The arrays an MLA cache holds along the sequence axis, plain or
    quantized. Shared by the single and the batch cache so both store, grow,
    slice and quantize the same way."""

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
        if self.quantized:
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
            old = [p[..., :start, :] for p in self._parts()]
            if not old:
                old = [mx.zeros((*x.shape[:2], 0, x.shape[3]), x.dtype) for x in new]
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
        if self.quantized:
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

    def _quantize_store(self, name, group_size, bits, end):
        """Quantizes the stored latent in place. A cache that is already
        quantized stays as it is: requantizing would only add error."""
        if self.quantized:
            return
        width = self.keys.shape[-1] if self.keys is not None else None
        _check_quant_params(name, group_size, bits, width)
        if self.keys is not None:
            packed = _quantize(self.keys[..., :end, :], group_size, bits)
            self.keys, self.scales, self.biases = packed
            self.values = self.values[..., :end, :]
        self.group_size, self.latent_bits = group_size, bits

    def _latent_spec(self):
        if self.quantized:
            return self.scales.shape[-1] * self.group_size, self.scales.dtype
        return self.keys.shape[-1], self.keys.dtype

    def _specs(self, group_size, bits):
        """(width, dtype) of each stored part in the given quantization."""
        width, dtype = self._latent_spec()
        rope = (self.values.shape[-1], self.values.dtype)
        if bits is None:
            return [(width, dtype), rope]
        groups = (width // group_size, dtype)
        return [(width * bits // 32, mx.uint32), groups, groups, rope]

    def _check_update(self, name, latent, rope, rows):
        _check_pair(name, latent, rope, rows)
        if self.quantized:
            _check_quant_params(
                name, self.group_size, self.latent_bits, latent.shape[-1]
            )
        if self.keys is None:
            return
        held = (self._latent_spec(), (self.values.shape[-1], self.values.dtype))
        for field, x, (width, dtype) in zip(
            ("latent", "rope key"), (latent, rope), held
        ):
            if x.shape[-1] != width or x.dtype != dtype:
                raise ValueError(
                    f"{name}.update_and_fetch: the {field} is {x.dtype} of "
                    f"width {x.shape[-1]}, but the cache holds {dtype} of width {width}"
                )

    def _padded_parts(self, template, group_size, bits, length):
        """This cache's rows in the given quantization, left padded to length.
        Used to build batches without changing the caches they come from."""
        n = self.size() if self.keys is not None else 0
        if n == 0:
            rows = self._rows()
            parts = [
                mx.zeros((rows, 1, 0, w), t)
                for w, t in template._specs(group_size, bits)
            ]
        else:
            parts = self._state_parts(n)
            if bits is not None and not self.quantized:
                parts = _quantize(parts[0], group_size, bits) + [parts[1]]
        return [_pad_seq(p, length - n) for p in parts]

    @property
    def nbytes(self):
        return sum(p.nbytes for p in self._parts())

    def empty(self):
        return self.keys is None

    def is_trimmable(self):
        return True

    # The whole state is in ``state``; the config array carries the
    # quantization so both mlx-lm save formats (0.31 and 0.32) can store it.
    def _config(self):
        return mx.array([self.group_size, self.latent_bits or 0], dtype=mx.int32)

    def _state_parts(self, end):
        return [p[..., :end, :] for p in self._parts()]

    def _load_state_parts(self, name, config, parts):
        if not isinstance(config, mx.array) or config.shape != (2,):
            raise ValueError(
                f"{name} state: the first entry must be the config array "
                f"[group_size, bits], got {_shape(config)}; this is not a state "
                f"saved by {name}"
            )
        group_size, bits = (int(v) for v in config.tolist())
        bits = bits or None
        if bits is not None:
            _check_quant_params(name, group_size, bits)
        expected = 0 if not parts else (4 if bits else 2)
        if len(parts) != expected:
            raise ValueError(
                f"{name} state: expected {4 if bits else 2} arrays for a "
                f"{'quantized' if bits else 'plain'} latent cache, got {len(parts)}"
            )
        for p in parts:
            if not isinstance(p, mx.array) or p.ndim != 4 or p.shape[1] != 1:
                raise ValueError(
                    f"{name} state: every array must have shape (B, 1, L, D), "
                    f"got {_shape(p)}"
                )
        if parts and len({p.shape[:3] for p in parts}) != 1:
            raise ValueError(
                f"{name} state: the arrays disagree on batch or length: "
                f"{[_shape(p) for p in parts]}"
            )
        if bits and parts:
            packed, scales, biases, _ = parts
            if packed.dtype != mx.uint32 or scales.shape != biases.shape:
                raise ValueError(f"{name} state: the packed latent is malformed")
            if packed.shape[-1] * 32 // bits != scales.shape[-1] * group_size:
                raise ValueError(
                    f"{name} state: packed width {packed.shape[-1]} does not "
                    f"match {scales.shape[-1]} groups of {group_size} at {bits} bits"
                )
        self._init_store(group_size, bits)
        if parts:
            self._set_parts(list(parts))

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


class MLALatentCache(_LatentStore):
    """The cache of one MLA layer for one sequence (B is usually 1).

    Args:
        group_size (int): Group size for latent quantization. Default: ``64``.
        bits (int, optional): Quantize the latent with this many bits from
            the start. Default: ``None`` (model dtype until ``to_quantized``).
    """

    def __init__(self, group_size: int = 64, bits: Optional[int] = None):
        if bits is not None:
            _check_quant_params("MLALatentCache", group_size, bits)
        self._init_store(group_size, bits)
        self.offset = 0

    def update_and_fetch(self, latent, rope):
        self._check_update(
            "MLALatentCache",
            latent,
            rope,
            self._rows() if self.keys is not None else None,
        )
        self._write(self.offset, latent, rope)
        self.offset += latent.shape[2]
        return self._read(self.offset)

    def _rows(self):
        return self.keys.shape[0] if self.keys is not None else 1

    def size(self):
        return self.offset

    def trim(self, n):
        n = max(0, min(self.offset, n))
        self.offset -= n
        return n

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        """Quantizes the latent in place and returns ``self``. Idempotent."""
        self._quantize_store("MLALatentCache", group_size, bits, self.offset)
        return self

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        # MLA models combine the mask with mx.where, so it is always an array.
        if N == 1 and window_size is None:
            return None
        return _causal_mask(N, self.offset, window_size=window_size)

    @property
    def state(self):
        return [self._config()] + self._state_parts(self.offset)

    @state.setter
    def state(self, v):
        if not isinstance(v, (list, tuple)) or not v:
            raise ValueError(
                f"MLALatentCache state must be a non-empty list, got {_shape(v)}"
            )
        self._load_state_parts("MLALatentCache", v[0], list(v[1:]))
        self.offset = self.values.shape[2] if self.values is not None else 0

    @classmethod
    def merge(cls, caches):
        return BatchMLALatentCache.merge(caches)


class BatchMLALatentCache(_LatentStore):
    """The cache of one MLA layer for a batch of sequences.

    Rows are left padded, so every row ends at the same index; ``offset`` is
    each row's own length, which is what RoPE needs.

    Args:
        left_padding (List[int]): Padding before each row's first token.
        group_size (int): Group size for latent quantization. Default: ``64``.
        bits (int, optional): Quantize the latent from the start.
    """

    def __init__(
        self, left_padding: List[int], group_size: int = 64, bits: Optional[int] = None
    ):
        if bits is not None:
            _check_quant_params("BatchMLALatentCache", group_size, bits)
        self._init_store(group_size, bits)
        self.left_padding = mx.array(left_padding, dtype=mx.int32)
        self._idx = 0
        self._right_padding = None

    @property
    def offset(self):
        return self._idx - self.left_padding

    def update_and_fetch(self, latent, rope):
        self._check_update("BatchMLALatentCache", latent, rope, self._rows())
        self._write(self._idx, latent, rope)
        self._idx += latent.shape[2]
        return self._read(self._idx)

    def size(self):
        return self._idx

    def _rows(self):
        return self.left_padding.shape[0]

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        if left_padding is not None:
            if self.keys is not None:
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
        if self._right_padding is None:
            return
        shifts = self._right_padding
        self._set_parts(
            [_roll_rows(p[..., : self._idx, :], shifts) for p in self._parts()]
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
        """Quantizes the latent of every row in place and returns ``self``."""
        self._quantize_store("BatchMLALatentCache", group_size, bits, self._idx)
        return self

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        return _causal_mask(N, self._idx, self.left_padding, window_size)

    def filter(self, batch_indices):
        """Keeps only the given rows, then drops padding no row needs."""
        idx = mx.array(batch_indices, dtype=mx.int32)
        self._set_parts([p[idx] for p in self._parts()])
        self.left_padding = self.left_padding[idx]
        if self._right_padding is not None:
            self._right_padding = self._right_padding[idx]
        shift = min(self.left_padding.tolist()) if len(batch_indices) else 0
        shift = min(shift, self._idx)
        if shift > 0:
            self._set_parts([p[..., shift:, :] for p in self._parts()])
            self._idx -= shift
            self.left_padding = self.left_padding - shift

    def extend(self, other):
        """Appends the rows of another batch cache, right aligning both."""
        if not isinstance(other, BatchMLALatentCache):
            raise TypeError(
                "BatchMLALatentCache.extend: expected a BatchMLALatentCache, "
                f"got {type(other).__name__}"
            )
        group_size, bits = _common_quantization(
            [self, other], "BatchMLALatentCache.extend"
        )
        idx = max(self._idx, other._idx)
        template = next((c for c in (self, other) if c.keys is not None), None)
        if template is not None:
            rows = [
                c._padded_parts(template, group_size, bits, idx) for c in (self, other)
            ]
            self.group_size, self.latent_bits = group_size, bits
            self._set_parts([mx.concatenate(ps, axis=0) for ps in zip(*rows)])
        self.left_padding = mx.concatenate(
            [self.left_padding + idx - self._idx, other.left_padding + idx - other._idx]
        )
        self._idx = idx

    def extract(self, idx):
        """Row idx as a single-sequence cache, in the same quantization."""
        cache = MLALatentCache(self.group_size, self.latent_bits)
        if self.keys is not None:
            start = self.left_padding[idx].item()
            cache._set_parts(
                [
                    mx.contiguous(p[idx : idx + 1, :, start : self._idx])
                    for p in self._parts()
                ]
            )
            cache.offset = self._idx - start
        return cache

    @classmethod
    def merge(cls, caches):
        """A batch cache from single-sequence caches, left padded to the
        longest. Quantized and plain caches merge into a quantized batch."""
        for i, c in enumerate(caches):
            if not isinstance(c, MLALatentCache):
                raise TypeError(
                    f"BatchMLALatentCache.merge: cache {i} is a "
                    f"{type(c).__name__}, expected MLALatentCache"
                )
            if c._rows() != 1:
                raise ValueError(
                    f"BatchMLALatentCache.merge: cache {i} holds {c._rows()} "
                    "sequences, expected 1"
                )
        group_size, bits = _common_quantization(caches, "BatchMLALatentCache.merge")
        lengths = [c.offset if c.keys is not None else 0 for c in caches]
        longest = max(lengths, default=0)
        template = next((c for c in caches if c.keys is not None), None)
        if template is None or longest == 0:
            return cls([0] * len(caches), group_size, bits)
        batch = cls([longest - n for n in lengths], group_size, bits)
        rows = [c._padded_parts(template, group_size, bits, longest) for c in caches]
        batch._set_parts([mx.concatenate(ps, axis=0) for ps in zip(*rows)])
        batch._idx = longest
        return batch

    @property
    def state(self):
        return [self._config(), self.left_padding] + self._state_parts(self._idx)

    @state.setter
    def state(self, v):
        if not isinstance(v, (list, tuple)) or len(v) < 2:
            raise ValueError(
                "BatchMLALatentCache state must be a list of at least "
                f"[config, left_padding], got {_shape(v)}"
            )
        config, left_padding, parts = v[0], v[1], list(v[2:])
        if not isinstance(left_padding, mx.array) or left_padding.ndim != 1:
            raise ValueError(
                "BatchMLALatentCache state: left_padding must be a 1-D mx.array, "
                f"got {_shape(left_padding)}"
            )
        self._load_state_parts("BatchMLALatentCache", config, parts)
        if parts and parts[0].shape[0] != left_padding.shape[0]:
            raise ValueError(
                f"BatchMLALatentCache state: {left_padding.shape[0]} paddings "
                f"for {parts[0].shape[0]} rows"
            )
        self.left_padding = left_padding.astype(mx.int32)
        self._idx = self.values.shape[2] if self.values is not None else 0
        self._right_padding = None


def _common_quantization(caches, where):
    """The (group_size, bits) of a batch made from these caches: quantized if
    any of them is. Differing settings are an error, since requantizing would
    add error silently."""
    held = [c for c in caches if c.keys is not None]
    specs = {
        (tuple(c._latent_spec()), c.values.shape[-1], c.values.dtype) for c in held
    }
    if len(specs) > 1:
        raise ValueError(f"{where}: caches hold latents of different widths or dtypes")
    settings = {(c.group_size, c.latent_bits) for c in caches if c.quantized}
    if len(settings) > 1:
        raise ValueError(
            f"{where}: caches are quantized differently: {sorted(settings)}"
        )
    if not settings:
        return (caches[0].group_size if caches else 64), None
    return settings.pop()
