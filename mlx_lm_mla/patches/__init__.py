"""Every change this package makes to mlx-lm, applied from one table.

Each module here lists its changes as ``Patch`` rows: ``quantize``
(``mlx_lm.models.cache``: quantizing a latent in place, batching it),
``models`` (the MLA model modules: their attention), ``files`` (prompt cache
files), ``generate`` (``mlx_lm.generate``) and ``server``
(``mlx_lm.server``, applied when the server is imported, so a program that
never imports it does not load it).

``install()`` applies every row and returns what it patched; calling it
again changes nothing. ``uninstall()`` puts every original back. A row is
applied only where its target is there and the private names it needs
(``contract.py``) are as expected; ``missing()`` names each one that is not,
and a warning says so once, naming what is switched off.
"""

import importlib
import sys
import types
import warnings

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from .. import importhook
from .._version import MLX_LM_RANGE
from . import contract


SERVER = "mlx_lm.server"

_applied = []  # (owner, name, had_own_value, old_value, label), in order
_missing = []  # labels of the targets and private names this mlx-lm lacks
_off = []  # features switched off for it
_server = []  # the mlx_lm.server module once its patches are applied
_warned = False
_warned_missing = set()


def mlx_lm_version():
    """The installed mlx-lm's release as (major, minor, patch)."""
    import mlx_lm

    return (Version(mlx_lm.__version__).release + (0, 0, 0))[:3]


def is_supported() -> bool:
    import mlx_lm

    return SpecifierSet(MLX_LM_RANGE).contains(Version(mlx_lm.__version__), prereleases=True)


def installed():
    """Labels of the patches in force."""
    return [p[-1] for p in _applied]


def missing():
    """What could not be patched: targets this mlx-lm lacks (renamed or
    removed upstream) and private names that are not as expected."""
    return list(_missing)


def _miss(label):
    if label not in _missing:
        _missing.append(label)


def _warn_missing():
    new = [label for label in _missing if label not in _warned_missing]
    if new:
        _warned_missing.update(new)
        off = f"; switched off: {', '.join(_off)}" if _off else ""
        warnings.warn(
            f"mlx-lm-mla could not apply {len(new)} patch(es), their targets are "
            f"not in this mlx-lm: {', '.join(new)}{off}",
            RuntimeWarning,
            stacklevel=3,
        )


def set_attr(owner, name, value, label=None):
    """Sets ``owner.name``, recorded so that ``uninstall()`` puts it back."""
    if label is None:
        where = owner.__name__ if isinstance(owner, types.ModuleType) else f"{owner.__module__}.{owner.__qualname__}"
        label = f"{where}.{name}"
    had = name in vars(owner)
    _applied.append((owner, name, had, vars(owner).get(name), label))
    setattr(owner, name, value)


def _owner(module, path):
    owner = module
    for part in path.split(".") if path else ():
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    return owner


_checked = {}  # private label: problem or None, per install


def _unmet(needs):
    unmet = []
    for label in needs:
        if label not in _checked:
            _checked[label] = contract.problem(contract.BY_LABEL[label])
        if _checked[label] is not None:
            unmet.append(label)
    return unmet


def apply(patch):
    """Applies one row, or names in missing() why it cannot be."""
    if patch.how == "unknown":
        _miss(patch.target)
        if patch.feature and patch.feature not in _off:
            _off.append(patch.feature)
        return
    module = importlib.import_module(patch.module)
    path, _, name = patch.target.rpartition(".")
    owner = _owner(module, path)
    label = f"{patch.module}.{patch.target}"
    unmet = _unmet(patch.needs)
    original = getattr(owner, name, None) if owner is not None else None
    if unmet or owner is None or (patch.how != "set" and not callable(original)):
        for gone in unmet or [label]:
            _miss(gone)
        if patch.feature and patch.feature not in _off:
            _off.append(patch.feature)
        return
    if patch.how in ("set", "wrap"):
        set_attr(owner, name, patch.make(original), label)
    elif patch.how == "classmethod":
        set_attr(owner, name, classmethod(patch.make(vars(owner)[name].__func__)), label)
    elif patch.how == "rebind":
        replacement = patch.make(original)
        for module_name, bound in list(sys.modules.items()):
            if module_name.startswith("mlx_lm") and getattr(bound, name, None) is original:
                set_attr(bound, name, replacement, f"{module_name}.{name}")
    else:
        raise ValueError(f"unknown patch kind {patch.how!r}")


def _install_server(server):
    if _server:
        return
    from . import server as server_patches

    _server.append(server)
    for patch in server_patches.table():
        apply(patch)


def server_imported(server):
    """Applies the server's patches once ``mlx_lm.server`` is imported."""
    if _applied and hasattr(server, "main"):
        _install_server(server)
        _warn_missing()


def install():
    """Activates the MLA caches and the guards. Idempotent.

    Returns:
        List[str]: what is patched, e.g. ``mlx_lm.models.cache.KVCache.to_quantized``.
    """
    global _warned
    import mlx_lm

    if _applied:
        return installed()
    if not is_supported() and not _warned:
        _warned = True
        low, _, high = MLX_LM_RANGE.partition(",")
        warnings.warn(
            f"mlx-lm-mla is tested with mlx-lm {low.lstrip('>=')} up to (not "
            f"including) {high.lstrip('<')}; found {mlx_lm.__version__}. Only "
            "patches whose targets are found are applied.",
            RuntimeWarning,
            stacklevel=2,
        )
    from . import files, generate, models, quantize

    _checked.clear()
    for patch in [*quantize.table(), *models.table(), *files.table(), *generate.table()]:
        apply(patch)
    importhook.after_import(SERVER, server_imported)
    _warn_missing()
    return installed()


def uninstall():
    """Restores everything ``install()`` changed. Returns what was restored."""
    from ..mla import _FOUND, ATTENTION

    restored = []
    ATTENTION.clear()
    _FOUND.clear()
    while _applied:
        owner, name, had, old, label = _applied.pop()
        if had:
            setattr(owner, name, old)
        else:
            delattr(owner, name)
        restored.append(label)
    _missing.clear()
    _off.clear()
    _server.clear()
    return restored[::-1]
