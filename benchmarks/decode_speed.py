"""Decode speed of MLA layers: the package's decode attention against stock
mlx-lm's, bf16 and with a quantized latent; ``mlx-lm-mla bench``
(``mlx_lm_mla/bench.py``, which says what is measured) with this tree's
package, the attention table and the CPU targets of the decode work.

Variants ``stock``, ``ours``, ``ours8``, ``ours4``, and on MLX's CUDA
backend ``portable``, ``portable8``, ``portable4`` (the kernel off).

    python benchmarks/decode_speed.py                       # CPU: 4K, 16K, batch 1
    python benchmarks/decode_speed.py --contexts 4096 --batches 8
    python benchmarks/decode_speed.py --contexts 4096 32768 131072 --batches 1 8   # a GPU
"""

import argparse
import time

import _common  # noqa: F401  (puts the repository root on sys.path)
from _common import RESULTS

from mlx_lm_mla import bench

# Targets of issue 30 (CPU, 16K positions, batch 1): tokens/s over stock's.
TARGETS = {(16384, 1): {"ours": 2.0, "ours8": 1.8, "ours4": 1.8}}


def main():
    started = time.perf_counter()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--batches", type=int, nargs="+", default=[1])
    offered = bench.offered_variants()
    p.add_argument("--variants", nargs="+", default=offered, choices=offered)
    p.add_argument("--steps", type=int, default=6, help="timed decode steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--attention-calls", type=int, default=4)
    p.add_argument("--no-attention", action="store_true", help="the decode table only")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument(
        "--chunk-bytes", type=int, default=None, help="default: decode.CHUNK_BYTES"
    )
    p.add_argument("--json", default=None, help=f"default: {RESULTS}/decode_speed.json")
    args = p.parse_args()
    if args.chunk_bytes:
        from mlx_lm_mla import decode

        decode.CHUNK_BYTES = dict.fromkeys(("cpu", "gpu"), args.chunk_bytes)
    options = bench.parser().parse_args([])
    options.__dict__.update(
        contexts=args.contexts,
        batch=args.batches,
        variants=args.variants,
        repeats=args.reps,
        steps=args.steps,
        warmup=args.warmup,
        layers=args.layers,
        attention=not args.no_attention,
        attention_calls=args.attention_calls,
    )
    bench.check_args(bench.parser(), options)
    result = bench.run(options)
    for row in result["decode_rows"]:
        target = TARGETS.get((row["context"], row["batch"]), {}).get(row["variant"])
        if target is not None:
            row.update(target=target, met=row["ratio"] >= target)
    columns = bench.DECODE_COLUMNS + [
        ("target", "target", ">= {:.1f}"),
        ("met", "met", None),
    ]
    bench.report(result, columns)
    result.update(benchmark="decode_speed", args=vars(args))
    path = _common.write_json(args.json, "decode_speed", args, result, started)
    print(f"\nwrote {path} ({time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
