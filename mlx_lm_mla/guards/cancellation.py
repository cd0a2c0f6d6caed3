"""A request ends when its client leaves: ``watch`` polls its connection and marks
its ``RequestState``; the generation thread ends it at its next reply
(``recovery.Replies``). A client that half-closes its connection looks gone.
"""

import logging
import selectors
import socket
import threading

logger = logging.getLogger(__name__)

POLL = 0.25  # seconds between looks at the connection
GONE = (BrokenPipeError, ConnectionResetError)


class ClientGone(RuntimeError):
    """The client of a request closed its connection."""


def ended(handler, state):
    logger.info(
        "mlx-lm-mla: cancelled %s after %d tokens: its client is gone",
        _name(handler),
        state.tokens,
    )


def _name(handler):
    host, port = (tuple(handler.client_address) + (None, None))[:2]
    return f"the request {handler.path} from {host}:{port}"


def _closed(connection) -> bool:
    """Whether the peer closed ``connection`` (not if it sent more: pipelined)."""
    if connection.fileno() < 0:  # closed on our side
        return True
    try:
        # A selector, not select.select: that refuses descriptors from 1024 on.
        with selectors.DefaultSelector() as selector:
            selector.register(connection, selectors.EVENT_READ)
            readable = selector.select(POLL)
        return (
            bool(readable)
            and connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        )
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


class Watch:
    def __init__(self, connection, state, name):
        self.connection, self.state, self.name = connection, state, name
        self.done = threading.Event()
        self.thread = threading.Thread(
            target=self._run, daemon=True, name="mlx-lm-mla client watch"
        )

    def _run(self):
        while not self.done.is_set():
            if _closed(self.connection):
                self.state.client_gone = self.name
                return
            self.done.wait(POLL)

    def __enter__(self):
        try:
            self.thread.start()
        except RuntimeError as e:  # no thread to spare: a failure of ours only
            logger.warning("mlx-lm-mla: %s runs unwatched: %s", self.name, e)
        return self

    def __exit__(self, *exc):
        self.done.set()


def watch(handler, state):
    return Watch(handler.connection, state, _name(handler))
