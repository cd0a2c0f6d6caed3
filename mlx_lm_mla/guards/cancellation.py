"""A request ends when its client leaves.

While a request is served, ``watch`` polls its connection; once the client
has closed it (end of file or a reset), the request is marked. The
generation thread sees the mark at the request's next reply
(``recovery.tracked_next_request``): it stops the request's context, so the
server drops its row and frees its slot, and unblocks the handler with
``ClientGone``. A streamed request whose write fails first is stopped by
upstream itself. Either way the handler logs one INFO line (``ended``):
which request, after how many tokens.

A client that half-closes its connection after sending a request (shuts
down its writing side, still reading) looks gone and is cancelled.
"""

import logging
import select
import socket
import threading

logger = logging.getLogger(__name__)

POLL = 0.25  # seconds between looks at the connection
MARK = "mlx_lm_mla_client_gone"
TOKENS = "mlx_lm_mla_tokens"
# What a handler meets when its client is gone.
GONE = (BrokenPipeError, ConnectionResetError)


class ClientGone(RuntimeError):
    """The client of a request closed its connection."""


def gone(request):
    """Which request's client is gone (a description), or None."""
    return getattr(request, MARK, None)


def count_token(request):
    """One more token generated for ``request`` (the generation thread)."""
    try:
        setattr(request, TOKENS, getattr(request, TOKENS, 0) + 1)
    except AttributeError:
        pass


def ended(handler, request):
    """Logs that ``request`` ended because its client left."""
    logger.info(
        "mlx-lm-mla: cancelled %s after %d tokens: its client is gone",
        _name(handler), getattr(request, TOKENS, 0),
    )


def _name(handler):
    host, port = (tuple(handler.client_address) + (None, None))[:2]
    return f"the request {handler.path} from {host}:{port}"


def _closed(connection) -> bool:
    """Whether the peer has closed ``connection``; False while it is open
    or has sent more (a pipelined request: the watch cannot tell then)."""
    try:
        readable, _, _ = select.select([connection], [], [], POLL)
        return bool(readable) and connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except (OSError, ValueError):  # reset, or closed on our side
        return True


class Watch:
    """Watches one request's connection until ``stop()``."""

    def __init__(self, connection, request, name):
        self.connection, self.request, self.name = connection, request, name
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="mlx-lm-mla client watch")

    def _run(self):
        while not self.done.is_set():
            if _closed(self.connection):
                try:
                    setattr(self.request, MARK, self.name)
                except AttributeError:
                    pass
                return
            self.done.wait(POLL)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()


def watch(handler, request):
    """A ``Watch`` on the handler's connection, to use as a context manager."""
    return Watch(handler.connection, request, _name(handler))
