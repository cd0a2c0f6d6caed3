"""A request ends when its client leaves: ``watch`` polls its connection and marks
its ``RequestState``; the generation thread ends it at its next reply
(``recovery.Replies``). A client that half-closes its connection looks gone.
"""

import logging
import select
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


def _readable(connection):
    """Whether ``connection`` has something to read within POLL seconds:
    ``poll`` takes any descriptor and makes none (``select.select`` refuses
    descriptors from 1024 on; a selector takes a descriptor a look)."""
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(connection, select.POLLIN)
        return bool(poller.poll(POLL * 1000))
    with selectors.DefaultSelector() as selector:
        selector.register(connection, selectors.EVENT_READ)
        return bool(selector.select(POLL))


def _closed(connection) -> bool:
    """Whether the peer closed ``connection`` (not if it sent more: pipelined)."""
    if connection.fileno() < 0:  # closed on our side
        return True
    try:
        readable = _readable(connection)
    except OSError:  # no way to look now (descriptors run out): not known gone
        return False
    try:
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
