"""``mlx-lm-mla bench``: decode speed on this device, stock mlx-lm against the
package, side by side.

The model is a ``glm4_moe_lite`` at GLM-4.7-Flash's attention widths (latent
512, RoPE key 64, 20 heads, nope 192, v 256) with ``--layers`` dense layers,
small MLPs and random weights, made on the fly, or ``--model PATH``, a local
mlx-lm model. Each repetition fills a fresh cache to the context (a short
prompt through the model, then random rows up to the context, 2,048 at a
time) and times ``--steps`` single-token steps after ``--warmup``. Variants:

- ``stock``: stock mlx-lm: the package's decode off, its ``KVCache``, bf16;
- ``ours``: the package's decode over the same bf16 cache;
- ``ours8`` / ``ours4``: the package with the latent quantized in place at 8
  / 4 bits (group 64), which stock cannot decode at all;
- ``portable*``: on MLX's CUDA backend only, the package with its CUDA
  kernel off.

Repetitions interleave the variants (the order rotates every repetition);
figures are medians. Per row: tokens/s of the whole model, its ratio to
stock, the cache's GB/s (the bytes of cache a step reads at least over the
step's time: a lower bound of the attention's rate) and the step's
transient (MLX's peak memory during the steps beyond what they started
with, per layer). ``--attention`` also times one layer's decode attention
alone.
"""

import argparse
import importlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {  # name: (label, bits of the latent); {dtype}: the cache's own
    "stock": ("stock {dtype}", None),
    "ours": ("{dtype}", None),
    "ours8": ("8-bit", 8),
    "ours4": ("4-bit", 4),
    "portable": ("{dtype}, no kernel", None),
    "portable8": ("8-bit, no kernel", 8),
    "portable4": ("4-bit, no kernel", 4),
}
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
# GLM-4.7-Flash's attention (its config.json); the rest of the model is small.
GLM_4_7_FLASH = dict(
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    num_attention_heads=20,
    num_key_value_heads=20,
    qk_nope_head_dim=192,
    v_head_dim=256,
)
CONTEXTS = [1024, 4096, 16384, 32768]
GROUP_SIZE = 64
FILL_STEP = 2048
PROMPT = 8  # tokens through the model before the random rows
MIB = 2**20

_KERNEL = []  # decode_cuda.ENABLED as the environment left it


def use_decode(variant):
    """Switches between stock mlx-lm and the package's decode for ``variant``.
    The one place that knows how: stock is the package uninstalled, mlx-lm as
    published (``MLX_LM_MLA_DECODE=stock`` would still run the package's
    caches); ``portable*`` the package with the CUDA kernel switched off."""
    import mlx_lm_mla
    from mlx_lm_mla import decode_cuda

    if not _KERNEL:
        _KERNEL.append(decode_cuda.ENABLED)
    if variant == "stock":
        mlx_lm_mla.uninstall()
    else:
        mlx_lm_mla.install()
    decode_cuda.ENABLED = _KERNEL[0] and not variant.startswith("portable")


def label(variant, dtype="bf16"):
    """The variant's name in tables, for a cache of ``dtype`` (short name)."""
    return VARIANTS[variant][0].format(dtype=dtype)


def offered_variants():
    from mlx_lm_mla import decode_cuda

    return [v for v in VARIANTS if decode_cuda.available() or "port" not in v]


def int_list(text):
    try:
        values = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers")
    return list(dict.fromkeys(values))  # a repeat would be a second row


def variant_list(text):
    values = [x for x in text.replace(" ", "").split(",") if x]
    unknown = [v for v in values if v not in offered_variants()]
    if not values or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown variant(s) {', '.join(unknown) or repr(text)}; "
            f"choose from {', '.join(offered_variants())}"
        )
    return list(dict.fromkeys(values))


def parser(prog="mlx-lm-mla bench"):
    p = argparse.ArgumentParser(
        prog=prog,
        description="Decode speed on this device: stock mlx-lm's bf16 against the "
        "package's bf16, 8-bit and 4-bit latent, interleaved. A table on stdout, "
        "progress on stderr.",
    )
    p.add_argument(
        "--model",
        default=None,
        help="a local mlx-lm model folder (default: a random glm4_moe_lite at "
        "GLM-4.7-Flash's attention widths, made on the fly)",
    )
    p.add_argument(
        "--contexts",
        type=int_list,
        default=CONTEXTS,
        help="cached positions, comma-separated (default 1024,4096,16384,32768)",
    )
    p.add_argument(
        "--batch", type=int_list, default=[1], help="batch sizes (default 1)"
    )
    p.add_argument(
        "--variants",
        type=variant_list,
        default=None,
        help=f"comma-separated, of {','.join(VARIANTS)} (default: all this "
        "device offers); stock is always measured",
    )
    p.add_argument("--repeats", type=int, default=3, help="repetitions (default 3)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per repetition")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    p.add_argument(
        "--layers", type=int, default=2, help="layers of the made-up model (default 2)"
    )
    p.add_argument(
        "--attention",
        action="store_true",
        help="also time one layer's decode attention alone (ms, GB/s)",
    )
    p.add_argument("--attention-calls", type=int, default=4, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help="write every figure to this file")
    p.add_argument(
        "--plot",
        default=None,
        help="draw tokens/s against context to this PNG (needs matplotlib: "
        "pip install 'mlx-lm-mla[plot]')",
    )
    return p


def check_args(p, args):
    """Refuses what would fail after the runs, before them."""
    if args.variants is None:
        args.variants = offered_variants()
    args.variants = ["stock"] + [v for v in args.variants if v != "stock"]
    if args.repeats < 1 or args.steps < 1 or args.warmup < 0 or args.layers < 1:
        p.error("--repeats, --steps and --layers take at least 1, --warmup 0")
    if args.model is not None and not Path(args.model, "config.json").is_file():
        p.error(
            f"--model {args.model}: not a local mlx-lm model folder (no config.json)"
        )
    if args.plot is not None:
        try:
            from matplotlib.figure import Figure
        except ImportError:
            p.error(
                "--plot needs matplotlib, which is not installed: "
                "pip install 'mlx-lm-mla[plot]' (or pip install matplotlib)"
            )
        kinds = Figure().canvas.get_supported_filetypes()
        if Path(args.plot).suffix[1:].lower() not in kinds:
            p.error(
                f"--plot {args.plot}: name a file ending in one of matplotlib's "
                f"formats ({', '.join('.' + k for k in sorted(kinds))})"
            )
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None:
            problem = unwritable(path)
            if problem:
                p.error(f"{flag} {path}: {problem}")


def unwritable(path):
    """Why ``path`` cannot be written, or None: tried by opening it, as the
    write after the runs will (a file this makes is removed again)."""
    path = Path(path)
    if path.is_dir():
        return "is a folder"
    if not path.resolve().parent.is_dir():
        return "its folder does not exist"
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        return e.strerror or str(e)
    if not existed:
        path.unlink()
    return None


def load_model(args):
    """(model, description) for ``--model`` or the made-up model."""
    import mlx.core as mx

    from mlx_lm_mla import mla, tiny

    use_decode("ours")  # the package's view of the model: which layers are MLA
    if args.model is None:
        overrides = dict(
            GLM_4_7_FLASH,
            hidden_size=256,
            q_lora_rank=64,
            num_hidden_layers=args.layers,
            first_k_dense_replace=99,  # dense layers: the CPU runs MoE in float32
        )
        model, config = tiny.build_model(
            "glm4_moe_lite", dtype=mx.bfloat16, **overrides
        )
        about = {"model": "made up: glm4_moe_lite, GLM-4.7-Flash attention widths"}
    else:
        import mlx_lm

        try:
            model, _ = mlx_lm.load(args.model)
            config = json.loads(Path(args.model, "config.json").read_text())
        except Exception as e:  # whatever mlx_lm.load finds wrong with the folder
            raise SystemExit(
                f"mlx-lm-mla bench: --model {args.model}: mlx_lm.load cannot "
                f"load it: {type(e).__name__}: {e}"
            )
        about = {"model": str(Path(args.model).resolve())}
    if not mla.has_latent_attention(model):
        raise SystemExit(
            f"mlx-lm-mla bench: {about['model']} ({config.get('model_type')}) has "
            "no MLA attention this package decodes"
        )
    return model, dict(about, model_type=config.get("model_type"), config=config)


def filled_cache(model, context, batch, bits):
    """A fresh cache of ``context`` positions per row: a short prompt through the
    model (every cache gets its widths and dtypes), then random rows; quantized
    in place as mlx-lm's generate does for ``bits``."""
    import mlx.core as mx
    from mlx_lm.generate import maybe_quantize_kv_cache
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lm_mla.mla import leaves

    cache = make_prompt_cache(model)
    done = min(PROMPT, context)  # a shorter context is the prompt alone
    prompt = [[(7 * b + i) % 240 + 10 for i in range(done)] for b in range(batch)]
    mx.eval(model(mx.array(prompt), cache=cache))
    grown = [c for c in leaves(cache) if _positions(c) is not None]
    blocks = {}  # one random block per shape, written again and again
    while done < context:
        n = min(FILL_STEP, context - done)
        for c in grown:
            rows = []
            for x in (c.keys, c.values):
                shape = (batch, x.shape[1], FILL_STEP, x.shape[-1])
                if (shape, x.dtype) not in blocks:
                    blocks[shape, x.dtype] = mx.random.normal(shape).astype(x.dtype)
                rows.append(blocks[shape, x.dtype][..., :n, :])
            c.update_and_fetch(*rows)
        mx.eval([c.state for c in grown])
        done += n
    if bits is not None:
        maybe_quantize_kv_cache(cache, 0, GROUP_SIZE, bits)
        mx.eval([c.state for c in leaves(cache)])
    return cache


def model_dtype(model):
    """The dtype the model's cache holds, as a one-token prompt writes it (it
    follows the model's weights: a float32 model writes a float32 latent)."""
    from mlx_lm_mla.mla import leaves

    grown = [c for c in leaves(filled_cache(model, 1, 1, None)) if _positions(c)]
    return grown[0].keys.dtype


def short_name(dtype):
    name = str(dtype).rsplit(".", 1)[-1]
    return DTYPES.get(name, name)


def _positions(c):
    keys = getattr(c, "keys", None)
    offset = getattr(c, "offset", None)
    if getattr(keys, "ndim", 0) != 4 or not isinstance(offset, int):
        return None
    return offset


def cache_bytes(cache):
    """Bytes a step reads at least: every position of every growing cache, in
    the form it is held (a packed latent's bytes, scales and biases)."""
    from mlx_lm_mla.mla import leaves

    total = 0
    for c in leaves(cache):
        n = _positions(c)
        if n is not None:
            per = sum(
                x.shape[0] * x.shape[1] * x.shape[-1] * x.itemsize
                for x in (c.keys, c.values)
            )
            total += per * n
    return total


def _steps(model, cache, batch, steps, first):
    import mlx.core as mx

    for i in range(steps):
        token = mx.array([[(first + i + 7 * b) % 240 + 10] for b in range(batch)])
        mx.eval(model(token, cache=cache))


def run_decode(model, args, context, batch, variant):
    """One repetition: tokens/s, seconds, transient and cache bytes."""
    import mlx.core as mx

    use_decode(variant)
    cache = filled_cache(model, context, batch, VARIANTS[variant][1])
    _steps(model, cache, batch, args.warmup, 0)
    read = cache_bytes(cache)
    mx.synchronize()
    held = mx.get_active_memory()
    mx.reset_peak_memory()
    start = time.perf_counter()
    _steps(model, cache, batch, args.steps, args.warmup)
    seconds = time.perf_counter() - start
    transient = mx.get_peak_memory() - held
    return dict(
        tokens_per_s=batch * args.steps / seconds,
        step_s=seconds / args.steps,
        transient_bytes=transient,
        cache_bytes=read,
    )


def mla_layer(model):
    """(index, attention module, member of the layer's cache it writes) of the
    first MLA layer."""
    from mlx_lm_mla import mla

    for i, layer in enumerate(model.layers):
        found = mla.latent_modules(layer)
        if found:
            return i, found[0], mla.ATTENTION[type(found[0])]
    raise ValueError("the model has no MLA layer")


def head_count(attention):
    # LongCat's MLA module names it num_attention_heads, the others num_heads.
    return getattr(attention, "num_heads", None) or attention.num_attention_heads


def run_attention(model, args, context, batch, variant):
    """One repetition of one layer's decode attention alone: ms per call (its
    ``update_and_fetch``, the RoPE-key scores, the module's attention)."""
    import mlx.core as mx

    (index, attention, member), dtype = args.mla_layer
    use_decode(variant)
    sdpa = importlib.import_module(
        type(attention).__module__
    ).scaled_dot_product_attention
    cache = filled_cache(model, context, batch, VARIANTS[variant][1])[index]
    cache = cache if member is None else cache[member]
    heads = head_count(attention)
    width, rope_width = attention.kv_lora_rank, attention.qk_rope_head_dim
    q = mx.random.normal((batch, heads, 1, width)).astype(dtype)
    q_pe = mx.random.normal((batch, heads, 1, rope_width)).astype(dtype)
    latent = mx.random.normal((batch, 1, 1, width)).astype(dtype)
    rope = mx.random.normal((batch, 1, 1, rope_width)).astype(dtype)
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
    return dict(ms=statistics.median(times) * 1e3, cache_bytes=cache_bytes([cache]))


def rotated(variants, rep):
    k = rep % len(variants)
    return variants[k:] + variants[:k]


def progress(total):
    """tqdm on stderr where installed, else a counter."""
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc="bench", file=sys.stderr, leave=False)
    except ImportError:
        return _Counter(total)


class _Counter:
    def __init__(self, total):
        self.total, self.n, self.text = total, 0, ""

    def set_postfix_str(self, text):
        self.text = text

    def update(self, n=1):
        self.n += n
        line = f"\rbench: {self.n}/{self.total} {self.text}"
        print(line, end="", file=sys.stderr, flush=True)

    def close(self):
        print(file=sys.stderr)


def run(args):
    """Every repetition, then the rows: the whole result as a dict."""
    import mlx.core as mx

    started = time.perf_counter()
    load_at_start = load_average()
    model, about = load_model(args)
    layers = len(model.layers)
    mx.random.seed(0)
    kinds = [("decode", run_decode)]
    cache_dtype = model_dtype(model)
    if args.attention:
        # The layer and the queries' dtype (as the model makes them), found once.
        args.mla_layer = mla_layer(model), cache_dtype
        kinds.append(("attention", run_attention))
    here = device()
    dtype = short_name(cache_dtype)
    print(
        f"{about['model']}, {layers} layers; device {here['name']}; "
        f"load average {load_at_start}",
        file=sys.stderr,
    )
    for v in args.variants:  # every path built and warm
        run_decode(model, argparse.Namespace(warmup=1, steps=1), 256, 1, v)
    jobs = [
        (kind, fn, context, batch, rep, v)
        for kind, fn in kinds
        for context in args.contexts
        for batch in args.batch
        for rep in range(args.repeats)
        for v in rotated(args.variants, rep)
    ]
    repetitions = []
    bar = progress(len(jobs))
    try:
        for kind, fn, context, batch, rep, v in jobs:
            bar.set_postfix_str(f"{kind} {context:,} x{batch} {label(v, dtype)}")
            found = fn(model, args, context, batch, v)
            repetitions.append(
                dict(
                    kind=kind, context=context, batch=batch, variant=v, rep=rep, **found
                )
            )
            bar.update()
    finally:
        bar.close()
        use_decode("ours")
    args_out = {k: v for k, v in vars(args).items() if k != "mla_layer"}
    return {
        "benchmark": "bench",
        "versions": versions(),
        "device": here,
        "git": git_state(),
        "settings": settings(),
        "args": args_out,
        "model": dict(about, layers=layers, cache_dtype=dtype),
        "load_average_1min_at_start": load_at_start,
        "load_average_1min_at_end": load_average(),
        "seconds": round(time.perf_counter() - started, 1),
        "decode_rows": decode_rows(repetitions, args.variants, layers, dtype),
        "attention_rows": attention_rows(
            repetitions, args.variants, here["peak_gb_per_s"], dtype
        ),
        "repetitions": repetitions,
    }


def _groups(repetitions, kind):
    groups = {}
    for r in repetitions:
        if r["kind"] == kind:
            key = (r["context"], r["batch"])
            groups.setdefault(key, {}).setdefault(r["variant"], []).append(r)
    return groups


def decode_rows(repetitions, variants, layers, dtype="bf16"):
    rows = []
    for (context, batch), runs in _groups(repetitions, "decode").items():
        base = statistics.median(r["tokens_per_s"] for r in runs["stock"])
        for v in variants:
            speed = statistics.median(r["tokens_per_s"] for r in runs[v])
            step = statistics.median(r["step_s"] for r in runs[v])
            rows.append(
                dict(
                    context=context,
                    batch=batch,
                    variant=v,
                    label=label(v, dtype),
                    tokens_per_s=speed,
                    ratio=speed / base,
                    cache_gb_per_s=runs[v][0]["cache_bytes"] / step / 1e9,
                    transient_mib=statistics.median(
                        r["transient_bytes"] for r in runs[v]
                    )
                    / MIB
                    / layers,
                    samples=[r["tokens_per_s"] for r in runs[v]],
                )
            )
    return rows


def attention_rows(repetitions, variants, peak_gb_per_s=None, dtype="bf16"):
    """Per context, batch and variant: the median ms, its ratio to stock's, and
    the cache's GB/s, with its share of the memory's peak where known."""
    rows = []
    for (context, batch), runs in _groups(repetitions, "attention").items():
        base = statistics.median(r["ms"] for r in runs["stock"])
        for v in variants:
            ms = statistics.median(r["ms"] for r in runs[v])
            floor = runs[v][0]["cache_bytes"]
            rows.append(
                dict(
                    context=context,
                    batch=batch,
                    variant=v,
                    label=label(v, dtype),
                    ms=ms,
                    speed=base / ms,
                    floor_mb=floor / 1e6,
                    gb_per_s=floor / ms / 1e6,
                    peak_percent=peak_gb_per_s
                    and 100 * floor / ms / 1e6 / peak_gb_per_s,
                    samples=[r["ms"] for r in runs[v]],
                )
            )
    return rows


DECODE_COLUMNS = [
    ("context", "context", "{:,}"),
    ("batch", "batch", None),
    ("label", "variant", None),
    ("tokens_per_s", "tokens/s", "{:.2f}"),
    ("ratio", "x stock", "{:.2f}"),
    ("cache_gb_per_s", "cache GB/s", "{:.3f}"),
    ("transient_mib", "transient MiB/layer", "{:.1f}"),
]
ATTENTION_COLUMNS = [
    ("context", "context", "{:,}"),
    ("batch", "batch", None),
    ("label", "variant", None),
    ("ms", "ms", "{:.2f}"),
    ("speed", "x stock", "{:.2f}"),
    ("floor_mb", "cache MB", "{:.1f}"),
    ("gb_per_s", "GB/s", "{:.2f}"),
]
PEAK_COLUMN = ("peak_percent", "% of peak", "{:.1f}")


def table(rows, columns, file=None):
    """Prints rows (dicts) as an aligned text table. columns: (key, title, fmt)."""
    cells = [[title for _, title, _ in columns]]
    for r in rows:
        cells.append(
            [
                "-" if r.get(k) is None else (fmt.format(r[k]) if fmt else str(r[k]))
                for k, _, fmt in columns
            ]
        )
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    out = file or sys.stdout
    for n, line in enumerate(cells):
        print(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(line, widths))
            ),
            file=out,
        )
        if n == 0:
            print("  ".join("-" * w for w in widths), file=out)
    out.flush()


def report(result, decode_columns=DECODE_COLUMNS):
    args = result["args"]
    print(
        f"decode: {result['model']['model']}; device {result['device']['name']}; "
        f"median of {args['repeats']}, variants interleaved, {args['steps']} steps "
        f"after {args['warmup']}; cache GB/s: cache bytes a step reads / its time"
        + "".join(f"; {k}={v}" for k, v in result.get("settings", {}).items())
        + "\n"
    )
    table(result["decode_rows"], decode_columns)
    if result["attention_rows"]:
        peak = result["device"].get("peak_gb_per_s")
        print(
            "\nattention: one layer's decode attention alone, ms per call, median; "
            "GB/s: the cache bytes it reads / its time"
            + (f"; % of peak: of the GPU memory's {peak:,.0f} GB/s" if peak else "")
            + "\n"
        )
        columns = ATTENTION_COLUMNS + ([PEAK_COLUMN] if peak else [])
        table(result["attention_rows"], columns)


def plot(rows, path):
    """tokens/s against context, one line a variant, one panel a batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    figure, axes = plt.subplots(
        1, len(batches), figsize=(6 * len(batches), 4.5), squeeze=False
    )
    for ax, batch in zip(axes[0], batches):
        for name in dict.fromkeys(r["label"] for r in rows):
            mine = [r for r in rows if r["batch"] == batch and r["label"] == name]
            ax.plot(
                [r["context"] for r in mine],
                [r["tokens_per_s"] for r in mine],
                marker="o",
                label=name,
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (cached positions)")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"batch {batch}")
        ax.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def device():
    import mlx.core as mx

    info = {}
    here = mx.default_device()
    for get, args in (
        # The default device as it is now: mlx 0.31.1's default argument is
        # the one at import.
        (getattr(mx, "device_info", None), (here,)),
        (getattr(getattr(mx, "metal", None), "device_info", None), ()),
    ):
        try:
            info = dict(get(*args)) if get else {}
        except Exception:  # an older mlx, or no such backend
            continue
        if info:
            break
    kind = "cpu" if here == mx.cpu else "gpu"
    if kind == "gpu":
        cuda = getattr(mx, "cuda", None)
        kind = "cuda" if cuda is not None and cuda.is_available() else "metal"
    name = info.get("device_name") or platform.processor() or platform.machine()
    return {
        "name": f"{name} ({kind})",
        "backend": kind,
        "mlx_device": str(here),
        "peak_gb_per_s": peak_gb_per_s(kind),
        "info": {k: v for k, v in info.items() if isinstance(v, (int, float, str))},
    }


def peak_gb_per_s(backend):
    """The GPU memory's peak bandwidth where its driver tells it (CUDA), else
    None: MLX does not give it on Metal, and a CPU's is not the cache's path."""
    if backend != "cuda":
        return None
    from mlx_lm_mla import decode_cuda

    try:
        bandwidth = decode_cuda.gpu().bandwidth
    except RuntimeError:  # no driver to ask
        return None
    return None if bandwidth is None else bandwidth / 1e9


def versions():
    import mlx.core as mx
    import mlx_lm

    import mlx_lm_mla

    return {
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "mlx_lm_mla": mlx_lm_mla.__version__,
        "mlx_lm_mla_path": str(Path(mlx_lm_mla.__file__).parent),
        "python": platform.python_version(),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cpus",
        "device": str(mx.default_device()),
    }


def git_state():
    """The commit measured where the package runs from a checkout, else None."""
    root = Path(__file__).resolve().parents[1]

    def git(*a):
        try:
            out = subprocess.run(
                ["git", *a], cwd=root, capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    if not (root / ".git").exists():
        return {"commit": None, "package_changes_uncommitted": None}
    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "package_changes_uncommitted": git("status", "--porcelain", "--", "mlx_lm_mla"),
    }


def load_average():
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


# The package's settings that change what a run measures (docs/decode.md).
SETTINGS = ("MLX_LM_MLA_DECODE", "MLX_LM_MLA_CUDA_KERNEL")


def settings():
    return {name: os.environ[name] for name in SETTINGS if name in os.environ}


def command_line(argv):
    """The command as run, with the settings it ran under: enough to repeat it."""
    words = [f"{k}={shlex.quote(v)}" for k, v in settings().items()]
    return " ".join(words + ["mlx-lm-mla", "bench", *map(shlex.quote, argv)])


def write_json(result, path, command):
    doc = {"command": command, **result}
    Path(path).write_text(json.dumps(doc, indent=2, default=str))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = parser()
    args = p.parse_args(argv)
    check_args(p, args)
    result = run(args)
    report(result)
    command = command_line(argv)
    if args.json:
        write_json(result, args.json, command)
        print(f"\nwrote {args.json}")
    if args.plot:
        plot(result["decode_rows"], args.plot)
        print(f"drew {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
