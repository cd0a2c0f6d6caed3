"""Patches on mlx-lm's MLA model modules: their attention marks the cache it
writes (``mla.py``) and their decode steps read the latent once (``decode.py``),
a feature per module.
"""

import inspect

from .. import decode, mla, prefill
from .table import CHUNKS, Patch, decode_feature, marks_feature

SDPA = "scaled_dot_product_attention"


def table():
    """Rows for each installed MLA attention and its module's decode attention; a
    class that does not say which cache it writes, or call ``SDPA``, is missing."""
    classes, unreadable = mla.load_attention()
    rows, modules = [], {}
    for cls, member in classes.items():
        mla.ATTENTION[cls] = member
        call, feature = f"{cls.__qualname__}.__call__", marks_feature(cls.__module__)
        if _takes_cache(cls):
            mark = lambda f, m=member: mla.marking_call(f, m)  # noqa: E731
            rows.append(Patch(cls.__module__, call, "wrap", mark, feature))
        else:
            gone = f"{cls.__module__}.{call} (takes no cache)"
            rows.append(Patch(cls.__module__, gone, "unknown", None, feature))
        modules.setdefault(cls.__module__, []).append(cls)
    for name in unreadable:
        module = name.split(" ")[0].rpartition(".")[0]
        gone = f"{name}.__call__ (the cache it writes)"
        rows.append(Patch(module, gone, "unknown", None, marks_feature(module)))
    for module, attention in sorted(modules.items()):
        feature = decode_feature(module)
        if all(mla.calls(cls, SDPA) for cls in attention):
            rows.append(Patch(module, SDPA, "wrap", decode.folded_attention, feature))
        else:
            gone = f"{module}.{SDPA} (called by its MLA attention)"
            rows.append(Patch(module, gone, "unknown", None, feature))
    return rows + chunk_rows(modules)


def chunk_rows(modules):
    """A chunk over a longer latent (``prefill.py``): the latent's expansions
    are recognised where made, and attended in the latent instead."""
    made = "mlx_lm.models.mla"
    rows = [
        Patch(made, f"{cls}.__call__", "wrap", prefill.recording_call, CHUNKS)
        for cls in ("MultiLinear", "QuantizedMultiLinear")
    ]
    for module, attention in sorted(modules.items()):
        if all(mla.calls(cls, SDPA) for cls in attention):
            rows.append(Patch(module, SDPA, "wrap", prefill.folded_chunks, CHUNKS))
    return rows


def _takes_cache(cls):
    # The cache it writes is found by this parameter's place (mla.marking_call).
    call = getattr(cls.__call__, "mlx_lm_mla_original", cls.__call__)
    try:
        return "cache" in inspect.signature(call).parameters
    except (TypeError, ValueError):
        return False
