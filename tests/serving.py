"""A real mlx_lm.server process on loopback, and a small client for it."""

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

from mlx_lm_mla import tiny

SYSTEM = (
    "You are a careful assistant that reasons step by step about code. "
    "Answer briefly and keep every answer on topic. " * 3
)


def save_served_model(path):
    """The report's set-up: a tiny GLM-4.7-Flash with 6-bit weights, as
    ``mlx-lm-mla tiny-model`` writes it."""
    return tiny.save_demo_model(path)


def server_supports(flag):
    out = subprocess.run(
        [sys.executable, "-m", "mlx_lm.server", "--help"],
        capture_output=True,
        text=True,
    )
    return flag in out.stdout


def cpu_seconds(pid):
    """The CPU time a process has used so far (None where it cannot be read)."""
    try:  # Linux: utime and stime, in clock ticks
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        pass
    out = subprocess.run(["ps", "-o", "time=", "-p", str(pid)], capture_output=True)
    return out.stdout.strip() or None  # macOS: [[dd-]hh:]mm:ss.cc, compared as is


def descendants(pid):
    """pid's live child processes, theirs, and so on (Linux; none elsewhere)."""
    children = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # not a process, or one that has just exited
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], list(children.get(pid, []))
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


def progress(proc, log):
    """What changes while a process works: its output's size and the CPU time
    of it and of every process it started (``mlx.launch``'s ranks; a launcher
    itself mostly waits)."""
    return os.fstat(log.fileno()).st_size, [
        cpu_seconds(pid) for pid in [proc.pid, *descendants(proc.pid)]
    ]


def answers(port):
    """Whether a server answers on ``port``."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
            return True
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


def listening(log, port):
    """Whether the server writing ``log`` says it listens on ``port`` (stock's
    line, written once it has bound the port)."""
    log.flush()
    size = os.fstat(log.fileno()).st_size
    return f"on port {port}..." in os.pread(log.fileno(), size, 0).decode(
        errors="replace"
    )


def output(log, tail=4000):
    """The end of what a process printed so far into ``log`` (an open file);
    all of it where ``tail`` is None."""
    log.flush()
    size = os.fstat(log.fileno()).st_size
    tail = size if tail is None else tail
    # pread: the process writes through the same file offset.
    end = os.pread(log.fileno(), tail, max(0, size - tail))
    return end.decode(errors="replace")


def wait_for(proc, log, done, stall=120, bound=900, what="process"):
    """Returns once ``done()`` holds, waiting as long as ``proc`` makes progress
    (its output in ``log``, an open file, grows or it or a process it started
    uses CPU time). Raises, naming its output, at once if it exits first,
    after ``stall`` seconds without progress, or after ``bound`` seconds in
    all. The caller stops it."""
    start = moved = time.monotonic()
    seen = progress(proc, log)
    while not done():
        if proc.poll() is not None and not done():  # done() may be its exit
            raise RuntimeError(
                f"{what} exited with {proc.returncode}; its output:\n{output(log)}"
            )
        now, state = time.monotonic(), progress(proc, log)
        if state != seen:
            seen, moved = state, now
        elif now - moved > stall:
            raise TimeoutError(
                f"{what} made no progress for {stall} s (no output, no CPU "
                f"time); its output:\n{output(log)}"
            )
        if now - start > bound:
            raise TimeoutError(
                f"{what} did not finish within {bound} s; its output:\n{output(log)}"
            )
        time.sleep(0.2)


def wait_until_up(proc, port, log, stall=120, bound=900, own=False):
    """Returns once the server ``proc`` answers on ``port`` (with ``own``, once
    its log says it listens there: a port another process took is not taken
    for its, and fails as it exits); raises as ``wait_for`` does."""
    wait_for(
        proc,
        log,
        lambda: answers(port) and (not own or listening(log, port)),
        stall,
        bound,
        what="server (not answering yet)",
    )


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m mlx_lm.server`` started on 127.0.0.1 with the given flags;
    the package activates through its start-up hook unless disabled. With
    ``faults`` (``point:n``), the fault-injecting server of the test kit;
    ``module`` runs another server module with the same flags.

    The start waits as long as the process makes progress (its output grows
    or its CPU time advances), so it holds on a loaded machine: it fails at
    once if the process exits, after ``stall`` seconds without progress, or
    after ``bound`` seconds in all; every failure stops the process and
    names its output."""

    GRACE = 20  # seconds between terminate and kill

    def __init__(
        self,
        model_path,
        *flags,
        disabled=False,
        env=None,
        log=None,
        faults=None,
        module="mlx_lm.server",
        stall=120,
        bound=900,
    ):
        self.port = free_port()
        environ = dict(os.environ, **(env or {}))
        environ.pop("MLX_LM_MLA_DISABLE", None)
        if disabled:
            environ["MLX_LM_MLA_DISABLE"] = "1"
        # faults ("point:n"): the server of mlx_lm_mla.testing.faults.
        server = ["mlx_lm_mla.testing.faults", faults] if faults else [module]
        cmd = [sys.executable, "-m", *server, "--model", str(model_path)]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), *map(str, flags)]
        # Without a log of the caller's, a temporary one: a failed start shows it.
        self.log = open(log, "w+") if log else tempfile.TemporaryFile("w+")
        try:
            self.proc = subprocess.Popen(
                cmd, env=environ, stdout=self.log, stderr=subprocess.STDOUT
            )
        except BaseException:
            self.log.close()
            raise
        try:
            wait_until_up(self.proc, self.port, self.log, stall, bound, own=True)
        except BaseException:
            self.close()
            raise

    def output(self, tail=4000):
        return output(self.log, tail)

    def close(self):
        """Terminates the server (kills it after GRACE seconds); idempotent."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=self.GRACE)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def abandon_stream(self, user, max_tokens, after_bytes):
        """Starts a streamed request and hangs up after reading a little."""
        body = chat_body(user, max_tokens=max_tokens, stream=True)
        hang_up(self.port, body, after_bytes)

    def chat(self, user, max_tokens=200, stream=False, timeout=120, **extra):
        """One /v1/chat/completions request. Returns (text, usage) or raises
        RequestFailed with what the server said."""
        body = chat_body(user, max_tokens=max_tokens, stream=stream, **extra)
        if stream:
            body["stream_options"] = {"include_usage": True}
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                raw = response.read().decode()
        except urllib.error.HTTPError as e:
            raise RequestFailed(f"HTTP {e.code}: {e.read().decode()[:300]}") from None
        except (urllib.error.URLError, ConnectionError, OSError) as e:
            raise RequestFailed(f"connection: {e}") from None
        return _parse(raw, stream)


def chat_body(user, **fields):
    """A greedy chat request: the shared system prompt, then ``user``."""
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": user},
    ]
    return {"messages": messages, "temperature": 0.0, **fields}


def hang_up(port, body, after_bytes=0, linger=0.0):
    """A chat request whose client closes its connection once it has read
    ``after_bytes`` (0: before any reply) and waited ``linger`` seconds."""
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(head.encode() + data)
        received = 0
        while received < after_bytes:
            chunk = sock.recv(after_bytes - received)
            if not chunk:
                break
            received += len(chunk)
        time.sleep(linger)


class RequestFailed(Exception):
    pass


def _parse(raw, stream):
    if not stream:
        data = json.loads(raw)
        if "error" in data:
            raise RequestFailed(str(data["error"]))
        return data["choices"][0]["message"].get("content"), data.get("usage", {})
    text, usage = [], {}
    for line in raw.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        data = json.loads(line[6:])
        if "error" in data:
            raise RequestFailed(str(data["error"]))
        for choice in data.get("choices", []):
            text.append(choice.get("delta", {}).get("content") or "")
        usage = data.get("usage") or usage
    if not usage and not text:
        raise RequestFailed(f"empty stream: {raw[:300]}")
    return "".join(text), usage


def cached_tokens(usage):
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def questions(n):
    """Distinct user turns after the shared system prompt."""
    return [
        f"Question {i}: what does function f{i * 7 % 13}(x) return for x = {i}?"
        for i in range(n)
    ]


def raw_post(port, path, data, timeout=120, limit=None):
    """POSTs ``data`` (bytes) and returns the whole raw reply, status lines
    and headers included, so a malformed reply can be seen as it is. With
    ``limit``, hangs up after that many bytes (the server stops a stream
    whose client is gone)."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    chunks, size = [], 0
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head.encode() + data)
        while (limit is None or size < limit) and (chunk := sock.recv(65536)):
            chunks.append(chunk)
            size += len(chunk)
    return b"".join(chunks)


def status_lines(reply):
    """The HTTP status lines in a raw reply's head (a well-formed one has one)."""
    head = reply.split(b"\r\n\r\n", 1)[0]
    return [line.decode() for line in head.split(b"\r\n") if line.startswith(b"HTTP/")]


def post_json(port, path, body, timeout=120):
    """(status, parsed JSON body) of one POST."""
    reply = raw_post(port, path, json.dumps(body).encode(), timeout)
    status = int(status_lines(reply)[0].split()[1])
    return status, json.loads(reply.split(b"\r\n\r\n", 1)[1] or b"null")


def four_clients(server, per_client, max_tokens):
    """Four concurrent clients, each sending its own ``per_client`` questions
    in turn (even clients streamed). Returns (served, errors)."""
    served, errors = [], []

    def client(k):
        for q in questions(per_client * (k + 1))[per_client * k :]:
            try:
                served.append(server.chat(q, max_tokens=max_tokens, stream=k % 2 == 0))
            except RequestFailed as e:
                errors.append(str(e))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return served, errors


class Stream(threading.Thread):
    """One streamed chat request in its own thread: ``started`` is set when
    its first token arrives; then ``text`` or ``error``."""

    def __init__(self, server, user, **extra):
        super().__init__(daemon=True)
        self.server, self.user, self.extra = server, user, extra
        self.started = threading.Event()
        self.text = self.error = None

    def run(self):
        body = chat_body(
            self.user, stream=True, stream_options={"include_usage": True}, **self.extra
        )
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.server.port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        lines = []
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                for line in response:
                    lines.append(line.decode())
                    if line.startswith(b"data: {"):
                        self.started.set()
            self.text = _parse("".join(lines), True)[0]
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.started.set()


def served_as_fresh(server, prompts):
    """What the next requests get, the ones a failure must not change:
    greedy, sampled without a seed, sampled with a seed, each streamed and
    not. An unseeded sampled answer is random, so it counts as "served"."""
    out = []
    for i, (extra, stream) in enumerate(
        [
            ({}, False),
            ({}, True),
            ({"temperature": 0.8}, False),
            ({"temperature": 0.8}, True),
            ({"temperature": 0.8, "seed": 7}, False),
            ({"temperature": 0.8, "seed": 7}, True),
        ]
    ):
        try:
            text, _ = server.chat(
                prompts[i % len(prompts)], max_tokens=16, stream=stream, **extra
            )
        except RequestFailed as e:
            out.append(f"failed: {e}")
            continue
        out.append("served" if "seed" not in extra and extra else text)
    return out
