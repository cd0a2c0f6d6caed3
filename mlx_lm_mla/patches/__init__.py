"""Every change this package makes to mlx-lm, applied from one table.

Each module here lists its changes as ``Patch`` rows (``server``'s when
``mlx_lm.server`` is imported). A feature's rows apply all or none: only where
every target takes what its replacement takes and every name it reads holds
(``contract.py``). ``missing()`` names what does not, as do one log line and a
warning per name.
"""

import importlib
import logging
import sys
import types
import warnings

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from .. import importhook
from .._version import MLX_LM_RANGE
from . import contract
from .table import EVERYTHING


SERVER = "mlx_lm.server"

_applied = []  # (owner, name, had_own_value, old_value, label, feature), in order
# (name, original, replacement) of each rebind: a module imported after it
# copies the replacement by name, and gets the original back at uninstall.
_rebound = []
_missing = []  # labels of the targets and private names this mlx-lm lacks
_why = {}  # label: how mlx-lm has it otherwise, where it has it at all
_off = []  # features switched off for it
_server = []  # the mlx_lm.server module once its patches are applied
_warned = False
_warned_missing = set()
_logged = 0  # how many missing names this install's log line listed

logger = logging.getLogger("mlx_lm_mla")


def mlx_lm_version():
    import mlx_lm

    return (Version(mlx_lm.__version__).release + (0, 0, 0))[:3]


def is_supported() -> bool:
    import mlx_lm

    return SpecifierSet(MLX_LM_RANGE).contains(
        Version(mlx_lm.__version__), prereleases=True
    )


def installed():
    return [p[4] for p in _applied]


def missing():
    """Targets and contract names this mlx-lm lacks or has otherwise."""
    return list(_missing)


def features_on():
    return list(dict.fromkeys(p[5] for p in _applied if p[5] is not None))


def _miss(label):
    if label not in _missing:
        _missing.append(label)


def _named(labels):
    """Each label, with what is wrong where it is there but otherwise."""
    return ", ".join(
        label
        if _why.get(label, "not found") == "not found"
        else f"{label} ({_why[label]})"
        for label in labels
    )


def _report():
    """One log line per install (one more if the server's patches find more) and
    a warning once per name."""
    global _logged
    import mlx_lm

    if len(_missing) > _logged:
        _logged = len(_missing)
        logger.warning(
            "mlx-lm-mla: mlx-lm %s lacks %s; switched off: %s",
            mlx_lm.__version__,
            _named(_missing),
            ", ".join(_off),
        )
    new = [label for label in _missing if label not in _warned_missing]
    if new:
        _warned_missing.update(new)
        off = f"; switched off: {', '.join(_off)}" if _off else ""
        warnings.warn(
            f"mlx-lm-mla could not apply {len(new)} patch(es), their targets are "
            f"not in this mlx-lm or not as expected: {_named(new)}{off}",
            RuntimeWarning,
            stacklevel=3,
        )


def set_attr(owner, name, value, label=None, feature=None):
    """Sets ``owner.name``, recorded for ``uninstall()``."""
    if label is None:
        where = (
            owner.__name__
            if isinstance(owner, types.ModuleType)
            else f"{owner.__module__}.{owner.__qualname__}"
        )
        label = f"{where}.{name}"
    had, old = name in vars(owner), vars(owner).get(name)
    setattr(owner, name, value)  # recorded once it holds: _undo takes back only that
    _applied.append((owner, name, had, old, label, feature))


def _owner(module, path):
    owner = module
    for part in path.split(".") if path else ():
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    return owner


_checked = {}  # label of a contract row: its problem or None, per install


def broken_names(features):
    """{feature: labels of the contract rows it relies on that do not hold}."""
    broken = {}
    for row in contract.rows():
        relied = [f for f in row.features if f in features]
        if relied and contract.applies(row):
            if row.label not in _checked:
                _checked[row.label] = contract.problem(row)
            if _checked[row.label] is not None:
                _why[row.label] = _checked[row.label]
                for feature in relied:
                    broken.setdefault(feature, []).append(row.label)
    return broken


def _plan(patch):
    """(owner, name, original, replacement), or the label of a target that is
    absent or takes other parameters."""
    if patch.how == "unknown":
        return patch.target
    label = f"{patch.module}.{patch.target}"
    try:
        module = importlib.import_module(patch.module)
    except ModuleNotFoundError as e:  # an mlx-lm without that module
        if not f"{patch.module}.".startswith(f"{e.name}."):
            raise  # a module it imports is missing: not mlx-lm's lack
        return label
    path, _, name = patch.target.rpartition(".")
    owner = _owner(module, path)
    original = getattr(owner, name, None) if owner is not None else None
    if patch.how == "classmethod":
        found = vars(owner).get(name) if isinstance(owner, type) else None
        original = found.__func__ if isinstance(found, classmethod) else None
    if owner is None or (patch.how != "set" and not callable(original)):
        return label
    replacement = patch.make(original)
    problem = patch.how != "set" and contract.signature_problem(replacement, original)
    if problem:
        _why[label] = problem
        return label
    return owner, name, original, replacement


def _apply(patch, planned):
    owner, name, original, replacement = planned
    # A target an earlier row of the table replaced is wrapped as it is now.
    if patch.how == "classmethod":
        current = vars(owner)[name].__func__
    else:
        current = getattr(owner, name, None)
    if current is not original:
        replacement = patch.make(current)
    label = f"{patch.module}.{patch.target}"
    if patch.how in ("set", "wrap"):
        set_attr(owner, name, replacement, label, patch.feature)
    elif patch.how == "classmethod":
        set_attr(owner, name, classmethod(replacement), label, patch.feature)
    elif patch.how == "rebind":
        _rebound.append((name, current, replacement))
        for module_name, bound in list(sys.modules.items()):
            if (
                module_name.startswith("mlx_lm")
                and getattr(bound, name, None) is current
            ):
                where = f"{module_name}.{name}"
                set_attr(bound, name, replacement, where, patch.feature)
    else:
        raise ValueError(f"unknown patch kind {patch.how!r}")


def apply_table(rows):
    """Applies each feature's rows all or none, naming what it lacks in missing()."""
    broken = broken_names({p.feature for p in rows})
    planned = []
    for patch in rows:
        if patch.feature in broken:
            continue  # its replacement may read the names that are gone
        found = _plan(patch)
        if isinstance(found, str):
            broken.setdefault(patch.feature, []).append(found)
        else:
            planned.append((patch, found))
    for feature, labels in broken.items():
        for label in labels:
            _miss(label)
        if feature not in _off:
            _off.append(feature)
    for patch, found in planned:
        if patch.feature not in broken:
            _apply(patch, found)


def server_imported(server):
    """Applies the server's patches as ``mlx_lm.server`` is imported; where
    they fail, takes back what they applied and warns: the import goes on."""
    if not (_applied and hasattr(server, "main")) or _server:
        return
    before = (len(_applied), len(_rebound))
    try:
        from . import server as server_patches

        _server.append(server)
        apply_table(server_patches.table())
    except Exception as e:
        _undo(*before)
        _server.clear()
        warnings.warn(
            f"mlx-lm-mla could not apply its mlx_lm.server patches "
            f"({type(e).__name__}: {e}); the server runs without them",
            RuntimeWarning,
            stacklevel=2,
        )
        return
    logger.info(
        "mlx-lm-mla: mlx_lm.server patched (%d patches in force)", len(_applied)
    )
    _report()


def _undo(keep, rebound):
    """Takes back every change after the first ``keep`` (and forgets the
    rebinds after the first ``rebound``); their labels."""
    del _rebound[rebound:]
    restored = []
    while len(_applied) > keep:
        owner, name, had, old, label, _ = _applied.pop()
        if had:
            setattr(owner, name, old)
        else:
            delattr(owner, name)
        restored.append(label)
    return restored[::-1]


def install():
    """Activates the MLA caches and the guards; idempotent. Returns what is
    patched, e.g. ``mlx_lm.models.cache.KVCache.to_quantized``."""
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
    _checked.clear()
    # The package's own modules subclass stock caches as they import.
    gone = broken_names({EVERYTHING}).get(EVERYTHING)
    if gone:
        for label in gone:
            _miss(label)
        if EVERYTHING not in _off:
            _off.append(EVERYTHING)
        _report()
        return installed()
    from . import files, generate, models, quantize

    try:
        apply_table(
            [*quantize.table(), *models.table(), *files.table(), *generate.table()]
        )
        importhook.after_import(SERVER, server_imported)
    except Exception:  # none of it, rather than part: the caller warns
        _undo(0, 0)
        raise
    _report()
    return installed()


def uninstall():
    """Restores everything ``install()`` changed; returns what it restored."""
    global _logged
    from ..mla import _FOUND, ATTENTION

    ATTENTION.clear()
    _FOUND.clear()
    restored = _undo(0, len(_rebound))
    # Modules imported since (mlx_lm.server, chat, cache_prompt...) copied the
    # replacements by name: the latest first, each back to what it wrapped.
    for name, original, replacement in reversed(_rebound):
        for module_name, bound in list(sys.modules.items()):
            if (
                module_name.startswith("mlx_lm")
                and getattr(bound, name, None) is replacement
            ):
                setattr(bound, name, original)
                restored.append(f"{module_name}.{name}")
    _rebound.clear()
    _missing.clear()
    _why.clear()
    _off.clear()
    _server.clear()
    _logged = 0
    return restored
