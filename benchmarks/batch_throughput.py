"""Total generated tokens/s through mlx_lm.server with --decode-concurrency
1, 2 and 4: ours against stock mlx-lm, with and without KV quantization.

For a decode concurrency of N, N client threads start together and each
sends ``--requests-per-client`` streaming /v1/chat/completions requests one
after another (the tests' short shared system prompt, a distinct question,
``max_tokens`` fixed, end-of-text suppressed so every completion has exactly
that length). Throughput = all completion tokens / wall time from the first
request sent to the last one finished.

Variants per N: ``ours`` (the package active), ``ours kv4`` (plus
``--kv-bits 4 --quantized-kv-start 64``) and ``stock`` (``MLX_LM_MLA_DISABLE=1``,
no KV quantization: stock mlx-lm crashes MLA models with ``--kv-bits``).
The ratio ours/stock is given where both exist (unquantized).

Stock mlx-lm's server (0.32.x) does not batch when ``--kv-bits`` is set (its
``--help`` says so; ``ResponseGenerator._is_batchable``): such requests are
served one at a time. The package's hooks keep MLA models batched under
``--kv-bits`` (``patches/server.py``) in versions that have them.
This script does not work around either; it measures what happens: the
"batched" column. "overlap" is the largest number of requests that were streaming
tokens at the same moment (first content chunk to end of stream): N when the
server batches, 1 when it serves one request at a time; "mean overlap" is
the summed streaming time over the wall time.

The servers for one N run at the same time on different ports and are
measured in turn, the order rotating each round (``--rounds``), so machine
noise hits every variant alike; figures are medians over rounds. Each server
gets one unmeasured warm-up request first (it also stores the shared system
prompt in the prompt cache, so every measured request starts from a hit).

    python benchmarks/batch_throughput.py                  # ~3 min here
    python benchmarks/batch_throughput.py --concurrency 1 2 4 8 --rounds 3 --max-tokens 256
"""

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import _serving_common as sc

NAME = "batch_throughput"


def run_clients(server, n_clients, per_client, max_tokens, first_q, args):
    """n_clients threads, each sending per_client requests in turn. Returns
    the records and the wall time."""
    qs = sc.serving.questions(first_q + n_clients * per_client)[first_q:]
    records, lock = [], threading.Lock()
    barrier = threading.Barrier(n_clients + 1)
    extra = {} if args.allow_eos else {"logit_bias": sc.EOS_BIAS}

    def client(k):
        barrier.wait()
        for j in range(per_client):
            q = qs[k * per_client + j]
            t = time.perf_counter()
            rec = {"client": k, "request": j, "start": t}
            try:
                r = sc.chat(
                    server.port,
                    sc.messages(sc.serving.SYSTEM, q),
                    max_tokens,
                    stream=True,
                    timeout=args.timeout,
                    **extra,
                )
                rec.update(
                    ok=True,
                    first=t + (r["ttft"] or r["latency"]),
                    end=t + r["latency"],
                    completion_tokens=r["usage"].get("completion_tokens", 0),
                    cached_tokens=sc.cached_tokens(r["usage"]),
                    prompt_tokens=r["usage"].get("prompt_tokens", 0),
                )
            except sc.RequestFailed as e:
                rec.update(ok=False, end=time.perf_counter(), error=str(e))
            with lock:
                records.append(rec)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(n_clients)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    barrier.wait()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for r in records:  # times relative to the start, for the JSON
        for key in ("start", "first", "end"):
            if key in r:
                r[key] = round(r[key] - t0, 4)
    return records, wall


def overlap(records):
    """Largest number of requests streaming at once, and the summed
    streaming time (first content chunk to end)."""
    events = []
    for r in records:
        if r.get("ok"):
            events += [(r["first"], 1), (r["end"], -1)]
    events.sort(key=lambda e: (e[0], e[1]))  # an end before a start at the same instant
    peak = cur = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    busy = sum(r["end"] - r["first"] for r in records if r.get("ok"))
    return peak, busy


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--requests-per-client", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--kv-bits", type=int, default=4)
    p.add_argument("--quantized-kv-start", type=int, default=64)
    p.add_argument(
        "--variants",
        nargs="+",
        default=["ours", "ours-kv", "stock"],
        choices=["ours", "ours-kv", "stock"],
    )
    p.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    p.add_argument("--allow-eos", action="store_true")
    p.add_argument(
        "--json", default=None, help=f"default benchmarks/results/{NAME}.json"
    )
    args = p.parse_args()

    started = time.perf_counter()
    vers = sc.versions()
    sc.warn_if_stale(vers)
    kv = ["--kv-bits", args.kv_bits, "--quantized-kv-start", args.quantized_kv_start]
    label = {"ours": "ours", "ours-kv": f"ours kv{args.kv_bits}", "stock": "stock"}
    print(
        f"{args.requests_per_client} requests per client, max_tokens {args.max_tokens}, "
        f"{args.rounds} rounds; KV quantization: {' '.join(map(str, kv))}",
        flush=True,
    )

    runs = {}  # (variant, c) -> list of round results
    errors = []
    total = len(args.concurrency) * len(args.variants) * (args.rounds + 1)
    progress = sc.Progress(total, "runs", every=3)
    q = 0
    with tempfile.TemporaryDirectory() as tmp:
        model_path = sc.save_served_model(Path(tmp) / "glm")
        try:
            for c in args.concurrency:
                servers = {}
                try:
                    for v in args.variants:
                        flags = ["--decode-concurrency", c] + (
                            kv if v == "ours-kv" else []
                        )
                        servers[v] = sc.Server(
                            model_path,
                            *flags,
                            disabled=v == "stock",
                            log=sc.log_path(args.json, NAME, f"{v}-c{c}"),
                        )
                    for v in args.variants:  # warm-up, unmeasured
                        try:
                            sc.chat(
                                servers[v].port,
                                sc.messages(sc.serving.SYSTEM, "Warm up."),
                                16,
                                timeout=args.timeout,
                            )
                        except sc.RequestFailed as e:
                            errors.append(
                                {
                                    "variant": v,
                                    "concurrency": c,
                                    "warmup": True,
                                    "error": str(e),
                                }
                            )
                        progress.update(f"c={c} warm-up {v}")
                    for rnd in range(args.rounds):
                        k = rnd % len(args.variants)
                        for v in args.variants[k:] + args.variants[:k]:
                            recs, wall = run_clients(
                                servers[v],
                                c,
                                args.requests_per_client,
                                args.max_tokens,
                                q,
                                args,
                            )
                            q += c * args.requests_per_client
                            ok = [r for r in recs if r["ok"]]
                            tokens = sum(r["completion_tokens"] for r in ok)
                            peak, busy = overlap(recs)
                            runs.setdefault((v, c), []).append(
                                {
                                    "round": rnd,
                                    "wall": wall,
                                    "tokens": tokens,
                                    "tokens_per_second": tokens / wall
                                    if wall
                                    else None,
                                    "served": len(ok),
                                    "errors": len(recs) - len(ok),
                                    "overlap_peak": peak,
                                    "overlap_mean": busy / wall if wall else None,
                                    "records": sorted(recs, key=lambda r: r["start"]),
                                }
                            )
                            for r in recs:
                                if not r["ok"]:
                                    errors.append(
                                        {
                                            "variant": v,
                                            "concurrency": c,
                                            "round": rnd,
                                            "client": r["client"],
                                            "request": r["request"],
                                            "error": r["error"],
                                        }
                                    )
                            progress.update(f"c={c} {v} {tokens / wall:.0f} tok/s")
                finally:
                    for s in servers.values():
                        s.close()
        finally:
            progress.close()

    summary, rows = [], []
    med = {}
    for c in args.concurrency:
        for v in args.variants:
            rs = runs.get((v, c), [])
            tps = sc.median([r["tokens_per_second"] for r in rs if r["served"]])
            med[(v, c)] = tps
            summary.append(
                {
                    "variant": v,
                    "concurrency": c,
                    "tokens_per_second": tps,
                    "tokens_per_second_rounds": [r["tokens_per_second"] for r in rs],
                    "overlap_peak": max((r["overlap_peak"] for r in rs), default=None),
                    "overlap_mean": sc.median([r["overlap_mean"] for r in rs]),
                    "served": sum(r["served"] for r in rs),
                    "errors": sum(r["errors"] for r in rs),
                    "batched": (max((r["overlap_peak"] for r in rs), default=0) > 1)
                    if rs
                    else None,
                }
            )
    for e in summary:
        v, c = e["variant"], e["concurrency"]
        stock = med.get(("stock", c))
        e["ours_over_stock"] = (
            (e["tokens_per_second"] / stock)
            if v == "ours" and stock and e["tokens_per_second"]
            else None
        )
        f = lambda x, s: "-" if x is None else format(x, s)  # noqa: E731
        rows.append(
            [
                str(c),
                label[v],
                f(e["tokens_per_second"], ".0f"),
                " ".join(f(x, ".0f") for x in e["tokens_per_second_rounds"]),
                f"{e['overlap_peak']} / {f(e['overlap_mean'], '.2f')}",
                "yes" if e["batched"] else "no (one at a time)" if c > 1 else "-",
                f"{e['served']} / {e['errors']}",
                f(e["ours_over_stock"], ".2f"),
            ]
        )
    print()
    sc.table(
        rows,
        [
            "concurrency",
            "variant",
            "tok/s",
            "rounds",
            "overlap peak/mean",
            "batched",
            "served/errors",
            "ours/stock",
        ],
    )
    for e in errors[:10]:
        print(f"error: {e}")
    path = sc.write_json(
        args.json,
        NAME,
        args,
        {
            "summary": summary,
            "runs": {f"{v}/c{c}": rs for (v, c), rs in runs.items()},
            "errors": errors,
        },
        started,
        vers,
    )
    print(f"\nwrote {path} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    sys.exit(main())
