"""The CUDA decode kernel's tile and ring sizes, side by side on the GPU that
runs it (MLX's CUDA backend only).

For each latent format (bf16, 8-bit, 4-bit, group 64) and batch, at
GLM-4.7-Flash's attention widths (20 heads, latent 512, RoPE key 64; bf16
queries, the RoPE-key scores as a bf16 mask, as the models call it): every
(positions a tile, tiles in the ring) whose shared memory the GPU allows,
each first passing the check the decode path makes before the kernel
serves a kind (``decode.kernel_agrees`` at those sizes), then timed in
interleaved repetitions, with the portable path (``decode.py``'s fold over
the same rows) beside them. Per row: microseconds a step (kernel and
combine, ``--calls`` steps evaluated together), the bytes the kernel reads
a step (latent rows, their scales and biases, the scores) over that time,
its share of the memory's peak (from the CUDA driver), and its speed
against the default sizes. ``decode_cuda.TILE``, ``STAGED`` and ``RING``
are what such a run should choose.

    python benchmarks/kernel_tiles.py                  # 32K and 128K, batch 1 and 8
    python benchmarks/kernel_tiles.py --contexts 2048 --batches 1 --repeats 2
"""

import argparse
import itertools
import statistics
import sys
import time

if __name__ == "__main__":  # this tree's package, not an installed copy
    import _common  # noqa: F401

import mlx.core as mx  # noqa: E402

from mlx_lm_mla import bench, decode, decode_cuda  # noqa: E402

HEADS, WIDTH, ROPE = 20, 512, 64  # GLM-4.7-Flash's attention
FORMATS = {
    "bf16": mx.bfloat16,
    "8-bit": (64, 8, WIDTH, "bfloat16", ROPE, "bfloat16"),
    "4-bit": (64, 4, WIDTH, "bfloat16", ROPE, "bfloat16"),
}


def candidates(q, rows, mask, packed, tiles, stages, gpu):
    """The default sizes (``prepare``'s), and {(tile, stages): shared bytes}
    of each size the GPU's shared memory holds, the default first."""
    first = decode_cuda.prepare(q, rows, 0.1, mask, packed, sms=gpu.sms)
    default = (decode_cuda.TILE, dict(first["template"])["STAGES"])
    found = {}
    for tile, ring in [default, *itertools.product(tiles, stages)]:
        launch = decode_cuda.prepare(
            q, rows, 0.1, mask, packed, sms=gpu.sms, tile=tile, stages=ring
        )
        if launch["shared_memory"] <= gpu.shared_memory:
            found.setdefault((tile, ring), launch["shared_memory"])
    return default, found


_AGREES = {}  # (kind, tile, ring) -> whether the kernel passed its check


def agrees(kind, tile, ring):
    """The check the decode path makes before the kernel serves a kind
    (``decode.kernel_agrees``), at these sizes; once a process."""
    key = (kind, tile, ring)
    if key not in _AGREES:
        try:
            _AGREES[key] = decode.kernel_agrees(kind, tile=tile, stages=ring)
        except Exception as e:  # fails to build or run
            print(f"tile {tile}, ring {ring}: {type(e).__name__}: {e}")
            _AGREES[key] = False
    return _AGREES[key]


def read_per_step(rows, packed, mask):
    """Bytes the kernel reads a step: each position's staged row and its
    RoPE-key scores (the mask), for every sequence."""
    B, H, _, L = mask.shape
    return B * L * (decode_cuda.row_bytes(rows, packed) + H * mask.dtype.size)


def seconds(run, calls):
    """Seconds a step, ``calls`` steps evaluated together."""
    start = time.perf_counter()
    mx.eval([run() for _ in range(calls)])
    mx.synchronize()
    return (time.perf_counter() - start) / calls


def measure(name, context, batch, args, gpu):
    # As the models call it: bf16 queries, the RoPE-key scores as a bf16 mask.
    kind = (HEADS, WIDTH, mx.bfloat16, FORMATS[name], mx.bfloat16)
    q, rows, mask, read, packed = decode.random_step(kind, batch, context)
    mx.eval(q, rows, mask, *(packed[:2] if packed else ()))
    default, sizes = candidates(q, rows, mask, packed, args.tiles, args.stages, gpu)
    runs = {"portable": lambda: decode.latent_attention(q, rows, 0.1, mask, read)}
    for tile, ring in sizes:
        if not agrees(kind, tile, ring):
            print(
                f"{name}: tile {tile}, ring {ring} fails the kernel's check: left out"
            )
            continue
        runs[(tile, ring)] = lambda t=tile, r=ring: decode_cuda.latent_attention(
            q, rows, 0.1, mask, packed, tile=t, stages=r
        )
    for run in runs.values():  # built and warm
        seconds(run, 1)
    samples = {key: [] for key in runs}
    for rep in range(args.repeats):
        for key in bench.rotated(list(runs), rep):
            samples[key].append(seconds(runs[key], args.calls))
    moved = read_per_step(rows, packed, mask)
    base = statistics.median(samples[default]) if default in samples else None
    found = []
    for key, times in samples.items():
        step = statistics.median(times)
        tile, ring = (None, None) if key == "portable" else key
        found.append(
            dict(
                context=context,
                batch=batch,
                format=name,
                path="portable" if key == "portable" else "kernel",
                tile=tile,
                ring=ring,
                default=key == default,
                shared_kb=sizes[key] / 1024 if key in sizes else None,
                us=step * 1e6,
                gb_per_s=moved / step / 1e9,
                peak_percent=gpu.bandwidth and 100 * moved / step / gpu.bandwidth,
                x_default=base and base / step,
                samples=times,
            )
        )
    return found


COLUMNS = [
    ("context", "context", "{:,}"),
    ("batch", "batch", None),
    ("format", "format", None),
    ("path", "path", None),
    ("tile", "tile", None),
    ("ring", "ring", None),
    ("default", "default", None),
    ("shared_kb", "shared KB", "{:.1f}"),
    ("us", "us a step", "{:.1f}"),
    ("gb_per_s", "GB/s", "{:.0f}"),
    ("peak_percent", "% of peak", "{:.1f}"),
    ("x_default", "x default", "{:.2f}"),
]


def main():
    started = time.perf_counter()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    p.add_argument("--tiles", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--calls", type=int, default=20, help="steps a sample")
    p.add_argument("--json", default=None, help="default: benchmarks/results/")
    args = p.parse_args()
    if not decode_cuda.available():
        sys.exit(
            "kernel_tiles.py measures the CUDA decode kernel: it needs MLX's CUDA "
            f"backend as the default device (here {mx.default_device()}, "
            f"mlx {mx.__version__})"
        )
    if min(args.tiles + args.stages) < 1:
        p.error(
            "--tiles and --stages take positive counts (a ring of 1: no copy ahead)"
        )
    gpu = decode_cuda.gpu()
    peak = f"{gpu.bandwidth / 1e9:,.0f} GB/s" if gpu.bandwidth else "not told"
    print(
        f"{mx.device_info(mx.default_device()).get('device_name', 'GPU')}: "
        f"{gpu.sms} SMs, {gpu.shared_memory // 1024} KB shared a block, peak {peak}"
    )
    rows = []
    jobs = list(itertools.product(args.contexts, args.batches, args.formats))
    for context, batch, name in _common.progress(jobs, desc="kernel_tiles"):
        rows += measure(name, context, batch, args, gpu)
    bench.table(rows, COLUMNS)
    about = dict(gpu._asdict(), peak_gb_per_s=gpu.bandwidth and gpu.bandwidth / 1e9)
    del about["bandwidth"]
    path = _common.write_json(
        args.json, "kernel_tiles", args, dict(gpu=about, rows=rows), started
    )
    print(f"\nwrote {path} ({time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
