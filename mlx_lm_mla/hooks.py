"""Which caches an MLA model should get.

Found from the model itself, not from a fixed list: an attention module that
has a ``kv_lora_rank`` and the absorbed projections ``embed_q`` and
``unembed_out`` caches a latent. Models with ``kv_lora_rank`` that expand the
latent to per-head K/V (``deepseek_v2``, ``minicpm3``) have no ``embed_q``
and keep their caches. Nothing here patches anything; ``patch.py`` does.
"""

import importlib
import pkgutil
from pathlib import Path

from .cache import BatchMLALatentCache, MLALatentCache


# mlx-lm is imported on use, not here: the start-up hook runs install() while
# mlx_lm itself is importing (see activate.py).
def _upstream():
    return importlib.import_module("mlx_lm.models.cache")


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


def candidate_model_types():
    """Model modules in the installed mlx-lm that may cache a latent: those
    that mention ``kv_lora_rank`` and those built on them (``kimi_k25`` wraps
    ``deepseek_v3``). A text scan, so nothing is imported just to look."""
    root = Path(importlib.import_module("mlx_lm.models").__path__[0])
    sources = {
        info.name: (root / f"{info.name}.py").read_text(encoding="utf-8")
        for info in pkgutil.iter_modules([str(root)])
        if (root / f"{info.name}.py").is_file()
    }
    found = {name for name, text in sources.items() if "kv_lora_rank" in text}
    grew = True
    while grew:
        users = {
            name
            for name, text in sources.items()
            if name not in found and any(f"from .{f} import" in text for f in found)
        }
        found |= users
        grew = bool(users)
    return sorted(found)


def with_latent_caches(model, caches):
    """Returns caches with a ``MLALatentCache`` in place of the plain
    ``KVCache`` of every latent-caching attention. ``CacheList`` layers get
    only their latent members replaced (the DSA indexer keeps its cache);
    other caches, such as the ``ArraysCache`` of linear layers, are kept."""
    up = _upstream()
    settings = vars(model).get("_mlx_lm_mla_kv", {})
    layers = list(model.layers)
    # Extra caches come first (LongCat n-gram keeps one before the layers).
    start = len(caches) - len(layers)
    if start < 0:
        return caches
    caches = list(caches)
    for i, layer in enumerate(layers):
        n = count_latent_attention(layer)
        if n == 0:
            continue
        c = caches[start + i]
        if type(c) is up.KVCache:
            caches[start + i] = MLALatentCache(**settings)
        elif isinstance(c, up.CacheList):
            members = list(c.caches)
            for j, m in enumerate(members):
                if n > 0 and type(m) is up.KVCache:
                    members[j] = MLALatentCache(**settings)
                    n -= 1
            caches[start + i] = up.CacheList(*members)
    return caches


def holds_latent_cache(cache) -> bool:
    if isinstance(cache, _upstream().CacheList):
        return any(holds_latent_cache(c) for c in cache.caches)
    return isinstance(cache, MLALatentCache)


def has_latent_attention(model) -> bool:
    # Found once per model instance; the layers do not change.
    found = vars(model).get("_mlx_lm_mla_latent")
    if found is None:
        found = any(count_latent_attention(layer) for layer in model.layers)
        object.__setattr__(model, "_mlx_lm_mla_latent", found)
    return found


def make_cache_hook(original):
    """Wraps a model class's own ``make_cache`` so latent attention layers
    get latent caches."""

    def make_cache(self):
        return with_latent_caches(self, original(self))

    make_cache.mlx_lm_mla_original = original
    return make_cache


class DefaultLatentCaches:
    """``make_cache`` for a model class that has none.

    It exists only on instances that cache a latent: for the others
    ``hasattr(model, "make_cache")`` stays False, so ``make_prompt_cache``
    keeps its default, ``max_kv_size`` included."""

    mlx_lm_mla_original = None

    def __get__(self, model, owner=None):
        if model is None:
            return self
        if not has_latent_attention(model):
            raise AttributeError("make_cache")

        def make_cache():
            plain = [_upstream().KVCache() for _ in model.layers]
            return with_latent_caches(model, plain)

        return make_cache


def batch_cache_hook(original):
    """Wraps mlx-lm 0.31's ``generate._make_cache``, which only knows the
    upstream cache types: latent caches become ``BatchMLALatentCache`` and
    everything else goes through the original."""

    def _make_cache(model, left_padding, max_kv_size):
        make = getattr(model, "make_cache", None)
        caches = make() if make is not None else None
        if caches is None or not any(holds_latent_cache(c) for c in caches):
            return original(model, left_padding, max_kv_size)
        shim = _CacheShim(model.layers, [_as_plain(c) for c in caches])
        batch = original(shim, left_padding, max_kv_size)
        return [_as_batch(c, b, left_padding) for c, b in zip(caches, batch)]

    _make_cache.mlx_lm_mla_original = original
    return _make_cache


class _CacheShim:
    """Stands in for the model so upstream code converts the other caches."""

    def __init__(self, layers, caches):
        self.layers = layers
        self._caches = caches

    def make_cache(self):
        return self._caches


def _as_plain(cache):
    up = _upstream()
    if isinstance(cache, MLALatentCache):
        return up.KVCache()
    if isinstance(cache, up.CacheList):
        return up.CacheList(*(_as_plain(c) for c in cache.caches))
    return cache


def _as_batch(single, converted, left_padding):
    if isinstance(single, MLALatentCache):
        return BatchMLALatentCache(left_padding, single.group_size, single.latent_bits)
    up = _upstream()
    if isinstance(single, up.CacheList):
        return up.CacheList(
            *(
                _as_batch(s, c, left_padding)
                for s, c in zip(single.caches, converted.caches)
            )
        )
    return converted


def batchable_with_kv_bits(original):
    """``ResponseGenerator._is_batchable`` that keeps batching MLA models when
    ``--kv-bits`` is set. Upstream refuses, since its quantized cache cannot
    batch; latent caches can, each row quantized once it holds
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
        settings = dict(
            group_size=cli.kv_group_size,
            bits=cli.kv_bits,
            quantize_after=cli.quantized_kv_start,
        )
        object.__setattr__(model, "_mlx_lm_mla_kv", settings)
        return True

    _is_batchable.mlx_lm_mla_original = original
    return _is_batchable
