"""MLA decode attention that reads the latent once.

In a single-token decode step of an MLA layer every query head attends over
the same latent, which is both its keys and its values. mlx-lm hands it to
``scaled_dot_product_attention`` as one KV head, which reads it once per
query head. Here the heads are the columns of one matmul per sequence, and
the latent is read a chunk at a time: a quantized latent is decoded from its
packed bytes chunk by chunk (an online softmax joins the chunks), so a step
never holds the whole latent expanded.
"""

import mlx.core as mx

# Bytes of latent one chunk holds as computed: the step's transient is a few
# chunks (MLX schedules a bounded number of ops ahead), never the latent. The
# CPU figure is measured (benchmarks/decode_speed.py); a GPU wants fewer,
# larger matmuls, and its figure is not measured yet.
CHUNK_BYTES = {"cpu": 1 << 20, "gpu": 32 << 20}


def is_latent_decode(queries, keys, values, mask, sinks=None):
    """Whether an attention call is an MLA decode step: one query position of
    several heads over one head that serves as both keys and values."""
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
    # MLX's CPU matmuls are fastest in float32 (BLAS); a GPU multiplies the
    # model's dtype (benchmarks/decode_speed.py).
    return mx.float32 if mx.default_device() == mx.cpu else dtype


def chunk_size(batch, width, dtype):
    """Positions per chunk for ``batch`` rows of ``width`` values of ``dtype``."""
    device = "cpu" if mx.default_device() == mx.cpu else "gpu"
    return max(64, CHUNK_BYTES[device] // (batch * width * dtype.size))


def latent_reader(cache, latent):
    """``read(start, stop, dtype, after)`` of the cache's packed rows behind
    ``latent``, if ``latent`` is what the cache (or a member of a CacheList)
    last fetched; else None."""
    for c in [cache, *getattr(cache, "caches", ())]:
        reader = getattr(c, "latent_reader", None)
        read = reader(latent) if callable(reader) else None
        if read is not None:
            return read
    return None


def latent_attention(queries, latent, scale, mask=None, read=None):
    """``softmax(scale * q @ latent.T + mask) @ latent`` for every head of
    ``queries`` (B, H, 1, D) over ``latent`` (B, 1, L, D), as
    ``mx.fast.scaled_dot_product_attention`` computes it with one KV head.

    ``read(start, stop, dtype, after)``, where given, returns rows of the
    latent (a quantized cache's, decoded), read only once ``after`` is
    computed; used instead of slicing ``latent``."""
    B, H, _, D = queries.shape
    L = latent.shape[2]
    dtype = compute_dtype(queries.dtype)
    if read is None:
        read = lambda a, b, t, after: _after(latent[..., a:b, :], after).astype(t)  # noqa: E731
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
    """``scaled_dot_product_attention`` of an MLA model's module that runs
    decode steps through ``latent_attention``; anything else as ``original``."""

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        if is_latent_decode(queries, keys, values, mask, sinks) and not hasattr(cache, "bits"):
            read = latent_reader(cache, keys)
            return latent_attention(queries, keys, scale, mask, read)
        return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention.mlx_lm_mla_original = original
    return scaled_dot_product_attention
