"""Patches on mlx-lm's MLA model modules (``mlx_lm.models.<model>``): their
attention marks the cache it writes (``mla.py``), and their decode steps
read the latent once (``decode.py``).

Which modules and classes is read from the installed sources: a module's
decode attention is changed only where each of its MLA attention classes
calls ``scaled_dot_product_attention`` by that name.
"""

from .. import decode, mla
from .table import Patch

SDPA = "scaled_dot_product_attention"
FEATURE = "MLA decode attention reading the latent once"


def table():
    """The MLA attention classes of the installed mlx-lm, each marking the
    cache it writes, and their modules' decode attention. One whose source
    does not say which cache, or that does not call ``SDPA``, is named in
    missing()."""
    classes, unreadable = mla.load_attention()
    rows, modules = [], {}
    for cls, member in classes.items():
        mla.ATTENTION[cls] = member
        rows.append(
            Patch(cls.__module__, f"{cls.__qualname__}.__call__", "wrap",
                  lambda f, m=member: mla.marking_call(f, m))
        )
        modules.setdefault(cls.__module__, []).append(cls)
    rows += [Patch("mlx_lm.models.cache", f"{name}.__call__ (the cache it writes)", "unknown", None)
             for name in unreadable]
    for module, attention in sorted(modules.items()):
        if all(mla.calls(cls, SDPA) for cls in attention):
            rows.append(Patch(module, SDPA, "wrap", decode.folded_attention,
                              needs=(f"mlx_lm.models.base.{SDPA}",), feature=FEATURE))
        else:
            rows.append(Patch(module, f"{module}.{SDPA} (called by its MLA attention)", "unknown",
                              None, feature=FEATURE))
    return rows
