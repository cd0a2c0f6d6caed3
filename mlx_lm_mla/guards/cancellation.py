"""A request ends when its client leaves.

While a request is served, ``watch`` polls its connection; once the client
has closed it (end of file or a reset), its ``RequestState`` says so. The
generation thread sees that at the request's next reply
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
# What a handler meets when its client is gone.
GONE = (BrokenPipeError, ConnectionResetError)


class ClientGone(RuntimeError):
    """The client of a request closed its connection."""


def ended(handler, state):
    """Logs that a request ended because its client left."""
    logger.info(
        "mlx-lm-mla: cancelled %s after %d tokens: its client is gone",
        _name(handler), state.tokens,
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

    def __init__(self, connection, state, name):
        self.connection, self.state, self.name = connection, state, name
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="mlx-lm-mla client watch")

    def _run(self):
        while not self.done.is_set():
            if _closed(self.connection):
                self.state.client_gone = self.name
                return
            self.done.wait(POLL)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()


def watch(handler, state):
    """A ``Watch`` on the handler's connection, to use as a context manager."""
    return Watch(handler.connection, state, _name(handler))
