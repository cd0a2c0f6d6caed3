"""Recovery in the server's generation thread: a failure ends the requests it hit,
with a clear error, and the loop serves the next ones."""

import logging
import sys
import time

from . import cancellation, sampling
from . import state as served

logger = logging.getLogger(__name__)

SERVER = "mlx_lm.server"


# Tries in a row for a failure with no request open (a model that cannot load).
TRIES = 4
BACKOFF = 0.05  # seconds before the second try; doubled each time


def _inflight(generator):
    # The replies the generator's loop owes, to answer if it fails.
    return served.of(generator.model_provider).open_replies


class Replies:
    """A request's reply queue as the loop sees it: once its sampling failed or its
    client left, the next reply is that error, its context is stopped (the server
    drops its row) and nothing more is sent."""

    def __init__(self, queue, state, open_requests):
        self.queue, self.state, self.open = queue, state, open_requests
        self.context = self.contexts = None
        self.answered = False

    def put(self, item, *args, **kwargs):
        if self.answered:
            return
        if self.contexts and isinstance(item, self.contexts):
            self.context = item
        elif not isinstance(item, Exception):
            item = self._ending(item)
        self.queue.put(item, *args, **kwargs)
        if item is None or isinstance(item, Exception):
            self.open.discard(self)

    def _ending(self, item):
        state = self.state
        if not (state.failure or state.client_gone):
            if hasattr(item, "token"):
                state.tokens += 1
            return item
        if state.failure:
            failure = state.failure
            item = RuntimeError(f"sampling failed: {type(failure).__name__}: {failure}")
        else:
            item = cancellation.ClientGone(f"{state.client_gone}: the client is gone")
        self.answered = True
        if self.context is not None:
            self.context.stop()  # the server removes the row
        return item


def tracked_next_request(original):
    """``ResponseGenerator._next_request`` handing the loop ``Replies``."""

    def _next_request(self, timeout=None):
        request = original(self, timeout)
        if request is None or isinstance(request[0], Replies):
            return request
        server = served.of(self.model_provider)
        # Another rank's copy of a request is not in this rank's open requests.
        state = server.requests.get(request[1]) or served.RequestState()
        replies = Replies(request[0], state, server.open_replies)
        replies.contexts = sys.modules[SERVER].GenerationContext
        replies.open.add(replies)
        return (replies, *request[1:])

    _next_request.mlx_lm_mla_original = original
    return _next_request


def _restore_after_failure(server):
    if sampling.repair_random(server):
        logger.warning("mlx-lm-mla: restored the random state after a failure")


def supervised_generate(original):
    """``ResponseGenerator._generate`` that survives a failing request: upstream's
    thread ends, so one bad batch ends the server. Here the open requests get the
    error and the loop starts again; a failure with no request open ends the
    thread after ``TRIES``, so mlx-lm 0.32's health check reports it."""

    def _generate(self):
        streak = 0
        while True:
            try:
                return original(self)
            except Exception as e:
                logger.exception("mlx-lm-mla: generation failed")
                _restore_after_failure(served.of(self.model_provider))
                error = RuntimeError(f"generation failed: {type(e).__name__}: {e}")
                # With requests open the failure is theirs: answer them, go on.
                streak = 0 if _inflight(self) else streak + 1
                for rqueue in list(_inflight(self)):
                    rqueue.put(error)
                _inflight(self).clear()
                if self._stop:
                    return
                if streak >= TRIES:
                    if hasattr(self, "generation_available"):  # mlx-lm 0.32 on
                        raise  # upstream marks the thread dead
                    return _refuse_all(self, error)
                if streak:
                    time.sleep(BACKOFF * 2 ** (streak - 1))

    _generate.mlx_lm_mla_original = original
    return _generate


def _refuse_all(generator, error):
    # mlx-lm 0.31 has no dead-thread state: its clients would wait for ever,
    # so each later request gets the error that ended the loop.
    logger.error("mlx-lm-mla: generation keeps failing; refusing requests")
    while not generator._stop:
        request = generator._next_request(timeout=0.5)
        if request is not None:
            request[0].put(error)
