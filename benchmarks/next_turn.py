"""The next turn of a long chat: time to first token of a short message
after a long conversation held in the cache, and its transient memory.

The model of ``mlx-lm-mla bench`` (a ``glm4_moe_lite`` at GLM-4.7-Flash's
attention widths, ``--layers`` dense layers, random weights, bfloat16). Each
repetition fills a fresh cache to ``--context`` positions as the bench does
(quantized in place for the 8- and 4-bit variants, group 64), then times one
model call on a ``--message``-token chunk and the evaluation of its logits:
the prefill of the next turn, up to its first token. Variants, interleaved
(the order rotates every repetition):

- ``stock``: stock mlx-lm, bf16 cache: the latent expanded to every head's
  keys and values, then its attention;
- ``ours`` / ``ours8`` / ``ours4``: the package, the chunk attended in the
  latent (``mlx_lm_mla/prefill.py``), bf16 / 8-bit / 4-bit latent;
- ``expand8`` / ``expand4``: the package with that off (``prefill.ENABLED``):
  the quantized latent dequantized, then expanded as stock does.

Transient: MLX's peak memory during the call beyond what was held before it,
per layer. Figures are medians over ``--reps``; ratios against ``stock``.

    python benchmarks/next_turn.py                          # 32K, 200 tokens
    python benchmarks/next_turn.py --context 8192 --reps 1  # a quick look
"""

import argparse
import time

import _common  # noqa: F401  (puts the repository root on sys.path)
from _common import load_average, median, progress, table, write_json

import mlx.core as mx

from mlx_lm_mla import bench, prefill

VARIANTS = {  # name: (label, latent bits, the chunk attended in the latent)
    "stock": ("stock bf16", None, False),
    "ours": ("bf16", None, True),
    "ours8": ("8-bit", 8, True),
    "ours4": ("4-bit", 4, True),
    "expand8": ("8-bit, expanded", 8, False),
    "expand4": ("4-bit, expanded", 4, False),
}


def next_turn(model, context, message, variant):
    """(seconds to the first token's logits, transient bytes)."""
    label, bits, fold = VARIANTS[variant]
    bench.use_decode("stock" if variant == "stock" else "ours")
    prefill.ENABLED = fold
    cache = bench.filled_cache(model, context, 1, bits)
    tokens = mx.array([[(11 * i) % 240 + 10 for i in range(message)]])
    mx.synchronize()
    held = mx.get_active_memory()
    mx.reset_peak_memory()
    start = time.perf_counter()
    mx.eval(model(tokens, cache=cache)[:, -1])
    seconds = time.perf_counter() - start
    transient = mx.get_peak_memory() - held
    prefill.ENABLED = True
    return seconds, transient


def main():
    started = time.perf_counter()
    load_at_start = load_average()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=32768, help="cached positions")
    p.add_argument("--message", type=int, default=200, help="tokens of the message")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument(
        "--json", default=None, help="default: benchmarks/results/next_turn.json"
    )
    args = p.parse_args()
    variants = ["stock"] + [v for v in args.variants if v != "stock"]
    model, about = bench.load_model(argparse.Namespace(model=None, layers=args.layers))
    layers = len(model.layers)
    mx.random.seed(0)
    for v in variants:  # every path built and warm
        next_turn(model, 512, 16, v)
    jobs = [v for r in range(args.reps) for v in bench.rotated(variants, r)]
    samples = {}
    bar = progress(total=len(jobs), desc="runs")
    for v in jobs:
        bar.set_postfix_str(v)
        samples.setdefault(v, []).append(
            next_turn(model, args.context, args.message, v)
        )
        bar.update()
    bar.close()
    bench.use_decode("ours")
    base = median([s for s, _ in samples["stock"]])
    base_transient = median([t for _, t in samples["stock"]])
    rows = []
    for v in variants:
        ttft = median([s for s, _ in samples[v]])
        transient = median([t for _, t in samples[v]])
        rows.append(
            dict(
                variant=v,
                label=VARIANTS[v][0],
                ttft_s=ttft,
                ratio=ttft / base,
                transient_mib=transient / 2**20 / layers,
                transient_ratio=transient / base_transient,
                samples=[s for s, _ in samples[v]],
                transient_samples=[t for _, t in samples[v]],
            )
        )
    print(
        f"\nnext turn: {args.message} tokens after {args.context:,} cached positions, "
        f"{layers} layers; TTFT median of {args.reps}, variants interleaved; "
        f"device {bench.device()['name']}\n"
    )
    table(
        rows,
        [
            ("label", "variant", None),
            ("ttft_s", "TTFT s", "{:.3f}"),
            ("ratio", "x stock", "{:.2f}"),
            ("transient_mib", "transient MiB/layer", "{:.1f}"),
            ("transient_ratio", "x stock", "{:.2f}"),
        ],
    )
    payload = {
        "model": about,
        "device": bench.device(),
        "load_average_1min_at_start": load_at_start,
        "rows": rows,
    }
    path = write_json(args.json, "next_turn", args, payload, started)
    print(f"\nwrote {path} ({time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
