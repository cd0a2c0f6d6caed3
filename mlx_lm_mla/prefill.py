"""The next turn of a long chat: a short chunk of new tokens over a long cached
latent attends with its heads and query positions folded over the latent.

For more than one query position mlx-lm's MLA attentions expand the whole
latent to per-head keys and values (``embed_q(latent, transpose=False)``,
``unembed_out(latent)``) before ``scaled_dot_product_attention``: after a long
conversation that costs more than the chunk's attention and holds every
head's keys and values. Here, where the expansion costs more multiply-adds
than attending in the latent, the queries are taken into the latent instead
(``embed_q(queries)``), every (head, position) is a column of one
``decode.latent_attention`` over the latent, read a chunk of positions at a
time (a quantized latent from its bytes), and ``unembed_out`` maps the result
back. The expansions, lazy, are then never computed.
"""

import weakref

import mlx.core as mx

from . import decode

ENABLED = True  # benchmarks/next_turn.py times the expansion beside it

# id(expansion) -> what made it: (weakref to it, the MultiLinear, its
# transpose, the latent). An entry goes with its expansion.
_MADE = {}


def recording_call(original):
    """``MultiLinear.__call__`` (and its quantized twin's) that remembers what
    it made from a latent (one head in, several out), so the attention it is
    handed to can tell an expansion of the latent."""

    def __call__(self, x, transpose=True):
        out = original(self, x, transpose)
        if x.ndim == 4 and x.shape[1] == 1 and out.ndim == 4 and out.shape[1] > 1:
            key = id(out)
            _MADE[key] = (weakref.ref(out), self, transpose, x)
            weakref.finalize(out, _MADE.pop, key, None)
        return out

    __call__.mlx_lm_mla_original = original
    return __call__


def made_from(array, transpose):
    """(the MultiLinear, the latent) ``array`` was made from with
    ``transpose``, or None."""
    found = _MADE.get(id(array))
    if found is None or found[0]() is not array or found[2] != transpose:
        return None
    return found[1], found[3]


def folds(chunk, width, key_width, value_width):
    """Whether attending in the latent costs fewer multiply-adds per head than
    expanding it: ``chunk`` positions x 2 ``width`` per cached position,
    against ``width`` x (``key_width`` + ``value_width``) to expand it and
    ``chunk`` x (``key_width`` + ``value_width``) to attend."""
    expanded = key_width + value_width
    return chunk * (2 * width - expanded) < width * expanded


def columns_chunk(batch, columns, width, dtype):
    """Positions read at a time: the latent's rows and the scores of every
    column for them within the decode step's budget each."""
    rows = decode.chunk_size(batch, width, dtype)
    device = "cpu" if mx.default_device() == mx.cpu else "gpu"
    scores = decode.CHUNK_BYTES[device] // (batch * columns * 4)
    return max(64, min(rows, scores))


def folded_attention(queries, latent, embed_q, unembed_out, scale, mask, cache):
    """``scaled_dot_product_attention`` of ``queries`` (B, H, L, key width) over
    ``embed_q(latent, transpose=False)`` and ``unembed_out(latent)``, in the
    latent: (B, H, L, value width)."""
    B, H, L, _ = queries.shape
    q = embed_q(queries)  # (B, H, L, width)
    width, positions = q.shape[-1], latent.shape[2]
    q = q.reshape(B, H * L, 1, width)
    if mask is not None:
        mask = mx.broadcast_to(mask, (B, H, L, positions)).reshape(
            B, H * L, 1, positions
        )
    owner = decode.packed_cache(cache, latent)
    read = None if owner is None else owner.latent_reader(latent)
    chunk = columns_chunk(B, H * L, width, decode.compute_dtype(q.dtype))
    out = decode.latent_attention(q, latent, scale, mask, read, chunk)
    return unembed_out(out.reshape(B, H, L, width))


def folded_chunks(original):
    """``scaled_dot_product_attention`` that attends a chunk over a longer
    latent in the latent where that costs less (``folds``)."""

    def scaled_dot_product_attention(
        queries, keys, values, cache, scale, mask, sinks=None
    ):
        keys_from = made_from(keys, False)
        values_from = made_from(values, True)
        if (
            ENABLED
            and sinks is None
            and keys_from is not None
            and values_from is not None
            and keys_from[1] is values_from[1]
            and (mask is None or isinstance(mask, mx.array))
            and queries.ndim == 4
            and 1 < queries.shape[2] < keys.shape[2]  # a chunk after others
            and folds(
                queries.shape[2],
                keys_from[1].shape[-1],
                keys.shape[-1],
                values.shape[-1],
            )
        ):
            embed_q, latent = keys_from
            return folded_attention(
                queries, latent, embed_q, values_from[0], scale, mask, cache
            )
        return original(
            queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks
        )

    scaled_dot_product_attention.mlx_lm_mla_original = original
    return scaled_dot_product_attention
