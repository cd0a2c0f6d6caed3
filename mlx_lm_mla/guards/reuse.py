"""Guards on the server's shared ``LRUPromptCache``: a bad cache is never handed
out or stored."""

import logging

from ..mla import leaves
from . import state as served

logger = logging.getLogger(__name__)


class NoStore(list):
    """The tokens of a ``"cache_prompt": false`` request, which neither reuses nor
    stores a cache: the policy travels with the tokens the server hands to
    ``fetch_nearest_cache`` and ``insert_cache``, and survives slicing. Those
    two receive only the model key and the tokens (a batch row's cache is
    inserted after its reply ended): no other carrier (docs/design.md)."""

    def __getitem__(self, index):
        found = super().__getitem__(index)
        return NoStore(found) if isinstance(index, slice) else found

    def copy(self):
        return NoStore(self)


def no_store_tokenize(original):
    """``ResponseGenerator._tokenize`` giving a no-store request ``NoStore`` tokens."""

    def _tokenize(self, tokenizer, request, args, *rest, **kwargs):
        result = original(self, tokenizer, request, args, *rest, **kwargs)
        state = served.of(self.model_provider).requests.get(request)
        if state is None or state.cache_prompt:
            return result
        return (NoStore(result[0]), result[1], [], *result[3:])

    _tokenize.mlx_lm_mla_original = original
    return _tokenize


def main_layers(model_key):
    """How many entries of a cache list the served model's own are, where the
    server drafts (stock appends the draft model's caches and splits the list
    at the model's layer count), or None: every entry is the model's."""
    server = served.current()
    provider = getattr(server, "provider", None)
    if getattr(provider, "draft_model", None) is None:
        return None
    if provider.model_key != model_key:
        return None
    return len(provider.model.layers)


def stored_key(model, tokens, caches):
    """(the tokens a cache is stored under, where its model's layers end):
    ``tokens``, or on a drafting server the ones its model's caches hold."""
    main = main_layers(model)
    if main is not None:
        tokens = tokens[: drafted_length(caches, tokens, main)]
    return tokens, main


def drafted_length(caches, tokens, main):
    """The tokens a drafting server's cache holds of ``tokens``: speculative
    decoding hands out its last token before the model has read it, so the
    model's caches may hold one token fewer; stored under the tokens they
    hold, they serve the next request rightly (stock's key claims one more)."""
    held = {
        c.offset
        for c in leaves(caches[:main])
        if isinstance(getattr(c, "offset", None), int)
    }
    if len(held) == 1 and 0 < held.pop() == len(tokens) - 1:
        return len(tokens) - 1
    return len(tokens)


def cache_problem(caches, length, main=None):
    """Why a prompt cache does not hold exactly ``length`` tokens, or None. Only
    mlx-lm's cache classes must have a state of arrays: others define their own.
    Entries from ``main`` on are a draft model's: speculative decoding leaves
    them behind (a token or more), which costs drafting, never a wrong token."""
    if not isinstance(caches, (list, tuple)) or not caches:
        return f"not a list of layer caches: {type(caches).__name__}"
    i = 0
    for n, entry in enumerate(caches):
        draft = main is not None and n >= main
        for c in leaves([entry]):
            problem = _layer_problem(c, length, draft)
            if problem:
                return f"layer {i}: {problem}"
            i += 1
    return None


def _layer_problem(c, length, draft):
    import mlx.core as mx
    import mlx_lm.models.cache as cache_module
    from mlx.utils import tree_flatten

    name = type(c).__name__
    offset = getattr(c, "offset", None)
    if isinstance(offset, int) and offset != length:
        if not (draft and 0 <= offset < length):
            return f"{name} holds {offset} tokens, expected {length}"
    if getattr(cache_module, name, None) is not type(c):
        return None
    try:
        state = c.state
    except Exception as e:
        return f"{name}.state fails: {e!r}"
    for key, leaf in tree_flatten(state):
        if not isinstance(leaf, (mx.array, int, float, str, type(None))):
            return f"{name}.state[{key}] is a {type(leaf).__name__}"
    # Only a quantized cache (one with bits) may keep lists of arrays.
    for field in ("keys", "values"):
        value = getattr(c, field, None)
        if not hasattr(c, "bits") and not isinstance(value, (mx.array, type(None))):
            return f"{name}.{field} is a {type(value).__name__}, not an array"
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
        if isinstance(tokens, NoStore):
            return None, tokens
        # Evict any candidate entry that does not hold what its key says.
        found = self._trie.search(model, tokens)
        keys = {
            tuple(k)
            for k in (found.exact, found.longer, found.shorter)
            if k is not None
        }
        main = main_layers(model)
        for key in map(list, keys):
            entry = self._trie.get(model, key)
            problem = cache_problem(entry.prompt_cache, len(key), main)
            if problem:
                logger.warning(
                    "mlx-lm-mla: evicted a bad prompt cache entry: %s", problem
                )
                _evict(self, model, key)
        cache, rest = original(self, model, tokens)
        if cache is None:
            return cache, rest
        if cache_problem(cache, len(tokens) - len(rest), main):
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
    """``LRUPromptCache.insert_cache`` refusing a partial or broken cache."""

    def insert_cache(self, model, tokens, prompt_cache, *args, **kwargs):
        if isinstance(tokens, NoStore):
            return  # the cache of a "cache_prompt": false request
        tokens, main = stored_key(model, tokens, prompt_cache)
        problem = cache_problem(prompt_cache, len(tokens), main)
        if problem:
            logger.warning("mlx-lm-mla: refused to store a prompt cache: %s", problem)
            return
        return original(self, model, tokens, prompt_cache, *args, **kwargs)

    insert_cache.mlx_lm_mla_original = original
    return insert_cache
