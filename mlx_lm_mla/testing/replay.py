"""Requests driven through mlx-lm's ``generate_step`` the way a server reuses
one prompt cache, for the tests and for the checks run in processes of their
own (tests/upstream_form, tests/distributed). ``generate_step`` is looked up at
each call: the package's while it is installed, stock's while it is not."""

import importlib

import mlx.core as mx
from mlx_lm.models.cache import (
    can_trim_prompt_cache,
    make_prompt_cache,
    trim_prompt_cache,
)

from ..mla import leaves

# The module, not the function ``mlx_lm.generate`` that shadows its name.
GENERATE = importlib.import_module("mlx_lm.generate")


def generated(model, cache, prompt, max_tokens, bits=None, start=0, group_size=64):
    """The tokens ``generate_step`` makes after ``prompt`` (greedy), the cache
    quantized at ``bits`` past ``start`` tokens."""
    steps = GENERATE.generate_step(
        mx.array(prompt),
        model,
        prompt_cache=cache,
        max_tokens=max_tokens,
        kv_bits=bits,
        kv_group_size=group_size,
        quantized_kv_start=start,
    )
    return [token for token, _ in steps]


def offset(cache):
    """How many tokens a prompt cache holds."""
    return next(c.offset for c in leaves(cache) if hasattr(c, "offset"))


def serve(model, cache, history, prompt, bits, start, max_tokens=12):
    """One request the way a server reuses its cache: trim to the common
    prefix, process the rest, remember what the cache now holds. Returns
    (the tokens it holds, the tokens made)."""
    common = 0
    while (
        common < min(len(history), len(prompt) - 1)
        and history[common] == prompt[common]
    ):
        common += 1
    if can_trim_prompt_cache(cache):
        trim_prompt_cache(cache, offset(cache) - common)
    elif common < len(history):  # a hybrid's state cannot be trimmed: start afresh
        cache[:], common = make_prompt_cache(model), 0
    out = generated(model, cache, prompt[common:], max_tokens, bits, start)
    return (prompt + out)[: offset(cache)], out


def requests(n):
    """n prompts sharing a 30-token prefix, each with a short tail of its own."""
    prefix = [(3 * i + 11) % 190 + 5 for i in range(30)]
    return [
        prefix + [(7 * r + j) % 190 + 5 for j in range(2 + r % 9)] for r in range(n)
    ]
