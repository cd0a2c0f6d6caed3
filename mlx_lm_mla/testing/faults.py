"""Fault injection for tests: ``python -m mlx_lm_mla.testing.faults point:n
[mlx_lm.server flags]`` runs the server with the fix, the n-th call of ``point``
raising ``InjectedFault`` once (``sample`` fails inside a compiled function, as
a failing mlx-lm sampler does).
"""

import functools
import sys
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


def parse(spec):
    point, _, n = spec.strip().partition(":")
    if point not in POINTS or not n.isdigit() or int(n) < 1:
        raise ValueError(
            f"fault {spec!r}: expected point:n with point one of "
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
            raise InjectedFault(f"injected fault at {point}")


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
    """``wrap`` failing inside a function compiled over ``mx.random.state``, which
    leaves the state holding an array never computed."""
    import mlx.core as mx

    @functools.wraps(function)
    def faulty(*args, **kwargs):
        def body(x):  # a new function each call, so it is traced each call
            trigger.hit(name)
            return x

        mx.compile(body, inputs=mx.random.state, outputs=mx.random.state)(mx.array(0))
        return function(*args, **kwargs)

    return faulty


def install(spec):
    """Makes the MLA caches' operations fail at ``spec``, through the patch table
    so ``uninstall()`` takes them out."""
    import mlx_lm.models.cache as cache_module

    from .. import patches
    from ..guards import sampling
    from ..patches import quantize as quantize_patches

    trigger = _Trigger(*parse(spec))
    patches.install()
    single, batch = cache_module.KVCache, cache_module.BatchKVCache
    for owner in (single, batch):
        for name in ("update_and_fetch", "trim"):
            patches.set_attr(owner, name, wrap(getattr(owner, name), name, trigger))
    for name in ("extract", "filter", "extend"):
        patches.set_attr(batch, name, wrap(getattr(batch, name), name, trigger))
    merge = vars(batch)["merge"].__func__
    patches.set_attr(batch, "merge", classmethod(wrap(merge, "merge", trigger)))
    # Every quantization of a latent, single or batch, goes through this.
    for name in ("quantize_latent", "quantize_rows"):
        quantize = getattr(quantize_patches, name)
        patches.set_attr(
            quantize_patches, name, wrap(quantize, "to_quantized", trigger)
        )
    # One request's sampler in a server's generation step.
    run = sampling.RowSampler.run
    patches.set_attr(sampling.RowSampler, "run", wrap_traced(run, "sample", trigger))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    install(argv[0])
    import mlx_lm.server

    sys.argv = [sys.argv[0], *argv[1:]]
    return mlx_lm.server.main()


if __name__ == "__main__":
    main()
