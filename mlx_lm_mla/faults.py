"""Fault injection, a test mode that is off unless asked for.

``MLX_LM_MLA_FAULT=point:n`` makes the n-th call of ``point`` in the process
raise ``InjectedFault`` (once). Points are the latent cache operations
(``update_and_fetch``, ``trim``, ``merge``, ``extract``, ``filter``,
``extend``, ``to_quantized``), ``prefill`` (an update of more than one token),
``decode`` (an update of one token) and ``sample`` (one request's sampler in
a generation step; it fails inside a function compiled with
``mx.random.state`` as input and output, as a failing mlx-lm sampler does).
Tests use it to check that a failing request ends with a clear error and
leaves nothing behind.
"""

import functools
import os
import threading

POINTS = (
    "update_and_fetch",
    "prefill",
    "decode",
    "trim",
    "merge",
    "extract",
    "filter",
    "extend",
    "to_quantized",
    "sample",
)


class InjectedFault(RuntimeError):
    pass


def requested():
    """(point, n) from MLX_LM_MLA_FAULT, or None."""
    spec = os.environ.get("MLX_LM_MLA_FAULT", "").strip()
    if not spec:
        return None
    point, _, n = spec.partition(":")
    if point not in POINTS or not n.isdigit() or int(n) < 1:
        raise ValueError(
            f"MLX_LM_MLA_FAULT={spec!r}: expected point:n with point one of "
            f"{', '.join(POINTS)} and n >= 1"
        )
    return point, int(n)


class _Trigger:
    def __init__(self, point, n):
        self.point, self.left = point, n
        self.lock = threading.Lock()

    def hit(self, point):
        if point != self.point:
            return
        with self.lock:
            self.left -= 1
            fire = self.left == 0
        if fire:
            raise InjectedFault(f"injected fault at {point} (MLX_LM_MLA_FAULT)")


def wrap(function, name, trigger):
    """function, raising at the trigger's point first."""

    @functools.wraps(function)
    def faulty(*args, **kwargs):
        trigger.hit(name)
        if name == "update_and_fetch":
            length = (
                args[1].shape[2] if len(args) > 1 and hasattr(args[1], "shape") else 1
            )
            trigger.hit("prefill" if length > 1 else "decode")
        return function(*args, **kwargs)

    return faulty


def wrap_traced(function, name, trigger):
    """function, raising at the trigger's point first, from inside a traced
    function that captures ``mx.random.state``: the failure leaves the
    random state holding an array that was never computed."""
    import mlx.core as mx

    @functools.wraps(function)
    def faulty(*args, **kwargs):
        def body(x):  # a new function each call, so it is traced each call
            trigger.hit(name)
            return x

        mx.compile(body, inputs=mx.random.state, outputs=mx.random.state)(mx.array(0))
        return function(*args, **kwargs)

    return faulty


def make_trigger():
    spec = requested()
    return _Trigger(*spec) if spec else None
