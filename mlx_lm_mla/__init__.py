"""MLA-aware caches for mlx-lm.

    import mlx_lm_mla
    mlx_lm_mla.install()   # every MLA model mlx-lm loads now gets latent caches
"""

from .cache import BatchMLALatentCache, MLALatentCache
from .patch import install, installed, uninstall

from ._version import __version__

__all__ = [
    "MLALatentCache",
    "BatchMLALatentCache",
    "install",
    "installed",
    "uninstall",
    "__version__",
]
