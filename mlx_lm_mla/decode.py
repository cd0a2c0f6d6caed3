"""MLA decode attention that reads the latent once.

mlx-lm's one-KV-head attention reads the latent (keys and values alike) once per
query head. Here the heads are the columns of one matmul, and the latent, decoded
from its bytes if quantized, is read a chunk at a time under an online softmax.
"""

import mlx.core as mx

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


def latent_reader(cache, latent):
    """``read`` of the cache (or CacheList member) that last fetched ``latent``."""
    for c in [cache, *getattr(cache, "caches", ())]:
        reader = getattr(c, "latent_reader", None)
        read = reader(latent) if callable(reader) else None
        if read is not None:
            return read
    return None


def latent_attention(queries, latent, scale, mask=None, read=None):
    """``softmax(scale * q @ latent.T + mask) @ latent`` for ``queries`` (B, H, 1, D)
    over ``latent`` (B, 1, L, D); ``read``, where given, returns its rows instead
    of slicing it (``_PackedLatent.latent_reader``)."""
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
    chunk = chunk_size(B, D, dtype)
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


def folded_attention(original):
    """``scaled_dot_product_attention`` that decodes through ``latent_attention``."""

    def scaled_dot_product_attention(
        queries, keys, values, cache, scale, mask, sinks=None
    ):
        if is_latent_decode(queries, keys, values, mask, sinks) and not hasattr(
            cache, "bits"
        ):
            read = latent_reader(cache, keys)
            return latent_attention(queries, keys, scale, mask, read)
        return original(
            queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks
        )

    scaled_dot_product_attention.mlx_lm_mla_original = original
    return scaled_dot_product_attention
