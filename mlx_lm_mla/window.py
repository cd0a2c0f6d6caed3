"""A rolling window that quantizes: ``RotatingKVCache`` with a quantized
latent.

Stock mlx-lm cannot quantize a ``RotatingKVCache`` at all. An MLA layer's
window can: the base class rotates the latent's bytes like any keys, so the
window keeps its size. Run time only: the upstream form refuses to quantize
a window, as stock does for every model.
"""

from mlx_lm.models.cache import RotatingKVCache

from .cache import QUANTIZED_LATENT, _PackedLatent


class QuantizedRotatingLatentCache(_PackedLatent, RotatingKVCache):
    """A ``RotatingKVCache`` whose latent is quantized."""

    @classmethod
    def merge(cls, caches):
        # BatchRotatingKVCache would batch the bytes and hand them to the model.
        raise ValueError(
            "QuantizedRotatingLatentCache cannot be batched: a quantized rolling "
            "window serves one sequence"
        )


QUANTIZED_LATENT[RotatingKVCache] = QuantizedRotatingLatentCache
