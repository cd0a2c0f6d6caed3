"""Decode speed of MLA layers: the package's decode attention against stock
mlx-lm's, bf16 and with a quantized latent.

A ``glm4_moe_lite`` with GLM-4.7-Flash's attention widths (latent 512, RoPE
key 64, 20 heads, nope 192, v 256), ``--layers`` dense layers, hidden size
256, random weights, bfloat16. Each layer's cache holds ``--batches`` rows
of the context (random latents written by ``update_and_fetch`` in chunks of
2,048 tokens, as a prefill writes them), quantized in place for ``ours8`` /
``ours4`` (group 64). Variants, interleaved (the order rotates every
repetition):

- ``stock``: the package off: mlx-lm's ``KVCache`` and its attention, bf16;
  the baseline (stock cannot decode a quantized MLA cache at all);
- ``ours``: the package on, bf16;
- ``ours8`` / ``ours4``: the package on, the latent quantized at 8 / 4 bits;
- ``portable`` / ``portable8`` / ``portable4``: the same with the CUDA decode
  kernel off (``decode_cuda.ENABLED``), on MLX's CUDA backend only, where
  ``ours`` runs the kernel; elsewhere they would repeat ``ours``.

Two measurements per context and batch:

- decode: tokens per second of the whole model (``--steps`` single-token
  steps after ``--warmup``, ``mx.eval`` of each step's logits), and the
  step's transient: MLX's peak memory during the steps beyond what was held
  before them, per layer;
- attention: one layer's decode attention alone (``update_and_fetch`` of one
  token, the RoPE-key scores, and the model module's
  ``scaled_dot_product_attention``, which the package replaces), in ms, and
  GB/s: the cache bytes a step must read at least (the floor: bytes per
  token x positions x rows) over its time.

Figures are medians over ``--reps``; ratios are against ``stock``.

    python benchmarks/decode_speed.py                       # CPU: 4K, 16K, batch 1
    python benchmarks/decode_speed.py --contexts 4096 --batches 8
    python benchmarks/decode_speed.py --contexts 4096 32768 131072 --batches 1 8   # a GPU
"""

import argparse
import sys
import time

import _common  # noqa: F401  (puts the repository root on sys.path)
from _common import (
    GLM_4_7_FLASH,
    glm_attention_model,
    load_average,
    median,
    progress,
    table,
    write_json,
)

import mlx.core as mx
from mlx_lm.models.cache import KVCache

import mlx_lm_mla
from mlx_lm_mla import decode_cuda

KERNEL = decode_cuda.ENABLED  # as MLX_LM_MLA_CUDA_KERNEL left it
FILL_STEP = 2048
GROUP_SIZE = 64
VARIANT_BITS = {"stock": None, "ours": None, "ours8": 8, "ours4": 4}
VARIANT_BITS.update(portable=None, portable8=8, portable4=4)
# Targets of issue 30 (CPU, 16K positions, batch 1): tokens/s over stock's.
TARGETS = {(16384, 1): {"ours": 2.0, "ours8": 1.8, "ours4": 1.8}}


def floor_bytes(variant):
    """Bytes per token per layer a decode step reads at least."""
    latent, rope = GLM_4_7_FLASH["kv_lora_rank"], GLM_4_7_FLASH["qk_rope_head_dim"]
    bits = VARIANT_BITS[variant]
    if bits is None:
        return (latent + rope) * 2
    return latent * bits // 8 + 2 * (latent // GROUP_SIZE) * 2 + rope * 2


def switch(variant):
    # stock is mlx-lm as published; the others run with the package.
    if variant == "stock":
        mlx_lm_mla.uninstall()
    else:
        mlx_lm_mla.install()
    decode_cuda.ENABLED = KERNEL and not variant.startswith("portable")


def filled_cache(model, context, batch, variant):
    cache = [KVCache() for _ in model.layers]
    shape, done = GLM_4_7_FLASH, 0
    while done < context:
        n = min(FILL_STEP, context - done)
        latent = mx.random.normal((batch, 1, n, shape["kv_lora_rank"])).astype(
            mx.bfloat16
        )
        rope = mx.random.normal((batch, 1, n, shape["qk_rope_head_dim"])).astype(
            mx.bfloat16
        )
        for c in cache:
            c.update_and_fetch(latent, rope)
        mx.eval([c.state for c in cache])
        done += n
    bits = VARIANT_BITS[variant]
    if bits is not None:  # in place, as maybe_quantize_kv_cache does
        cache = [c.to_quantized(group_size=GROUP_SIZE, bits=bits) for c in cache]
        mx.eval([c.state for c in cache])
    return cache


def decode(model, cache, batch, steps, first):
    for i in range(steps):
        token = mx.array([[(first + i + 7 * b) % 240 + 10] for b in range(batch)])
        mx.eval(model(token, cache=cache))


def run_decode(model, args, context, batch, variant):
    """(tokens per second, transient bytes per layer)."""
    switch(variant)
    cache = filled_cache(model, context, batch, variant)
    decode(model, cache, batch, args.warmup, 0)
    mx.synchronize()
    held = mx.get_active_memory()
    mx.reset_peak_memory()
    start = time.perf_counter()
    decode(model, cache, batch, args.steps, args.warmup)
    seconds = time.perf_counter() - start
    transient = (mx.get_peak_memory() - held) / len(model.layers)
    return batch * args.steps / seconds, transient


def run_attention(model, args, context, batch, variant):
    """Milliseconds per decode attention step of one layer."""
    import importlib

    switch(variant)
    attention = model.layers[0].self_attn
    sdpa = importlib.import_module(
        type(attention).__module__
    ).scaled_dot_product_attention
    shape = GLM_4_7_FLASH
    heads, width, rope_width = (
        shape["heads"],
        shape["kv_lora_rank"],
        shape["qk_rope_head_dim"],
    )
    cache = filled_cache(model, context, batch, variant)[0]
    q = mx.random.normal((batch, heads, 1, width)).astype(mx.bfloat16)
    q_pe = mx.random.normal((batch, heads, 1, rope_width)).astype(mx.bfloat16)
    latent = mx.random.normal((batch, 1, 1, width)).astype(mx.bfloat16)
    rope = mx.random.normal((batch, 1, 1, rope_width)).astype(mx.bfloat16)
    mx.eval(q, q_pe, latent, rope)
    times = []
    for i in range(args.attention_calls + 1):
        start = time.perf_counter()
        kv, pe = cache.update_and_fetch(latent, rope)
        scores = (q_pe * 0.1) @ pe.swapaxes(-1, -2)
        mx.eval(sdpa(q, kv, kv, cache=cache, scale=0.1, mask=scores))
        seconds = time.perf_counter() - start
        del kv, pe, scores
        cache.trim(1)  # the same context every call
        if i:
            times.append(seconds)
    return median(times) * 1e3


def rotated(variants, rep):
    k = rep % len(variants)
    return variants[k:] + variants[:k]


def main():
    started = time.perf_counter()
    load_at_start = load_average()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--batches", type=int, nargs="+", default=[1])
    variants = [v for v in VARIANT_BITS if decode_cuda.available() or "port" not in v]
    p.add_argument(
        "--variants", nargs="+", default=variants, choices=list(VARIANT_BITS)
    )
    p.add_argument(
        "--steps", type=int, default=6, help="timed decode steps per repetition"
    )
    p.add_argument(
        "--warmup", type=int, default=2, help="untimed decode steps before them"
    )
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--attention-calls",
        type=int,
        default=4,
        help="calls timed per attention repetition",
    )
    p.add_argument("--no-attention", action="store_true", help="the decode table only")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument(
        "--chunk-bytes",
        type=int,
        default=None,
        help="bytes per chunk (default: decode.CHUNK_BYTES)",
    )
    p.add_argument(
        "--json", default=None, help="default: benchmarks/results/decode_speed.json"
    )
    args = p.parse_args()
    if "stock" not in args.variants:
        args.variants.insert(0, "stock")
    if args.chunk_bytes:
        from mlx_lm_mla import decode as decode_module

        decode_module.CHUNK_BYTES = dict.fromkeys(("cpu", "gpu"), args.chunk_bytes)
    mx.random.seed(0)
    model, config = glm_attention_model(args.layers, mx.bfloat16)
    device = str(mx.default_device())
    print(
        f"model: glm4_moe_lite, {args.layers} dense layers, bfloat16, GLM-4.7-Flash attention "
        f"widths; device {device}; load average {load_average():.2f}",
        file=sys.stderr,
    )
    for v in args.variants:  # warm up every path
        run_decode(model, argparse.Namespace(warmup=1, steps=1), 512, 1, v)

    kinds = [("decode", run_decode)] + (
        [] if args.no_attention else [("attention", run_attention)]
    )
    jobs = [
        (kind, fn, ctx, b, v)
        for kind, fn in kinds
        for ctx in args.contexts
        for b in args.batches
        for r in range(args.reps)
        for v in rotated(args.variants, r)
    ]
    samples = {}
    bar = progress(total=len(jobs), desc="runs")
    for kind, fn, ctx, b, v in jobs:
        bar.set_postfix_str(f"{kind} {ctx} x{b} {v}")
        samples.setdefault((kind, ctx, b), {}).setdefault(v, []).append(
            fn(model, args, ctx, b, v)
        )
        bar.update()
    bar.close()
    mlx_lm_mla.uninstall()

    decode_rows, attention_rows = [], []
    for (kind, ctx, b), runs in samples.items():
        if kind == "decode":
            base = median([s[0] for s in runs["stock"]])
            for v in args.variants:
                speed = median([s[0] for s in runs[v]])
                row = dict(
                    context=ctx,
                    batch=b,
                    variant=v,
                    tokens_per_s=speed,
                    ratio=speed / base,
                    transient_mib=median([s[1] for s in runs[v]]) / 2**20,
                    samples=[s[0] for s in runs[v]],
                )
                target = TARGETS.get((ctx, b), {}).get(v)
                if target is not None:
                    row.update(target=target, met=row["ratio"] >= target)
                decode_rows.append(row)
        else:
            base = median(runs["stock"])
            for v in args.variants:
                ms = median(runs[v])
                floor = floor_bytes(v) * ctx * b
                attention_rows.append(
                    dict(
                        context=ctx,
                        batch=b,
                        variant=v,
                        ms=ms,
                        speed=base / ms,
                        floor_mb=floor / 1e6,
                        gb_per_s=floor / ms / 1e6,
                        samples=runs[v],
                    )
                )

    print(
        f"\ndecode: tokens/s of the whole model, median of {args.reps}, variants interleaved; "
        f"{args.steps} steps after {args.warmup}; transient: peak memory beyond what the "
        f"steps started with, per layer; device {device}\n"
    )
    table(
        decode_rows,
        [
            ("context", "context", "{:,}"),
            ("batch", "batch", None),
            ("variant", "variant", None),
            ("tokens_per_s", "tok/s", "{:.2f}"),
            ("ratio", "x stock", "{:.2f}"),
            ("transient_mib", "transient MiB", "{:.1f}"),
            ("target", "target", ">= {:.1f}"),
            ("met", "met", None),
        ],
    )
    if attention_rows:
        print(
            "\nattention: one layer's decode attention (update_and_fetch, RoPE-key scores, "
            "scaled_dot_product_attention), ms per call, median; GB/s = the cache bytes a "
            "step reads at least / its time\n"
        )
        table(
            attention_rows,
            [
                ("context", "context", "{:,}"),
                ("batch", "batch", None),
                ("variant", "variant", None),
                ("ms", "ms", "{:.2f}"),
                ("speed", "x stock", "{:.2f}"),
                ("floor_mb", "floor MB", "{:.1f}"),
                ("gb_per_s", "GB/s", "{:.2f}"),
            ],
        )
    payload = {
        "model": {"model_type": "glm4_moe_lite", "config": config},
        "device": device,
        "load_average_1min_at_start": load_at_start,
        "decode_rows": decode_rows,
        "attention_rows": attention_rows,
    }
    path = write_json(args.json, "decode_speed", args, payload, started)
    print(f"\nwrote {path} ({time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
