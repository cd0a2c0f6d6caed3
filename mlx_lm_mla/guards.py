"""Checks on the paths where a cache is reused, so a bad cache is refused
with a clear error instead of poisoning later requests."""

import json
import logging
import math
import os
import struct
import threading

logger = logging.getLogger(__name__)

_DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
    "C64": 8,
}


class CorruptCacheFile(ValueError):
    """A prompt cache file that cannot be what it claims to be."""


def check_cache_file(path):
    """Checks that a ``.safetensors`` prompt cache file is whole: a readable
    header, and every tensor's bytes inside the file. Older MLX reads past
    the end of a truncated file without an error, which would load garbage.
    """
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CorruptCacheFile(
                f"prompt cache file {path} is too short ({size} bytes)"
            )
        (header_len,) = struct.unpack("<Q", head)
        if 8 + header_len > size:
            raise CorruptCacheFile(
                f"prompt cache file {path} is truncated: its header needs "
                f"{8 + header_len} bytes, the file has {size}"
            )
        try:
            header = json.loads(f.read(header_len))
        except ValueError as e:
            raise CorruptCacheFile(
                f"prompt cache file {path} has an unreadable header: {e}"
            )
    if not isinstance(header, dict):
        raise CorruptCacheFile(f"prompt cache file {path} has an unreadable header")
    data = size - 8 - header_len
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = info["data_offsets"]
            expected = math.prod(info["shape"]) * _DTYPE_BYTES.get(info["dtype"], 0)
        except (KeyError, TypeError, ValueError):
            raise CorruptCacheFile(
                f"prompt cache file {path}: tensor {name!r} is malformed"
            )
        if end > data or end - start < 0 or (expected and end - start != expected):
            raise CorruptCacheFile(
                f"prompt cache file {path} is truncated or corrupt: tensor "
                f"{name!r} needs bytes {start}..{end} of {data}"
            )


# --- the prompt cache shared across requests (LRUPromptCache) ---------------

# "cache_prompt": false (LM Studio clients send it): the request neither
# reuses nor stores a prompt cache. The handler tags the request, the
# generation thread notes the request it took last, and the prompt cache
# looks at that note; prompts not to store are kept until their final insert.
_taken = threading.local()
_no_store = []


def tag_request(request, body):
    if isinstance(body, dict) and body.get("cache_prompt", True) is False:
        try:
            request.mlx_lm_mla_cache_prompt = False
        except AttributeError:
            pass


def wants_prompt_cache():
    request = getattr(_taken, "request", None)
    return getattr(request, "mlx_lm_mla_cache_prompt", True) is not False


def _remember_no_store(tokens):
    _no_store.append(list(tokens))
    del _no_store[:-64]  # a cancelled request never sends its final insert


def _is_no_store(tokens, final):
    # The request's own caches: its prompt's segments (a prefix of the
    # prompt) and its final one (the prompt and what it generated).
    for prompt in _no_store:
        n = min(len(prompt), len(tokens))
        if tokens[:n] == prompt[:n]:
            if final:
                _no_store.remove(prompt)
            return True
    return False


def _leaves(caches):
    for c in caches:
        inner = getattr(c, "caches", None)
        if isinstance(inner, (list, tuple)):
            yield from _leaves(inner)
        else:
            yield c


def cache_problem(caches, length):
    """Why a prompt cache cannot hold ``length`` tokens, or None if it can:
    every layer is a known cache class, its state is arrays (or scalars), and
    every layer with an ``offset`` holds exactly ``length`` tokens."""
    import mlx.core as mx
    import mlx_lm.models.cache as cache_module
    from mlx.utils import tree_flatten

    if not isinstance(caches, (list, tuple)) or not caches:
        return f"not a list of layer caches: {type(caches).__name__}"
    for i, c in enumerate(_leaves(caches)):
        name = type(c).__name__
        if getattr(cache_module, name, None) is not type(c):
            return f"layer {i}: unknown cache class {name}"
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
        offset = getattr(c, "offset", None)
        if isinstance(offset, int) and offset != length:
            return f"layer {i}: {name} holds {offset} tokens, expected {length}"
    return None


def _evict(store, model, key):
    entry = store._trie.pop(model, key)
    store._lru.remove(model, key)
    store._n_bytes -= entry.nbytes
    store._n_bytes_by_type[entry.cache_type] -= entry.nbytes


def guarded_fetch(original):
    """``LRUPromptCache.fetch_nearest_cache`` that never hands out a bad cache
    and never an empty remainder."""

    def fetch_nearest_cache(self, model, tokens):
        if not wants_prompt_cache():
            _remember_no_store(tokens)
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
        if not rest:
            # An exact hit: step back one token so there is one to process.
            if all(c.is_trimmable() for c in cache) and len(tokens) > 0:
                for c in cache:
                    c.trim(1)
                return cache, tokens[-1:]
            return None, tokens
        return cache, rest

    fetch_nearest_cache.mlx_lm_mla_original = original
    return fetch_nearest_cache


def guarded_insert(original):
    """``LRUPromptCache.insert_cache`` that refuses a cache which does not
    hold exactly the tokens of its key (a partial or broken one)."""

    def insert_cache(self, model, tokens, prompt_cache, *args, **kwargs):
        if _is_no_store(
            tokens, final=kwargs.get("cache_type", "assistant") == "assistant"
        ):
            return
        problem = cache_problem(prompt_cache, len(tokens))
        if problem:
            logger.warning("mlx-lm-mla: refused to store a prompt cache: %s", problem)
            return
        return original(self, model, tokens, prompt_cache, *args, **kwargs)

    insert_cache.mlx_lm_mla_original = original
    return insert_cache


# --- the server's generation thread ----------------------------------------


def _inflight(generator):
    return generator.__dict__.setdefault("_mlx_lm_mla_inflight", set())


def tracked_next_request(original):
    """``ResponseGenerator._next_request`` that remembers which requests are
    open, so they can be answered if the generation loop fails."""

    def _next_request(self, timeout=None):
        request = original(self, timeout)
        if request is not None:
            _taken.request = request[1]
            rqueue, open_requests = request[0], _inflight(self)
            open_requests.add(rqueue)
            put = rqueue.put

            def put_and_track(item, *args, **kwargs):
                put(item, *args, **kwargs)
                if item is None or isinstance(item, Exception):
                    open_requests.discard(rqueue)

            rqueue.put = put_and_track
        return request

    _next_request.mlx_lm_mla_original = original
    return _next_request


def supervised_generate(original):
    """``ResponseGenerator._generate`` that survives a failing request.

    Upstream, an exception in the batched loop ends the generation thread and
    every later request fails or hangs. Here the open requests get a clear
    error, their batch and caches are dropped (nothing partial was stored:
    the prompt cache keeps copies only), and the loop starts again."""

    def _generate(self):
        while True:
            try:
                return original(self)
            except Exception as e:
                logger.exception("mlx-lm-mla: generation failed; recovering")
                error = RuntimeError(f"generation failed: {type(e).__name__}: {e}")
                for rqueue in list(_inflight(self)):
                    rqueue.put(error)
                _inflight(self).clear()
                if self._stop:
                    return

    _generate.mlx_lm_mla_original = original
    return _generate


def guarded_completion(original):
    """``APIHandler.handle_completion`` that honours ``"cache_prompt": false``
    and answers a request which failed during generation. Upstream lets the
    exception close the connection, so the client sees no reason; here it
    gets HTTP 500 with the error, or an ``error`` event when streaming (the
    headers went out already)."""

    def handle_completion(self, *args, **kwargs):
        if args:
            tag_request(args[0], getattr(self, "body", None))
        try:
            return original(self, *args, **kwargs)
        except Exception as e:
            logger.warning("mlx-lm-mla: request failed: %s: %s", type(e).__name__, e)
            error = json.dumps(
                {
                    "error": {
                        "message": f"{type(e).__name__}: {e}",
                        "type": "server_error",
                    }
                }
            )
            try:
                if getattr(self, "stream", False):
                    self.wfile.write(f"data: {error}\n\n".encode())
                else:
                    self.send_response(500)
                    self.send_header("Content-Type", "application/json")
                    self.end_headers()
                    self.wfile.write(error.encode())
                self.wfile.flush()
            except OSError:
                pass  # the client is gone

    handle_completion.mlx_lm_mla_original = original
    return handle_completion


def checked_load(original):
    """``load_prompt_cache`` that checks the file is whole first."""

    def load_prompt_cache(file_name, *args, **kwargs):
        check_cache_file(file_name)
        return original(file_name, *args, **kwargs)

    load_prompt_cache.mlx_lm_mla_original = original
    return load_prompt_cache
