"""Soak: the workload that broke in the field, against a real mlx_lm.server.

BigCodeBench through ``mlx_lm.server`` with KV-cache quantization: many
sequential /v1/chat/completions requests that share a long system prefix
(so the server's cross-request prompt cache hits on every request after the
first), each asking for a long completion (1,000-3,400 tokens). Stock
mlx-lm fails these with ``AttributeError: 'list' object has no attribute
'swapaxes'`` once the cache crosses ``--quantized-kv-start``.

The tiny random-weight GLM-4.7-Flash of ``tests/serving.py`` (6-bit weights,
character-level tokenizer) decodes a few hundred tokens/s on a laptop CPU, so
the completion lengths are scaled: each request's ``max_tokens`` is drawn
deterministically (``--seed``) between ``1000*scale`` and ``3400*scale``.
Completions always run to ``max_tokens``: the end-of-text token gets a
``logit_bias`` of -100 (``--allow-eos`` turns that off).

Both servers run at once and get the same requests, in turn (request i goes
to ours and to stock, the order alternating): ours (the package active
through its start-up hook) and stock mlx-lm (``MLX_LM_MLA_DISABLE=1``).
A failed request is recorded with its error text and the run goes on. Each
request has a timeout (``--timeout``); after ``--max-consecutive-timeouts``
timeouts in a row the server counts as hung, and if its process has died,
nothing more is sent to it: the rest of the requests count as errors
("not sent"). Peak memory is the server process's VmHWM from /proc, read at
the end before it is terminated. Server logs go to a logs/ folder next to
the JSON (benchmarks/results/logs/ by default).

An error in OUR server is a bug: the script prints its request index, error
text and the server log tail.

    python benchmarks/soak_server.py                      # defaults, ~5 min
    python benchmarks/soak_server.py --requests 1140 --scale 1 --timeout 600
"""

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import _serving_common as sc

NAME = "soak_server"

LIBRARIES = [
    "numpy",
    "pandas",
    "re",
    "itertools",
    "collections",
    "json",
    "datetime",
    "matplotlib",
    "scipy",
    "random",
    "os",
    "hashlib",
    "sklearn",
    "requests",
]


def system_prefix(chars, seed):
    """A BigCodeBench-style instruction block with library notes, ``chars``
    characters long (about one token per character)."""
    rng = random.Random(seed)
    head = (
        "You are an expert Python programmer. Complete the function the user "
        "gives you. Return only self-contained code that starts with the imports "
        "and the function signature, with no explanation. Follow the docstring "
        "exactly: requirements, raised exceptions and the example output.\n"
        "Reference notes for the libraries you may use:\n"
    )
    lines = [head]
    n = 0
    while sum(map(len, lines)) < chars:
        lib = rng.choice(LIBRARIES)
        lines.append(
            f"- {lib}: note {n}: prefer vectorised calls; check inputs of type "
            f"{rng.choice(['list', 'dict', 'str', 'DataFrame', 'ndarray'])} and "
            f"raise ValueError on {rng.choice(['empty', 'negative', 'malformed'])} input.\n"
        )
        n += 1
    return "".join(lines)[:chars]


def user_turn(i, rng):
    libs = ", ".join(rng.sample(LIBRARIES, 3))
    return (
        f"Task BigCodeBench/{i}: write task_func_{i}(data, n={rng.randint(1, 99)}) using {libs}. "
        f"It should return the {rng.choice(['mean', 'histogram', 'sorted keys', 'hash'])} "
        f"of the input and raise ValueError if data is empty."
    )


class Target:
    """One server under the soak: its process, records and state."""

    def __init__(self, label, model_path, flags, disabled, json_path):
        self.label = label
        self.log = sc.log_path(json_path, NAME, label)
        self.records = []
        self.summary = {
            "label": label,
            "flags": [str(f) for f in flags],
            "log": str(self.log),
        }
        self.stop_reason = None
        self.consecutive_timeouts = 0
        self.busy = 0.0  # seconds spent on this server's requests
        try:
            self.server = sc.Server(model_path, *flags, disabled=disabled, log=self.log)
        except Exception as e:  # the server did not come up: every request is an error
            self.server, self.stop_reason = None, f"server did not start: {e!r}"

    def send(self, i, system, user, max_tokens, args):
        rec = {"index": i, "max_tokens": max_tokens}
        server = self.server
        if self.stop_reason is None and not sc.server_alive(server):
            self.stop_reason = (
                f"server process exited with code {server.proc.returncode}"
            )
        if self.stop_reason is not None:
            rec.update(ok=False, sent=False, error=f"not sent: {self.stop_reason}")
            self.records.append(rec)
            return
        stream = args.stream_every > 0 and i % args.stream_every == 0
        extra = {} if args.allow_eos else {"logit_bias": sc.EOS_BIAS}
        t_request = time.perf_counter()
        try:
            r = sc.chat(
                server.port,
                sc.messages(system, user),
                max_tokens,
                stream=stream,
                timeout=args.timeout,
                **extra,
            )
            usage = r["usage"]
            rec.update(
                ok=True,
                sent=True,
                stream=stream,
                latency=r["latency"],
                prompt_tokens=usage.get("prompt_tokens", 0),
                completion_tokens=usage.get("completion_tokens", 0),
                cached_tokens=sc.cached_tokens(usage),
            )
            self.consecutive_timeouts = 0
        except sc.RequestFailed as e:
            rec.update(
                ok=False,
                sent=True,
                stream=stream,
                error=str(e),
                latency=time.perf_counter() - t_request,
            )
            if isinstance(e, sc.Timeout):
                self.consecutive_timeouts += 1
                if self.consecutive_timeouts >= args.max_consecutive_timeouts:
                    self.stop_reason = (
                        f"server unresponsive: {self.consecutive_timeouts} "
                        f"consecutive timeouts of {args.timeout:g} s"
                    )
            else:
                self.consecutive_timeouts = 0
            if not sc.server_alive(server):
                self.stop_reason = (
                    f"server process exited with code {server.proc.returncode}"
                )
        self.busy += time.perf_counter() - t_request
        self.records.append(rec)

    def finish(self):
        s = self.summary
        if self.server is not None:
            s.update(
                {k.lower(): v for k, v in sc.proc_status(self.server.proc.pid).items()}
            )
            s["exit_code_before_close"] = self.server.proc.poll()
            self.server.close()
            self.server = None
        s["busy_seconds"] = self.busy
        s["stop_reason"] = self.stop_reason
        summarize(s, self.records)
        s["server_exceptions"] = sc.log_exceptions(self.log)
        # the server's own account of its prompt cache (GB, 2 decimals)
        stats = [
            ln.split("INFO - ")[-1].strip()
            for ln in open(self.log, errors="replace")
            if "Prompt Cache:" in ln
        ]
        s["prompt_cache_last_log"] = stats[-1] if stats else None
        if self.label == "ours" and s["errors"]:
            s["log_tail"] = sc.log_tail(self.log, 40)
        return s, self.records


def run(model_path, flags, work, args):
    """Both servers up at once; request i goes to each in turn (the order
    alternates), so slow patches of the machine hit both alike."""
    targets = []
    try:
        for label in args.servers:
            targets.append(
                Target(label, model_path, flags, label == "stock", args.json)
            )
        progress = sc.Progress(len(work), "requests", every=20)
        try:
            for i, (system, user, max_tokens) in enumerate(work):
                order = targets if i % 2 == 0 else targets[::-1]
                for t in order:
                    t.send(i, system, user, max_tokens, args)
                progress.update(
                    "  ".join(
                        f"{t.label} {sum(not r['ok'] for r in t.records)} err"
                        for t in targets
                    )
                )
        finally:
            progress.close()
    finally:
        results = {t.label: t.finish() for t in targets}
    return results


def summarize(s, records):
    ok = [r for r in records if r["ok"]]
    bad = [r for r in records if not r["ok"]]
    lat = [r["latency"] for r in ok]
    prompt = sum(r["prompt_tokens"] for r in ok)
    s.update(
        requests=len(records),
        served=len(ok),
        errors=len(bad),
        errors_not_sent=sum(not r["sent"] for r in bad),
        first_error_index=bad[0]["index"] if bad else None,
        first_error=bad[0]["error"] if bad else None,
        distinct_errors=sorted({r["error"][:160] for r in bad})[:10],
        latency_p50=sc.percentile(lat, 50),
        latency_p95=sc.percentile(lat, 95),
        prompt_tokens=prompt,
        cached_tokens=sum(r["cached_tokens"] for r in ok),
        cached_ratio=(sum(r["cached_tokens"] for r in ok) / prompt) if prompt else None,
        completion_tokens=sum(r["completion_tokens"] for r in ok),
        short_completions=sum(r["completion_tokens"] < r["max_tokens"] for r in ok),
        tokens_per_second=(sum(r["completion_tokens"] for r in ok) / sum(lat))
        if lat
        else None,
    )


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument(
        "--scale",
        type=float,
        default=0.03,
        help="completion lengths are drawn between 1000*scale and 3400*scale tokens "
        "(default 0.03: 30-102 tokens; both servers take ~5 min on 2 CPU cores)",
    )
    p.add_argument("--min-completion", type=int, default=1000, help="before --scale")
    p.add_argument("--max-completion", type=int, default=3400, help="before --scale")
    p.add_argument(
        "--prefix-chars",
        type=int,
        default=1000,
        help="shared system prefix, characters (~ tokens)",
    )
    p.add_argument("--kv-bits", type=int, default=4, help="0 = no KV quantization")
    p.add_argument("--quantized-kv-start", type=int, default=64)
    p.add_argument("--decode-concurrency", type=int, default=4)
    p.add_argument("--timeout", type=float, default=60.0, help="per request, seconds")
    p.add_argument("--max-consecutive-timeouts", type=int, default=3)
    p.add_argument(
        "--stream-every",
        type=int,
        default=0,
        help="stream every Nth request (0: none, as the field workload)",
    )
    p.add_argument(
        "--allow-eos",
        action="store_true",
        help="let the model stop early (default: EOS suppressed by logit_bias)",
    )
    p.add_argument(
        "--servers", nargs="+", default=["ours", "stock"], choices=["ours", "stock"]
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--json", default=None, help=f"default benchmarks/results/{NAME}.json"
    )
    args = p.parse_args()

    started = time.perf_counter()
    vers = sc.versions()
    sc.warn_if_stale(vers)
    lo = max(1, round(args.min_completion * args.scale))
    hi = max(lo, round(args.max_completion * args.scale))
    rng = random.Random(args.seed)
    system = system_prefix(args.prefix_chars, args.seed)
    work = [
        (system, user_turn(i, rng), rng.randint(lo, hi)) for i in range(args.requests)
    ]
    flags = ["--decode-concurrency", args.decode_concurrency]
    if args.kv_bits:
        flags += [
            "--kv-bits",
            args.kv_bits,
            "--quantized-kv-start",
            args.quantized_kv_start,
        ]
    print(
        f"scale {args.scale}: max_tokens drawn in [{lo}, {hi}] "
        f"(field: [{args.min_completion}, {args.max_completion}]), "
        f"{args.requests} requests, {sum(w[2] for w in work)} completion tokens asked per server, "
        f"system prefix {len(system)} chars",
        flush=True,
    )
    print("server flags: " + " ".join(map(str, flags)), flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        model_path = sc.save_served_model(Path(tmp) / "glm")
        results = run(model_path, flags, work, args)

    labels = list(results)
    rows = [
        ["requests served"]
        + [f"{results[k][0]['served']} / {results[k][0]['requests']}" for k in labels],
        ["errors"] + [str(results[k][0]["errors"]) for k in labels],
        ["  of them not sent"]
        + [str(results[k][0]["errors_not_sent"]) for k in labels],
        ["first error at request"]
        + [fmt(results[k][0]["first_error_index"], "d") for k in labels],
        ["latency p50 (s)"]
        + [fmt(results[k][0]["latency_p50"], ".3f") for k in labels],
        ["latency p95 (s)"]
        + [fmt(results[k][0]["latency_p95"], ".3f") for k in labels],
        ["cached-token ratio"]
        + [fmt(results[k][0]["cached_ratio"], ".3f") for k in labels],
        ["completion tokens"]
        + [f"{results[k][0]['completion_tokens']:,}" for k in labels],
        ["completion tok/s (request time)"]
        + [fmt(results[k][0]["tokens_per_second"], ".0f") for k in labels],
        ["peak memory VmHWM (MiB)"]
        + [fmt(results[k][0].get("vmhwm", 0) / 2**20, ".0f") for k in labels],
        ["time in its requests (s)"]
        + [f"{results[k][0]['busy_seconds']:.0f}" for k in labels],
    ]
    heads = {"ours": "with mlx-lm-mla", "stock": f"stock mlx-lm {vers['mlx_lm']}"}
    print()
    sc.table(rows, [""] + [heads[k] for k in labels])
    for k in labels:
        s = results[k][0]
        print(f"first error, {k}: {s['first_error'] or '-'}")
        exc = s["server_exceptions"]
        if exc:
            print(
                f"  server log, {k}: {exc['count']} tracebacks; first: {exc['first']}"
            )
        if s["stop_reason"]:
            print(f"  stopped sending to {k}: {s['stop_reason']}")
    ours = results.get("ours", (None,))[0]
    if ours and ours["errors"]:
        print("\nERRORS IN OUR SERVER (bugs):")
        for r in results["ours"][1]:
            if not r["ok"]:
                print(f"  request {r['index']}: {r['error']}")
        print(f"server log tail ({ours['log']}):\n{ours['log_tail']}")

    path = sc.write_json(
        args.json,
        NAME,
        args,
        {
            "scale": args.scale,
            "max_tokens_range": [lo, hi],
            "system_prefix_chars": len(system),
            "server_flags": [str(f) for f in flags],
            "summary": {k: results[k][0] for k in labels},
            "requests": {k: results[k][1] for k in labels},
        },
        started,
        vers,
    )
    print(f"\nwrote {path} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    sys.exit(main())
