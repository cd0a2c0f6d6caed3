"""Peak memory at long context, with and without a quantized latent.

A GLM-4.7-Flash shaped model (the real attention widths: kv_lora_rank 512,
qk_rope_head_dim 64, 20 heads; small dense MLPs, random weights, bfloat16)
with ``--layers`` layers. Each variant runs in a fresh process:

1. a ``--context``-token prompt written into every layer's cache in chunks of
   2,048 tokens, as a prefill writes it: ``update_and_fetch`` of the chunk,
   ``mx.eval`` of what it hands back (a quantized cache hands back its whole
   dequantized latent), then ``maybe_quantize_kv_cache`` as ``generate_step``
   calls it after every chunk. The prefill's attention itself is left out: it
   is the same for every variant, and quadratic (hours on a CPU);
2. ``--steps`` decode steps through the real model with ``generate_step``
   (``kv_bits``, ``quantized_kv_start``), as a server runs them.

Reported, per layer: MLX's peak memory over both phases
(``mx.get_peak_memory``) less the memory held before (the weights) and less
the cache's bytes at the end ("transient"), and the decode phase's own
transient: its peak less what was held when it began (the cache, which
grows by copying once every 256 positions, as stock's does). Target: a
quantized run's decode transient is no larger than the bf16 run's.

Variants: ``stock`` (the package switched off) and ``ours``, each at bf16,
8 and 4 bits; stock cannot quantize an MLA cache, so its quantized runs
fail, and the table says how.

    python benchmarks/peak_memory.py
    python benchmarks/peak_memory.py --context 8192 --steps 32 --layers 2
"""

import argparse
import json
import os
import subprocess
import sys
import time

import _common  # noqa: F401  (puts the repository root on sys.path)
from _common import GLM_4_7_FLASH, glm_attention_model, table, write_json

PREFILL_STEP = 2048
VARIANTS = [
    ("stock", None),
    ("ours", None),
    ("ours", 8),
    ("ours", 4),
    ("stock", 8),
    ("stock", 4),
]


def one_run(args):
    """The measurement, in this process; prints one JSON line."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step, maybe_quantize_kv_cache
    from mlx_lm.models.cache import make_prompt_cache

    import mlx_lm_mla

    if args.package == "ours":
        mlx_lm_mla.install()
    shape, dtype = GLM_4_7_FLASH, mx.bfloat16
    model, _ = glm_attention_model(args.layers, dtype)
    cache = make_prompt_cache(model)
    mx.random.seed(0)
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    error = fill_peak = decode_start = None
    try:
        done = 0
        while done < args.context:
            n = min(PREFILL_STEP, args.context - done)
            latent = mx.random.normal((1, 1, n, shape["kv_lora_rank"])).astype(dtype)
            rope = mx.random.normal((1, 1, n, shape["qk_rope_head_dim"])).astype(dtype)
            for c in cache:
                mx.eval(c.update_and_fetch(latent, rope))
            del latent, rope
            maybe_quantize_kv_cache(cache, args.start, 64, args.bits)
            mx.eval([c.state for c in cache])
            done += n
        mx.synchronize()
        fill_peak = mx.get_peak_memory()
        decode_start = mx.get_active_memory()
        mx.reset_peak_memory()
        steps = generate_step(
            mx.array([11]),
            model,
            prompt_cache=cache,
            max_tokens=args.steps,
            kv_bits=args.bits,
            kv_group_size=64,
            quantized_kv_start=args.start,
        )
        for _ in steps:
            pass
    except Exception as e:  # stock's quantized runs
        error = f"{type(e).__name__}: {e}"
    mx.synchronize()
    decode_peak = mx.get_peak_memory() if error is None else 0
    peak = max(fill_peak, decode_peak) if error is None else mx.get_peak_memory()
    held = sum(c.nbytes for c in cache)
    print(
        json.dumps(
            dict(
                package=args.package,
                bits=args.bits,
                error=error,
                peak=peak - before,
                cache=held,
                decode_transient=decode_peak - decode_start if error is None else None,
                classes=sorted({type(c).__name__ for c in cache}),
                offset=cache[0].offset,
            )
        )
    )


def main():
    started = time.perf_counter()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--context", type=int, default=32768, help="prompt tokens (default: 32768)"
    )
    p.add_argument(
        "--steps", type=int, default=256, help="decode steps after it (default: 256)"
    )
    p.add_argument("--layers", type=int, default=2, help="model layers (default: 2)")
    p.add_argument(
        "--start", type=int, default=4096, help="quantized_kv_start (default: 4096)"
    )
    p.add_argument(
        "--variants",
        nargs="+",
        default=[f"{p}{b or ''}" for p, b in VARIANTS],
        help="of stock, ours, ours8, ours4, stock8, stock4 (default: all)",
    )
    p.add_argument(
        "--json", default=None, help="default: benchmarks/results/peak_memory.json"
    )
    p.add_argument("--package", choices=["stock", "ours"], help=argparse.SUPPRESS)
    p.add_argument("--bits", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.package:
        return one_run(args)

    rows = []
    for package, bits in VARIANTS:
        if f"{package}{bits or ''}" not in args.variants:
            continue
        print(f"{package} {bits or 'bf16'} ...", file=sys.stderr, flush=True)
        cmd = [
            sys.executable,
            __file__,
            "--package",
            package,
            "--context",
            str(args.context),
            "--steps",
            str(args.steps),
            "--layers",
            str(args.layers),
            "--start",
            str(args.start),
        ]
        cmd += ["--bits", str(bits)] if bits else []
        env = {
            **os.environ,
            "MLX_LM_MLA_DISABLE": "1",
        }  # each run installs (or not) itself
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))

    base = next(r for r in rows if r["bits"] is None)  # the bf16 run (stock's, if run)
    for r in rows:
        r["variant"] = (
            f"{r['package']} {r['bits']}-bit" if r["bits"] else f"{r['package']} bf16"
        )
        r["transient"] = r["peak"] - r["cache"]
        keys = ("peak", "cache", "transient", "decode_transient")
        r["per_layer"] = {k: None if r[k] is None else r[k] / args.layers for k in keys}
        r["allowed"] = base["decode_transient"] if r["bits"] else None
        r["met"] = (
            None
            if r["error"] or not r["bits"]
            else r["decode_transient"] <= r["allowed"]
        )

    def mb(x):
        return None if x is None else x / 2**20

    print(
        f"\nPeak memory beyond the weights: {args.context:,}-token prompt in {PREFILL_STEP:,}-token "
        f"chunks, then {args.steps} decode steps; {args.layers} layers, quantized_kv_start "
        f"{args.start}; MiB, per layer. Target: a quantized run's decode transient is at most "
        f"the {base['package']} bf16 run's\n"
    )
    table(
        [
            dict(
                variant=r["variant"],
                peak=mb(r["per_layer"]["peak"]),
                cache=mb(r["per_layer"]["cache"]),
                transient=mb(r["per_layer"]["transient"]),
                decode=mb(r["per_layer"]["decode_transient"]),
                allowed=None
                if r["allowed"] is None
                else mb(r["allowed"] / args.layers),
                met=r["met"],
                result=r["error"]
                or f"{', '.join(r['classes'])}, {r['offset']:,} tokens",
            )
            for r in rows
        ],
        [
            ("variant", "variant", None),
            ("peak", "peak/layer", "{:,.1f}"),
            ("cache", "cache/layer", "{:,.1f}"),
            ("transient", "transient/layer", "{:,.1f}"),
            ("decode", "decode transient/layer", "{:,.1f}"),
            ("allowed", "allowed/layer", "{:,.1f}"),
            ("met", "target", None),
            ("result", "result", None),
        ],
    )
    path = write_json(args.json, "peak_memory", args, {"rows": rows}, started)
    print(f"\nwrote {path} ({time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
