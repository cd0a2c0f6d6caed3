"""How long a server takes to end on SIGTERM during a long prefill, with the
disk tier and without.

A fresh ``mlx_lm.server`` on the tiny demo GLM (``--prefill-step-size 64``)
answers a short request (with the tier, its cache is queued for disk), then
gets a streamed request of ``--prompt`` characters (one token each) and
``--max-tokens`` tokens; once its first progress line arrives (the prefill
has begun), SIGTERM is sent. Timed: from the signal to the process's end
(``waitpid``). Two of upstream's paths: one request at a time (a request with
a seed: upstream's step is the whole request) and batched. Variants run
interleaved, ``--rounds`` fresh servers each; median and largest.

    python benchmarks/disk_sigterm.py        # ~3 min here
"""

import argparse
import json
import re
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import _serving_common as sc

NAME = "disk_sigterm"
TARGET_S = 0.5  # after the signal, during a long prefill (the issue)
PATHS = {"one at a time": {"seed": 0}, "batched": {}}


def body(user, max_tokens, **extra):
    return {
        "messages": sc.messages(sc.serving.SYSTEM, user),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logit_bias": sc.EOS_BIAS,
        **extra,
    }


def stop_during_prefill(server, request):
    """Seconds from SIGTERM to the process's end, and the prefill's progress
    (processed, total) at the signal and at the end."""
    data = json.dumps(request).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        "Connection: close\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    raw, sent, at_signal = b"", None, None
    with socket.create_connection(("127.0.0.1", server.port), timeout=600) as sock:
        sock.sendall(head.encode() + data)
        while chunk := sock.recv(65536):
            raw += chunk
            steps = re.findall(rb": keepalive (\d+)/(\d+)", raw)
            if sent is None and steps:
                sent = time.perf_counter()
                server.proc.send_signal(signal.SIGTERM)
                at_signal = tuple(map(int, steps[-1]))
    server.proc.wait()
    seconds = time.perf_counter() - sent
    steps = re.findall(rb": keepalive (\d+)/(\d+)", raw)
    return seconds, at_signal, tuple(map(int, steps[-1])), b"[DONE]" in raw


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", type=int, default=3000, help="characters (tokens)")
    p.add_argument("--max-tokens", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    started, vers = time.perf_counter(), sc.versions()
    sc.warn_if_stale(vers)
    user = "".join(chr(97 + i * 7 % 26) for i in range(args.prompt))
    runs = {(v, path): [] for path in PATHS for v in ("no tier", "tier")}
    with tempfile.TemporaryDirectory() as tmp:
        model = sc.save_served_model(Path(tmp) / "model")
        for r in range(args.rounds):
            keys = list(runs)
            for variant, path in keys[r % len(keys) :] + keys[: r % len(keys)]:
                folder = Path(tmp) / f"caches-{r}-{len(runs[variant, path])}"
                flags = ["--prefill-step-size", 64]
                if variant == "tier":
                    flags += ["--prompt-cache-dir", folder]
                with sc.Server(model, *flags) as server:
                    sc.chat(server.port, sc.messages(sc.serving.SYSTEM, "Hi"), 2)
                    result = stop_during_prefill(
                        server,
                        body(user, args.max_tokens, stream=True, **PATHS[path]),
                    )
                runs[variant, path].append(result)
                print(f"  {variant}, {path}: {result}", file=sys.stderr)
    rows = []
    for (variant, path), results in runs.items():
        seconds = [s for s, _, _, _ in results]
        rows.append(
            {
                "variant": variant,
                "path": path,
                "median_s": sc.median(seconds),
                "max_s": max(seconds),
                "runs": len(results),
                "prompt_tokens": results[0][1][1],
                "processed_at_signal_max": max(a[0] for _, a, _, _ in results),
                "processed_at_end_max": max(e[0] for _, _, e, _ in results),
                "finished": sum(done for _, _, _, done in results),
            }
        )
    sc.table(
        [
            [
                r["variant"],
                r["path"],
                f"{r['median_s']:.2f}",
                f"{r['max_s']:.2f}",
                f"{r['processed_at_end_max']:,} / {r['prompt_tokens']:,}",
                r["finished"],
            ]
            for r in rows
        ],
        ["server", "path", "exit s (median)", "largest", "prefilled, most", "done"],
    )
    worst = max(r["max_s"] for r in rows if r["variant"] == "tier")
    print(
        f"\ntarget: a tier server ends <= {TARGET_S} s after SIGTERM: "
        f"{'MET' if worst <= TARGET_S else 'MISSED'} ({worst:.2f} s)"
    )
    path = sc.write_json(args.json, NAME, args, {"rows": rows}, started, vers)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
