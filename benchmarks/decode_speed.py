"""Decode and prefill speed: our latent caches against mlx-lm's stock KVCache.

A GLM-4.7-Flash shaped model with the real attention widths (kv_lora_rank
512, qk_rope_head_dim 64, 20 heads, qk_nope_head_dim 192, v_head_dim 256),
few layers (2) and small MLP widths, random weights (``mlx_lm_mla.tiny``).
The layers are dense (``first_k_dense_replace=99``) so the model runs in
bfloat16, the real model dtype: on the MLX CPU backend the MoE layers
need float32 (``GatherMM`` only supports float32); ``--moe --dtype float32``
runs them.

Variants: ``stock`` (the ``KVCache`` per layer mlx-lm gives an MLA model,
bfloat16: the baseline), ``ours8`` / ``ours4`` (the same ``KVCache``
quantized in place into a ``QuantizedLatentCache`` after the prefill, group
size 64; each step also calls ``to_quantized`` on every layer, as
``generate_step`` does with ``kv_bits``), and ``ours`` (unquantized with the
package installed: stock's own code, so off by default). Stock mlx-lm with
``kv_bits`` crashes MLA models, so the quantized variants are compared with
the unquantized stock cache.

Decode: the cache is filled to the context (by default with random latent
and RoPE-key arrays of the real widths, written by ``update_and_fetch`` in
chunks of 2048 tokens as a prefill writes them; ``--fill model`` runs the
real prefill instead), then ``--warmup`` steps (they include the buffer
growth, which both caches do once every 256 tokens), then ``--steps``
single-token steps are timed, ``mx.eval`` on each step's logits.

Prefill (``--prefill-contexts``): the real model over the context, chunked
like ``generate_step``.

Layer step: one layer's decode attention without the rest of the model:
``update_and_fetch`` of one token, the RoPE-key scores and
``scaled_dot_product_attention`` over the latent, as the absorbed MLA decode
path runs them; milliseconds per call.

Cache step: ``update_and_fetch`` of one token alone (plus the per-step
``to_quantized`` call of the quantized variants) and ``mx.eval`` of what it
returns; microseconds per call. The quantized caches dequantize the whole
latent on every fetch, so this is where they differ.

Variants are interleaved (the order rotates every repetition) and the
figures are medians over repetitions; the ratio is ours / stock.
Targets: 8-bit and 4-bit decode >= 0.95x stock at 4K and 16K positions.

    python benchmarks/decode_speed.py
    python benchmarks/decode_speed.py --contexts 4096 16384 --steps 16 --reps 4
"""

import argparse
import sys
import time

import _common  # noqa: F401  (puts the repository root on sys.path)
from _common import GLM_4_7_FLASH, glm_attention_model, load_average, median, progress, table, write_json

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

import mlx_lm_mla

DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
PREFILL_STEP = 2048
GROUP_SIZE = 64
VARIANT_BITS = {"stock": None, "ours": None, "ours8": 8, "ours4": 4}
TARGETS = {"ours": 0.98, "ours8": 0.95, "ours4": 0.95}
TARGET_UP_TO = 16384  # the decode targets hold at 4K and 16K positions


def build(args):
    return glm_attention_model(args.layers, DTYPES[args.dtype], args.hidden_size, args.q_lora_rank, args.moe)


def check_cache_classes(model):
    """The lists built here are what make_prompt_cache gives, with and
    without the package."""
    mlx_lm_mla.uninstall()
    stock = {type(c).__name__ for c in make_prompt_cache(model)}
    mlx_lm_mla.install()
    ours = {type(c).__name__ for c in make_prompt_cache(model)}
    # Left installed: the quantized variants quantize through it.
    assert stock == ours == {"KVCache"}, (stock, ours)
    return {"stock": sorted(stock), "ours": sorted(ours)}


def new_cache(model, variant):
    # Stock's class for every variant; the quantized ones turn in place.
    return [KVCache() for _ in model.layers]


def quantize(cache, variant):
    bits = VARIANT_BITS[variant]
    if bits is not None:
        for i, c in enumerate(cache):
            cache[i] = c.to_quantized(group_size=GROUP_SIZE, bits=bits)
        mx.eval([c.state for c in cache])


def tokens_for(n, offset=0):
    return mx.array([[(7 * i + 3 * offset) % 240 + 10 for i in range(n)]])


def prefill(model, cache, tokens):
    """generate_step's prompt processing. Returns the last token's logits."""
    n = tokens.shape[1]
    done = 0
    while n - done > 1:
        k = min(PREFILL_STEP, n - done - 1)
        model(tokens[:, done : done + k], cache=cache)
        mx.eval([c.state for c in cache])
        mx.clear_cache()
        done += k
    logits = model(tokens[:, done:], cache=cache)[:, -1, :]
    mx.eval(logits)
    return logits


def synthetic_fill(cache, context, dtype):
    """Writes context tokens of random latent / RoPE key into every layer, in
    the chunks a prefill writes."""
    shape = GLM_4_7_FLASH
    done = 0
    while done < context:
        k = min(PREFILL_STEP, context - done)
        latent = mx.random.normal((1, 1, k, shape["kv_lora_rank"])).astype(dtype)
        rope = mx.random.normal((1, 1, k, shape["qk_rope_head_dim"])).astype(dtype)
        for c in cache:
            c.update_and_fetch(latent, rope)
        mx.eval([c.state for c in cache])
        done += k


def decode(model, cache, variant, steps, start_token):
    bits = VARIANT_BITS[variant]
    for i in range(steps):
        logits = model(mx.array([[(start_token + i) % 240 + 10]]), cache=cache)[:, -1, :]
        if bits is not None:
            # What generate_step's maybe_quantize_kv_cache does every step.
            for j, c in enumerate(cache):
                cache[j] = c.to_quantized(group_size=GROUP_SIZE, bits=bits)
        mx.eval(logits)


def run_decode(model, args, context, variant, rep):
    dtype = DTYPES[args.dtype]
    cache = new_cache(model, variant)
    if args.fill == "model":
        prefill(model, cache, tokens_for(context, rep))
    else:
        synthetic_fill(cache, context, dtype)
    quantize(cache, variant)
    decode(model, cache, variant, args.warmup, 0)
    t0 = time.perf_counter()
    decode(model, cache, variant, args.steps, args.warmup)
    dt = time.perf_counter() - t0
    assert cache[0].offset == context + args.warmup + args.steps
    return args.steps / dt


def run_prefill(model, args, context, variant, rep):
    cache = new_cache(model, variant)
    tokens = tokens_for(context, rep)
    mx.eval(tokens)
    t0 = time.perf_counter()
    prefill(model, cache, tokens)
    dt = time.perf_counter() - t0
    return context / dt


def run_cache_step(model, args, context, variant, rep):
    """Microseconds per update_and_fetch(1 token) + eval, one layer."""
    dtype = DTYPES[args.dtype]
    shape = GLM_4_7_FLASH
    cache = new_cache(model, variant)[:1]
    synthetic_fill(cache, context, dtype)
    quantize(cache, variant)
    bits = VARIANT_BITS[variant]
    latent = mx.random.normal((1, 1, 1, shape["kv_lora_rank"])).astype(dtype)
    rope = mx.random.normal((1, 1, 1, shape["qk_rope_head_dim"])).astype(dtype)
    mx.eval(latent, rope)
    times = []
    for i in range(args.cache_calls + 2):
        t0 = time.perf_counter()
        out = cache[0].update_and_fetch(latent, rope)
        if bits is not None:
            cache[0] = cache[0].to_quantized(group_size=GROUP_SIZE, bits=bits)
        mx.eval(out)
        dt = time.perf_counter() - t0
        # The model drops what a layer fetched before its next step; holding
        # it would make every later write copy the buffers it views.
        del out
        if i >= 2:
            times.append(dt)
    return median(times) * 1e6


def run_layer_step(model, args, context, variant, rep):
    """Milliseconds per decode step of one layer's attention over its cache:
    update_and_fetch of one token, the RoPE-key scores and the attention over
    the latent, as the absorbed MLA decode path runs them."""
    from mlx_lm.models.base import scaled_dot_product_attention

    dtype, shape = DTYPES[args.dtype], GLM_4_7_FLASH
    heads, width, rope_width = shape["heads"], shape["kv_lora_rank"], shape["qk_rope_head_dim"]
    cache = new_cache(model, variant)[:1]
    synthetic_fill(cache, context, dtype)
    quantize(cache, variant)
    q = mx.random.normal((1, heads, 1, width)).astype(dtype)
    q_pe = mx.random.normal((1, heads, 1, rope_width)).astype(dtype)
    latent = mx.random.normal((1, 1, 1, width)).astype(dtype)
    rope = mx.random.normal((1, 1, 1, rope_width)).astype(dtype)
    mx.eval(q, q_pe, latent, rope)
    times = []
    for i in range(args.layer_calls + 1):
        t0 = time.perf_counter()
        kv, pe = cache[0].update_and_fetch(latent, rope)
        scores = (q_pe * 0.1) @ pe.swapaxes(-1, -2)
        out = scaled_dot_product_attention(q, kv, kv, cache=None, scale=0.1, mask=scores)
        mx.eval(out)
        dt = time.perf_counter() - t0
        del kv, pe, scores, out
        cache[0].trim(1)  # the same context every call
        if i >= 1:
            times.append(dt)
    return median(times) * 1e3


def rotated(variants, rep):
    k = rep % len(variants)
    return variants[k:] + variants[:k]


def summarize(kind, context, samples, variants):
    rows = []
    stock = median(samples["stock"])
    for v in variants:
        m = median(samples[v])
        row = dict(
            kind=kind,
            context=context,
            variant=v,
            tokens_per_s=m,
            min=min(samples[v]),
            max=max(samples[v]),
            reps=len(samples[v]),
            samples=samples[v],
        )
        if v != "stock":
            row["ratio"] = m / stock
            paired = [a / b for a, b in zip(samples[v], samples["stock"])]
            row["paired_ratio_min"], row["paired_ratio_max"] = min(paired), max(paired)
            target = TARGETS.get(v) if kind == "decode" and context <= TARGET_UP_TO else None
            if target is not None:
                row["target"] = target
                row["met"] = row["ratio"] >= target
        rows.append(row)
    return rows


def main():
    started = time.perf_counter()
    load_at_start = load_average()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768], help="decode contexts (default: 4096 16384 32768)")
    p.add_argument("--prefill-contexts", type=int, nargs="*", default=[], help="prefill contexts (default: none; 4096 takes minutes per run on a 2-core CPU)")
    p.add_argument("--variants", nargs="+", default=["stock", "ours8", "ours4"], choices=list(VARIANT_BITS))
    p.add_argument("--prefill-variants", nargs="+", default=["ours", "stock"], choices=["ours", "stock"])
    p.add_argument("--steps", type=int, default=8, help="timed decode steps per repetition")
    p.add_argument("--warmup", type=int, default=2, help="untimed decode steps before them")
    p.add_argument("--reps", type=int, default=3, help="decode repetitions per variant")
    p.add_argument("--prefill-reps", type=int, default=3)
    p.add_argument("--cache-calls", type=int, default=16, help="calls timed per cache-step repetition")
    p.add_argument("--layer-calls", type=int, default=4, help="calls timed per layer-step repetition")
    p.add_argument("--fill", choices=["synthetic", "model"], default="synthetic", help="how the decode cache is filled")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument("--moe", action="store_true", help="keep the MoE layers (needs --dtype float32 on CPU)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--q-lora-rank", type=int, default=64)
    p.add_argument("--json", default=None, help="default: benchmarks/results/decode_speed.json")
    args = p.parse_args()
    if "stock" not in args.variants:
        args.variants.append("stock")
    if "stock" not in args.prefill_variants:
        args.prefill_variants.append("stock")
    mx.random.seed(0)

    model, config = build(args)
    classes = check_cache_classes(model)
    dtype_used = str(model.layers[0].self_attn.kv_a_proj_with_mqa.weight.dtype)
    print(
        f"model: glm4_moe_lite, {args.layers} layers, {'MoE' if args.moe else 'dense'}, "
        f"{dtype_used}, hidden {args.hidden_size}, attention widths of GLM-4.7-Flash; "
        f"device {mx.default_device()}; load average {load_average():.2f}",
        file=sys.stderr,
    )
    # Warm up both cache types and the model's kernels.
    for v in ("stock", "ours", "ours8"):
        c = new_cache(model, v)
        prefill(model, c, tokens_for(64))
        quantize(c, v)
        decode(model, c, v, 2, 0)

    rows = []
    jobs = [("prefill", ctx, v, r) for ctx in args.prefill_contexts for r in range(args.prefill_reps) for v in rotated(args.prefill_variants, r)]
    jobs += [("decode", ctx, v, r) for ctx in args.contexts for r in range(args.reps) for v in rotated(args.variants, r)]
    jobs += [("cache step", ctx, v, r) for ctx in args.contexts for r in range(args.reps) for v in rotated(args.variants, r)]
    jobs += [("layer step", ctx, v, r) for ctx in args.contexts for r in range(args.reps) for v in rotated(args.variants, r)]
    samples = {}
    bar = progress(total=len(jobs), desc="runs")
    for kind, ctx, v, r in jobs:
        bar.set_postfix_str(f"{kind} {ctx} {v}")
        fn = {"prefill": run_prefill, "decode": run_decode, "cache step": run_cache_step, "layer step": run_layer_step}[kind]
        samples.setdefault((kind, ctx), {}).setdefault(v, []).append(fn(model, args, ctx, v, r))
        bar.update()
    bar.close()
    step_rows, layer_rows = [], []
    for (kind, ctx), s in samples.items():
        variants = args.prefill_variants if kind == "prefill" else args.variants
        into = {"cache step": step_rows, "layer step": layer_rows}.get(kind, rows)
        into.extend(summarize(kind, ctx, s, variants))

    print(
        f"\ntokens/s, median of {args.reps} decode / {args.prefill_reps} prefill repetitions, "
        f"variants interleaved; {dtype_used}, {args.layers} layers, decode = {args.steps} steps "
        f"after {args.warmup} warmup, decode cache filled: {args.fill}\n"
    )
    table(
        rows,
        [
            ("kind", "kind", None),
            ("context", "context", "{:,}"),
            ("variant", "variant", None),
            ("tokens_per_s", "tok/s", "{:.2f}"),
            ("min", "min", "{:.2f}"),
            ("max", "max", "{:.2f}"),
            ("ratio", "ours/stock", "{:.3f}"),
            ("paired_ratio_min", "paired min", "{:.3f}"),
            ("paired_ratio_max", "paired max", "{:.3f}"),
            ("target", "target", ">= {:.2f}"),
            ("met", "met", None),
        ],
    )
    print(
        f"\ncache step: one layer's update_and_fetch(1 token) + eval (+ to_quantized for "
        f"ours8/ours4), microseconds per call, median; ratio = ours / stock time\n"
    )
    for r in step_rows:
        r["us_per_call"] = r.pop("tokens_per_s")
        r["min_us"], r["max_us"] = r.pop("min"), r.pop("max")
    table(
        step_rows,
        [
            ("context", "context", "{:,}"),
            ("variant", "variant", None),
            ("us_per_call", "us/call", "{:.1f}"),
            ("min_us", "min", "{:.1f}"),
            ("max_us", "max", "{:.1f}"),
            ("ratio", "ours/stock", "{:.2f}"),
            ("paired_ratio_min", "paired min", "{:.2f}"),
            ("paired_ratio_max", "paired max", "{:.2f}"),
        ],
    )
    print(
        "\nlayer step: one layer's decode attention (update_and_fetch of 1 token + RoPE-key "
        "scores + scaled_dot_product_attention over the latent), ms per call, median; "
        "ratio = stock time / ours time (speed relative to bf16)\n"
    )
    for r in layer_rows:
        r["ms_per_call"] = r.pop("tokens_per_s")
        if "ratio" in r:
            r["speed"] = 1 / r["ratio"]
    table(
        layer_rows,
        [
            ("context", "context", "{:,}"),
            ("variant", "variant", None),
            ("ms_per_call", "ms/call", "{:.2f}"),
            ("speed", "speed vs bf16", "{:.3f}"),
        ],
    )
    payload = {
        "model": {"model_type": "glm4_moe_lite", "dtype": dtype_used, "config": config},
        "cache_classes_from_make_prompt_cache": classes,
        "load_average_1min_at_start": load_at_start,
        "rows": rows,
        "cache_step_rows": step_rows,
        "layer_step_rows": layer_rows,
    }
    path = write_json(args.json, "decode_speed", args, payload, started)
    print(f"\nwrote {path} ({time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
