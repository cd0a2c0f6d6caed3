"""How far a quantized latent moves the logits, by how many positions the
attention reads.

Max |logit difference| against the unquantized cache, over several random
seeds, for a tiny GLM-4.7-Flash (dense attention over every position) and the
DSA models DeepSeek-V3.2 / GLM-5 at several ``index_topk`` (their attention
reads only the positions the indexer picks). Dense layers only, so MoE routing
flips do not hide the cache's own error; one layer for the DSA models, so the
indexer's picks cannot change. Prefill, quantize as ``generate_step`` does,
then decode one token at a time.

With ``--tf32`` every float32 matmul (``@``, ``mx.matmul``, ``mx.addmm``: the
models' linear layers, the RoPE-key scores, the decode fold) takes its inputs
rounded to TF32's 10-bit mantissa, as a GPU's tensor cores take them where
MLX lets float32 matmuls run as TF32 (CUDA by default): emulated here, on the
reference and the quantized run alike. MLX's attention kernel keeps float32.

    python benchmarks/fidelity.py            # ~30 s
    python benchmarks/fidelity.py --tf32 --json benchmarks/results/fidelity_tf32.json
"""

import argparse
import contextlib
import statistics
import time

from _common import progress, table, write_json

import mlx.core as mx
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import make_prompt_cache

import mlx_lm_mla
from mlx_lm_mla import tiny


def tf32(x):
    # Round to nearest (ties away from zero) at TF32's 10 mantissa bits.
    if not isinstance(x, mx.array) or x.dtype != mx.float32:
        return x
    bits = mx.view(x, mx.uint32) + mx.array(0x1000, mx.uint32)
    return mx.view(bits & mx.array(0xFFFFE000, mx.uint32), mx.float32)


@contextlib.contextmanager
def tf32_matmuls():
    """Every float32 matmul written in Python runs on TF32-rounded inputs."""
    matmul, addmm, operator = mx.matmul, mx.addmm, mx.array.__matmul__
    mx.matmul = lambda a, b, **k: matmul(tf32(a), tf32(b), **k)
    mx.addmm = lambda c, a, b, **k: addmm(c, tf32(a), tf32(b), **k)
    mx.array.__matmul__ = lambda a, b: operator(tf32(a), tf32(b))
    try:
        yield
    finally:
        mx.matmul, mx.addmm, mx.array.__matmul__ = matmul, addmm, operator


def decode_logits(model, tokens, prefill, bits):
    cache = make_prompt_cache(model)
    model(mx.array([tokens[:prefill]]), cache=cache)
    maybe_quantize_kv_cache(cache, quantized_kv_start=0, kv_group_size=64, kv_bits=bits)
    return mx.concatenate(
        [model(mx.array([[t]]), cache=cache) for t in tokens[prefill:]], axis=1
    )


def positions_read(k, prefill, end):
    # The indexer picks only once a step holds more than k positions.
    if k >= end:
        return "all"
    return str(k) if k <= prefill else f"all, then {k}"


def variants(topks, prefill, end):
    """(model type, positions read per step, config overrides)."""
    yield "glm4_moe_lite", "all", {"first_k_dense_replace": 99}
    for model_type in ("deepseek_v32", "glm_moe_dsa"):
        if model_type not in tiny.MLA_MODEL_TYPES:
            continue
        for k in topks:
            config = {
                "first_k_dense_replace": 99,
                "num_hidden_layers": 1,
                "index_topk": k,
            }
            if model_type == "deepseek_v32":
                config["rope_scaling"] = None  # as glm4_moe_lite's
            yield model_type, positions_read(k, prefill, end), config


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--seeds", type=int, default=8, help="random models per variant"
    )
    parser.add_argument("--prefill", type=int, default=96)
    parser.add_argument("--decode", type=int, default=48)
    parser.add_argument("--topk", type=int, nargs="+", default=[16, 32, 48, 96])
    parser.add_argument(
        "--tf32", action="store_true", help="float32 matmuls on TF32-rounded inputs"
    )
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    started = time.perf_counter()
    mlx_lm_mla.install()
    with tf32_matmuls() if args.tf32 else contextlib.nullcontext():
        rows = measure(args)
    print(
        f"max |logit difference|, {args.prefill} tokens prefilled and quantized, "
        f"{args.decode} decoded; median and largest over seeds 0-{args.seeds - 1}"
        + (", float32 matmuls on TF32-rounded inputs" if args.tf32 else "")
    )
    table(
        rows,
        [
            ("model", "model", None),
            ("read", "positions read", None),
            ("median8", "8-bit median", "{:.4f}"),
            ("max8", "8-bit max", "{:.4f}"),
            ("median4", "4-bit median", "{:.4f}"),
            ("max4", "4-bit max", "{:.4f}"),
        ],
    )
    payload = {
        "rows": [
            {k if isinstance(k, str) else f"bits{k}": v for k, v in r.items()}
            for r in rows
        ]
    }
    print("wrote", write_json(args.json, "fidelity", args, payload, started))


def measure(args):
    tokens = [(5 * i + 7) % 190 + 5 for i in range(args.prefill + args.decode)]
    rows = []
    variant_list = list(variants(args.topk, args.prefill, len(tokens)))
    for model_type, read, config in progress(variant_list, desc="variants"):
        row = {"model": model_type, "read": read}
        for seed in range(args.seeds):
            model, _ = tiny.build_model(model_type, seed=seed, **config)
            reference = decode_logits(model, tokens, args.prefill, None)
            for bits in (8, 4):
                diff = (
                    mx.abs(decode_logits(model, tokens, args.prefill, bits) - reference)
                    .max()
                    .item()
                )
                row.setdefault(bits, []).append(diff)
        for bits in (8, 4):
            row[f"median{bits}"], row[f"max{bits}"] = (
                statistics.median(row[bits]),
                max(row[bits]),
            )
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
