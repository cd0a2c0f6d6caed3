"""MLA decode attention that reads the latent once.

mlx-lm's one-KV-head attention reads the latent (keys and values alike) once per
query head. Here the heads are the columns of one matmul, and the latent, decoded
from its bytes if quantized, is read a chunk at a time under an online softmax.
"""

import logging
import time

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from . import decode_cuda
from .cache import quantize_latent

log = logging.getLogger(__name__)

# Bytes of latent per chunk: a step holds a few chunks, never the latent. The
# CPU value is measured (benchmarks/decode_speed.py), the GPU's not yet.
CHUNK_BYTES = {"cpu": 1 << 20, "gpu": 32 << 20}


def is_latent_decode(queries, keys, values, mask, sinks=None):
    """One query position of several heads over one head that is keys and values."""
    return (
        sinks is None
        and keys is values
        and isinstance(keys, mx.array)
        and queries.ndim == keys.ndim == 4
        and queries.shape[2] == 1
        and keys.shape[1] == 1
        and queries.shape[1] > 1
        and queries.shape[-1] == keys.shape[-1]
        and (mask is None or isinstance(mask, mx.array))
    )


def compute_dtype(dtype):
    # On the CPU a float16 latent attends faster cast to float32, a bfloat16 one
    # as it is (16K positions: 143 / 159 ms, 106 / 128 ms); a GPU keeps the dtype.
    on_cpu = mx.default_device() == mx.cpu
    return mx.float32 if on_cpu and dtype == mx.float16 else dtype


def chunk_size(batch, width, dtype):
    """Positions per chunk for ``batch`` rows of ``width`` values of ``dtype``."""
    device = "cpu" if mx.default_device() == mx.cpu else "gpu"
    return max(64, CHUNK_BYTES[device] // (batch * width * dtype.size))


def packed_cache(cache, latent):
    """The cache (or CacheList member) that last fetched ``latent`` from its
    bytes, or None."""
    for c in [cache, *getattr(cache, "caches", ())]:
        found = getattr(c, "latent_bytes", None)
        if callable(found) and found(latent) is not None:
            return c
    return None


def latent_attention(queries, latent, scale, mask=None, read=None, chunk=None):
    """``softmax(scale * q @ latent.T + mask) @ latent`` for ``queries`` (B, H, 1, D)
    over ``latent`` (B, 1, L, D); ``read``, where given, returns its rows instead
    of slicing it (``_PackedLatent.latent_reader``); ``chunk``: positions read at
    a time (default ``chunk_size``)."""
    B, H, _, D = queries.shape
    L = latent.shape[2]
    dtype = compute_dtype(queries.dtype)
    if read is None:
        read = (
            lambda a, b, t, after: (  # noqa: E731
                _after(latent[..., a:b, :], after).astype(t)
            )
        )
    # Heads as columns: scores come out (B, 1, positions, H).
    q = (queries * scale).astype(dtype).reshape(B, 1, H, D).swapaxes(-1, -2)
    q = mx.contiguous(q)
    if mask is not None:
        mask = mx.broadcast_to(mask, (B, H, 1, L)).transpose(0, 2, 3, 1)
    top = total = out = None
    chunk = chunk or chunk_size(B, D, dtype)
    for start in range(0, L, chunk):
        stop = min(start + chunk, L)
        # Read once the last chunk is done: fewer chunks in flight at a time.
        rows = read(start, stop, dtype, out)
        scores = (rows @ q).astype(mx.float32)
        if mask is not None:
            scores = _masked(scores, mask[..., start:stop, :])
        new_top = scores.max(axis=-2, keepdims=True)
        if top is not None:
            new_top = mx.maximum(top, new_top)
        weights = mx.exp(scores - new_top)
        part = mx.contiguous(weights.astype(dtype).swapaxes(-1, -2)) @ rows
        part_total = weights.sum(axis=-2, keepdims=True)
        if top is None:
            out, total = part.astype(mx.float32), part_total
        else:
            carry = mx.exp(top - new_top)
            out = out * carry.swapaxes(-1, -2) + part
            total = total * carry + part_total
        top = new_top
    out = out / total.swapaxes(-1, -2)
    return out.astype(queries.dtype).reshape(B, H, 1, D)


def _after(x, after):
    return x if after is None else mx.depends(x, after)


def _masked(scores, mask):
    if mask.dtype == mx.bool_:
        low = mx.array(mx.finfo(mx.float32).min, mx.float32)
        return mx.where(mask, scores, low)
    return scores + mask.astype(mx.float32)


def kernel_attention(queries, latent, scale, mask=None, cache=None):
    """``latent_attention`` by ``decode_cuda``'s kernel, where it has a variant
    that was as close to float32 attention as ``latent_attention`` on random
    rows of the same kind, and ran faster than it on this device at this
    length (to the next power of two); else None. ``cache``: the one that
    holds ``latent`` as bytes, if any."""
    packed = None if cache is None else cache.latent_bytes(latent)
    kind = (
        queries.shape[1],
        queries.shape[-1],
        queries.dtype,
        packed[2] if packed else latent.dtype,
        getattr(mask, "dtype", None),
    )

    def kernel():
        return decode_cuda.latent_attention(queries, latent, scale, mask, packed)

    def portable():
        read = None if cache is None else cache.latent_reader(latent)
        return latent_attention(queries, latent, scale, mask, read)

    length = (queries.shape[0], latent.shape[2].bit_length())
    try:
        if kind not in _KERNEL_AGREES:
            _KERNEL_AGREES[kind] = _kernel_agrees(kind)
        if _KERNEL_AGREES[kind] and (kind, length) not in _KERNEL_FASTER:
            # The step's own inputs, not the dequantized latent (never evaluated).
            mx.eval(
                queries, [] if mask is None else mask, packed[:2] if packed else latent
            )
            _KERNEL_FASTER[kind, length] = _seconds(kernel) < _seconds(portable)
    except Exception as e:  # a kernel that fails to build or run is not used
        log.warning("MLA decode kernel off for %s: %s: %s", kind, type(e).__name__, e)
        _KERNEL_AGREES[kind] = False
    if _KERNEL_AGREES[kind] and _KERNEL_FASTER[kind, length]:
        return kernel()
    return None


_KERNEL_AGREES = {}  # kind of step -> whether the kernel gave the reference's
_KERNEL_FASTER = {}  # (kind, (batch, length's bits)) -> measured faster


def _seconds(run, repeats=3):
    mx.eval(run())  # built and warm
    start = time.perf_counter()
    for _ in range(repeats):
        mx.eval(run())
    return (time.perf_counter() - start) / repeats


def _kernel_agrees(kind):
    """Both paths on random rows of ``kind`` (more than one tile, a mask if the
    step has one, the step's format, quantized through a cache) against float32
    attention over the same rows: the kernel must be as close as the portable
    path, which rounds to the model's dtype where the kernel keeps float32."""
    H, D, dtype, fmt, mask_dtype = kind
    L = 2 * decode_cuda.TILE + 5
    k = mx.random.split(mx.random.key(0), 3)
    q = mx.random.normal((1, H, 1, D), key=k[0]).astype(dtype)
    rows = mx.random.normal((1, 1, L, D), key=k[1])
    read, packed = None, None
    if isinstance(fmt, tuple):  # quantized: (group, bits, width, dtype, ...)
        group_size, bits, _, latent_dtype, rope_width, rope_dtype = fmt
        rope = mx.zeros((1, 1, L, rope_width), getattr(mx, rope_dtype))
        small = KVCache()
        small.update_and_fetch(rows.astype(getattr(mx, latent_dtype)), rope)
        small = quantize_latent(small, group_size, bits)
        rows, _ = small.update_and_fetch(rows[:, :, :1], rope[:, :, :1])
        read, packed = small.latent_reader(rows), small.latent_bytes(rows)
    else:
        rows = rows.astype(fmt)
    mask = None
    if mask_dtype is not None:
        keep = mx.random.uniform(shape=(1, H, 1, rows.shape[2]), key=k[2]) > 0.2
        mask = keep if mask_dtype == mx.bool_ else mx.where(keep, 0.0, -1e4)
        mask = mask.astype(mask_dtype)
    wide = mask if mask is None or mask.dtype == mx.bool_ else mask.astype(mx.float32)
    exact = latent_attention(q.astype(mx.float32), rows.astype(mx.float32), 0.1, wide)
    portable = latent_attention(q, rows, 0.1, mask, read)
    got = decode_cuda.latent_attention(q, rows, 0.1, mask, packed)
    if got is None:
        log.warning("MLA decode kernel off for %s: it has no variant", kind)
        return False
    bound = 2 * mx.abs(portable.astype(mx.float32) - exact).max() + 1e-4
    agrees = (mx.abs(got.astype(mx.float32) - exact).max() <= bound).item()
    if not agrees:
        log.warning("MLA decode kernel off for %s: it disagreed", kind)
    return agrees


def folded_attention(original):
    """``scaled_dot_product_attention`` that decodes through ``latent_attention``
    (on MLX's CUDA backend, its kernel where it agrees with it and is faster)."""

    def scaled_dot_product_attention(
        queries, keys, values, cache, scale, mask, sinks=None
    ):
        if is_latent_decode(queries, keys, values, mask, sinks) and not hasattr(
            cache, "bits"
        ):
            owner = packed_cache(cache, keys)
            if decode_cuda.available():
                out = kernel_attention(queries, keys, scale, mask, owner)
                if out is not None:
                    return out
            read = None if owner is None else owner.latent_reader(keys)
            return latent_attention(queries, keys, scale, mask, read)
        return original(
            queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks
        )

    scaled_dot_product_attention.mlx_lm_mla_original = original
    return scaled_dot_product_attention
