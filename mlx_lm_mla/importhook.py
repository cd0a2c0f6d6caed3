"""Calls back when a module finishes importing, through a meta path finder that
wraps the real loader. A callback that fires while one of our modules is still
importing waits until none is. ``python -m mlx_lm.server`` (and ``.generate``)
runs the imported module's ``main()``: runpy's ``__main__`` copy would define
functions of its own that no patch reaches.
"""

import sys

OURS = "mlx_lm_mla."
# Modules that run as ``python -m`` through their imported copy: those that
# define what is patched and have a ``main()``.
RUN_IMPORTED = ("mlx_lm.server", "mlx_lm.generate")

_callbacks = {}  # module name: [callback], until it is imported
_importing = []  # the package's modules being imported through the hook
_waiting = []  # (callback, module) that fired while one of ours was importing


def after_import(name, callback):
    """Calls ``callback(module)`` when ``name`` finishes importing, now if it has."""
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    if module is not None and not getattr(spec, "_initializing", False):
        _call(callback, module)
        return
    waiting = _callbacks.setdefault(name, [])
    if callback not in waiting:
        waiting.append(callback)
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def _call(callback, module):
    if _importing:
        _waiting.append((callback, module))
    else:
        callback(module)


def _imported(name, module):
    for callback in _callbacks.pop(name, []):
        _call(callback, module)


class _Loader:
    """Runs the real loader, then the callbacks."""

    def __init__(self, loader, name):
        self._loader = loader
        self._name = name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        if not self._name.startswith(OURS):
            self._loader.exec_module(module)
            _imported(self._name, module)
            return
        _importing.append(self._name)
        try:
            self._loader.exec_module(module)
        finally:  # a module of ours that fails to import holds back nothing
            _importing.pop()
            while _waiting and not _importing:
                callback, target = _waiting.pop(0)
                callback(target)

    def get_code(self, name):
        # Only runpy asks for the code of these (imports use exec_module). A
        # run under another name (multiprocessing's "__mp_main__") runs nothing.
        if name in RUN_IMPORTED:
            # The module by name: mlx_lm.generate is also a function of mlx_lm's.
            code = (
                f"import importlib\nif __name__ == '__main__':\n"
                f"    importlib.import_module({name!r}).main()\n"
            )
            return compile(code, f"<mlx-lm-mla: python -m {name}>", "exec")
        return self._loader.get_code(name)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _Finder:
    # A plain meta path finder: importlib.abc would pull in importlib.resources.
    def find_spec(self, name, path, target=None):
        if (
            name not in _callbacks
            and name not in RUN_IMPORTED
            and not name.startswith(OURS)
        ):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader, name)
        return spec
