"""What the guards know of each request, in one object. mlx-lm hands each hook the
request or its generation arguments, unhashable dataclasses: ``REQUESTS`` finds
the ``RequestState`` from either by identity, while the handler has it open.
"""

import threading
from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class RequestState:
    cache_prompt: bool = True  # "cache_prompt": false neither reuses nor stores
    client_gone: Optional[str] = None  # which request, once its client left
    tokens: int = 0  # generated so far
    failure: Optional[BaseException] = None  # its own sampling's, in a batch
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
    """The open requests' states, by identity of the objects that stand for them."""

    def __init__(self):
        self._by_id = {}  # id(obj): (obj, state); obj held, so the id stays its
        self._lock = threading.Lock()

    def open(self, request) -> RequestState:
        state = RequestState()
        self.bind(request, state)
        return state

    def bind(self, obj, state):
        with self._lock:
            self._by_id[id(obj)] = (obj, state)

    def get(self, obj) -> Optional[RequestState]:
        found = self._by_id.get(id(obj))
        return found[1] if found is not None and found[0] is obj else None

    def close(self, request):
        """Forgets the request and every object bound to its state."""
        state = self.get(request)
        with self._lock:
            for key, (_, s) in list(self._by_id.items()):
                if s is state:
                    del self._by_id[key]

    def __len__(self):
        return len(self._by_id)


REQUESTS = Requests()
