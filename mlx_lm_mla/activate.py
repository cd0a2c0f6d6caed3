"""Turns the fix on in every Python process that imports ``mlx_lm``.

``mlx_lm_mla.pth`` calls ``watch()`` at start-up, which only adds an import hook;
once ``mlx_lm`` is imported the hook calls ``install()``. ``MLX_LM_MLA_DISABLE=1``
turns it off.
"""

import os
import warnings

from . import importhook
from .switches import OFF, ON, switch


def disabled() -> bool:
    return switch("MLX_LM_MLA_DISABLE", False) is True


def _activate(mlx_lm):
    try:  # all of it: never break the user's import of mlx_lm
        # logging is loaded by now (mlx_lm imports it); not at start-up
        from logging import getLogger

        from . import __version__
        from .patches import install

        patched = install()
        getLogger("mlx_lm_mla").info(
            "mlx-lm-mla %s active (%d patches)", __version__, len(patched)
        )
        _check_settings()
    except Exception as e:
        warnings.warn(f"mlx-lm-mla could not activate: {e!r}", RuntimeWarning)


# Each switch, and what a value that is no switch leaves on.
SWITCHES = {
    "MLX_LM_MLA_DISABLE": "the fix stays on",
    "MLX_LM_MLA_CUDA_KERNEL": "the CUDA decode kernel stays on",
}


def _check_settings():
    """A bad MLX_LM_MLA_DECODE named when the process starts, not first at a
    request's decode step (which still refuses it); a switch set to a word
    that is none, which leaves its part on."""
    from .decode import decode_path

    for name, left in SWITCHES.items():
        if switch(name, True) is None:
            value = os.environ[name]
            warnings.warn(
                f"mlx-lm-mla: {name}={value!r} is not a switch (use one of "
                f"{', '.join(ON + OFF)}); {left}",
                RuntimeWarning,
            )

    try:
        decode_path()
    except ValueError as e:
        warnings.warn(
            f"mlx-lm-mla: {e}; every MLA decode step raises this until it is set right",
            RuntimeWarning,
        )


def watch():
    """Activates when ``mlx_lm`` is imported (now, if it already is)."""
    if not disabled():
        importhook.after_import("mlx_lm", _activate)
