"""A row of the patch table: one change to mlx-lm (see ``__init__.py``)."""

from dataclasses import dataclass
from typing import Callable, Optional, Tuple


@dataclass(frozen=True)
class Patch:
    """``module.target`` (``"Class.attribute"`` or ``"function"``) replaced.

    how: ``wrap``: by ``make(original)``; ``classmethod``: the classmethod's
    function by ``make(function)``; ``set``: by ``make(original)``, where
    the attribute may not exist yet (None) or is not a function; ``rebind``: a function by ``make(original)``,
    wherever mlx-lm bound it by name (``from ... import``) too; ``unknown``:
    nothing, a target known not to be readable (named in missing() as is).
    needs: the private names (``contract.PRIVATE`` labels) it relies on.
    feature: what is off when it cannot be applied."""

    module: str
    target: str
    how: str
    make: Callable
    needs: Tuple[str, ...] = ()
    feature: Optional[str] = None
