"""Cache bytes per token at real MLA layer widths, against the exact floor.

For GLM-4.7-Flash and DeepSeek-V3 layer shapes, fills one layer's cache with
random arrays of the real widths the way generation does (a prefill in chunks
of 2048 tokens, then --tail single-token decode steps; quantized caches are
quantized after the prefill, as ``quantized_kv_start`` does) and multiplies by
the number of layers. No model weights are needed. Measured per cache:

- ``nbytes`` (what the cache reports, what mlx-lm's prompt-cache LRU counts);
- the growth of MLX's active memory while building it (what it really holds,
  including buffers kept alive by views).

Compared against the floor, the exact bytes of the stored elements (latent +
RoPE key in the model dtype; or packed latent + scales + biases + RoPE key).
Target for our caches: at most 1 % over the floor plus one growth step (256
tokens) of padding.

Our caches are stock's, quantized in place: ``KVCache`` -> ``QuantizedLatentCache``
and, merged, ``BatchKVCache`` -> ``BatchQuantizedLatentCache``.

Also: per rank across machines (``mlx.launch``, ``sharded_load``): under
tensor parallel every rank holds the whole latent of every layer (one latent
head cannot be split over ranks), under pipeline each rank holds the layers
it runs, split as mlx-lm splits them (evenly, the low ranks taking the extra
layer); computed from the measured bytes per layer at the largest N
(``--ranks``, default 2 4). And: a batch of sequences of different lengths merged (left padded to the
longest), bytes per real token; and a rolling window (``RotatingKVCache``,
what ``make_prompt_cache(model, max_kv_size=W)`` gives), which must hold W
tokens whatever N is, quantized or not.

    python benchmarks/bytes_per_token.py
    python benchmarks/bytes_per_token.py --tokens 1000 4096 32768 --batch 4000 2800 1200 200 --window 2048
"""

import argparse
import gc
import sys
import time

import _common  # noqa: F401  (puts the repository root on sys.path)
from _common import (
    DEEPSEEK_V3,
    DEEPSEEK_V3_2,
    GLM_4_7_FLASH,
    GLM_5,
    active_memory,
    cache_arrays,
    table,
    write_json,
)

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

import mlx_lm_mla

mlx_lm_mla.install()  # to_quantized of a latent-layout cache quantizes in place

DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
STEP = 256  # the growth step of mlx-lm's KVCache and of our caches
PREFILL_STEP = 2048


def floor_bytes(shape, dtype_bytes, bits=None, group_size=64):
    """Exact bytes per token per layer of the stored elements."""
    lat, rope = shape["kv_lora_rank"], shape["qk_rope_head_dim"]
    if bits is None:
        return (lat + rope) * dtype_bytes
    return lat * bits / 8 + 2 * (lat // group_size) * dtype_bytes + rope * dtype_bytes


def expanded_bytes(shape, dtype_bytes):
    """Per token per layer of standard attention's per-head K and V."""
    h = shape["heads"]
    return (
        h
        * (shape["qk_nope_head_dim"] + shape["qk_rope_head_dim"] + shape["v_head_dim"])
        * dtype_bytes
    )


def _eval_cache(cache):
    mx.eval(cache_arrays(cache))


def fill(cache, widths, rows, n, tail, dtype, bits=None, group_size=64):
    """Writes n tokens: prefill of n - tail in chunks, then tail single steps.
    widths: (key width, value width), heads: from widths[2] (1 for MLA)."""
    kw, vw, heads = widths
    prefill = max(n - tail, 0)
    done = 0
    while done < prefill:
        L = min(PREFILL_STEP, prefill - done)
        k = mx.random.normal((rows, heads, L, kw)).astype(dtype)
        v = mx.random.normal((rows, heads, L, vw)).astype(dtype)
        out = cache.update_and_fetch(k, v)
        mx.eval(out)
        del k, v, out
        _eval_cache(cache)
        done += L
    if bits is not None:
        cache = cache.to_quantized(group_size=group_size, bits=bits)
        _eval_cache(cache)
    while done < n:
        k = mx.random.normal((rows, heads, 1, kw)).astype(dtype)
        v = mx.random.normal((rows, heads, 1, vw)).astype(dtype)
        out = cache.update_and_fetch(k, v)
        mx.eval(out)
        del k, v, out
        _eval_cache(cache)
        done += 1
    return cache


def measure(build):
    """(cache, nbytes, active-memory growth) of the cache that build() makes."""
    gc.collect()
    before = active_memory()
    cache = build()
    gc.collect()
    held = active_memory() - before
    return cache, cache.nbytes, held


def single_rows(shape, n, args, dtype):
    dbytes = mx.zeros((1,), dtype).itemsize
    lat, rope = shape["kv_lora_rank"], shape["qk_rope_head_dim"]
    layers = shape["layers"]
    rows = []

    def row(cache_name, nbytes, held, floor, target=True, note=""):
        allowed = 1.01 * floor * n + floor * STEP
        per_layer = nbytes / n
        return dict(
            model=shape["name"],
            tokens=n,
            layers=layers,
            cache=cache_name,
            bytes_per_token=per_layer * layers,
            held_per_token=None if held is None else held / n * layers,
            floor_per_token=floor * layers,
            ratio=nbytes / (floor * n),
            held_ratio=None if held is None else held / (floor * n),
            allowed_ratio=allowed / (floor * n) if target else None,
            met=(max(nbytes, held or 0) <= allowed) if target else None,
            note=note,
        )

    for bits in (None, 8, 4):
        floor = floor_bytes(shape, dbytes, bits, args.group_size)
        _, nb, held = measure(
            lambda: fill(
                KVCache(), (lat, rope, 1), 1, n, args.tail, dtype, bits, args.group_size
            )
        )
        name = (
            f"QuantizedLatentCache {bits}-bit"
            if bits
            else f"KVCache {args.dtype} (stock)"
        )
        note = (
            "keys=packed latent, values=rope+scales+biases"
            if bits
            else "keys=latent, values=rope"
        )
        rows.append(row(name, nb, held, floor, note=note))

    floor = floor_bytes(shape, dbytes)
    per_tok = expanded_bytes(shape, dbytes)
    if per_tok * n <= args.max_alloc_mb * 2**20:
        widths = (
            shape["qk_nope_head_dim"] + shape["qk_rope_head_dim"],
            shape["v_head_dim"],
            shape["heads"],
        )
        _, nb, held = measure(lambda: fill(KVCache(), widths, 1, n, args.tail, dtype))
        note = "allocated"
    else:
        cap = -(-n // STEP) * STEP
        nb, held, note = per_tok * cap, None, "computed (too big to allocate)"
    rows.append(
        row("stock KVCache, expanded K/V", nb, held, floor, target=False, note=note)
    )
    return rows


def batch_rows(shape, lengths, args, dtype):
    dbytes = mx.zeros((1,), dtype).itemsize
    lat, rope = shape["kv_lora_rank"], shape["qk_rope_head_dim"]
    layers = shape["layers"]
    real = sum(lengths)
    rows = []
    variants = [
        (f"BatchKVCache {args.dtype} (stock)", None),
        ("BatchQuantizedLatentCache 8-bit", 8),
        ("BatchQuantizedLatentCache 4-bit", 4),
    ]
    for name, qbits in variants:
        floor = floor_bytes(shape, dbytes, qbits, args.group_size)

        def singles():
            out = []
            for n in lengths:
                c = fill(KVCache(), (lat, rope, 1), 1, n, 0, dtype)
                if qbits:
                    c.to_quantized(group_size=args.group_size, bits=qbits)
                out.append(c)
            mx.eval([cache_arrays(c) for c in out])
            return out

        caches = singles()
        batch, nb, held = measure(lambda c=caches: _merged(c))
        del caches
        gc.collect()
        stages = [("merged", real, nb, held)]
        # Then every row decodes args.tail tokens together.
        for _ in range(args.tail):
            k = mx.random.normal((len(lengths), 1, 1, lat)).astype(dtype)
            v = mx.random.normal((len(lengths), 1, 1, rope)).astype(dtype)
            mx.eval(batch.update_and_fetch(k, v))
        _eval_cache(batch)
        stages.append(
            (
                f"+{args.tail} decode steps",
                real + args.tail * len(lengths),
                batch.nbytes,
                None,
            )
        )
        for stage, tokens, nbytes, held_b in stages:
            rows.append(
                dict(
                    model=shape["name"],
                    cache=name,
                    stage=stage,
                    lengths=" ".join(map(str, lengths)),
                    real_tokens=tokens,
                    # rows x positions allocated, padding and spare capacity included
                    stored_positions=round(nbytes / floor),
                    bytes_per_real_token=nbytes / tokens * layers,
                    floor_per_token=floor * layers,
                    ratio=nbytes / (floor * tokens),
                    held_ratio=None if held_b is None else held_b / (floor * tokens),
                    padding_share=1 - tokens / (nbytes / floor) if nbytes else None,
                )
            )
        del batch
        gc.collect()
    return rows


def _merged(caches):
    b = caches[0].merge(caches)
    _eval_cache(b)
    return b


def window_rows(shape, window, n, args, dtype):
    """A rolling window of W tokens after N: it must hold W, not N."""
    dbytes = mx.zeros((1,), dtype).itemsize
    lat, rope = shape["kv_lora_rank"], shape["qk_rope_head_dim"]
    rows = []
    for bits in (None, 8, 4):
        floor = floor_bytes(shape, dbytes, bits, args.group_size)
        cache, nb, held = measure(
            lambda: fill(
                RotatingKVCache(max_size=window, keep=4),
                (lat, rope, 1),
                1,
                n,
                args.tail,
                dtype,
                bits,
                args.group_size,
            )
        )
        rows.append(
            dict(
                model=shape["name"],
                tokens=n,
                window=window,
                cache=type(cache).__name__
                + (f" {bits}-bit" if bits else f" {args.dtype} (stock)"),
                positions=cache.keys.shape[2],
                bytes_whole_model=nb * shape["layers"],
                window_floor=floor * window * shape["layers"],
                ratio=nb / (floor * window),
                held_ratio=held / (floor * window),
            )
        )
    return rows


def dsa_rows(shape, n, args, dtype):
    """A DSA model's layer: the latent (quantized under kv_bits) and the
    indexer's key cache, which stays at the model's dtype. mlx-lm's indexer
    also stores a zero array as wide as its keys in the values slot."""
    dbytes = mx.zeros((1,), dtype).itemsize
    lat, rope, index = (
        shape["kv_lora_rank"],
        shape["qk_rope_head_dim"],
        shape["index_head_dim"],
    )
    layers = shape["layers"]
    _, indexer, _ = measure(
        lambda: fill(KVCache(), (index, index, 1), 1, n, args.tail, dtype)
    )
    exact = None
    rows = []
    for bits in (None, 8, 4):
        _, latent, _ = measure(
            lambda: fill(
                KVCache(), (lat, rope, 1), 1, n, args.tail, dtype, bits, args.group_size
            )
        )
        total = (latent + indexer) / n * layers
        exact = exact or total
        rows.append(
            dict(
                model=shape["name"],
                tokens=n,
                latent=f"{bits}-bit" if bits else f"{args.dtype} (stock)",
                latent_per_token=latent / n * layers,
                latent_floor=floor_bytes(shape, dbytes, bits, args.group_size) * layers,
                latent_ratio=latent
                / (floor_bytes(shape, dbytes, bits, args.group_size) * n),
                indexer_per_token=indexer / n * layers,
                total_per_token=total,
                of_unquantized=total / exact,
            )
        )
    return rows


def pipeline_split(layers, ranks):
    """Layers per pipeline rank: even, the low ranks take the extra ones."""
    base, extra = divmod(layers, ranks)
    return [base + (1 if r < extra else 0) for r in range(ranks)]


def per_rank_rows(single, shapes, ranks_list):
    """Bytes per token each rank holds, from the measured single-sequence
    caches at the largest N (stock's expanded K/V left out)."""
    rows = []
    for shape in shapes:
        mine = [
            r
            for r in single
            if r["model"] == shape["name"] and "expanded" not in r["cache"]
        ]
        n = max(r["tokens"] for r in mine)
        for r in (r for r in mine if r["tokens"] == n):
            per_layer = r["bytes_per_token"] / shape["layers"]
            for ranks in ranks_list:
                for parallel, layers in (
                    ("tensor", [shape["layers"]] * ranks),
                    ("pipeline", pipeline_split(shape["layers"], ranks)),
                ):
                    held = [per_layer * k for k in layers]
                    rows.append(
                        dict(
                            model=shape["name"],
                            cache=r["cache"],
                            parallel=parallel,
                            ranks=ranks,
                            tokens=n,
                            layers_per_rank=" / ".join(
                                str(k) for k in sorted(set(layers), reverse=True)
                            ),
                            largest_rank=max(held),
                            smallest_rank=min(held),
                            all_ranks=sum(held),
                            one_process=r["bytes_per_token"],
                        )
                    )
    return rows


def main():
    started = time.perf_counter()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=[1000, 4096],
        help="sequence lengths N (default: 1000 4096)",
    )
    p.add_argument(
        "--batch",
        type=int,
        nargs="+",
        default=[1000, 700, 300, 50],
        help="lengths of the merged batch rows",
    )
    p.add_argument(
        "--window", type=int, default=1024, help="rolling window size W (default: 1024)"
    )
    p.add_argument(
        "--tail",
        type=int,
        default=16,
        help="single-token decode steps after the prefill (default: 16)",
    )
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument(
        "--max-alloc-mb",
        type=float,
        default=1024,
        help="compute stock expanded K/V arithmetically above this size",
    )
    p.add_argument(
        "--ranks",
        type=int,
        nargs="+",
        default=[2, 4],
        help="ranks for the per-rank table (default: 2 4)",
    )
    p.add_argument(
        "--json", default=None, help="default: benchmarks/results/bytes_per_token.json"
    )
    args = p.parse_args()
    dtype = DTYPES[args.dtype]
    mx.random.seed(0)

    # The first allocations of a process (the random generator's key, ...)
    # would be counted as held by the first cache measured.
    for bits in (None, 8, 4):
        measure(lambda: fill(KVCache(), (64, 32, 1), 1, 300, args.tail, dtype, bits))

    single, batch, windows, dsa = [], [], [], []
    for shape in (GLM_4_7_FLASH, DEEPSEEK_V3):
        for n in args.tokens:
            print(f"{shape['name']}, N={n} ...", file=sys.stderr, flush=True)
            single += single_rows(shape, n, args, dtype)
            if n > args.window:
                windows += window_rows(shape, args.window, n, args, dtype)
        print(f"{shape['name']}, batch {args.batch} ...", file=sys.stderr, flush=True)
        batch += batch_rows(shape, args.batch, args, dtype)
    for shape in (DEEPSEEK_V3_2, GLM_5):
        print(f"{shape['name']}, N={max(args.tokens)} ...", file=sys.stderr, flush=True)
        dsa += dsa_rows(shape, max(args.tokens), args, dtype)

    print(
        f"\nBytes per token, whole model ({args.dtype}; prefill N-{args.tail} in chunks of {PREFILL_STEP}, then {args.tail} decode steps)"
    )
    print(
        "ratio = nbytes / floor; held = growth of MLX active memory / floor; allowed = 1% + one 256-token step\n"
    )
    table(
        single,
        [
            ("model", "model", None),
            ("tokens", "N", "{:,}"),
            ("cache", "cache", None),
            ("bytes_per_token", "bytes/token", "{:,.0f}"),
            ("floor_per_token", "floor", "{:,.0f}"),
            ("ratio", "ratio", "{:.4f}"),
            ("held_ratio", "held", "{:.4f}"),
            ("allowed_ratio", "allowed", "{:.4f}"),
            ("met", "target", None),
            ("note", "note", None),
        ],
    )
    print(
        f"\nBatch of {len(args.batch)} rows merged (lengths {args.batch}), bytes per real token (whole model)\n"
    )
    table(
        batch,
        [
            ("model", "model", None),
            ("cache", "cache", None),
            ("stage", "stage", None),
            ("real_tokens", "real tok", "{:,}"),
            ("stored_positions", "positions held", "{:,}"),
            ("bytes_per_real_token", "bytes/real tok", "{:,.0f}"),
            ("floor_per_token", "floor", "{:,.0f}"),
            ("ratio", "ratio", "{:.3f}"),
            ("held_ratio", "held", "{:.3f}"),
            ("padding_share", "padding", "{:.1%}"),
        ],
    )
    print(
        f"\nRolling window of {args.window} tokens (make_prompt_cache(model, max_kv_size)), whole model\n"
    )
    table(
        windows,
        [
            ("model", "model", None),
            ("tokens", "N", "{:,}"),
            ("cache", "cache", None),
            ("positions", "positions held", "{:,}"),
            ("bytes_whole_model", "bytes", "{:,.0f}"),
            ("window_floor", "floor (W tokens)", "{:,.0f}"),
            ("ratio", "ratio", "{:.4f}"),
            ("held_ratio", "held", "{:.4f}"),
        ],
    )
    print(
        f"\nDSA models (a CacheList per layer), bytes per token at N={max(args.tokens):,}, whole model: "
        "the latent quantizes under kv_bits, the indexer's keys stay at the model's dtype\n"
    )
    table(
        dsa,
        [
            ("model", "model", None),
            ("latent", "latent", None),
            ("latent_per_token", "latent bytes/token", "{:,.0f}"),
            ("latent_floor", "latent floor", "{:,.0f}"),
            ("latent_ratio", "ratio", "{:.4f}"),
            ("indexer_per_token", "indexer bytes/token", "{:,.0f}"),
            ("total_per_token", "total", "{:,.0f}"),
            ("of_unquantized", "of unquantized", "{:.3f}"),
        ],
    )
    per_rank = per_rank_rows(single, (GLM_4_7_FLASH, DEEPSEEK_V3), args.ranks)
    print(
        f"\nPer rank across machines, bytes per token at N={max(args.tokens):,}: tensor parallel "
        "replicates the latent (one head), pipeline splits the layers\n"
    )
    table(
        per_rank,
        [
            ("model", "model", None),
            ("cache", "cache", None),
            ("parallel", "parallel", None),
            ("ranks", "ranks", None),
            ("layers_per_rank", "layers/rank", None),
            ("largest_rank", "bytes/token, largest rank", "{:,.0f}"),
            ("smallest_rank", "smallest rank", "{:,.0f}"),
            ("all_ranks", "all ranks", "{:,.0f}"),
            ("one_process", "one process", "{:,.0f}"),
        ],
    )
    path = write_json(
        args.json,
        "bytes_per_token",
        args,
        {
            "single": single,
            "batch": batch,
            "window": windows,
            "dsa": dsa,
            "per_rank": per_rank,
        },
        started,
    )
    print(f"\nwrote {path} ({time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
