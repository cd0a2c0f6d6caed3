"""Helpers for the server benchmarks (soak_server, prefix_ttft,
batch_throughput); not a benchmark itself.

These benchmarks measure a real ``python -m mlx_lm.server`` subprocess
started by ``tests/serving.py``. The server gets the package the way a user's
server does, through the start-up hook of the copy *installed* in the
virtualenv (``MLX_LM_MLA_DISABLE=1`` gives stock mlx-lm), so the installed
copy is what is measured, not the working tree. ``versions()`` says which
copy that is and whether it matches the working tree; after changing
``mlx_lm_mla/`` run ``pip install /path/to/repo`` first.
"""

import hashlib
import http.client
import json
import os
import platform
import shlex
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "tests"))

import serving  # noqa: E402  (tests/serving.py: Server, save_served_model, ...)
from serving import RequestFailed, Server, cached_tokens, save_served_model  # noqa: E402,F401

# The tiny model's end-of-text token. Requests suppress it with logit_bias so
# every completion has exactly the length asked for (a random model may stop
# anywhere); --allow-eos in the scripts turns that off.
EOS_BIAS = {"1": -100.0}


def _load():
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


LOAD_AT_START = _load()  # other work on the machine skews the timings


class Timeout(RequestFailed):
    pass


# --- requests ---------------------------------------------------------------


def _body(messages, max_tokens, stream, extra):
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update(extra)
    return json.dumps(body).encode()


def chat(port, messages, max_tokens, stream=False, timeout=120.0, **extra):
    """One /v1/chat/completions request with our own messages (tests/serving
    always sends its short SYSTEM). Returns a dict: text, usage, latency (s),
    ttft (s, time to the first content chunk; streaming only, else None).
    Raises RequestFailed (Timeout when ``timeout`` seconds pass in total)."""
    data = _body(messages, max_tokens, stream, extra)
    start = time.perf_counter()
    deadline = start + timeout
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(
            "POST",
            "/v1/chat/completions",
            body=data,
            headers={"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        if resp.status != 200:
            raise RequestFailed(
                f"HTTP {resp.status}: {resp.read().decode(errors='replace')[:300]}"
            )
        if not stream:
            raw = resp.read().decode()
            text, usage = serving._parse(raw, False)
            return {
                "text": text,
                "usage": usage,
                "latency": time.perf_counter() - start,
                "ttft": None,
            }
        ttft, lines = None, []
        while True:
            if time.perf_counter() > deadline:
                raise Timeout(f"timed out after {timeout:g} s (stream)")
            line = resp.readline()
            if not line:
                break
            line = line.decode().rstrip("\r\n")
            lines.append(line)
            if ttft is None and line.startswith("data: ") and line != "data: [DONE]":
                try:
                    chunk = json.loads(line[6:])
                except ValueError:
                    continue
                if any(
                    (c.get("delta") or {}).get("content")
                    for c in chunk.get("choices", [])
                ):
                    ttft = time.perf_counter() - start
        text, usage = serving._parse("\n".join(lines), True)
        return {
            "text": text,
            "usage": usage,
            "latency": time.perf_counter() - start,
            "ttft": ttft,
        }
    except RequestFailed:
        raise
    except (socket.timeout, TimeoutError):
        raise Timeout(f"timed out after {timeout:g} s") from None
    except (ConnectionError, OSError, http.client.HTTPException) as e:
        raise RequestFailed(f"connection: {type(e).__name__}: {e}") from None
    except ValueError as e:  # a reply that is not the JSON we expect
        raise RequestFailed(f"bad reply: {e}") from None
    finally:
        conn.close()


def messages(system, user):
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


# --- the server process -----------------------------------------------------


def server_alive(server):
    return server.proc.poll() is None


def proc_status(pid):
    """VmHWM (peak resident set) and VmRSS of a process, in bytes."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "VmRSS"):
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def log_path(json_path, name, label):
    """The server log for ``label``: in a ``logs`` folder next to the JSON,
    named after it (benchmarks/results/logs/NAME-LABEL.log by default)."""
    json_path = Path(json_path) if json_path else RESULTS / f"{name}.json"
    logs = json_path.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    return logs / f"{json_path.stem}-{label}.log"


def log_tail(path, lines=30):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


# --- reporting --------------------------------------------------------------


def _tree_digest(path):
    h = hashlib.sha256()
    for p in sorted(Path(path).glob("*.py")):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def versions():
    import mlx.core as mx
    import mlx_lm

    import mlx_lm_mla

    installed = Path(mlx_lm_mla.__file__).parent
    try:
        import subprocess

        head = (
            subprocess.run(
                ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
            ).stdout.strip()
            or None
        )
    except OSError:
        head = None
    return {
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "mlx_lm_mla": mlx_lm_mla.__version__,
        "mlx_lm_mla_path": str(installed),
        "mlx_lm_mla_digest": _tree_digest(installed)[:12],
        "mlx_lm_mla_matches_worktree": _tree_digest(installed)
        == _tree_digest(ROOT / "mlx_lm_mla"),
        "worktree_head": head,
        "python": platform.python_version(),
        "executable": sys.executable,
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cpus",
    }


def warn_if_stale(v):
    if not v["mlx_lm_mla_matches_worktree"]:
        print(
            f"note: the installed mlx_lm_mla ({v['mlx_lm_mla_path']}) differs from the working "
            f"tree; the server runs the installed copy (pip install {ROOT} to update)",
            file=sys.stderr,
        )


def write_json(path, name, args, payload, started, vers):
    path = Path(path) if path else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    import mlx_lm_mla

    digest_end = _tree_digest(Path(mlx_lm_mla.__file__).parent)[:12]
    if digest_end != vers.get("mlx_lm_mla_digest"):
        print(
            "WARNING: the installed mlx_lm_mla changed during the run; servers started "
            "before the change ran the old code",
            file=sys.stderr,
        )
    doc = {
        "benchmark": name,
        "command": " ".join(
            ["python", f"benchmarks/{name}.py", *map(shlex.quote, sys.argv[1:])]
        ),
        "versions": vers,
        "args": vars(args),
        "seconds": round(time.perf_counter() - started, 1),
        "mlx_lm_mla_digest_at_end": digest_end,
        "load_average_1min_at_start": LOAD_AT_START,
        "load_average_1min_at_end": _load(),
        **payload,
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, default=str)
    return path


def median(xs):
    return statistics.median(xs) if xs else None


def percentile(xs, q):
    """Linear-interpolated percentile (q in 0..100) of a non-empty list."""
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def table(rows, columns, file=None):
    """rows: list of lists of cells (str); the first column is left-aligned."""
    cells = [columns] + [[("-" if c is None else str(c)) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
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


class Progress:
    """A one-line counter on stderr (only when stderr is a terminal, else a
    line every ``every`` steps, so logs stay short)."""

    def __init__(self, total, desc, every=25):
        self.total, self.desc, self.n, self.every = total, desc, 0, every
        self.tty = sys.stderr.isatty()
        self.start = time.perf_counter()

    def update(self, note=""):
        self.n += 1
        elapsed = time.perf_counter() - self.start
        msg = f"{self.desc}: {self.n}/{self.total} {elapsed:6.1f}s {note}"
        if self.tty:
            print("\r" + msg.ljust(78), end="", file=sys.stderr, flush=True)
        elif self.n % self.every == 0 or self.n == self.total:
            print(msg, file=sys.stderr, flush=True)

    def close(self):
        if self.tty:
            print(file=sys.stderr, flush=True)


# mlx-lm's /v1/models handler scans the Hugging Face cache and logs this
# traceback when there is none; tests/serving.py polls /v1/models at start-up.
BENIGN = ("huggingface_hub.errors.CacheNotFound",)


def log_exceptions(path, ignore=BENIGN):
    """The exceptions a server logged (the last line of each traceback, the
    ``ignore`` ones left out): how many, and the first one. Stock mlx-lm's
    server drops the connection on an error, so the client sees only
    "Remote end closed connection"; the log says why."""
    found, in_tb = [], False
    try:
        lines = open(path, errors="replace").read().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("Traceback (most recent call last):"):
            in_tb = True
        elif in_tb and line and not line.startswith((" ", "\t")):
            if not line.startswith(ignore):
                found.append(line.strip())
            in_tb = False
    if not found:
        return None
    return {"count": len(found), "first": found[0], "distinct": sorted(set(found))[:10]}
