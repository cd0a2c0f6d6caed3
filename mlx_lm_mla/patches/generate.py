"""Patches on ``mlx_lm.generate``: a prompt cache is checked against its model and
``kv_bits`` before the first step, and ``BatchGenerator`` quantizes an MLA
model's batches under ``--kv-bits`` (applied with the server's patches)."""

import inspect
from dataclasses import dataclass

from ..cache import (
    BatchMixedLatentCache,
    QuantizedRotatingLatentCache,
    _PackedLatent,
)
from ..guards import state as served
from ..mla import (
    ATTENTION,
    found_once,
    has_latent_attention,
    latent_layers,
    leaves,
    mark_model_caches,
)
from .table import CACHE_CHECKS, Patch
from . import quantize


@dataclass(frozen=True)
class KVSettings:
    """A server's ``--kv-bits``, ``--kv-group-size`` and ``--quantized-kv-start``."""

    group_size: int
    bits: int
    start: int

    @classmethod
    def of(cls, cli_args):
        # mlx-lm 0.31's server has no --kv-bits (its contract rows start at 0.32).
        if getattr(cli_args, "kv_bits", None) is None:
            return None
        return cls(
            cli_args.kv_group_size, cli_args.kv_bits, cli_args.quantized_kv_start
        )


GENERATE = "mlx_lm.generate"


def table():
    return [
        Patch(GENERATE, "generate_step", "rebind", checked_generate_step, CACHE_CHECKS),
        Patch(
            GENERATE,
            "BatchGenerator.insert_segments",
            "wrap",
            checked_insert,
            CACHE_CHECKS,
        ),
    ]


def checked_insert(original):
    """``BatchGenerator.insert_segments`` (``insert`` calls it) refusing, before
    the generator takes anything, a row whose cache cannot join a batch: the
    refusal would otherwise come from a later ``next()``, after the generator
    moved the row's books, and fail every call after it."""

    def insert_segments(self, segments, max_tokens=None, caches=None, *a, **kw):
        problem = insert_problem(self, caches)
        if problem:
            raise ValueError(f"BatchGenerator.insert: {problem}")
        return original(self, segments, max_tokens, caches, *a, **kw)

    insert_segments.mlx_lm_mla_original = original
    return insert_segments


def _row(where):
    return "the rows it holds" if where == "held" else f"row {where}"


def insert_problem(generator, caches):
    """Why rows with ``caches`` cannot be batched with each other and the rows
    the generator holds, or None: a quantized rolling window is never batched,
    and one layer's quantized latents batch only in one format."""
    # The rows it holds, where this mlx-lm keeps them as the contract says
    # (--kv-bits batching reads them; that feature is off where they are not):
    # queued ones (a row's cache is its entry's fourth), and batched ones.
    batches = (
        getattr(generator, "_prompt_batch", None),
        getattr(generator, "_generation_batch", None),
    )
    queued = getattr(generator, "_unprocessed_sequences", ())
    held = [entry[3] or [] for entry in queued]
    held += [getattr(b, "prompt_cache", None) or [] for b in batches]
    formats = {}  # layer: {format: where}
    for where, layers in [*enumerate(caches or []), *(("held", b) for b in held)]:
        for i, layer in enumerate(layers or []):
            for c in leaves([layer]):
                if isinstance(c, BatchMixedLatentCache):
                    c = c.packed  # its quantized rows
                if isinstance(c, QuantizedRotatingLatentCache):
                    return (
                        f"{_row(where)}: a quantized rolling window "
                        "(max_kv_size with kv_bits), which is never batched"
                    )
                if isinstance(c, _PackedLatent):
                    formats.setdefault(i, {}).setdefault(c._format, where)
    for i, found in formats.items():
        if len(found) > 1:
            named = "; ".join(
                f"{_row(w)}: {f[1]} bits, groups of {f[0]}" for f, w in found.items()
            )
            return (
                f"layer {i}'s latent is quantized in more than one format "
                f"({named}); a batch holds one"
            )
    return None


def quantizing_next(original):
    """``BatchGenerator._next`` that quantizes an MLA model's batches under the
    ``--kv-bits`` of the server whose generation thread runs it."""

    def _next(self):
        result = original(self)
        server = served.current()
        settings = KVSettings.of(server.cli_args) if server is not None else None
        if settings is not None and has_latent_attention(self.model):
            for batch in (self._prompt_batch, self._generation_batch):
                quantize.quantize_batches(
                    batch.prompt_cache,
                    settings.group_size,
                    settings.bits,
                    settings.start,
                )
        return result

    _next.mlx_lm_mla_original = original
    return _next


def _latent_widths(model):
    """{layer: (latent width, RoPE width, CacheList member)} of MLA layers."""

    def find():
        found = {}
        for i, module in latent_layers(model).items():
            rope = getattr(module, "qk_rope_head_dim", None)
            if isinstance(rope, int):
                found[i] = (module.kv_lora_rank, rope, ATTENTION[type(module)])
        return found

    return found_once(model, "widths", find)


def _made(model):
    """Whether each cache the model makes for itself is a ``CacheList``."""
    from mlx_lm.models.cache import CacheList, make_prompt_cache

    def find():
        return [isinstance(c, CacheList) for c in make_prompt_cache(model)]

    return found_once(model, "made", find)


def cache_mismatch(model, cache):
    """Why ``cache`` cannot serve ``model``'s MLA layers (another number of
    layers, another structure, per-head K/V, stock's quantized K/V, or other
    widths), or None."""
    import mlx.core as mx
    from mlx_lm.models.cache import CacheList, QuantizedKVCache

    widths = _latent_widths(model) if cache else {}
    if not widths:
        return None
    made = _made(model)  # what the cache must be: the model's own
    if len(cache) != len(made):
        return (
            f"prompt cache holds {len(cache)} layer caches; this model makes "
            f"{len(made)}: the cache is from another model"
        )
    for i, listed in enumerate(made):
        if isinstance(cache[i], CacheList) != listed:
            kinds = ("a cache", "a CacheList")
            return (
                f"prompt cache layer {i} is {kinds[not listed]}; this model makes "
                f"{kinds[listed]} there: the cache is from another model"
            )
    for i, (latent, rope, member) in widths.items():
        inner = getattr(cache[i], "caches", ()) if member is not None else None
        if inner is not None and member >= len(inner):
            return (
                f"prompt cache layer {i} is a CacheList of {len(inner)}; this "
                f"model writes its latent to member {member}: the cache is from "
                "another model"
            )
        c = cache[i] if inner is None else inner[member]
        if isinstance(c, QuantizedKVCache):
            return (
                f"prompt cache layer {i} (QuantizedKVCache) holds keys and values "
                "quantized by stock mlx-lm, which an MLA layer cannot read (a "
                "cache of another model, or of this one made without mlx-lm-mla); "
                "make it again with mlx-lm-mla installed"
            )
        fmt = getattr(c, "_format", None)
        if fmt is not None:
            held = (fmt[2], fmt[4])
            heads = 1
        else:
            k, v = getattr(c, "keys", None), getattr(c, "values", None)
            if not (
                isinstance(k, mx.array) and isinstance(v, mx.array) and k.ndim == 4
            ):
                continue
            held, heads = (k.shape[-1], v.shape[-1]), k.shape[1]
        if heads != 1:
            return (
                f"prompt cache layer {i} ({type(c).__name__}) holds per-head keys and "
                f"values ({heads} heads, widths {held[0]} and {held[1]}), as a model "
                "with full attention saves them; this model caches one MLA latent "
                f"per layer (1 head, widths {latent} and {rope})"
            )
        if held != (latent, rope):
            return (
                f"prompt cache layer {i} ({type(c).__name__}) holds a latent of width "
                f"{held[0]} and a RoPE key of width {held[1]}; this model caches "
                f"widths {latent} and {rope}: the cache is from another model"
            )
    return None


def checked_generate_step(original):
    """``generate_step`` refusing a prompt cache of another model or ``kv_bits``."""

    # Keyword-only parameters of generate_step (a contract row says so).
    default_group_size = inspect.signature(original).parameters["kv_group_size"].default

    def generate_step(prompt, model, *args, **kwargs):
        cache = kwargs.get("prompt_cache")
        if isinstance(cache, (list, tuple)):
            bits = kwargs.get("kv_bits")
            group_size = kwargs.get("kv_group_size", default_group_size)
            problem = cache_mismatch(model, cache) or settings_mismatch(
                cache, bits, group_size
            )
            if problem:
                raise ValueError(problem)  # before marking what is not its own
            mark_model_caches(model, cache)
        return original(prompt, model, *args, **kwargs)

    generate_step.mlx_lm_mla_original = original
    return generate_step


def settings_mismatch(cache, bits, group_size):
    """Why a quantized latent cannot continue under ``kv_bits``/``kv_group_size``,
    or None: refused up front, as mlx-lm refuses a ``QuantizedKVCache`` of other
    bits, not only once ``quantized_kv_start`` is reached."""
    if bits is None:
        return None
    for c in leaves(cache):
        if isinstance(c, _PackedLatent) and (c.group_size, c.latent_bits) != (
            int(group_size),
            int(bits),
        ):
            return (
                f"prompt cache: its MLA latent is quantized with group_size "
                f"{c.group_size} and {c.latent_bits} bits; kv_bits {bits} with "
                f"kv_group_size {group_size} was asked for, and a quantized cache "
                "is not requantized"
            )
    return None
