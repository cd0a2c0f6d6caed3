"""Every change this package makes to mlx-lm, in one place.

``install()`` wires the MLA caches and the reuse guards into the installed
mlx-lm and returns what it patched; calling it again changes nothing.
``uninstall()`` puts every original back. A patch is applied only where the
code it replaces is there, and outside the tested mlx-lm range a warning
says so once.
"""

import importlib
import logging
import sys
import types
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


def _label(owner, name):
    if isinstance(owner, types.ModuleType):
        return f"{owner.__name__}.{name}"
    return f"{owner.__module__}.{owner.__qualname__}.{name}"


def _set(owner, name, value):
    had = name in vars(owner)
    _applied.append((owner, name, had, vars(owner).get(name), _label(owner, name)))
    setattr(owner, name, value)


def _wrap(owner, name, wrapper):
    """Replaces owner.name by wrapper(owner.name), if owner has it."""
    if callable(getattr(owner, name, None)):
        _set(owner, name, wrapper(getattr(owner, name)))


def _install_caches(cache_module):
    # load_prompt_cache and CacheList look cache classes up by name here.
    for cls in (MLALatentCache, BatchMLALatentCache):
        _set(cache_module, cls.__name__, cls)

    for name in hooks.candidate_model_types():
        try:
            module = importlib.import_module(f"mlx_lm.models.{name}")
        except Exception as e:  # a model with optional dependencies
            logging.debug("mlx-lm-mla: skipping %s: %s", name, e)
            continue
        cls = getattr(module, "Model", None)
        current = getattr(cls, "make_cache", None)
        if cls is None or hasattr(current, "mlx_lm_mla_original"):
            continue  # no model here, or it inherits a hooked make_cache
        if current is None:
            _set(cls, "make_cache", hooks.DefaultLatentCaches())
        else:
            _set(cls, "make_cache", hooks.make_cache_hook(current))

    # mlx-lm 0.31 builds batch caches from a fixed list of types.
    generate = importlib.import_module("mlx_lm.generate")
    _wrap(generate, "_make_cache", hooks.batch_cache_hook)


def _install_reuse_guards(cache_module):
    # Refuse truncated cache files, wherever mlx-lm bound load_prompt_cache.
    load = getattr(cache_module, "load_prompt_cache", None)
    if callable(load):
        checked = guards.checked_load(load)
        for name, module in list(sys.modules.items()):
            if (
                name.startswith("mlx_lm")
                and getattr(module, "load_prompt_cache", None) is load
            ):
                _set(module, "load_prompt_cache", checked)

    store = getattr(cache_module, "LRUPromptCache", None)
    trie = getattr(store(), "_trie", None) if store is not None else None
    if all(hasattr(trie, f) for f in ("search", "get", "pop")):
        _wrap(store, "fetch_nearest_cache", guards.guarded_fetch)
        _wrap(store, "insert_cache", guards.guarded_insert)

    server = importlib.import_module("mlx_lm.server")
    _wrap(
        getattr(server, "APIHandler", None),
        "handle_completion",
        guards.guarded_completion,
    )
    generator = getattr(server, "ResponseGenerator", None)
    _wrap(generator, "_is_batchable", hooks.batchable_with_kv_bits)
    if callable(getattr(generator, "_next_request", None)):
        _wrap(generator, "_next_request", guards.tracked_next_request)
        _wrap(generator, "_generate", guards.supervised_generate)


def _install_faults():
    """Test mode: MLX_LM_MLA_FAULT=point:n (see faults.py)."""
    trigger = faults.make_trigger()
    if trigger is None:
        return
    # A batch quantizes its rows through quantize_rows.
    points = [
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
    for cls, name, point in points:
        _set(cls, name, faults.wrap(vars(cls)[name], point, trigger))
    merge = vars(BatchMLALatentCache)["merge"].__func__
    _set(
        BatchMLALatentCache, "merge", classmethod(faults.wrap(merge, "merge", trigger))
    )


def install():
    """Activates the MLA caches and the reuse guards. Idempotent.

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
    cache_module = importlib.import_module("mlx_lm.models.cache")
    _install_caches(cache_module)
    _install_reuse_guards(cache_module)
    _install_faults()
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
