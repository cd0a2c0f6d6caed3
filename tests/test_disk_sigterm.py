"""SIGTERM ends a server with the disk tier as it ends one without: in a long
request, without waiting for the request (or upstream's step) to finish, and
with the caches already queued for disk committed. The tier's handler stands
only in place of the default one, and only while the server runs."""

import argparse
import json
import re
import signal
import socket
import sqlite3
import types

import pytest

from mlx_lm_mla.disk import hooks
from mlx_lm_mla.disk.folder import INDEX, SUBFOLDER
from serving import SYSTEM, Server, post_json

LONG = 3000  # tokens a request may generate: minutes of work on this machine
HUNG = 600  # seconds: a server still streaming or alive this long has hung


def chat(user, max_tokens, **extra):
    return {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": user},
        ],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logit_bias": {"1": -100},  # no early end-of-text
        **extra,
    }


def stored_tokens(folder):
    db = sqlite3.connect(f"file:{folder / SUBFOLDER / INDEX}?mode=ro", uri=True)
    try:
        return [n for (n,) in db.execute("SELECT n_tokens FROM entries")]
    finally:
        db.close()


def stop_in_a_long_request(server, body):
    """Streams ``body``, sends SIGTERM once its prompt is being processed, and
    reads until the server closes the stream. Returns what was streamed."""
    data = json.dumps(body).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        "Connection: close\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    raw, signalled = b"", False
    with socket.create_connection(("127.0.0.1", server.port), timeout=HUNG) as sock:
        sock.sendall(head.encode() + data)
        while chunk := sock.recv(65536):
            raw += chunk
            if not signalled and b": keepalive" in raw:  # the prefill has begun
                server.proc.send_signal(signal.SIGTERM)
                signalled = True
    assert signalled, raw[:300]
    return raw.decode(errors="replace")


@pytest.mark.parametrize(
    "path",
    [{"seed": 0}, {}],
    ids=["one request at a time (a seed)", "batched"],
)
def test_sigterm_in_a_long_request_ends_the_server_before_the_request_ends(
    path, model_path, tmp_path
):
    folder = tmp_path / "caches"
    with Server(
        model_path,
        "--prompt-cache-dir",
        folder,
        "--prefill-step-size",
        64,
        log=tmp_path / "log",
    ) as server:
        status, reply = post_json(server.port, "/v1/chat/completions", chat("Hi", 2))
        assert status == 200, reply
        first = reply["usage"]["prompt_tokens"]
        long_prompt = "".join(chr(97 + i * 7 % 26) for i in range(1500))
        streamed = stop_in_a_long_request(
            server, chat(long_prompt, LONG, stream=True, **path)
        )
        server.proc.wait(timeout=HUNG)
    assert server.proc.returncode == -signal.SIGTERM
    # Upstream would end its step first: there, the whole request (its
    # prefill and every token). Here the server ended long before.
    assert re.findall(r'"finish_reason": "(\w+)"', streamed) == []
    assert "[DONE]" not in streamed
    # The first answer's cache, queued before the signal, is on disk.
    assert max(stored_tokens(folder)) >= first


def run_with_tier(folder):
    """``mlx_lm.server.run`` as the tier wraps it, on a stand-in ``run`` that
    returns at once; returns the SIGTERM handler set while it ran."""
    seen = []
    provider = types.SimpleNamespace(
        cli_args=argparse.Namespace(prompt_cache_dir=str(folder), model=None),
        is_distributed=False,
    )
    hooks.with_tier(lambda *args: seen.append(signal.getsignal(signal.SIGTERM)))(
        "127.0.0.1", 0, provider
    )
    return seen[0]


def test_the_tier_sets_its_sigterm_handler_only_in_place_of_the_default_and_puts_it_back(
    tmp_path,
):
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert run_with_tier(tmp_path) not in (signal.SIG_DFL, None)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_sigterm_handler_the_tier_did_not_set_is_left_alone(tmp_path):
    def theirs(signum, frame):
        pass

    found = signal.signal(signal.SIGTERM, theirs)
    try:
        assert run_with_tier(tmp_path) is theirs
        assert signal.getsignal(signal.SIGTERM) is theirs
    finally:
        signal.signal(signal.SIGTERM, found)  # the test runner's, as it was


class FailingClose:
    """A tier whose close fails (a full disk, a stuck writer)."""

    closed = False

    def close(self):
        raise OSError("no space left on device")


def test_sigterm_is_handed_on_even_where_committing_the_queued_writes_fails(
    monkeypatch,
):
    raised = []
    monkeypatch.setattr(signal, "raise_signal", raised.append)
    stop = hooks._SigtermStop(FailingClose())
    try:
        with pytest.raises(OSError):
            stop.end()
    finally:
        stop.remove()
    assert raised == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
