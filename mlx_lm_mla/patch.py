"""Every change this package makes to mlx-lm, in one place.

``install()`` wires the MLA caches and the reuse guards into the installed
mlx-lm and returns what it patched; calling it again changes nothing.
``uninstall()`` puts every original back. A patch is applied only where the
code it replaces is there; ``missing()`` names each one whose target is
gone, and a warning says so once, as it does outside the tested mlx-lm
range. The server's guards are applied when ``mlx_lm.server`` is imported
(``server_imported``), so a program that never imports it (LM Studio's
engine, ``mlx_lm.generate``) does not load it.
"""

import importlib
import sys
import types
import warnings

from packaging.version import Version

from . import (
    activate,
    faults,
    files,
    guards,
    handler,
    hooks,
    latent,
    sampling,
    window,
)  # noqa: F401 (window registers its class)
from .cache import QUANTIZED_LATENT

# Tested range of mlx-lm: [low, high).
SUPPORTED_MLX_LM = ((0, 31, 2), (0, 33, 0))

_applied = []  # (owner, name, had_own_value, old_value, label), in order
_missing = []  # labels of the patches whose target this mlx-lm lacks
_server = []  # the mlx_lm.server module once its guards are applied
_warned = False
_warned_missing = set()


def mlx_lm_version():
    import mlx_lm

    return (Version(mlx_lm.__version__).release + (0, 0, 0))[:3]


def is_supported() -> bool:
    low, high = SUPPORTED_MLX_LM
    return low <= mlx_lm_version() < high


def installed():
    """Labels of the patches in force."""
    return [p[-1] for p in _applied]


def missing():
    """Labels of the patches that could not be applied: their target is not
    in this mlx-lm (renamed or removed upstream)."""
    return list(_missing)


def _miss(label):
    if label not in _missing:
        _missing.append(label)


def _warn_missing():
    new = [label for label in _missing if label not in _warned_missing]
    if new:
        _warned_missing.update(new)
        warnings.warn(
            f"mlx-lm-mla could not apply {len(new)} patch(es), their targets are "
            f"not in this mlx-lm: {', '.join(new)}",
            RuntimeWarning,
            stacklevel=3,
        )


def _owner(module, name):
    """module.name, or None (named in missing()) if this mlx-lm lacks it."""
    found = getattr(module, name, None)
    if found is None:
        _miss(f"{module.__name__}.{name}")
    return found


def _label(owner, name):
    if isinstance(owner, types.ModuleType):
        return f"{owner.__name__}.{name}"
    return f"{owner.__module__}.{owner.__qualname__}.{name}"


def _set(owner, name, value):
    had = name in vars(owner)
    _applied.append((owner, name, had, vars(owner).get(name), _label(owner, name)))
    setattr(owner, name, value)


def _wrap(owner, name, wrapper):
    """Replaces owner.name by wrapper(owner.name), if owner has it; names it
    in missing() if not (a missing owner was named already)."""
    if callable(getattr(owner, name, None)):
        _set(owner, name, wrapper(getattr(owner, name)))
    elif owner is not None:
        _miss(_label(owner, name))


def _wrap_classmethod(owner, name, wrapper):
    _set(owner, name, classmethod(wrapper(vars(owner)[name].__func__)))


def _install_attention():
    # The caches an MLA attention writes are marked as latent (latent.py).
    # One whose source does not say which cache it writes is named in missing().
    classes, unreadable = latent.load_attention()
    for cls, member in classes.items():
        _wrap(cls, "__call__", lambda f, m=member: latent.marking_call(f, m))
        latent.ATTENTION[cls] = member
    for name in unreadable:
        _miss(f"{name}.__call__ (the cache it writes)")


def _install_caches(cache_module):
    # Models keep stock's caches; the fix is where stock quantizes them.
    # load_prompt_cache and CacheList look cache classes up by name here.
    for cls in QUANTIZED_LATENT.values():
        _set(cache_module, cls.__name__, cls)
    _install_attention()
    _rebind(cache_module, "make_prompt_cache", hooks.marked_make_prompt_cache)
    for owner in (cache_module.KVCache, cache_module.RotatingKVCache):
        _wrap(owner, "to_quantized", hooks.latent_to_quantized)
    batch = cache_module.BatchKVCache
    _wrap_classmethod(batch, "merge", lambda f: hooks.latent_merge(f, batch))
    _wrap(batch, "extend", hooks.latent_extend)
    _wrap(batch, "extract", hooks.marked_extract)
    listed = cache_module.CacheList
    _set(listed, "to_quantized", property(hooks.cache_list_to_quantized))
    _set(listed, "offset", property(hooks.cache_list_offset))
    _wrap_classmethod(
        cache_module.BatchRotatingKVCache, "merge", hooks.refuse_quantized_merge
    )
    # mlx_lm.server --kv-bits batches MLA models (see _install_server).
    generate = importlib.import_module("mlx_lm.generate")
    _wrap(_owner(generate, "BatchGenerator"), "_next", hooks.quantizing_next)


def _rebind(home, name, wrapper):
    # Wherever mlx-lm bound the function by name (from ... import), too.
    original = getattr(home, name, None)
    if not callable(original):
        _miss(f"{home.__name__}.{name}")
        return
    replacement = wrapper(original)
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("mlx_lm") and getattr(module, name, None) is original:
            _set(module, name, replacement)


def _install_reuse_guards(cache_module):
    # Cache files: refused when truncated or changed, checksummed when latent.
    _rebind(cache_module, "load_prompt_cache", files.checked_load)
    _rebind(
        cache_module,
        "save_prompt_cache",
        lambda f: files.checked_save(f, latent.is_latent),
    )
    generate = importlib.import_module("mlx_lm.generate")
    _rebind(generate, "generate_step", files.checked_generate_step)

    store = _owner(cache_module, "LRUPromptCache")
    trie = getattr(store(), "_trie", None) if store is not None else None
    if all(hasattr(trie, f) for f in ("search", "get", "pop")):
        _wrap(store, "fetch_nearest_cache", guards.guarded_fetch)
        _wrap(store, "insert_cache", guards.guarded_insert)
    elif store is not None:
        _miss(_label(store, "_trie"))


def _install_server(server):
    # The guards on mlx_lm.server's HTTP side and its generation loop.
    if _server:
        return
    _server.append(server)
    api = _owner(server, "APIHandler")
    _wrap(api, "handle_completion", handler.guarded_completion)
    _wrap(api, "_set_completion_headers", handler.bad_request_status)
    _wrap(api, "do_POST", handler.bad_body_status)
    generator = _owner(server, "ResponseGenerator")
    _wrap(generator, "_is_batchable", hooks.batchable_with_kv_bits)
    _wrap(generator, "_tokenize", lambda f: handler.checked_tokenize(f, server))
    _wrap(generator, "_tokenize", guards.no_store_tokenize)
    # The loop is supervised only where the open requests can be tracked.
    if callable(getattr(generator, "_next_request", None)):
        _wrap(generator, "_next_request", guards.tracked_next_request)
        _wrap(generator, "_generate", guards.supervised_generate)
    elif generator is not None:
        _miss(_label(generator, "_next_request"))
    _wrap(server, "_make_sampler", sampling.guarded_make_sampler)
    _wrap(server, "_make_logits_processors", sampling.guarded_make_logits_processors)


def server_imported(server):
    """The start-up hook calls this once ``mlx_lm.server`` is imported."""
    if _applied:
        _install_server(server)
        _warn_missing()


def _install_faults(cache_module):
    """Test mode: MLX_LM_MLA_FAULT=point:n (see faults.py). The points are
    the operations of the caches an MLA model gets, exact or quantized."""
    trigger = faults.make_trigger()
    if trigger is None:
        return
    single, batch = cache_module.KVCache, cache_module.BatchKVCache
    points = [
        (single, "update_and_fetch"),
        (single, "trim"),
        (batch, "update_and_fetch"),
        (batch, "trim"),
        (batch, "extract"),
        (batch, "filter"),
        (batch, "extend"),
    ]
    for owner, name in points:
        _set(owner, name, faults.wrap(getattr(owner, name), name, trigger))
    merge = vars(batch)["merge"].__func__
    _set(batch, "merge", classmethod(faults.wrap(merge, "merge", trigger)))
    # Every quantization of a latent, single or batch, goes through this.
    quantize = hooks.quantize_latent
    _set(hooks, "quantize_latent", faults.wrap(quantize, "to_quantized", trigger))
    # One request's sampler in a server's generation step.
    run = sampling.RowSampler.run
    _set(sampling.RowSampler, "run", faults.wrap_traced(run, "sample", trigger))


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
    _install_faults(cache_module)
    server = sys.modules.get("mlx_lm.server")
    if server is not None and hasattr(server, "main"):
        _install_server(server)
    else:  # applied by the hook when the server is imported, if ever
        activate.hook()
    _warn_missing()
    return installed()


def uninstall():
    """Restores everything ``install()`` changed. Returns what was restored."""
    restored = []
    latent.ATTENTION.clear()
    while _applied:
        owner, name, had, old, label = _applied.pop()
        if had:
            setattr(owner, name, old)
        else:
            delattr(owner, name)
        restored.append(label)
    _missing.clear()
    _server.clear()
    return restored[::-1]


# The start-up hook fired while this module was being imported (its caches
# import mlx_lm) and could not call install() yet: it is called now.
if activate.deferred():
    install()
