"""Two servers in one process keep their own state: each its disk tier, its
``--kv-bits`` and its open requests (mlx_lm_mla/guards/state.py)."""

import argparse
import sqlite3
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace


from mlx_lm_mla.disk import hooks
from mlx_lm_mla.disk.folder import INDEX, SUBFOLDER
from mlx_lm_mla.guards import state as served
from serving import SYSTEM, post_json


def command_line(monkeypatch, *argv):
    """The arguments ``mlx_lm.server.main`` parses from ``argv``, the tier's flags
    among them."""
    import mlx_lm.server as server

    seen = []
    with monkeypatch.context() as m:
        m.setattr(
            server, "ModelProvider", lambda args: argparse.Namespace(cli_args=args)
        )
        m.setattr(server, "run", lambda host, port, provider: seen.append(provider))
        m.setattr(sys, "argv", ["mlx_lm.server", *map(str, argv)])
        server.main()
    return seen[0].cli_args


class Serving:
    """One server as ``mlx_lm.server.run`` builds it (its ``LRUPromptCache``,
    ``ResponseGenerator`` and HTTP server), run in a thread through the package's
    wrapper of ``run``, which opens its disk tier; ``stop()`` ends it as Ctrl-C
    does, which commits the tier."""

    def __init__(self, cli_args):
        import mlx_lm.server as server

        self.server = server
        self.provider = server.ModelProvider(cli_args)
        self.ready = threading.Event()
        self.failure = None
        self.thread = threading.Thread(
            target=hooks.with_tier(self._run), args=("127.0.0.1", 0, self.provider)
        )
        self.thread.start()
        while not self.ready.wait(0.5):
            assert self.thread.is_alive(), "the server's thread ended before serving"
        assert self.failure is None, self.failure

    def _run(self, host, port, provider):
        try:
            self.lru = self.server.LRUPromptCache(provider.cli_args.prompt_cache_size)
            self.generator = self.server.ResponseGenerator(provider, self.lru)
            try:
                self.httpd = ThreadingHTTPServer(
                    (host, port), lambda *a: self.server.APIHandler(self.generator, *a)
                )
            except BaseException:
                self.generator.stop_and_join()  # its loop runs from the start
                raise
            self.port = self.httpd.server_address[1]
        except BaseException as e:
            self.failure = e
            raise
        finally:
            self.ready.set()
        try:
            self.httpd.serve_forever()
        finally:
            self.httpd.server_close()
            self.generator.stop_and_join()

    def chat(self, text):
        body = {
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": text},
            ],
            "max_tokens": 6,
            "temperature": 0.0,
        }
        status, reply = post_json(self.port, "/v1/chat/completions", body)
        assert status == 200, reply
        return reply

    def stop(self):
        self.httpd.shutdown()
        self.thread.join()


def stored_rows(directory):
    db = sqlite3.connect(
        f"file:{Path(directory) / SUBFOLDER / INDEX}?mode=ro", uri=True
    )
    try:
        return db.execute("SELECT name, n_tokens FROM entries").fetchall()
    finally:
        db.close()


def test_two_servers_in_one_process_keep_their_own_tier_kv_bits_and_requests(
    installed, model_path, tmp_path, monkeypatch
):
    disk = ["--prompt-cache-dir-min-tokens", 64, "--prompt-cache-size", 4]
    a_args = command_line(
        monkeypatch, "--model", model_path, "--prompt-cache-dir", tmp_path / "a", *disk
    )
    b_args = command_line(
        monkeypatch, "--model", model_path, "--prompt-cache-dir", tmp_path / "b", *disk
    )
    kv_bits = hasattr(a_args, "kv_bits")  # mlx-lm 0.31's server has none
    if kv_bits:
        a_args.kv_bits, a_args.quantized_kv_start = 4, 0
    a = Serving(a_args)
    try:
        b = Serving(b_args)
        try:
            # Both are up, each with its own state and tier.
            sa, sb = served.of(a.provider), served.of(b.provider)
            assert sa is not sb and sa.tier is not None and sb.tier is not None
            assert sa.tier.folder != sb.tier.folder
            a.chat("Which file holds the parser?")
            b.chat("Which file holds the tokenizer and its tests?")
        finally:
            b.stop()
    finally:
        a.stop()
    for s in (sa, sb):  # closed: nothing left open, the tier handed back
        assert len(s.requests) == 0 and not s.open_replies and s.tier is None
    # Each server wrote its own conversation to its own folder, and only there
    # (a file's name follows its tokens: two conversations, two names).
    a_rows, b_rows = stored_rows(tmp_path / "a"), stored_rows(tmp_path / "b")
    assert len(a_rows) == 1 and len(b_rows) == 1
    assert a_rows[0][0] != b_rows[0][0] and a_rows[0][1] != b_rows[0][1]
    if kv_bits:  # only A's loop quantized its caches (4-bit latents): under half
        assert 2 * a.lru.nbytes < b.lru.nbytes


def test_nothing_is_bound_to_a_request_already_closed():
    requests = served.Requests()
    request, args = object(), object()
    state = requests.open(request)
    assert requests.bind_to(request, args) is state
    assert requests.get(args) is state
    requests.close(request)
    assert requests.bind_to(request, object()) is None
    assert len(requests) == 0


class Recorded(set):
    """A server's open replies: each the loop opens puts its first token, then
    waits until the handler has ended the request (its context stopped): a
    handler's failure that overtakes the loop between a token and its check."""

    def __init__(self):
        super().__init__()
        self.added, self.contexts = [], []
        self.released = threading.Event()  # the test is done: wait no more

    def add(self, replies):
        self.added.append(replies)
        super().add(replies)
        put = replies.queue.put

        def put_then_wait(item, *args, **kwargs):
            put(item, *args, **kwargs)
            if hasattr(item, "token"):
                # The handler's thread runs on; a context that never stops
                # fails the test's checks instead of hanging the server's stop.
                while not (self.contexts[0]._should_stop or self.released.is_set()):
                    time.sleep(0.01)

        replies.queue = SimpleNamespace(put=put_then_wait, queue=replies.queue)


def test_a_request_whose_handler_failed_is_owed_nothing(
    installed, model_path, monkeypatch
):
    args = command_line(monkeypatch, "--model", model_path)
    s, owed = Serving(args), Recorded()
    try:
        served.of(s.provider).open_replies = owed
        generate = s.generator.generate

        def fails_after_the_first_token(*a, **k):
            ctx, response = generate(*a, **k)
            owed.contexts.append(ctx)

            def replies():
                yield next(iter(response))
                raise ValueError("the handler failed")

            return ctx, replies()

        monkeypatch.setattr(s.generator, "generate", fails_after_the_first_token)
        # One step a round: the loop drops stopped rows after each step.
        monkeypatch.setattr(s.generator, "_time_budget", [None])
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2000}
        status, reply = post_json(s.port, "/v1/chat/completions", body)
        assert status == 500 and "the handler failed" in reply["error"]
    finally:
        owed.released.set()
        s.stop()  # joins the handler's thread and the loop
    assert owed.contexts[0]._should_stop
    # Upstream dropped the stopped row after the token the handler read, with
    # no None: the request is still owed nothing.
    (replies,) = owed.added
    assert list(replies.queue.queue.queue) == [] and not owed
