"""Checks on the paths where a cache is reused, so a bad cache is refused
with a clear error instead of poisoning later requests."""

import logging
import sys
import threading
import time

from . import sampling
from .latent import leaves

logger = logging.getLogger(__name__)


# --- the prompt cache shared across requests (LRUPromptCache) ---------------

# "cache_prompt": false (LM Studio clients send it): the request neither
# reuses nor stores a prompt cache. The mark is on the request itself, so
# concurrent requests cannot touch each other's caches. The generation
# thread notes the request it is tokenizing (the fetch follows at once) and
# the request whose reply it just ended (its final insert follows at once).
_taken = threading.local()


def tag_request(request, body):
    if isinstance(body, dict) and body.get("cache_prompt", True) is False:
        try:
            request.mlx_lm_mla_cache_prompt = False
        except AttributeError:
            pass


def _stores(request):
    return getattr(request, "mlx_lm_mla_cache_prompt", True) is not False


def no_store_tokenize(original):
    """``ResponseGenerator._tokenize`` that notes the request for the fetch
    that follows, and gives a no-store request no segments to store."""

    def _tokenize(self, tokenizer, request, args, *rest, **kwargs):
        _taken.request = request
        result = original(self, tokenizer, request, args, *rest, **kwargs)
        if _stores(request):
            return result
        request.mlx_lm_mla_prompt = list(result[0])
        return (result[0], result[1], [], *result[3:])

    _tokenize.mlx_lm_mla_original = original
    return _tokenize


def _ended(request):
    # Called as the request's reply ends: its final insert comes next.
    if not _stores(request):
        _taken.skip_insert = getattr(request, "mlx_lm_mla_prompt", None)


def cache_problem(caches, length):
    """Why a prompt cache cannot hold ``length`` tokens, or None if it can:
    every layer with an integer ``offset`` holds exactly ``length`` tokens,
    and a layer of an mlx-lm cache class has a state of arrays (or scalars).
    Caches of other classes (mlx-vlm's, custom ones) are stored as upstream
    stores them: their state is theirs to define."""
    import mlx.core as mx
    import mlx_lm.models.cache as cache_module
    from mlx.utils import tree_flatten

    if not isinstance(caches, (list, tuple)) or not caches:
        return f"not a list of layer caches: {type(caches).__name__}"
    for i, c in enumerate(leaves(caches)):
        name = type(c).__name__
        offset = getattr(c, "offset", None)
        if isinstance(offset, int) and offset != length:
            return f"layer {i}: {name} holds {offset} tokens, expected {length}"
        if getattr(cache_module, name, None) is not type(c):
            continue
        try:
            state = c.state
        except Exception as e:
            return f"layer {i}: {name}.state fails: {e!r}"
        for key, leaf in tree_flatten(state):
            if not isinstance(leaf, (mx.array, int, float, str, type(None))):
                return f"layer {i}: {name}.state[{key}] is a {type(leaf).__name__}"
        # Only a quantized cache (one with bits) may keep lists of arrays.
        for field in ("keys", "values"):
            value = getattr(c, field, None)
            if not hasattr(c, "bits") and not isinstance(value, (mx.array, type(None))):
                return f"layer {i}: {name}.{field} is a {type(value).__name__}, not an array"
    return None


def _evict(store, model, key):
    entry = store._trie.pop(model, key)
    store._lru.remove(model, key)
    store._n_bytes -= entry.nbytes
    store._n_bytes_by_type[entry.cache_type] -= entry.nbytes


def guarded_fetch(original):
    """``LRUPromptCache.fetch_nearest_cache`` that never hands out a bad cache
    and never an empty remainder for a prompt that has tokens."""

    def fetch_nearest_cache(self, model, tokens):
        if not _stores(getattr(_taken, "request", None)):
            return None, tokens
        # Evict any candidate entry that does not hold what its key says.
        found = self._trie.search(model, tokens)
        keys = {
            tuple(k)
            for k in (found.exact, found.longer, found.shorter)
            if k is not None
        }
        for key in map(list, keys):
            entry = self._trie.get(model, key)
            problem = cache_problem(entry.prompt_cache, len(key))
            if problem:
                logger.warning(
                    "mlx-lm-mla: evicted a bad prompt cache entry: %s", problem
                )
                _evict(self, model, key)
        cache, rest = original(self, model, tokens)
        if cache is None:
            return cache, rest
        if cache_problem(cache, len(tokens) - len(rest)):
            return None, tokens
        if rest or not tokens:
            return cache, rest
        # An exact hit: step back one token so there is one to process.
        if all(getattr(c, "is_trimmable", lambda: False)() for c in cache):
            for c in cache:
                c.trim(1)
            return cache, tokens[-1:]
        return None, tokens

    fetch_nearest_cache.mlx_lm_mla_original = original
    return fetch_nearest_cache


def guarded_insert(original):
    """``LRUPromptCache.insert_cache`` that refuses a cache which does not
    hold exactly the tokens of its key (a partial or broken one)."""

    def insert_cache(self, model, tokens, prompt_cache, *args, **kwargs):
        skip, _taken.skip_insert = getattr(_taken, "skip_insert", None), None
        if skip is not None and list(tokens[: len(skip)]) == skip:
            return  # the final cache of a "cache_prompt": false request
        problem = cache_problem(prompt_cache, len(tokens))
        if problem:
            logger.warning("mlx-lm-mla: refused to store a prompt cache: %s", problem)
            return
        return original(self, model, tokens, prompt_cache, *args, **kwargs)

    insert_cache.mlx_lm_mla_original = original
    return insert_cache


# --- the server's generation thread ----------------------------------------

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
    request whose own sampling failed in a batch step (see sampling.py):
    its next reply is replaced by the error, its context is stopped so the
    server drops its row, and nothing more is sent to it."""

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
                    if item is None:
                        _ended(body)
                    return
                if isinstance(item, context):
                    held["ctx"] = item
                elif not isinstance(item, Exception) and sampling.failure(args):
                    error = sampling.failure(args)
                    item = RuntimeError(f"sampling failed: {type(error).__name__}: {error}")
                    held["answered"] = True
                    if held["ctx"] is not None:
                        held["ctx"].stop()  # the server removes the row
                put(item, *args_, **kwargs)
                if item is None:
                    _ended(body)
                if item is None or isinstance(item, Exception):
                    open_requests.discard(rqueue)

            rqueue.put = put_and_track
        return request

    _next_request.mlx_lm_mla_original = original
    return _next_request


def _restore_after_failure():
    """What a failed step can leave behind in the process: a random state
    that cannot be computed, and this thread's notes on the request being
    fetched or stored."""
    if sampling.repair_random():
        logger.warning("mlx-lm-mla: restored the random state after a failure")
    _taken.request = None
    _taken.skip_insert = None


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
