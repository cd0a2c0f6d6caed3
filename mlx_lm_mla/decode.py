"""MLA decode attention that reads the latent once.

mlx-lm's one-KV-head attention reads the latent (keys and values alike) once per
query head. Here the heads are the columns of one matmul, and the latent, decoded
from its bytes if quantized, is read a chunk at a time under an online softmax.
Each step takes whichever of stock's attention, this fold and (on CUDA) the
kernel of ``decode_cuda`` agreed and ran fastest for its kind (``attend``).
"""

import logging
import os
import time

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from . import decode_cuda
from .cache import quantize_latent

log = logging.getLogger(__name__)

# Bytes of latent per chunk: a step holds a few chunks, never the latent. The
# CPU value is measured (benchmarks/decode_speed.py), the GPU's not yet.
CHUNK_BYTES = {"cpu": 1 << 20, "gpu": 32 << 20}


def is_latent_decode(queries, keys, values, mask, sinks=None):
    """One query position of several heads over one head that is keys and values."""
    return (
        sinks is None
        and keys is values
        and isinstance(keys, mx.array)
        and queries.ndim == keys.ndim == 4
        and queries.shape[2] == 1
        and keys.shape[1] == 1
        and queries.shape[1] > 1
        and queries.shape[-1] == keys.shape[-1]
        and (mask is None or isinstance(mask, mx.array))
    )


def compute_dtype(dtype):
    # On the CPU a float16 latent attends faster cast to float32, a bfloat16 one
    # as it is (16K positions: 143 / 159 ms, 106 / 128 ms); a GPU keeps the dtype.
    on_cpu = mx.default_device() == mx.cpu
    return mx.float32 if on_cpu and dtype == mx.float16 else dtype


def chunk_size(batch, width, dtype):
    """Positions per chunk for ``batch`` rows of ``width`` values of ``dtype``."""
    device = "cpu" if mx.default_device() == mx.cpu else "gpu"
    return max(64, CHUNK_BYTES[device] // (batch * width * dtype.size))


def packed_cache(cache, latent):
    """The cache (or CacheList member) that last fetched ``latent`` from its
    bytes, or None."""
    for c in [cache, *getattr(cache, "caches", ())]:
        found = getattr(c, "latent_bytes", None)
        if callable(found) and found(latent) is not None:
            return c
    return None


def latent_attention(queries, latent, scale, mask=None, read=None, chunk=None):
    """``softmax(scale * q @ latent.T + mask) @ latent`` for ``queries`` (B, H, 1, D)
    over ``latent`` (B, 1, L, D); ``read``, where given, returns its rows instead
    of slicing it (``_PackedLatent.latent_reader``); ``chunk``: positions read at
    a time (default ``chunk_size``)."""
    B, H, _, D = queries.shape
    L = latent.shape[2]
    dtype = compute_dtype(queries.dtype)
    if read is None:
        read = (  # noqa: E731
            lambda a, b, t, after: _after(latent[..., a:b, :], after).astype(t)
        )
    # Heads as columns: scores come out (B, 1, positions, H).
    q = (queries * scale).astype(dtype).reshape(B, 1, H, D).swapaxes(-1, -2)
    q = mx.contiguous(q)
    if mask is not None:
        mask = mx.broadcast_to(mask, (B, H, 1, L)).transpose(0, 2, 3, 1)
    top = total = out = None
    chunk = chunk or chunk_size(B, D, dtype)
    for start in range(0, L, chunk):
        stop = min(start + chunk, L)
        # Read once the last chunk is done, its output and its sum both: else the
        # sums' chain runs after every output, each chunk's weights held till then.
        rows = read(start, stop, dtype, None if out is None else [out, total])
        scores = (rows @ q).astype(mx.float32)
        if mask is not None:
            scores = _masked(scores, mask[..., start:stop, :])
        new_top = scores.max(axis=-2, keepdims=True)
        if top is not None:
            new_top = mx.maximum(top, new_top)
        weights = mx.exp(scores - new_top)
        part = mx.contiguous(weights.astype(dtype).swapaxes(-1, -2)) @ rows
        part_total = weights.sum(axis=-2, keepdims=True)
        if top is None:
            out, total = part.astype(mx.float32), part_total
        else:
            carry = mx.exp(top - new_top)
            out = out * carry.swapaxes(-1, -2) + part
            total = total * carry + part_total
        top = new_top
    out = out / total.swapaxes(-1, -2)
    return out.astype(queries.dtype).reshape(B, H, 1, D)


def _after(x, after):
    return x if after is None else mx.depends(x, after)


def _masked(scores, mask):
    if mask.dtype == mx.bool_:
        low = mx.array(mx.finfo(mx.float32).min, mx.float32)
        return mx.where(mask, scores, low)
    return scores + mask.astype(mx.float32)


PATHS = ("auto", "stock", "fold", "kernel")
_PARSED = {}  # MLX_LM_MLA_DECODE's value -> its path


def decode_path():
    """The path MLA decode steps take, from ``MLX_LM_MLA_DECODE``: ``auto`` (the
    default: chosen per kind of step, see ``attend``), ``stock`` (mlx-lm's
    attention), ``fold`` (``latent_attention``) or ``kernel`` (``decode_cuda``)."""
    value = os.environ.get("MLX_LM_MLA_DECODE", "")
    path = _PARSED.get(value)  # read at every layer's step: parsed once a value
    if path is None:
        path = value.strip().lower() or "auto"
        if path not in PATHS:
            raise ValueError(
                f"MLX_LM_MLA_DECODE={value!r} is not a decode path: use one of "
                + ", ".join(PATHS)
            )
        _PARSED[value] = path
    return path


def reference_attention(queries, latent, scale, mask=None, read=None):
    """``latent_attention`` in float32 on the CPU stream: a GPU's float32
    matmuls may run as TF32, which is not the float32 reference."""
    with mx.stream(mx.cpu):
        out = latent_attention(queries.astype(mx.float32), latent, scale, mask, read)
        mx.eval(out)
    return out


# (kind, batch, length's bits, device, the paths offered) -> the path serving
# those steps: a choice holds only where every one of its rivals was there.
_CHOSEN = {}
_OFF = {}  # kind -> paths that failed or disagreed on a step of that kind
_KERNEL_AGREES = {}  # kind -> whether the kernel passed its check on random rows


def attend(original, queries, latent, cache, scale, mask):
    """One MLA decode step by the path ``decode_path`` names; under ``auto``,
    the path chosen for the step's kind (heads, width, dtypes, format, mask),
    batch, length (by its power of two: 64 to 127 positions share a choice),
    device and the paths it offers: on the CPU by rule (see ``rule``),
    elsewhere by ``choose`` at the first such step. A chosen path that raises
    later is turned off for the kind and stock serves."""
    owner = packed_cache(cache, latent)
    packed = None if owner is None else owner.latent_bytes(latent)
    kind = _kind(queries, latent, packed, mask)
    path = decode_path()
    if path == "auto":
        key = _key(kind, queries, latent)
        if _CHOSEN.get(key) == "stock":  # stock's step and nothing else to build
            read = None if owner is None else owner.latent_reader(latent)
            return _stock(original, queries, latent, read, cache, scale, mask)
    paths = _paths(original, queries, latent, cache, scale, mask, owner, packed, kind)
    if path != "auto":
        if path not in paths:
            raise RuntimeError(f"MLX_LM_MLA_DECODE=kernel: {_no_kernel()}")
        return paths[path]()
    if key not in _CHOSEN:
        path = rule(key)
        if path is None:
            if _traced(queries):  # mx.compile, mx.vmap: nothing can be timed
                return paths["stock"]()
            path, out = choose(key, paths)
            if path is not None:
                _CHOSEN[key] = path
            return out
        path = "stock" if path in _OFF.get(kind, ()) else path
        _CHOSEN[key] = path
        log.info("MLA decode: %s serves %s (CPU rule)", path, _named(key))
    else:  # a local: another server's thread may turn a path off meanwhile
        path = _CHOSEN.get(key, "stock")
    if path != "stock":
        try:
            return paths[path]()
        except Exception as e:
            _turn_off(kind, path, e)
    return paths["stock"]()


# On the CPU the fold serves from 16 positions, stock below (where the two
# are within noise of each other), at the latent width the rule was measured
# at; narrower latents ran slower folded. See docs/decode.md.
CPU_FOLD_FROM = 16
CPU_FOLD_WIDTH = 512


def rule(key):
    """The path for steps of ``key`` without timing, or None where they are
    timed: on the CPU, where a rule measured once holds (docs/decode.md)."""
    if mx.default_device() != mx.cpu:
        return None
    if key[0][1] != CPU_FOLD_WIDTH:  # not measured there: stock, never slower
        return "stock"
    return "fold" if 1 << (key[2] - 1) >= CPU_FOLD_FROM else "stock"


def _kind(queries, latent, packed, mask):
    """Heads, width, query dtype, the latent's dtype or packed format, mask dtype."""
    return (
        queries.shape[1],
        queries.shape[-1],
        queries.dtype,
        packed[2] if packed else latent.dtype,
        getattr(mask, "dtype", None),
    )


PORTABLE = ("stock", "fold")  # the paths every device offers


def _key(kind, queries, latent):
    """What a choice is kept for: the kind, batch, length's bits, device and the
    paths offered (those ``_paths`` gives, less the reference)."""
    offered = ("stock", "fold", "kernel") if decode_cuda.available() else PORTABLE
    return (
        kind,
        queries.shape[0],
        latent.shape[2].bit_length(),
        str(mx.default_device()),
        offered,
    )


def _stock(original, queries, latent, read, cache, scale, mask):
    # A quantized latent dequantized afresh, as stock's step pays for it.
    rows = latent if read is None else read(0, latent.shape[2], latent.dtype)
    return original(queries, rows, rows, cache, scale=scale, mask=mask)


def _paths(original, queries, latent, cache, scale, mask, owner, packed, kind):
    """The step's paths, each a function giving its output."""
    read = None if owner is None else owner.latent_reader(latent)

    def stock():
        return _stock(original, queries, latent, read, cache, scale, mask)

    def fold():
        return latent_attention(queries, latent, scale, mask, read)

    def kernel():
        out = decode_cuda.latent_attention(queries, latent, scale, mask, packed)
        if out is None:
            raise NotImplementedError(
                f"the CUDA decode kernel has no variant for {kind} (heads, width, "
                "query dtype, latent dtype or format, mask dtype)"
            )
        return out

    paths = {"stock": stock, "fold": fold}
    if decode_cuda.available():
        paths["kernel"] = kernel
    paths["reference"] = lambda: reference_attention(queries, latent, scale, mask, read)
    return paths


def _no_kernel():
    if not decode_cuda.ENABLED:
        return "the CUDA decode kernel is switched off (MLX_LM_MLA_CUDA_KERNEL=0)"
    return (
        f"no decode kernel on this device ({mx.default_device()}): the kernel "
        "runs on MLX's CUDA backend only"
    )


def _named(key):
    (heads, width, dtype, fmt, mask), batch, bits, device, _ = key
    fmt = f"{fmt[1]}-bit latent" if isinstance(fmt, tuple) else f"{fmt} latent"
    return (
        f"{heads} heads of width {width}, {dtype} queries, {fmt}, mask {mask}, "
        f"batch {batch}, {1 << max(bits - 1, 0)} to {(1 << bits) - 1} positions "
        f"on {device}"
    )


def _traced(x):
    """Whether ``x`` is being traced (``mx.compile``, ``mx.vmap``), where it
    cannot be evaluated: a step there is not one to choose by."""
    try:
        mx.eval(x)
    except ValueError as e:
        if "transformations" in str(e):
            return True
        raise
    return False


def _finite(x):
    return mx.all(mx.isfinite(x)).item()


def choose(key, paths):
    """(path, its output): of the paths that run and agree with float32
    attention on the step's own inputs (as closely as stock, twice its error),
    the fastest, timed in interleaved repetitions; stock wins a tie. A step
    whose attention is not finite (a NaN in its inputs) is served by stock
    and chooses nothing: (None, stock's output)."""
    kind = key[0]
    off = _OFF.setdefault(kind, set())
    if "kernel" in paths and "kernel" not in off and not kernel_checked(kind):
        _off(kind, "kernel")
    outs = {"stock": paths["stock"]()}
    mx.eval(outs["stock"])
    try:
        exact = paths["reference"]()
    except Exception as e:  # nothing can be checked: stock serves
        log.warning(
            "MLA decode: no float32 reference for %s: %s: %s; stock serves",
            kind,
            type(e).__name__,
            e,
        )
        exact, off = None, {"fold", "kernel"}
    if exact is not None and not (_finite(outs["stock"]) and _finite(exact)):
        log.info("MLA decode: a step of %s is not finite; stock serves it", kind)
        return None, outs["stock"]
    for name in ("fold", "kernel"):
        if name in paths and name not in off:
            try:
                outs[name] = paths[name]()
                mx.eval(outs[name])
            except Exception as e:
                log.warning(
                    "MLA decode: %s off for %s: %s: %s", name, kind, type(e).__name__, e
                )
                _off(kind, name)
                outs.pop(name, None)
    if exact is not None:
        error = {n: _distance(out, exact) for n, out in outs.items()}
        bound = 2 * error["stock"] + 1e-4 * (1 + _distance(exact, 0.0))
    for name in [n for n in outs if n != "stock"]:
        if not error[name] <= bound:  # NaN disagrees
            log.warning(
                "MLA decode: %s off for %s: %.3g from float32 attention, stock %.3g",
                name,
                kind,
                error[name],
                error["stock"],
            )
            _off(kind, name)
            del outs[name]
    seconds = {}
    if len(outs) > 1:
        seconds = _seconds({n: paths[n] for n in outs})
        for name in [n for n in outs if n != "stock" and n not in seconds]:
            log.warning("MLA decode: %s off for %s: it raised while timed", name, kind)
            _off(kind, name)
            del outs[name]
    best = min(outs, key=lambda n: seconds.get(n, 0.0))
    timed = ", ".join(f"{n} {1e3 * s:.3g} ms" for n, s in seconds.items())
    log.info("MLA decode: %s serves %s (%s)", best, _named(key), timed or "alone")
    return best, outs[best]


def _distance(a, b):
    return mx.abs(a.astype(mx.float32) - b).max().item()


def _turn_off(kind, path, error):
    log.warning(
        "MLA decode: %s off for %s after %s: %s; stock serves the step",
        path,
        kind,
        type(error).__name__,
        error,
    )
    _off(kind, path)


def _off(kind, path):
    """``path`` serves no step of ``kind`` from now on: the lengths it was
    chosen for are chosen again among the others."""
    _OFF.setdefault(kind, set()).add(path)
    # list() copies at once: a server's other thread may be adding a choice.
    for key, chosen in list(_CHOSEN.items()):
        if key[0] == kind and chosen == path:
            _CHOSEN.pop(key, None)


def _seconds(runs, repeats=5):
    """Median seconds of each run, the repetitions interleaved (the order
    rotating) so that a change of clock or load falls on every run alike; a
    run that raises is left out."""
    names = list(runs)
    times = {n: [] for n in names}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if name not in times:
                continue
            start = time.perf_counter()
            try:
                mx.eval(runs[name]())
            except Exception as e:  # left out: it serves no step
                log.warning("MLA decode: %s raised while timed: %s", name, e)
                del times[name]
                continue
            times[name].append(time.perf_counter() - start)
    return {n: sorted(t)[len(t) // 2] for n, t in times.items()}


def kernel_checked(kind):
    """Whether the kernel passed ``kernel_agrees`` for ``kind`` (run once);
    a kernel that fails to build or run fails it."""
    if kind not in _KERNEL_AGREES:
        try:
            _KERNEL_AGREES[kind] = kernel_agrees(kind)
        except Exception as e:
            log.warning(
                "MLA decode: kernel off for %s: %s: %s", kind, type(e).__name__, e
            )
            _KERNEL_AGREES[kind] = False
    return _KERNEL_AGREES[kind]


CHECK_TILES = 2 * decode_cuda.RING[1] + 1  # a block's tiles in kernel_agrees


def kernel_agrees(kind, batch=2, **sizes):
    """The kernel and the fold on random rows of ``kind`` (``batch`` sequences,
    enough positions that each block takes several tiles, a mask if the step
    has one, the step's format, quantized through a cache) against float32
    attention over the same rows: the kernel must be as close as the fold,
    which rounds to the model's dtype where the kernel keeps float32.
    ``sizes``: the kernel's tile and ring, where not the default."""
    H = kind[0]
    groups = -(-H // decode_cuda.heads_per_block(H))
    # The blocks of a long step on this GPU, each taking enough tiles (the last
    # partial) that every slot of the largest ring is refilled twice.
    blocks = decode_cuda.splits(batch, groups, 1 << 30, decode_cuda.sm_count())
    L = CHECK_TILES * sizes.get("tile", decode_cuda.TILE) * blocks - 5
    q, rows, mask, read, packed = random_step(kind, batch, L)
    exact = reference_attention(q, rows, 0.1, mask, read)
    fold = latent_attention(q, rows, 0.1, mask, read)
    got = decode_cuda.latent_attention(q, rows, 0.1, mask, packed, **sizes)
    if got is None:
        log.warning("MLA decode: kernel off for %s: it has no variant", kind)
        return False
    bound = 2 * _distance(fold, exact) + 1e-4
    agrees = _distance(got, exact) <= bound
    if not agrees:
        log.warning("MLA decode: kernel off for %s: it disagreed", kind)
    return agrees


def random_step(kind, batch, length, seed=0):
    """A decode step of ``kind`` on random rows: (queries, latent, mask, read,
    packed), the latent of ``length`` positions (at least 2) quantized through
    a cache where ``kind``'s format is, its last row the step's own, and a
    mask that keeps four positions in five where the kind has one."""
    H, D, dtype, fmt, mask_dtype = kind
    k = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((batch, H, 1, D), key=k[0]).astype(dtype)
    rows = mx.random.normal((batch, 1, length, D), key=k[1])
    read, packed = None, None
    if isinstance(fmt, tuple):  # quantized: (group, bits, width, dtype, ...)
        group_size, bits, _, latent_dtype, rope_width, rope_dtype = fmt
        rope = mx.zeros((batch, 1, length, rope_width), getattr(mx, rope_dtype))
        rows = rows.astype(getattr(mx, latent_dtype))
        small = KVCache()
        small.update_and_fetch(rows[:, :, :-1], rope[:, :, :-1])
        small = quantize_latent(small, group_size, bits)
        rows, _ = small.update_and_fetch(rows[:, :, -1:], rope[:, :, -1:])
        read, packed = small.latent_reader(rows), small.latent_bytes(rows)
    else:
        rows = rows.astype(fmt)
    mask = None
    if mask_dtype is not None:
        keep = mx.random.uniform(shape=(batch, H, 1, rows.shape[2]), key=k[2]) > 0.2
        mask = keep if mask_dtype == mx.bool_ else mx.where(keep, 0.0, -1e4)
        mask = mask.astype(mask_dtype)
    return q, rows, mask, read, packed


def folded_attention(original):
    """``scaled_dot_product_attention`` whose MLA decode steps go through
    ``attend``: stock's function, the fold or the CUDA kernel."""

    def scaled_dot_product_attention(
        queries, keys, values, cache, scale, mask, sinks=None
    ):
        if is_latent_decode(queries, keys, values, mask, sinks) and not hasattr(
            cache, "bits"
        ):
            return attend(original, queries, keys, cache, scale, mask)
        return original(
            queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks
        )

    scaled_dot_product_attention.mlx_lm_mla_original = original
    return scaled_dot_product_attention
