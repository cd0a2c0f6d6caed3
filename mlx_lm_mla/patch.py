"""Every change this package makes to mlx-lm, in one place.

``install()`` wires the MLA caches into the installed mlx-lm and returns what
it patched; calling it again changes nothing. ``uninstall()`` puts every
original back. Each patch is applied only where the code it replaces is
there, and outside the tested mlx-lm range a warning says so once.
"""

import importlib
import logging
import sys
import warnings

from . import faults, guards, hooks
from .cache import BatchMLALatentCache, MLALatentCache

# Tested range of mlx-lm: [low, high).
SUPPORTED_MLX_LM = ((0, 31, 2), (0, 33, 0))

_applied = []  # (owner, name, had_own_value, old_value, label), in order
_warned = False


def mlx_lm_version():
    import mlx_lm

    parts = []
    for piece in mlx_lm.__version__.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit()) or "0"
        parts.append(int(digits))
    return tuple(parts + [0] * (3 - len(parts)))


def is_supported() -> bool:
    low, high = SUPPORTED_MLX_LM
    return low <= mlx_lm_version() < high


def installed():
    """Labels of the patches in force."""
    return [p[-1] for p in _applied]


def _set(owner, name, value, label):
    had = name in vars(owner)
    _applied.append((owner, name, had, vars(owner).get(name), label))
    setattr(owner, name, value)


def checked_load_hook(original):
    def load_prompt_cache(file_name, *args, **kwargs):
        guards.check_cache_file(file_name)
        return original(file_name, *args, **kwargs)

    load_prompt_cache.mlx_lm_mla_original = original
    return load_prompt_cache


def _install_faults():
    """Test mode: MLX_LM_MLA_FAULT=point:n (see faults.py)."""
    trigger = faults.make_trigger()
    if trigger is None:
        return
    # Operation points; a batch quantizes its rows through quantize_rows.
    targets = [
        (MLALatentCache, "update_and_fetch", "update_and_fetch"),
        (MLALatentCache, "trim", "trim"),
        (MLALatentCache, "to_quantized", "to_quantized"),
        (BatchMLALatentCache, "update_and_fetch", "update_and_fetch"),
        (BatchMLALatentCache, "trim", "trim"),
        (BatchMLALatentCache, "extract", "extract"),
        (BatchMLALatentCache, "filter", "filter"),
        (BatchMLALatentCache, "extend", "extend"),
        (BatchMLALatentCache, "quantize_rows", "to_quantized"),
    ]
    for cls, name, point in targets:
        wrapped = faults.wrap(vars(cls)[name], point, trigger)
        _set(cls, name, wrapped, f"fault:{cls.__name__}.{name}")
    merge = vars(BatchMLALatentCache)["merge"].__func__
    _set(
        BatchMLALatentCache,
        "merge",
        classmethod(faults.wrap(merge, "merge", trigger)),
        "fault:BatchMLALatentCache.merge",
    )


def _install_reuse_guards(cache_module):
    """Guards on the cross-request path, for every model type."""
    store = getattr(cache_module, "LRUPromptCache", None)
    trie = getattr(store(), "_trie", None) if store is not None else None
    if all(hasattr(trie, f) for f in ("search", "get", "pop")):
        _set(
            store,
            "fetch_nearest_cache",
            guards.guarded_fetch(store.fetch_nearest_cache),
            "mlx_lm.models.cache.LRUPromptCache.fetch_nearest_cache",
        )
        _set(
            store,
            "insert_cache",
            guards.guarded_insert(store.insert_cache),
            "mlx_lm.models.cache.LRUPromptCache.insert_cache",
        )
    server = importlib.import_module("mlx_lm.server")
    handler = getattr(server, "APIHandler", None)
    if callable(getattr(handler, "handle_completion", None)):
        _set(
            handler,
            "handle_completion",
            guards.guarded_completion(handler.handle_completion),
            "mlx_lm.server.APIHandler.handle_completion",
        )
    generator = getattr(server, "ResponseGenerator", None)
    if callable(getattr(generator, "_is_batchable", None)):
        _set(
            generator,
            "_is_batchable",
            hooks.batchable_with_kv_bits(generator._is_batchable),
            "mlx_lm.server.ResponseGenerator._is_batchable",
        )
    if all(
        callable(getattr(generator, f, None)) for f in ("_generate", "_next_request")
    ):
        _set(
            generator,
            "_next_request",
            guards.tracked_next_request(generator._next_request),
            "mlx_lm.server.ResponseGenerator._next_request",
        )
        _set(
            generator,
            "_generate",
            guards.supervised_generate(generator._generate),
            "mlx_lm.server.ResponseGenerator._generate",
        )


def install():
    """Activates the MLA caches in the installed mlx-lm. Idempotent.

    Returns:
        List[str]: what is patched, e.g. ``mlx_lm.models.deepseek_v3.Model.make_cache``.
    """
    global _warned
    # Importing mlx_lm may run the start-up hook, which calls install() first.
    import mlx_lm

    if _applied:
        return installed()
    if not is_supported() and not _warned:
        _warned = True
        low, high = SUPPORTED_MLX_LM
        warnings.warn(
            f"mlx-lm-mla is tested with mlx-lm {'.'.join(map(str, low))} up to "
            f"(not including) {'.'.join(map(str, high))}; found "
            f"{mlx_lm.__version__}. Only patches whose targets are found are applied.",
            RuntimeWarning,
            stacklevel=2,
        )

    # load_prompt_cache and CacheList look cache classes up by name here.
    cache_module = importlib.import_module("mlx_lm.models.cache")
    if hasattr(cache_module, "load_prompt_cache"):
        for cls in (MLALatentCache, BatchMLALatentCache):
            _set(cache_module, cls.__name__, cls, f"mlx_lm.models.cache.{cls.__name__}")

    for name in hooks.candidate_model_types():
        try:
            module = importlib.import_module(f"mlx_lm.models.{name}")
        except Exception as e:  # a model with optional dependencies
            logging.debug("mlx-lm-mla: skipping %s: %s", name, e)
            continue
        cls = getattr(module, "Model", None)
        if cls is None:
            continue
        current = getattr(cls, "make_cache", None)
        if hasattr(current, "mlx_lm_mla_original"):
            continue  # inherits a hooked make_cache
        hook = (
            hooks.DefaultLatentCaches()
            if current is None
            else hooks.make_cache_hook(current)
        )
        _set(cls, "make_cache", hook, f"{module.__name__}.Model.make_cache")

    # Refuse truncated cache files before they are read.
    original_load = getattr(cache_module, "load_prompt_cache", None)
    if callable(original_load):
        checked = checked_load_hook(original_load)
        for name, module in list(sys.modules.items()):
            if (
                name.startswith("mlx_lm")
                and getattr(module, "load_prompt_cache", None) is original_load
            ):
                _set(module, "load_prompt_cache", checked, f"{name}.load_prompt_cache")

    _install_reuse_guards(cache_module)

    _install_faults()

    # mlx-lm 0.31 builds batch caches from a fixed list of types.
    generate = importlib.import_module("mlx_lm.generate")
    if callable(getattr(generate, "_make_cache", None)):
        _set(
            generate,
            "_make_cache",
            hooks.batch_cache_hook(generate._make_cache),
            "mlx_lm.generate._make_cache",
        )
    return installed()


def uninstall():
    """Restores everything ``install()`` changed. Returns what was restored."""
    restored = []
    while _applied:
        owner, name, had, old, label = _applied.pop()
        if had:
            setattr(owner, name, old)
        else:
            delattr(owner, name)
        restored.append(label)
    return restored[::-1]
