"""What one server's hooks share, on one object per server: its open requests'
states, the replies its generation loop owes, the loop's last random key and its
disk tier. mlx-lm's ``run`` builds one ``ModelProvider`` per server from the
command line; every server object reaches it (the generator's ``model_provider``,
the handler's ``response_generator.model_provider``), so the state hangs there,
under one attribute. The hooks mlx-lm calls with no server object (samplers,
``LRUPromptCache``, ``BatchGenerator``) run in the server's generation thread and
find it with ``current()``, which that thread's ``_generate`` sets.
"""

import contextlib
import contextvars
import threading
from dataclasses import dataclass
from typing import Any, Optional

ATTRIBUTE = "mlx_lm_mla"  # on the ModelProvider


@dataclass
class RequestState:
    cache_prompt: bool = True  # "cache_prompt": false neither reuses nor stores
    max_tokens_sent: bool = True  # by the client, not the server's --max-tokens
    client_gone: Optional[str] = None  # which request, once its client left
    tokens: int = 0  # generated so far
    failure: Optional[BaseException] = None  # its own sampling's, in a batch
    refused: Optional[str] = None  # why it was refused as the client's (a 400)
    # Built when the request was checked, handed to its batch row once.
    sampler: Any = None
    processors: Any = None

    def fail(self, error):
        # The first failure is the one the request is answered with.
        if self.failure is None:
            self.failure = error

    def take(self, name):
        built = getattr(self, name)
        setattr(self, name, None)
        return built


class Requests:
    """A server's open requests' states, found from the objects mlx-lm hands each
    hook for a request (its ``CompletionRequest``, its ``GenerationArguments``):
    unhashable dataclasses, so matched by identity while the handler has them."""

    def __init__(self):
        self._bound = []  # (obj, state)
        self._lock = threading.Lock()

    def open(self, request) -> RequestState:
        state = RequestState()
        self.bind(request, state)
        return state

    def bind(self, obj, state):
        with self._lock:
            self._bound.append((obj, state))

    def _find(self, obj) -> Optional[RequestState]:
        # Under self._lock.
        return next((s for o, s in self._bound if o is obj), None)

    def get(self, obj) -> Optional[RequestState]:
        with self._lock:
            return self._find(obj)

    def bind_to(self, request, obj) -> Optional[RequestState]:
        """Binds ``obj`` to ``request``'s state while the request is open, in
        one step: a close between a lookup and a bind would leave it bound."""
        with self._lock:
            state = self._find(request)
            if state is not None:
                self._bound.append((obj, state))
            return state

    def close(self, request):
        """Forgets the request and every object bound to its state."""
        with self._lock:
            state = self._find(request)
            self._bound = [(o, s) for o, s in self._bound if s is not state]

    def __len__(self):
        return len(self._bound)


class ServerState:
    """The state one server's hooks share."""

    def __init__(self, cli_args, provider=None):
        self.cli_args = cli_args  # the server's command line
        self.provider = provider  # its ModelProvider: the model it serves now
        self.requests = Requests()
        self.open_replies = set()  # recovery.Replies its generation loop owes
        self.last_key = None  # the loop's random key before its last guarded call
        self.tier = None  # its DiskTier while mlx_lm.server.run runs (disk.hooks)

    def close_replies(self, state):
        """The loop owes a request nothing once its handler has ended: upstream
        drops the row of a stopped context without a final None."""
        for replies in list(self.open_replies):  # copied at once: the loop adds
            if replies.state is state:
                self.open_replies.discard(replies)


def of(model_provider) -> ServerState:
    """The state of the server whose ``ModelProvider`` this is, made at first use."""
    found = vars(model_provider).get(ATTRIBUTE)
    if found is None:  # setdefault: the handler and the loop may ask at once
        found = vars(model_provider).setdefault(
            ATTRIBUTE, ServerState(model_provider.cli_args, model_provider)
        )
    return found


# The server whose generation loop runs in this thread (set by serving()).
_SERVING = contextvars.ContextVar("mlx_lm_mla_serving", default=None)


def current() -> Optional[ServerState]:
    """The state of the server whose generation thread this is, or None."""
    return _SERVING.get()


@contextlib.contextmanager
def running(server):
    """``server`` is ``current()`` in this thread while the block runs."""
    token = _SERVING.set(server)
    try:
        yield server
    finally:
        _SERVING.reset(token)


def serving(original):
    """``ResponseGenerator._generate`` run with its server as ``current()``. Each
    feature that reads ``current()`` wraps with it; the inner ones find it set."""

    def _generate(self):
        server = of(self.model_provider)
        if _SERVING.get() is server:
            return original(self)
        with running(server):
            return original(self)

    _generate.mlx_lm_mla_original = original
    return _generate
