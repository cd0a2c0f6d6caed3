"""Turns the fix on in every Python process that imports ``mlx_lm``.

Installing the package puts ``mlx_lm_mla.pth`` in site-packages. Python runs
it at start-up, and it calls ``watch()``, which only adds an import hook: no
mlx or mlx-lm import happens then. When ``mlx_lm`` finishes importing, the
hook calls ``mlx_lm_mla.install()``. So ``python -m mlx_lm.server``,
``mlx_lm.generate`` and servers that import ``mlx_lm`` get the fix with no
change to their code. ``MLX_LM_MLA_DISABLE=1`` turns it off.

The server's guards wait for ``mlx_lm.server`` itself: when it finishes
importing, the hook applies them (``patch.server_imported``), so a program
that never imports the server does not load it.

``python -m mlx_lm.server`` needs one more step: runpy would execute the
server's source as ``__main__``, a copy of the module that install() never
sees, so for that one module the hook hands runpy code that imports
``mlx_lm.server`` and calls its ``main()``.

Activation works in any import order: when ``mlx_lm`` is first imported by
one of this package's own modules (``import mlx_lm_mla.cache``, or
``mlx_lm_mla.install()`` importing ``patch.py``), activation waits until no
module of the package is still importing, then runs.
"""

import os
import sys
import warnings

TARGET = "mlx_lm"
# ``python -m mlx_lm.server`` runs the server's code as __main__, a second copy
# whose classes install() cannot reach; the hook runs the imported module instead.
SERVER = "mlx_lm.server"
RUN_SERVER = "import mlx_lm_mla.activate as a; a.run_server()"
PATCH = "mlx_lm_mla.patch"
OURS = "mlx_lm_mla."
_deferred = []
_importing = []  # the package's modules being imported through the hook


def disabled() -> bool:
    return os.environ.get("MLX_LM_MLA_DISABLE", "").strip().lower() in (
        "1",
        "true",
        "yes",
        "on",
    )


def deferred():
    """True once, if activation waited for patch.py to finish importing."""
    return bool(_deferred and _deferred.pop())


def _activate():
    patch = sys.modules.get(PATCH)
    if _importing or (patch is not None and not hasattr(patch, "install")):
        _deferred.append(True)  # one of ours is importing mlx_lm: activate after it
        return
    try:
        from .patch import install

        patched = install()
    except Exception as e:  # never break the user's import of mlx_lm
        warnings.warn(f"mlx-lm-mla could not activate: {e!r}", RuntimeWarning)
    else:  # logging is loaded by now (mlx_lm imports it); not at start-up
        from logging import getLogger
        from . import __version__

        getLogger("mlx_lm_mla").info("mlx-lm-mla %s active (%d patches)", __version__, len(patched))


def _server_imported(module):
    # The server's guards, once install() has run (it always has when the
    # hook is on: importing mlx_lm.server imports mlx_lm first).
    patch = sys.modules.get(PATCH)
    if patch is None or not hasattr(patch, "server_imported"):
        return
    try:
        patch.server_imported(module)
    except Exception as e:  # never break the user's import of mlx_lm.server
        warnings.warn(f"mlx-lm-mla could not guard mlx_lm.server: {e!r}", RuntimeWarning)


def run_server():
    import mlx_lm.server

    mlx_lm.server.main()


class _Loader:
    """Runs the real loader, then activates. Anything else goes to the real one."""

    def __init__(self, loader, name):
        self._loader = loader
        self._name = name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        if self._name.startswith(OURS):
            _importing.append(self._name)
            try:
                self._loader.exec_module(module)
            finally:
                _importing.pop()
            if not _importing and deferred():
                _activate()
            return
        self._loader.exec_module(module)
        if self._name == TARGET:
            _activate()
        elif self._name == SERVER:
            _server_imported(module)

    def get_code(self, name):
        # Only runpy asks for the code of mlx_lm.server (imports use exec_module).
        if name == SERVER:
            return compile(RUN_SERVER, "<mlx-lm-mla: python -m mlx_lm.server>", "exec")
        return self._loader.get_code(name)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _AfterImport:
    # A plain meta path finder: importlib.abc would pull in importlib.resources.
    def find_spec(self, name, path, target=None):
        if name not in (TARGET, SERVER) and not name.startswith(OURS):
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


def hook():
    """Puts the import hook in place (once)."""
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


def watch():
    """Activates when ``mlx_lm`` is imported (now, if it already is)."""
    if disabled():
        return
    if TARGET in sys.modules:
        _activate()
    else:
        hook()
