"""Patches on mlx-lm's MLA model modules (``mlx_lm.models.<model>``): their
attention marks the cache it writes (``mla.py``), and their decode steps
read the latent once (``decode.py``). Each module's are a feature of its own.

Which modules and classes is read from the installed sources: a module's
decode attention is changed only where each of its MLA attention classes
calls ``scaled_dot_product_attention`` by that name.
"""

import inspect

from .. import decode, mla
from .table import Patch, decode_feature, marks_feature

SDPA = "scaled_dot_product_attention"


def table():
    """The MLA attention classes of the installed mlx-lm, each marking the
    cache it writes, and their modules' decode attention. One whose source
    does not say which cache, whose ``__call__`` takes no ``cache``, or that
    does not call ``SDPA``, is named in missing()."""
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
    return rows


def _takes_cache(cls):
    # The cache it writes is found by this parameter's place (mla.marking_call).
    call = getattr(cls.__call__, "mlx_lm_mla_original", cls.__call__)
    try:
        return "cache" in inspect.signature(call).parameters
    except (TypeError, ValueError):
        return False
