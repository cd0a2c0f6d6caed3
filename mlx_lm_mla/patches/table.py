"""A row of the patch table, and the features the rows make up."""

from dataclasses import dataclass
from typing import Callable

# Each is switched on or off as a whole.
EVERYTHING = "everything"  # the package's caches subclass stock's
QUANTIZE = "MLA latent quantization"
FILES = "checked prompt cache files"
CACHE_CHECKS = "prompt cache checks in generate_step"
KV_BATCHING = "--kv-bits batching of MLA models"
REQUEST_CHECKS = "request checks"
BAD_REQUESTS = "400 for bad requests"
REUSE = "prompt cache reuse guards"
DISK = "prompt caches on disk"
RECOVERY = "recovery after a failure"
SAMPLING = "sampling guards"
CHUNKS = "MLA chunks over a longer latent attended in the latent"
# Not a patch: repro and tiny-model check the names they read before they run.
TINY = "tiny models (repro, tiny-model)"


def decode_feature(module):
    return f"MLA decode attention reading the latent once ({module})"


def marks_feature(module):
    return f"caches marked by their MLA attention ({module})"


@dataclass(frozen=True)
class Patch:
    """``module.target`` (``"Class.attribute"`` or ``"function"``) replaced by
    ``make(original)``. how: ``wrap``; ``classmethod`` (its function); ``set``
    (the original may be absent or not a function); ``rebind`` (also wherever
    mlx-lm imported it by name); ``unknown`` (nothing: named in missing())."""

    module: str
    target: str
    how: str
    make: Callable
    feature: str
