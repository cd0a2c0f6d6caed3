"""Turns the fix on in every Python process that imports ``mlx_lm``.

Installing the package puts ``mlx_lm_mla.pth`` in site-packages. Python runs
it at start-up, and it calls ``watch()``, which only adds an import hook
(``importhook.py``): no mlx or mlx-lm import happens then. When ``mlx_lm``
finishes importing, the hook calls ``mlx_lm_mla.install()``. So
``python -m mlx_lm.server``, ``mlx_lm.generate`` and servers that import
``mlx_lm`` get the fix with no change to their code.
``MLX_LM_MLA_DISABLE=1`` turns it off.
"""

import os
import warnings

from . import importhook


def disabled() -> bool:
    return os.environ.get("MLX_LM_MLA_DISABLE", "").strip().lower() in (
        "1",
        "true",
        "yes",
        "on",
    )


def _activate(mlx_lm):
    try:
        from .patches import install

        patched = install()
    except Exception as e:  # never break the user's import of mlx_lm
        warnings.warn(f"mlx-lm-mla could not activate: {e!r}", RuntimeWarning)
    else:  # logging is loaded by now (mlx_lm imports it); not at start-up
        from logging import getLogger

        from . import __version__

        getLogger("mlx_lm_mla").info("mlx-lm-mla %s active (%d patches)", __version__, len(patched))


def watch():
    """Activates when ``mlx_lm`` is imported (now, if it already is)."""
    if not disabled():
        importhook.after_import("mlx_lm", _activate)
