"""Replays the failure users saw, with stock mlx-lm and with this package.

A tiny ``glm4_moe_lite`` serves requests sharing a prefix through one live cache
with KV quantization on, as LM Studio's engine does. Stock mlx-lm fails from the
first request past ``quantized_kv_start`` on, short ones too: the cache is broken.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import mlx.core as mx


def serve_requests(
    fixed,
    requests=12,
    prefix_tokens=40,
    max_tokens=16,
    kv_bits=4,
    quantized_kv_start=64,
):
    """Runs the request stream at library level and returns its figures."""
    import mlx_lm
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    from . import patches
    from . import tiny

    if fixed:
        patches.install()
    else:
        patches.uninstall()

    model, config = tiny.build_model("glm4_moe_lite", **tiny.DEMO_WIDTHS)
    vocab = config["vocab_size"]
    prefix = [(7 * i + 3) % vocab for i in range(prefix_tokens)]
    # One live cache reused across requests, as LM Studio's engine does.
    cache = make_prompt_cache(model)
    history = []
    served, errors, first_error, failed_short = 0, 0, None, 0
    bytes_per_token = measured_at = None

    for r in range(requests):
        # Most requests grow the conversation; every third one is short and
        # would never reach quantized_kv_start on its own.
        short = r % 3 == 2
        suffix = [(r * 13 + j) % vocab for j in range(2 if short else 4 + 6 * r)]
        prompt = prefix + suffix
        common = 0
        while (
            common < min(len(history), len(prompt) - 1)
            and history[common] == prompt[common]
        ):
            common += 1
        trim_prompt_cache(cache, cache[0].offset - common)
        try:
            tokens = list(prompt)
            for token, _ in generate_step(
                mx.array(prompt[common:]),
                model,
                prompt_cache=cache,
                max_tokens=max_tokens,
                kv_bits=kv_bits,
                quantized_kv_start=quantized_kv_start,
            ):
                tokens.append(token)
            history = tokens[: cache[0].offset]
            measured_at = cache[0].offset
            bytes_per_token = sum(c.nbytes for c in cache) / measured_at
            served += 1
        except Exception as e:
            errors += 1
            failed_short += short
            if first_error is None:
                first_error = f"{type(e).__name__}: {e}"
            # Start again from an empty cache, as a careful server would.
            trim_prompt_cache(cache, cache[0].offset)
            history = []

    return {
        "mlx_lm": mlx_lm.__version__,
        "fixed": fixed,
        "requests": requests,
        "served": served,
        "errors": errors,
        "failed_short_requests": failed_short,
        "first_error": first_error,
        "bytes_per_token": bytes_per_token,
        "measured_at": measured_at,
        "cache_class": type(cache[0]).__name__,
    }


def _stock_in_subprocess(args):
    env = dict(os.environ, MLX_LM_MLA_DISABLE="1")
    # An isolated interpreter (LM Studio's layers) runs its child isolated too.
    isolated = ["-I"] if sys.flags.isolated else []
    cmd = [sys.executable, *isolated, "-m", "mlx_lm_mla", "repro", "--json", "--stock"]
    cmd += ["--requests", str(args.requests), "--kv-bits", str(args.kv_bits)]
    cmd += ["--quantized-kv-start", str(args.quantized_kv_start)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = out.stdout.strip().splitlines()
    if not lines:
        raise RuntimeError(f"the stock run printed nothing:\n{out.stderr}")
    return json.loads(lines[-1])


def _table(stock, fixed):
    def cell(result, key):
        value = result[key]
        if key == "served":
            return f"{value} / {result['requests']}"
        if key == "bytes_per_token":
            return (
                "-" if value is None else f"{value:,.0f} at {result['measured_at']} tok"
            )
        return "-" if value is None else str(value)

    rows = [
        ("cache class", "cache_class"),
        ("requests served", "served"),
        ("errors", "errors"),
        ("short requests failed", "failed_short_requests"),
        ("cache bytes / token", "bytes_per_token"),
    ]
    left = f"stock mlx-lm {stock['mlx_lm']}"
    lines = [f"{'':24}{left:<22}with mlx-lm-mla"]
    for label, key in rows:
        lines.append(f"{label:<24}{cell(stock, key):<22}{cell(fixed, key)}")
    lines.append(f"first error, stock:     {cell(stock, 'first_error')}")
    lines.append(f"first error, fixed:     {cell(fixed, 'first_error')}")
    lines.append(
        "(cache bytes: memory held after the last request served, including the\n"
        " spare capacity caches grow by, 256 tokens at a time)"
    )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="mlx-lm-mla repro", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=12,
        help="requests sharing a prefix, served in turn (default: 12)",
    )
    parser.add_argument(
        "--kv-bits",
        type=int,
        default=4,
        help="KV cache bits, as --kv-bits (default: 4)",
    )
    parser.add_argument(
        "--quantized-kv-start",
        type=int,
        default=64,
        help="tokens cached before it is quantized (default: 64)",
    )
    parser.add_argument(
        "--stock", action="store_true", help="run stock mlx-lm only (the fix off)"
    )
    parser.add_argument(
        "--json", action="store_true", help="print the results as one JSON line"
    )
    args = parser.parse_args(argv)
    settings = dict(
        requests=args.requests,
        kv_bits=args.kv_bits,
        quantized_kv_start=args.quantized_kv_start,
    )

    if args.stock:
        result = serve_requests(fixed=False, **settings)
        print(json.dumps(result) if args.json else result)
        return 0 if result["errors"] == 0 else 1

    start = time.perf_counter()
    stock = _stock_in_subprocess(args)
    fixed = serve_requests(fixed=True, **settings)
    if args.json:
        print(json.dumps({"stock": stock, "fixed": fixed}))
    else:
        print(
            f"{args.requests} sequential requests sharing a prefix, prompt cache "
            f"reused, kv_bits={args.kv_bits}, quantized_kv_start="
            f"{args.quantized_kv_start}, tiny glm4_moe_lite\n"
        )
        print(_table(stock, fixed))
        print(f"\n({time.perf_counter() - start:.1f} s)")
    return 0 if fixed["errors"] == 0 else 1
