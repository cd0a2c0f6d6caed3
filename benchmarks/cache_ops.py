"""Cost of the cache operations against a plain copy of the same bytes.

One layer at the real GLM-4.7-Flash widths (latent 512, RoPE key 64,
bfloat16), single caches of a few thousand tokens and a batch of 4 rows of
different lengths. Timed, each with ``mx.eval`` of everything the operation
produces inside the timing:

- merge       4 single caches -> a batch (left padded)
- extract     one row of the batch -> a single cache
- filter      keep rows 1-3 of the batch (drops the longest row, so the
              batch also sheds the padding no row needs)
- extend      a batch of 2 rows extended by another batch of 2 rows
- trim        the last --trim tokens, of a single cache and of the batch
- save        ``mlx_lm`` ``save_prompt_cache`` of [cache]
- load        ``mlx_lm`` ``load_prompt_cache`` (after ``mlx_lm_mla.install()``,
              so the class names resolve and the file is checked) + eval
- to_quantized  8-bit, group size 64, of a single cache and of the batch

Floor: the op's output bytes copied once, by the fastest plain copy MLX has
(``mx.eval(src + 0)`` on a flat uint8 array of that many bytes, from a warm
buffer pool). For trim, which moves no bytes, the floor is a copy of the
trimmed tokens' bytes. For save and load the output is the file; the memory
copy floor is used for the target, and the time to save / load one plain
array of the file's size with ``mx.save_safetensors`` / ``mx.load`` is shown
next to it (the I/O floor). The stock mlx-lm operation on ``KVCache`` /
``BatchKVCache`` holding the same latent is timed too. Runs of op, floor and
stock are interleaved; figures are medians. Target: every op <= 2x its floor.

Unquantized, "ours" is stock's ``KVCache`` / ``BatchKVCache`` with the
package installed: it must cost what stock costs. --quantized also times the
ops on 8-bit caches (``QuantizedLatentCache`` / ``BatchQuantizedLatentCache``,
made in place by ``to_quantized``; no stock counterpart: stock mlx-lm cannot
quantize an MLA cache).

    python benchmarks/cache_ops.py
    python benchmarks/cache_ops.py --lengths 16384 12000 8000 2000 --reps 30
"""

import argparse
import copy
import gc
import os
import sys
import tempfile
import time

import _common  # noqa: F401  (puts the repository root on sys.path)
from _common import GLM_4_7_FLASH, cache_arrays, median, progress, table, write_json

import mlx.core as mx
import mlx_lm.models.cache as mlx_cache
from mlx_lm.models.cache import BatchKVCache, KVCache

import mlx_lm_mla
from mlx_lm_mla import BatchQuantizedLatentCache, QuantizedLatentCache
from mlx_lm_mla.cache import quantize_rows

DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
TARGET = 2.0


arrays_of = cache_arrays


def cache_bytes(cache):
    return cache.nbytes


def copy_of(cache):
    """An independent cache with the same state (views of the same arrays;
    MLX copies on write where needed)."""
    if isinstance(cache, (QuantizedLatentCache, BatchQuantizedLatentCache)):
        c = copy.copy(cache)  # ops replace its arrays, never write into them
    elif isinstance(cache, BatchKVCache):
        c = BatchKVCache([0])
        c.state = cache.state
    else:
        c = KVCache()
        c.state = cache.state
    mx.eval(arrays_of(c))
    return c


class Data:
    """The caches every op starts from, built once and evaluated."""

    def __init__(self, args, bits):
        shape = GLM_4_7_FLASH
        dtype = DTYPES[args.dtype]
        self.lengths = args.lengths
        mx.random.seed(0)
        self.latents = [
            (
                mx.random.normal((1, 1, n, shape["kv_lora_rank"])).astype(dtype),
                mx.random.normal((1, 1, n, shape["qk_rope_head_dim"])).astype(dtype),
            )
            for n in args.lengths
        ]
        mx.eval(self.latents)
        self.ours = []
        self.stock = []
        for lat, rope in self.latents:
            c = KVCache()
            c.update_and_fetch(lat, rope)
            if bits:
                c.to_quantized(group_size=64, bits=bits)
            mx.eval(arrays_of(c))
            self.ours.append(c)
            s = KVCache()
            s.update_and_fetch(lat, rope)
            mx.eval(arrays_of(s))
            self.stock.append(s)
        self.batch = BatchKVCache.merge(self.ours)
        self.stock_batch = BatchKVCache.merge(self.stock)
        self.half = (
            BatchKVCache.merge(self.ours[:2]),
            BatchKVCache.merge(self.ours[2:]),
        )
        self.stock_half = (
            BatchKVCache.merge(self.stock[:2]),
            BatchKVCache.merge(self.stock[2:]),
        )
        # The batch's latent as one plain array, for mx.quantize alone.
        self.batch_latent = mx.array(self.batch.keys) if not bits else None
        mx.eval(
            [
                arrays_of(c)
                for c in (self.batch, self.stock_batch, *self.half, *self.stock_half)
            ],
            self.batch_latent if self.batch_latent is not None else [],
        )


def ops(data, args, tmp, bits):
    """(name, tokens, setup_ours, op_ours, setup_stock, op_stock). Each
    setup returns the op's input; op returns (outputs to eval, output bytes)."""
    n_trim = args.trim
    rows = len(data.lengths)
    real = sum(data.lengths)
    first = data.lengths[0]
    paths = {
        k: os.path.join(tmp, f"{k}.safetensors")
        for k in ("ours1", "oursB", "stock1", "stockB")
    }
    mlx_cache.save_prompt_cache(paths["ours1"], [data.ours[0]])
    mlx_cache.save_prompt_cache(paths["oursB"], [data.batch])
    mlx_cache.save_prompt_cache(paths["stock1"], [data.stock[0]])
    mlx_cache.save_prompt_cache(paths["stockB"], [data.stock_batch])

    def out(c):
        return arrays_of(c), cache_bytes(c)

    def merge(cls):
        def f(caches):
            b = cls.merge(caches)
            return out(b)

        return f

    def extract(b):
        return out(b.extract(1))

    def filt(b):
        b.filter([1, 2, 3])
        return out(b)

    def extend(pair):
        a, b = pair
        a.extend(b)
        return out(a)

    def trim(c):
        c.trim(n_trim)
        arrays = arrays_of(c)
        # the bytes of n_trim positions of every row
        per_position = sum(p.nbytes / p.shape[2] for p in arrays if p.ndim == 4)
        return arrays, n_trim * per_position

    def save(key):
        def f(c):
            path = os.path.join(tmp, f"save-{key}.safetensors")
            mlx_cache.save_prompt_cache(path, [c])
            return [], os.path.getsize(path)

        return f

    def load(key):
        def f(_):
            cache = mlx_cache.load_prompt_cache(paths[key])
            mx.eval([arrays_of(c) for c in cache])
            return [], os.path.getsize(paths[key])

        return f

    def quantize(c):
        q = c.to_quantized(group_size=64, bits=8)
        return out(q)

    def quantize_batch(c):
        # A batch has no to_quantized: the server's loop quantizes its rows.
        return out(quantize_rows(c, list(range(c.offset.size)), group_size=64, bits=8))

    def plain_quantize(x):
        return [mx.quantize(x, group_size=64, bits=8)], 0

    stock = not bits

    def entry(
        name, tokens, setup, op, s_setup=None, s_op=None, k_setup=None, k_op=None
    ):
        return dict(
            name=name,
            tokens=tokens,
            ours=(setup, op),
            stock=(s_setup, s_op) if stock and s_op else None,
            kernel=(k_setup, k_op) if k_op else None,
        )

    single_latent = lambda: data.latents[0][0]  # noqa: E731
    batch_latent = lambda: data.batch_latent  # noqa: E731
    entries = [
        entry(
            "merge",
            real,
            lambda: data.ours,
            merge(BatchKVCache),
            lambda: data.stock,
            merge(BatchKVCache),
        ),
        entry(
            "extract",
            data.lengths[1],
            lambda: data.batch,
            extract,
            lambda: data.stock_batch,
            extract,
        ),
        entry(
            "filter",
            sum(data.lengths[1:]),
            lambda: copy_of(data.batch),
            filt,
            lambda: copy_of(data.stock_batch),
            filt,
        ),
        entry(
            "extend",
            real,
            lambda: (copy_of(data.half[0]), copy_of(data.half[1])),
            extend,
            lambda: (copy_of(data.stock_half[0]), copy_of(data.stock_half[1])),
            extend,
        ),
        entry(
            "trim, single",
            n_trim,
            lambda: copy_of(data.ours[0]),
            trim,
            lambda: copy_of(data.stock[0]),
            trim,
        ),
        entry(
            "trim, batch",
            n_trim * rows,
            lambda: copy_of(data.batch),
            trim,
            lambda: copy_of(data.stock_batch),
            trim,
        ),
        entry(
            "save, single",
            first,
            lambda: data.ours[0],
            save("ours1"),
            lambda: data.stock[0],
            save("stock1"),
        ),
        entry(
            "save, batch",
            real,
            lambda: data.batch,
            save("oursB"),
            lambda: data.stock_batch,
            save("stockB"),
        ),
        entry(
            "load, single",
            first,
            lambda: None,
            load("ours1"),
            lambda: None,
            load("stock1"),
        ),
        entry(
            "load, batch",
            real,
            lambda: None,
            load("oursB"),
            lambda: None,
            load("stockB"),
        ),
    ]
    if not bits:
        entries += [
            entry(
                "to_quantized, single",
                first,
                lambda: copy_of(data.ours[0]),
                quantize,
                lambda: copy_of(data.stock[0]),
                quantize,
                single_latent,
                plain_quantize,
            ),
            entry(
                "to_quantized, batch",
                real,
                lambda: copy_of(data.batch),
                quantize_batch,
                k_setup=batch_latent,
                k_op=plain_quantize,
            ),
        ]
    return entries


def timed(setup, op):
    x = setup()
    gc.collect()
    t0 = time.perf_counter()
    outputs, nbytes = op(x)
    mx.eval(outputs)
    dt = time.perf_counter() - t0
    del x, outputs
    return dt, nbytes


def floor_copy(nbytes, pool):
    n = max(int(nbytes), 1)
    if n not in pool:
        pool.clear()  # one source buffer at a time
        pool[n] = mx.zeros((n,), mx.uint8) + 1
        mx.eval(pool[n])
    src = pool[n]
    t0 = time.perf_counter()
    mx.eval(src + 0)
    return time.perf_counter() - t0


def concat_copy(nbytes, pool, dtype):
    """One pass of MLX's general copy kernel over the same bytes in the cache
    dtype: two halves concatenated into a new array."""
    item = mx.zeros((1,), dtype).itemsize
    n = max(int(nbytes) // item // 2, 1)
    if n not in pool:
        pool.clear()
        pool[n] = (mx.zeros((1, 1, n), dtype) + 1, mx.zeros((1, 1, n), dtype) + 2)
        mx.eval(pool[n])
    a, b = pool[n]
    t0 = time.perf_counter()
    mx.eval(mx.concatenate([a, b], axis=1))
    return time.perf_counter() - t0


def io_floor(nbytes, tmp, kind, pool):
    n = max(int(nbytes), 1)
    path = os.path.join(tmp, "plain.safetensors")
    if ("io", n) not in pool:
        pool.clear()
        pool[("io", n)] = mx.zeros((n,), mx.uint8) + 1
        mx.eval(pool[("io", n)])
        mx.save_safetensors(path, {"a": pool[("io", n)]})
    t0 = time.perf_counter()
    if kind == "save":
        mx.save_safetensors(path, {"a": pool[("io", n)]})
    else:
        mx.eval(mx.load(path)["a"])
    return time.perf_counter() - t0


def run(args, tmp, bits, label):
    data = Data(args, bits)
    entries = ops(data, args, tmp, bits)
    rows = []
    pool, io_pool, concat_pool = {}, {}, {}
    bar = progress(total=len(entries) * args.reps, desc=f"ops ({label})")
    for e in entries:
        name, tokens = e["name"], e["tokens"]
        bar.set_postfix_str(name)
        t = {k: [] for k in ("op", "floor", "concat", "io", "stock", "kernel")}
        nbytes = None
        for r in range(args.reps + args.warmup):
            sample = {}
            sample["op"], nbytes = timed(*e["ours"])
            sample["floor"] = floor_copy(nbytes, pool)
            sample["concat"] = concat_copy(nbytes, concat_pool, DTYPES[args.dtype])
            if name.startswith(("save", "load")):
                sample["io"] = io_floor(nbytes, tmp, name.split(",")[0], io_pool)
            if e["stock"]:
                sample["stock"] = timed(*e["stock"])[0]
            if e["kernel"]:
                sample["kernel"] = timed(*e["kernel"])[0]
            if r >= args.warmup:
                for k, v in sample.items():
                    t[k].append(v)
                bar.update()
        m = {k: median(v) if v else None for k, v in t.items()}
        row = dict(
            cache=label,
            op=name,
            tokens=tokens,
            out_bytes=int(nbytes),
            out_mb=nbytes / 2**20,
            ms=m["op"] * 1e3,
            ns_per_token=m["op"] / tokens * 1e9,
            floor_ms=m["floor"] * 1e3,
            ratio=m["op"] / m["floor"],
            concat_ms=m["concat"] * 1e3,
            concat_ratio=m["op"] / m["concat"],
            io_floor_ms=m["io"] * 1e3 if m["io"] else None,
            io_ratio=m["op"] / m["io"] if m["io"] else None,
            stock_ms=m["stock"] * 1e3 if m["stock"] else None,
            vs_stock=m["op"] / m["stock"] if m["stock"] else None,
            kernel_ms=m["kernel"] * 1e3 if m["kernel"] else None,
            met=m["op"] / m["floor"] <= TARGET,
            samples_ms=[x * 1e3 for x in t["op"]],
        )
        rows.append(row)
    bar.close()
    return rows


def main():
    started = time.perf_counter()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--lengths",
        type=int,
        nargs=4,
        default=[4096, 3000, 2000, 1000],
        help="token counts of the 4 sequences (default: 4096 3000 2000 1000)",
    )
    p.add_argument(
        "--trim", type=int, default=256, help="tokens trimmed (default: 256)"
    )
    p.add_argument("--reps", type=int, default=25)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument(
        "--no-quantized",
        dest="quantized",
        action="store_false",
        help="skip the ops on 8-bit caches",
    )
    p.add_argument(
        "--tmp",
        default=None,
        help="directory for the cache files (default: a new temporary directory)",
    )
    p.add_argument(
        "--json", default=None, help="default: benchmarks/results/cache_ops.json"
    )
    args = p.parse_args()
    mlx_lm_mla.install()  # load_prompt_cache finds the class names
    rows = []
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        print(f"cache files in {tmp}", file=sys.stderr)
        rows += run(args, tmp, None, args.dtype)
        if args.quantized:
            rows += run(args, tmp, 8, "8-bit")
    print(
        f"\nOne layer, GLM-4.7-Flash widths, {args.dtype}, lengths {args.lengths}; "
        f"median of {args.reps}; floor = copy of the op's output bytes (uint8 src + 0); "
        f"target <= {TARGET:.0f}x floor\n"
    )
    table(
        rows,
        [
            ("cache", "cache", None),
            ("op", "op", None),
            ("tokens", "tokens", "{:,}"),
            ("out_mb", "out MB", "{:.2f}"),
            ("ms", "ms", "{:.2f}"),
            ("ns_per_token", "ns/token", "{:.0f}"),
            ("floor_ms", "floor ms", "{:.2f}"),
            ("ratio", "x floor", "{:.2f}"),
            ("concat_ratio", "x concat", "{:.2f}"),
            ("io_floor_ms", "I/O floor ms", "{:.2f}"),
            ("io_ratio", "x I/O", "{:.2f}"),
            ("stock_ms", "stock ms", "{:.2f}"),
            ("vs_stock", "ours/stock", "{:.2f}"),
            ("kernel_ms", "mx.quantize ms", "{:.2f}"),
            ("met", "<= 2x", None),
        ],
    )
    path = write_json(args.json, "cache_ops", args, {"rows": rows}, started)
    print(f"\nwrote {path} ({time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()
