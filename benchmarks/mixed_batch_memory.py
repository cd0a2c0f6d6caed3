"""Memory of a batch whose rows are quantized each on its own, against
uniform batches (``BatchMixedLatentCache``, ``mlx_lm.server --kv-bits``).

A row's precision depends on that row alone, so a batch can hold rows of
both kinds; while it does, it keeps the latent as every row reads it beside
the quantized bytes of every row. These are the bytes such a batch holds
for one MLA layer at GLM-4.7-Flash's widths (latent 512, RoPE key 64,
bfloat16), 4-bit groups of 64: exact figures (``nbytes``), not timings.

    python benchmarks/mixed_batch_memory.py [--rows 4] [--tokens 4096]
"""

import argparse
import time

import _common  # noqa: F401 (this tree's mlx_lm_mla first)
import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

import mlx_lm_mla
from mlx_lm_mla.cache import quantize_rows

GLM = _common.GLM_4_7_FLASH


def batch(rows, tokens):
    singles = []
    for _ in range(rows):
        c = KVCache()
        c.update_and_fetch(
            mx.zeros((1, 1, tokens, GLM["kv_lora_rank"]), mx.bfloat16),
            mx.zeros((1, 1, tokens, GLM["qk_rope_head_dim"]), mx.bfloat16),
        )
        singles.append(c)
    return BatchKVCache.merge(singles)


def held(rows, tokens, quantized):
    b = batch(rows, tokens)
    quantize_rows(b, list(range(quantized)), 64, 4)
    mx.eval(
        b.state if quantized in (0, rows) else (b.keys, b.packed.keys, b.packed.values)
    )
    return type(b).__name__, b.nbytes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument(
        "--json",
        default=None,
        help="default: benchmarks/results/mixed_batch_memory.json",
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    mlx_lm_mla.install()
    exact = held(args.rows, args.tokens, 0)[1]
    rows = []
    for q in range(args.rows + 1):
        name, n = held(args.rows, args.tokens, q)
        rows.append(
            dict(quantized=q, cls=name, bytes=n, bytes_mib=n / 2**20, ratio=n / exact)
        )
    print(
        f"{args.rows} rows of {args.tokens} tokens, one MLA layer (x{GLM['layers']} for the model)\n"
    )
    _common.table(
        rows,
        [
            ("quantized", "rows quantized", None),
            ("cls", "cache", None),
            ("bytes_mib", "MiB per layer", "{:.2f}"),
            ("ratio", "against all exact", "{:.2f}"),
        ],
    )
    path = _common.write_json(
        args.json, "mixed_batch_memory", args, {"rows": rows}, started
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
