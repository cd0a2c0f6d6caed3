"""Recovery in the server's generation thread: a failure ends the requests
it hit, with a clear error, and the loop serves the next ones as a fresh
server would."""

import logging
import sys
import time

from . import cancellation, sampling

logger = logging.getLogger(__name__)


# A failure with no request open (a default model that cannot load) is
# given this many tries in a row, backed off, before the thread ends the
# way upstream's does.
TRIES = 4
BACKOFF = 0.05  # seconds before the second try; doubled each time


def _inflight(generator):
    return generator.__dict__.setdefault("_mlx_lm_mla_inflight", set())


def tracked_next_request(original):
    """``ResponseGenerator._next_request`` that remembers which requests are
    open, so they can be answered if the generation loop fails, and ends a
    request whose own sampling failed in a batch step (see guards/sampling.py)
    or whose client is gone (see guards/cancellation.py): its next reply is
    replaced by the error, its context is stopped so the server drops its
    row, and nothing more is sent to it."""

    def _next_request(self, timeout=None):
        request = original(self, timeout)
        if request is not None:
            rqueue, body, args = request[0], request[1], request[2]
            open_requests = _inflight(self)
            open_requests.add(rqueue)
            put = rqueue.put
            context = getattr(sys.modules.get(type(self).__module__), "GenerationContext", ())
            held = {"ctx": None, "answered": False}

            def put_and_track(item, *args_, **kwargs):
                if held["answered"]:
                    return
                if isinstance(item, context):
                    held["ctx"] = item
                elif not isinstance(item, Exception):
                    item = _ending(item, body, args, held)
                put(item, *args_, **kwargs)
                if item is None or isinstance(item, Exception):
                    open_requests.discard(rqueue)

            rqueue.put = put_and_track
        return request

    _next_request.mlx_lm_mla_original = original
    return _next_request


def _ending(item, body, args, held):
    """The reply to send in place of ``item``: the error that ends the
    request, if its sampling failed or its client is gone; else ``item``."""
    failure, client = sampling.failure(args), cancellation.gone(body)
    if not (failure or client):
        if hasattr(item, "token"):
            cancellation.count_token(body)
        return item
    if failure:
        item = RuntimeError(f"sampling failed: {type(failure).__name__}: {failure}")
    else:
        item = cancellation.ClientGone(f"{client}: the client is gone")
    held["answered"] = True
    if held["ctx"] is not None:
        held["ctx"].stop()  # the server removes the row
    return item


def _restore_after_failure():
    """What a failed step can leave behind in the process: a random state
    that cannot be computed."""
    if sampling.repair_random():
        logger.warning("mlx-lm-mla: restored the random state after a failure")


def supervised_generate(original):
    """``ResponseGenerator._generate`` that survives a failing request.

    Upstream, an exception in the batched loop ends the generation thread, so
    one bad batch ends the server. Here the open requests get a clear error,
    their batch and caches are dropped (nothing partial was stored: the
    prompt cache keeps copies only), and the loop starts again. A failure
    with no request open is retried ``TRIES`` times in a row, backed off,
    then ends the thread as upstream's does, so mlx-lm 0.32's
    ``generation_available()`` and health check report it."""

    def _generate(self):
        streak = 0
        while True:
            try:
                return original(self)
            except Exception as e:
                logger.exception("mlx-lm-mla: generation failed")
                _restore_after_failure()
                error = RuntimeError(f"generation failed: {type(e).__name__}: {e}")
                # With requests open the failure is theirs: answer them, go on.
                streak = 0 if _inflight(self) else streak + 1
                for rqueue in list(_inflight(self)):
                    rqueue.put(error)
                _inflight(self).clear()
                if self._stop:
                    return
                if streak >= TRIES:
                    if hasattr(self, "generation_available"):
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
