"""Time to first token through mlx_lm.server: prompt-cache hit against miss.

A shared prefix of about 2K and 8K tokens (the tiny model's tokenizer is
character level: one token per character, plus a few for the chat template)
goes in the system message, a short question in the user message.

- miss: a fresh prefix every time (its first characters vary), so the
  server's prompt cache holds nothing that starts like it;
- hit: the same prefix every time (stored once by an unmeasured priming
  request) followed by a different short question, so only the question is
  prefilled.

TTFT is measured on streaming requests, from sending the request to the
arrival of the first chunk with content (the server's ": keepalive" lines
during prefill do not count). Ours (the package active) and stock mlx-lm
(``MLX_LM_MLA_DISABLE=1``) run at the same time on different ports and the
requests alternate between them (the order rotates each repetition), so
machine noise hits both alike. No KV quantization: stock mlx-lm crashes MLA
models with ``--kv-bits``. Figures are medians over ``--reps`` repetitions.

The server's prefill step size is its default (``--prefill-step-size``,
2048 in mlx-lm 0.32.x; the script reads it from ``--help``) unless
``--prefill-step-size`` is given here, which passes it to both servers.

Target (the issue): hit TTFT <= 5 % of miss TTFT for the 8K prefix.

    python benchmarks/prefix_ttft.py               # ~3 min here
    python benchmarks/prefix_ttft.py --sizes 2048 8192 16384 --reps 7
"""

import argparse
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _serving_common as sc

NAME = "prefix_ttft"
TARGET = 0.05  # hit TTFT / miss TTFT at the largest (8K) prefix


def base_text(chars, seed):
    """Deterministic code-like text, ``chars`` long."""
    rng = random.Random(seed)
    words = [
        "data",
        "index",
        "value",
        "result",
        "count",
        "items",
        "key",
        "total",
        "node",
        "buf",
    ]
    out, n = [], 0
    while n < chars:
        a, b = rng.sample(words, 2)
        line = f"def {a}_{n % 97}({b}):\n    return {b} * {rng.randint(2, 99)} + len({a!r})\n"
        out.append(line)
        n += len(line)
    return "".join(out)[:chars]


def default_prefill_step():
    out = subprocess.run(
        [sys.executable, "-m", "mlx_lm.server", "--help"],
        capture_output=True,
        text=True,
    ).stdout
    # the option's own help block: from its line to the next option
    m = re.search(r"^\s+--prefill-step-size\b(.*?)(?=^\s+-)", out, re.S | re.M)
    d = m and re.search(r"default:?\s*(\d+)", m.group(1))
    return int(d.group(1)) if d else None


def measure(server, system, user, args):
    extra = {} if args.allow_eos else {"logit_bias": sc.EOS_BIAS}
    r = sc.chat(
        server.port,
        sc.messages(system, user),
        args.max_tokens,
        stream=True,
        timeout=args.timeout,
        **extra,
    )
    if r["ttft"] is None:
        raise sc.RequestFailed("no content chunk in the stream")
    return {
        "ttft": r["ttft"],
        "latency": r["latency"],
        "prompt_tokens": r["usage"].get("prompt_tokens"),
        "cached_tokens": sc.cached_tokens(r["usage"]),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[2048, 8192],
        help="shared prefix lengths, characters (~ tokens)",
    )
    p.add_argument(
        "--reps", type=int, default=3, help="misses and hits per size and server"
    )
    p.add_argument(
        "--max-tokens", type=int, default=4, help="per request (only the first counts)"
    )
    p.add_argument(
        "--prefill-step-size",
        type=int,
        default=None,
        help="passed to both servers (default: the server's own default)",
    )
    p.add_argument(
        "--servers", nargs="+", default=["ours", "stock"], choices=["ours", "stock"]
    )
    p.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    p.add_argument("--allow-eos", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--json", default=None, help=f"default benchmarks/results/{NAME}.json"
    )
    args = p.parse_args()

    started = time.perf_counter()
    vers = sc.versions()
    sc.warn_if_stale(vers)
    server_default_step = default_prefill_step()
    step = args.prefill_step_size or server_default_step
    flags = (
        []
        if args.prefill_step_size is None
        else ["--prefill-step-size", args.prefill_step_size]
    )
    print(
        f"prefill step size: {step} "
        f"({'passed with --prefill-step-size' if flags else 'the server default'}); "
        f"no KV quantization; sizes {args.sizes}; {args.reps} reps",
        flush=True,
    )

    text = base_text(max(args.sizes) + 64, args.seed)
    samples = {
        (lab, n, kind): []
        for lab in args.servers
        for n in args.sizes
        for kind in ("miss", "hit")
    }
    errors = []
    total = len(args.sizes) * len(args.servers) * (1 + 2 * args.reps)
    progress = sc.Progress(total, "requests", every=5)
    servers = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_path = sc.save_served_model(Path(tmp) / "glm")
        try:
            for lab in args.servers:
                servers[lab] = sc.Server(
                    model_path,
                    *flags,
                    disabled=lab == "stock",
                    log=sc.log_path(args.json, NAME, lab),
                )
            fresh = 0
            for n in args.sizes:
                shared = text[:n]
                for (
                    lab
                ) in args.servers:  # prime: store the shared prefix (also a warm-up)
                    try:
                        measure(servers[lab], shared, "Prime: what is this code?", args)
                    except sc.RequestFailed as e:
                        errors.append(
                            {"server": lab, "size": n, "kind": "prime", "error": str(e)}
                        )
                    progress.update(f"{n} prime {lab}")
                for rep in range(args.reps):
                    order = (
                        args.servers[rep % len(args.servers) :]
                        + args.servers[: rep % len(args.servers)]
                    )
                    for lab in order:
                        fresh += 1
                        tag = f"#{fresh:04d}{args.seed}# "
                        cases = [
                            (
                                "miss",
                                tag + text[: n - len(tag)],
                                f"Question {rep}: what does it do?",
                            ),
                            (
                                "hit",
                                shared,
                                f"Question {rep}: which function is longest?",
                            ),
                        ]
                        for kind, system, user in cases:
                            try:
                                samples[(lab, n, kind)].append(
                                    measure(servers[lab], system, user, args)
                                )
                            except sc.RequestFailed as e:
                                errors.append(
                                    {
                                        "server": lab,
                                        "size": n,
                                        "kind": kind,
                                        "rep": rep,
                                        "error": str(e),
                                    }
                                )
                            progress.update(f"{n} {kind} {lab}")
            memory = {lab: sc.proc_status(s.proc.pid) for lab, s in servers.items()}
        finally:
            progress.close()
            for s in servers.values():
                s.close()

    rows, summary = [], []
    for n in args.sizes:
        for lab in args.servers:
            miss, hit = samples[(lab, n, "miss")], samples[(lab, n, "hit")]
            m = sc.median([x["ttft"] for x in miss])
            h = sc.median([x["ttft"] for x in hit])
            entry = {
                "server": lab,
                "prefix_chars": n,
                "prompt_tokens_miss": sc.median([x["prompt_tokens"] for x in miss]),
                "cached_tokens_miss": sc.median([x["cached_tokens"] for x in miss]),
                "cached_tokens_hit": sc.median([x["cached_tokens"] for x in hit]),
                "ttft_miss": m,
                "ttft_hit": h,
                "hit_over_miss": (h / m) if (h and m) else None,
                "n_miss": len(miss),
                "n_hit": len(hit),
            }
            summary.append(entry)
    by = {(e["server"], e["prefix_chars"]): e for e in summary}
    for e in summary:
        other = by.get(("stock", e["prefix_chars"])) if e["server"] == "ours" else None
        e["ours_over_stock_miss"] = (
            (e["ttft_miss"] / other["ttft_miss"])
            if other and other["ttft_miss"] and e["ttft_miss"]
            else None
        )
        e["ours_over_stock_hit"] = (
            (e["ttft_hit"] / other["ttft_hit"])
            if other and other["ttft_hit"] and e["ttft_hit"]
            else None
        )
        f = lambda v, s: "-" if v is None else format(v, s)  # noqa: E731
        rows.append(
            [
                str(e["prefix_chars"]),
                e["server"],
                f(e["prompt_tokens_miss"], ".0f"),
                f"{f(e['cached_tokens_miss'], '.0f')} / {f(e['cached_tokens_hit'], '.0f')}",
                f(e["ttft_miss"], ".3f"),
                f(e["ttft_hit"], ".3f"),
                "-"
                if e["hit_over_miss"] is None
                else f"{100 * e['hit_over_miss']:.1f} %",
                f(e["ours_over_stock_miss"], ".2f"),
                f(e["ours_over_stock_hit"], ".2f"),
            ]
        )
    print()
    sc.table(
        rows,
        [
            "prefix",
            "server",
            "prompt tok",
            "cached miss/hit",
            "TTFT miss s",
            "TTFT hit s",
            "hit/miss",
            "ours/stock miss",
            "ours/stock hit",
        ],
    )
    largest = max(args.sizes)
    target = by.get(("ours", largest))
    met = None
    if target and target["hit_over_miss"] is not None:
        met = target["hit_over_miss"] <= TARGET
        print(
            f"\ntarget: hit TTFT <= {TARGET:.0%} of miss at the {largest}-char prefix (ours): "
            f"{100 * target['hit_over_miss']:.1f} % -> {'MET' if met else 'MISSED'}"
        )
    for e in errors:
        print(f"error: {e}")
    path = sc.write_json(
        args.json,
        NAME,
        args,
        {
            "prefill_step_size": step,
            "prefill_step_size_source": "--prefill-step-size"
            if flags
            else "server default",
            "target": {
                "hit_over_miss_max": TARGET,
                "prefix_chars": largest,
                "met": met,
            },
            "summary": summary,
            "samples": {
                f"{lab}/{n}/{kind}": v for (lab, n, kind), v in samples.items()
            },
            "errors": errors,
            "server_memory_at_end": memory,
        },
        started,
        vers,
    )
    print(f"\nwrote {path} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    sys.exit(main())
