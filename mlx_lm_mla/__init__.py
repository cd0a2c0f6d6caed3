"""MLA-aware caches for mlx-lm.

    import mlx_lm_mla
    mlx_lm_mla.install()   # MLA caches quantize their latent, in place

The caches and patches load on first use, so the start-up hook costs little.
"""

import importlib

from ._version import __version__

_EXPORTS = {
    "QuantizedLatentCache": "cache",
    "BatchQuantizedLatentCache": "cache",
    "BatchMixedLatentCache": "cache",
    "QuantizedRotatingLatentCache": "cache",
    "quantize_latent": "cache",
    "install": "patches",
    "installed": "patches",
    "missing": "patches",
    "uninstall": "patches",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name):
    if name in _EXPORTS:
        module = importlib.import_module(f".{_EXPORTS[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
