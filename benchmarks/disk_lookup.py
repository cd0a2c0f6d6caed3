"""The disk tier's lookup against the number of files it indexes, and the
time to first token of a short prompt that shares nothing with a large file
on disk.

lookup: a tier folder whose index holds N rows (100, 1,000, 10,000) of
``--tokens`` tokens each, all starting with the same ``--system`` tokens (a
shared system prompt), as the server's writer adds them; the rows have no
files, so only the index is read. ``DiskTier.lookup`` (what ``restore`` does
before it reads a file, on the server's generation thread) is timed, median
of ``--repeat`` calls, for three prompts: one that shares nothing, one that
shares the system prompt only (every row is a candidate), one that shares
half of one row. Also timed: the index's check when a server opens the
folder (``Index.problem``: SQLite's quick_check), and the index's size.

ttft: a tiny bf16 ``qwen2`` served three ways: without the tier, with an
empty ``--prompt-cache-dir``, and with one holding a 32K-token prompt cache
(about 33 MB, written by the tier itself from random arrays of the model's
shapes, under the chat template's tokens). Each server gets a warm-up
request, then ``--requests`` short unrelated prompts, streamed; TTFT is from
sending a request to its first content chunk. The variants run interleaved,
``--rounds`` fresh servers each.

    python benchmarks/disk_lookup.py                     # ~6 min here
    python benchmarks/disk_lookup.py --rows 100 1000 --skip-ttft
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _serving_common as sc

NAME = "disk_lookup"
TARGET_MS = 5.0  # a lookup at 10,000 rows (the issue)


def _prompt(n, seed):
    return [seed % 97 + 3] + [3 + (seed * 7919 + i * 31) % 1000 for i in range(n - 1)]


def fill(tier, key, rows, tokens, system):
    """``rows`` index rows of ``tokens`` tokens, each starting with ``system``."""
    import json

    import numpy as np

    from mlx_lm_mla.disk import index
    from mlx_lm_mla.disk.cachefile import make_record
    from mlx_lm_mla.disk.tier import file_name

    model, digest = tier._model(key)
    with tier.index.transaction() as db:
        for i in range(rows):
            ids = system + _prompt(tokens - len(system), 1000 + i)
            blob = np.asarray(ids, dtype="<i4").tobytes()
            record = make_record(
                json.loads(model), digest, tier.cache_digest, {}, blob, True
            )
            index.add(
                db, file_name(digest, tier.cache_digest, blob), record, blob, 1 << 20
            )


def timed(call, repeat):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def lookups(args, tmp):
    import argparse as ap

    import mlx_lm_mla
    from mlx_lm_mla.disk.fingerprint import cache_settings
    from mlx_lm_mla.disk.folder import INDEX, SUBFOLDER
    from mlx_lm_mla.disk.index import Index
    from mlx_lm_mla.disk.tier import DiskTier

    mlx_lm_mla.install()
    model = Path(tmp) / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    key = (str(model), None, None)
    system = _prompt(args.system, 1)
    results = []
    for n in args.rows:
        folder = Path(tmp) / f"rows-{n}"
        tier = DiskTier(folder, 1 << 62, cache_settings(ap.Namespace()), min_tokens=256)
        started = time.perf_counter()
        fill(tier, key, n, args.tokens, system)
        built = time.perf_counter() - started
        one = system + _prompt(args.tokens - len(system), 1000 + n // 2)
        prompts = {
            "unrelated": _prompt(args.tokens // 2, 77),
            "system prompt": system + _prompt(args.tokens // 2, 5),
            "half a row": one[: args.tokens // 2] + _prompt(200, 6),
        }
        found = {k: tier.lookup(key, p) for k, p in prompts.items()}
        assert found["unrelated"] is None and found["half a row"][1] == args.tokens // 2
        ms = {
            k: 1e3 * timed(lambda p=p: tier.lookup(key, p), args.repeat)
            for k, p in prompts.items()
        }
        tier.close()
        size = (folder / SUBFOLDER / INDEX).stat().st_size
        check = timed(lambda: Index(folder / SUBFOLDER).problem(), 3)
        entry = {
            "rows": n,
            "tokens_per_row": args.tokens,
            "index_mb": size / 1e6,
            "fill_s": built,
            "check_at_start_s": check,
            **{f"lookup_ms_{k.replace(' ', '_')}": v for k, v in ms.items()},
        }
        results.append(entry)
        print(
            f"{n} rows: lookups {', '.join(f'{k} {v:.2f} ms' for k, v in ms.items())}; "
            f"index {size / 1e6:.0f} MB, checked in {check:.2f} s",
            file=sys.stderr,
            flush=True,
        )
    return results


def server_args(argv):
    """The arguments mlx_lm.server parses from ``argv`` (its defaults
    included), read by its own parser in this process."""
    import argparse as ap

    import mlx_lm.server as server

    seen, real = [], (server.run, server.ModelProvider, sys.argv)
    server.run = lambda host, port, provider: seen.append(provider.cli_args)
    server.ModelProvider = lambda parsed: ap.Namespace(cli_args=parsed)
    sys.argv = ["mlx_lm.server", *map(str, argv)]
    try:
        server.main()
    finally:
        server.run, server.ModelProvider, sys.argv = real
    return seen[0]


def write_large_file(model_path, folder, tokens):
    """A ``tokens``-token prompt cache of the model, written by the tier into
    ``folder`` under the chat template's tokens, with random values."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lm_mla.disk.fingerprint import cache_settings
    from mlx_lm_mla.disk.tier import DiskTier
    from mlx_lm_mla import tiny
    from prefix_ttft import base_text

    model, tokenizer = tiny.load(model_path)
    text = base_text(tokens * 2, seed=3)
    ids = tokenizer.apply_chat_template(
        sc.messages(text, "Summarise."), add_generation_prompt=True
    )
    ids = list(ids)[:tokens]
    cache = make_prompt_cache(model)
    model(mx.array([ids[:1]]), cache=cache)  # the layers' shapes
    for layer in cache:
        shape = list(layer.keys.shape)
        shape[2] = len(ids)
        layer.keys = layer.values = None
        layer.offset = 0
        layer.update_and_fetch(
            mx.random.normal(shape).astype(mx.bfloat16),
            mx.random.normal(shape).astype(mx.bfloat16),
        )
    args = server_args(["--model", model_path, "--prompt-cache-dir", folder])
    tier = DiskTier(folder, 1 << 40, cache_settings(args), min_tokens=256)
    tier.store((str(model_path), None, None), ids, cache)
    tier.flush()
    tier.close()
    return sum(p.stat().st_size for p in Path(folder).rglob("*.safetensors"))


def ttfts(args, tmp):
    import mlx.core as mx

    import mlx_lm_mla
    from mlx_lm_mla import tiny

    mlx_lm_mla.install()
    model = tiny.save_model(
        Path(tmp) / "qwen2", "qwen2", dtype=mx.bfloat16, max_position_embeddings=65536
    )
    large = Path(tmp) / "with-file"
    nbytes = write_large_file(str(model), large, args.file_tokens)
    variants = {
        "no tier": [],
        "tier, empty folder": ["--prompt-cache-dir", Path(tmp) / "empty"],
        f"tier, a {args.file_tokens:,}-token file": ["--prompt-cache-dir", large],
    }
    times, cached, logs = {v: [] for v in variants}, {v: 0 for v in variants}, {}
    for r in range(args.rounds):
        order = (
            list(variants)[r % len(variants) :] + list(variants)[: r % len(variants)]
        )
        for variant in order:
            log = Path(tmp) / f"log-{len(logs)}"
            logs[log] = variant
            with sc.Server(model, *variants[variant], log=log) as server:
                sc.chat(
                    server.port,
                    sc.messages("Be brief.", "Hello?"),
                    4,
                    stream=True,
                    logit_bias=sc.EOS_BIAS,
                )
                for i in range(args.requests):
                    q = sc.messages("Be brief.", f"What is {i} plus {r}?")
                    out = sc.chat(
                        server.port, q, 4, stream=True, logit_bias=sc.EOS_BIAS
                    )
                    times[variant].append(out["ttft"])
                    cached[variant] = max(
                        cached[variant], sc.cached_tokens(out["usage"])
                    )
    restored = [
        v for log, v in logs.items() if "restored a prompt cache" in log.read_text()
    ]
    results = [
        {
            "variant": v,
            "ttft_median_s": statistics.median(t),
            "n": len(t),
            "max_cached_tokens": cached[v],
        }
        for v, t in times.items()
    ]
    return results, nbytes, restored


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[100, 1000, 10000])
    p.add_argument("--tokens", type=int, default=8192, help="tokens per row")
    p.add_argument(
        "--system", type=int, default=1024, help="tokens every row starts with"
    )
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--file-tokens", type=int, default=32768)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--skip-ttft", action="store_true")
    p.add_argument(
        "--json", default=None, help=f"default benchmarks/results/{NAME}.json"
    )
    args = p.parse_args()

    started = time.perf_counter()
    vers = sc.versions()
    sc.warn_if_stale(vers)
    with tempfile.TemporaryDirectory() as tmp:
        lookup = lookups(args, tmp)
        ttft, nbytes, restored = ttfts(args, tmp) if not args.skip_ttft else ([], 0, [])

    print()
    sc.table(
        [
            [
                f"{e['rows']:,}",
                f"{e['tokens_per_row']:,}",
                f"{e['index_mb']:.0f}",
                f"{e['lookup_ms_unrelated']:.2f}",
                f"{e['lookup_ms_system_prompt']:.2f}",
                f"{e['lookup_ms_half_a_row']:.2f}",
                f"{e['check_at_start_s']:.2f}",
            ]
            for e in lookup
        ],
        [
            "rows",
            "tokens/row",
            "index MB",
            "lookup ms: unrelated",
            "system prompt",
            "half a row",
            "check at start s",
        ],
    )
    largest = max(lookup, key=lambda e: e["rows"])
    worst = max(v for k, v in largest.items() if k.startswith("lookup_ms"))
    met = largest["rows"] >= 10000 and worst <= TARGET_MS
    print(
        f"\ntarget: a lookup at 10,000 rows <= {TARGET_MS:g} ms: "
        f"{'MET' if met else 'MISSED'} "
        f"({worst:.2f} ms at {largest['rows']:,} rows)"
    )
    if ttft:
        print()
        sc.table(
            [
                [
                    e["variant"],
                    f"{e['ttft_median_s']:.3f}",
                    str(e["n"]),
                    str(e["max_cached_tokens"]),
                ]
                for e in ttft
            ],
            ["server", "TTFT s (median)", "requests", "cached tokens, most"],
        )
        print(
            f"\nfile on disk: {nbytes / 1e6:.1f} MB; servers that restored from disk: "
            f"{sorted(set(restored)) or 'none'}"
        )
    path = sc.write_json(
        args.json,
        NAME,
        args,
        {
            "lookup": lookup,
            "ttft": ttft,
            "file_bytes": nbytes,
            "restored": restored,
            "target": {"lookup_ms": TARGET_MS, "met": met},
        },
        started,
        vers,
    )
    print(f"\nwrote {path} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
