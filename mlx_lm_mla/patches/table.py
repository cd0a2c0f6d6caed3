"""A row of the patch table: one change to mlx-lm (see ``__init__.py``),
and the features the rows make up."""

from dataclasses import dataclass
from typing import Callable

# What is switched on or off as a whole: a feature's patches are applied
# all or none, and only where every name it reads holds (``contract.py``).
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
# Not a patch: the commands that build tiny models (repro, tiny-model) check
# the names they read before they run.
TINY = "tiny models (repro, tiny-model)"


def decode_feature(module):
    return f"MLA decode attention reading the latent once ({module})"


def marks_feature(module):
    return f"caches marked by their MLA attention ({module})"


@dataclass(frozen=True)
class Patch:
    """``module.target`` (``"Class.attribute"`` or ``"function"``) replaced.

    how: ``wrap``: by ``make(original)``; ``classmethod``: the classmethod's
    function by ``make(function)``; ``set``: by ``make(original)``, where
    the attribute may not exist yet (None) or is not a function;
    ``rebind``: a function by ``make(original)``, wherever mlx-lm bound it
    by name (``from ... import``) too; ``unknown``: nothing, a target known
    not to be readable (named in missing() as is).
    feature: the feature it belongs to (off as a whole when it cannot be
    applied). A wrapped, rebound or classmethod target must take what its
    replacement takes (``contract.signature_problem``)."""

    module: str
    target: str
    how: str
    make: Callable
    feature: str
