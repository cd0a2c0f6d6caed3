"""Hooks on stock mlx-lm for MLA models; ``patch.py`` applies them.

MLA models keep stock's caches (``KVCache``, ``RotatingKVCache``,
``BatchKVCache``): other programs know those classes by name, and they serve
a plain latent well. The hooks act where stock goes wrong, at quantization.

Which models cache a latent is found from the model itself: an attention
module with a ``kv_lora_rank`` and the absorbed projections ``embed_q`` and
``unembed_out``. ``deepseek_v2`` and ``minicpm3`` expand the latent to
per-head K/V and have no ``embed_q``.
"""

from .cache import (
    QUANTIZED_LATENT,
    BatchQuantizedLatentCache,
    _PackedLatent,
    extend_latent,
    is_latent_layout,
    quantize_latent,
)


def is_latent_attention(module) -> bool:
    return (
        isinstance(getattr(module, "kv_lora_rank", None), int)
        and hasattr(module, "embed_q")
        and hasattr(module, "unembed_out")
    )


def count_latent_attention(layer) -> int:
    """How many latent-caching attention modules one decoder layer has (two
    in LongCat-Flash, which runs two attention sublayers)."""
    return sum(is_latent_attention(m) for _, m in layer.named_modules())


def has_latent_attention(model) -> bool:
    # Found once per model instance; the layers do not change.
    found = vars(model).get("_mlx_lm_mla_latent")
    if found is None:
        found = any(count_latent_attention(layer) for layer in model.layers)
        object.__setattr__(model, "_mlx_lm_mla_latent", found)
    return found


# --- stock caches, fixed where they are quantized --------------------------


def latent_to_quantized(original):
    """``to_quantized`` of a stock cache: a cache that holds an MLA latent
    quantizes it in place; any other cache does what upstream does."""

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        if is_latent_layout(self):
            return quantize_latent(self, group_size, bits)
        return original(self, group_size, bits)

    to_quantized.mlx_lm_mla_original = original
    return to_quantized


def latent_merge(original, owner):
    """``BatchKVCache.merge`` that batches quantized latent caches (with any
    exact ones among them) into a quantized batch."""

    def merge(cls, caches):
        if cls is owner and any(isinstance(c, _PackedLatent) for c in caches):
            return BatchQuantizedLatentCache.merge(caches)
        return original(cls, caches)

    merge.mlx_lm_mla_original = original
    return merge


def refuse_quantized_merge(original):
    """``BatchRotatingKVCache.merge``, which would batch the bytes of a
    quantized window and hand them to the model."""

    def merge(cls, caches):
        if any(isinstance(c, _PackedLatent) for c in caches):
            raise ValueError(
                f"{cls.__name__}.merge: a quantized rolling window cannot be batched"
            )
        return original(cls, caches)

    merge.mlx_lm_mla_original = original
    return merge


def latent_extend(original):
    """``BatchKVCache.extend``: a batch that takes quantized rows is
    quantized first, so one batch holds one precision."""

    def extend(self, other):
        if isinstance(self, _PackedLatent):  # reached through its super()
            return original(self, other)
        return extend_latent(self, other, lambda o: original(self, o))

    extend.mlx_lm_mla_original = original
    return extend


def quantize_batches(caches, group_size, bits, start):
    """Quantizes, in place, each plain batch cache that holds an MLA latent
    once its longest row (``_idx``, no host sync) holds ``start`` tokens."""
    for c in caches:
        if (
            type(c) in QUANTIZED_LATENT  # not a rotating batch: it cannot quantize
            and isinstance(getattr(c, "_idx", None), int)
            and c._idx >= start
            and is_latent_layout(c)
        ):
            quantize_latent(c, group_size, bits)


def quantizing_next(original):
    """``BatchGenerator._next`` that quantizes the batches of an MLA model
    served with ``--kv-bits`` (see ``batchable_with_kv_bits``)."""

    def _next(self):
        result = original(self)
        settings = vars(self.model).get("_mlx_lm_mla_kv")
        if settings is not None:
            for name in ("_prompt_batch", "_generation_batch"):
                batch = getattr(self, name, None)
                quantize_batches(getattr(batch, "prompt_cache", []), *settings)
        return result

    _next.mlx_lm_mla_original = original
    return _next


def batchable_with_kv_bits(original):
    """``ResponseGenerator._is_batchable`` that keeps batching MLA models when
    ``--kv-bits`` is set. Upstream refuses, since its quantized cache cannot
    batch; a latent batch can, quantized once its longest row holds
    ``--quantized-kv-start`` tokens. Other models keep upstream behaviour."""

    def _is_batchable(self, args):
        if original(self, args):
            return True
        cli, provider = self.cli_args, self.model_provider
        model = getattr(provider, "model", None)
        if (
            getattr(cli, "kv_bits", None) is None
            or model is None
            or args.seed is not None
        ):
            return False
        if not (provider.is_batchable and has_latent_attention(model)):
            return False
        settings = (cli.kv_group_size, cli.kv_bits, cli.quantized_kv_start)
        object.__setattr__(model, "_mlx_lm_mla_kv", settings)
        return True

    _is_batchable.mlx_lm_mla_original = original
    return _is_batchable
