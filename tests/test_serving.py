"""The test kit's server helper (tests/serving.py): a start that fails stops
its process, an exit fails at once with the output, and a slow start that
makes progress is waited for. A small fake server stands in for mlx_lm.server:
its ``--model`` says how it starts."""

import os

import pytest

import serving
from serving import Server, answers

FAKE = """
import argparse, http.server, os, signal, sys, time

parser = argparse.ArgumentParser()
for flag in ("--model", "--host", "--port"):
    parser.add_argument(flag)
args = parser.parse_args()
open(os.environ["FAKE_PID_FILE"], "w").write(str(os.getpid()))
how, _, seconds = args.model.partition(":")
if how == "exits":
    print("fake: no model here", flush=True)
    sys.exit(3)
if how == "hangs":  # no output, no CPU time, deaf to SIGTERM
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        time.sleep(60)
until = time.monotonic() + float(seconds or 0)
while time.monotonic() < until:
    if how == "prints":
        print("fake: loading", flush=True)
        time.sleep(0.1)
    # "computes": a silent busy loop


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):  # silent: "computes" prints nothing
        pass


httpd = http.server.HTTPServer((args.host, int(args.port)), Handler)
print(f"Starting httpd at {args.host} on port {args.port}...", flush=True)  # stock's
httpd.serve_forever()
"""


@pytest.fixture
def fake(tmp_path):
    """Starts the fake server as ``how``; ``fake.pid()`` is its process id."""
    (tmp_path / "fake_server.py").write_text(FAKE)
    pid_file = tmp_path / "pid"
    env = {"PYTHONPATH": str(tmp_path), "FAKE_PID_FILE": str(pid_file)}

    def start(how, **budget):
        return Server(how, module="fake_server", env=env, **budget)

    start.pid = lambda: int(pid_file.read_text())
    return start


def running(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_server_that_exits_fails_at_once_with_its_output(fake):
    # A stall or the bound would raise TimeoutError, long after the exit.
    with pytest.raises(RuntimeError, match=r"exited with 3(.|\n)*fake: no model here"):
        fake("exits", stall=600, bound=600)


def test_a_start_without_progress_fails_and_leaves_no_process(fake, monkeypatch):
    monkeypatch.setattr(Server, "GRACE", 1)  # it ignores SIGTERM: killed after 1 s
    with pytest.raises(TimeoutError, match="no progress for 1 s"):
        fake("hangs", stall=1)
    assert not running(fake.pid())


class Interrupted(Exception):
    pass


def test_an_error_in_the_start_wait_leaves_no_process(fake, tmp_path, monkeypatch):
    def interrupted(port):
        if (tmp_path / "pid").exists():
            raise Interrupted
        return False

    monkeypatch.setattr(serving, "answers", interrupted)
    monkeypatch.setattr(Server, "GRACE", 1)
    with pytest.raises(Interrupted):
        fake("hangs")
    assert not running(fake.pid())


def test_a_slow_start_that_prints_is_waited_for(fake):
    with fake("prints:3", stall=1) as server:
        assert answers(server.port)
    assert not running(fake.pid())


def test_a_slow_start_that_computes_silently_is_waited_for(fake):
    with fake("computes:3", stall=1.5) as server:
        bound = f"Starting httpd at 127.0.0.1 on port {server.port}..."
        assert answers(server.port) and server.output().splitlines() == [bound]
    assert not running(fake.pid())


def test_a_port_another_server_took_is_not_taken_for_the_servers_own(fake, monkeypatch):
    with fake("prints:0") as other:  # it answers on the port the next start is given
        monkeypatch.setattr(serving, "free_port", lambda: other.port)
        with pytest.raises(RuntimeError, match="exited with 1(.|\n)*Address already"):
            with fake("prints:1"):  # stopped, should it be taken for up
                pass


def test_a_start_that_progresses_past_the_bound_fails(fake):
    with pytest.raises(TimeoutError, match=r"within 2 s(.|\n)*fake: loading"):
        fake("prints:600", stall=60, bound=2)
    assert not running(fake.pid())
