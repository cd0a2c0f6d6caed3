"""Sampling in ``mlx_lm.server``, so that no failure outlives its request.

A request's sampler and processors, built by the server's own builders, run once
on one row before it is queued: what they refuse, the request is refused for. In
a batch each row runs guarded and a failure ends only its request. mlx-lm's
samplers are compiled with ``mx.random.state`` as input and output, so a failure
inside one leaves a state never computed: every guarded call puts the key back.
"""

import dataclasses
import sys
import time

import mlx.core as mx

from . import state as served


def random_key():
    return mx.random.state[0]


def restore_random(key):
    """Makes ``key`` the random state again: mlx < 0.32.4 keeps it in a list,
    later ones behind a read-only view that ``seed`` sets (a key is its halves)."""
    state = mx.random.state
    if isinstance(state, list):
        state[0] = key
        return
    high, low = (int(v) for v in key.tolist())
    mx.random.seed((high << 32) | low)


def repair_random(server):
    """After ``server``'s generation loop failed: puts back the last good key it saw
    if the random state cannot be computed. True if it had to."""
    try:
        mx.eval(random_key())
        return False
    except Exception:
        pass
    if server.last_key is not None:
        restore_random(server.last_key)
    else:  # no key was seen: seed from the clock, as mlx seeds a new process
        mx.random.seed(time.time_ns() // 1_000_000)
    return True


# --- one run of a request's sampling, before it is queued ------------------


def _row(vocab):
    # A valid log-probability row with distinct values (no random draw).
    logits = -mx.arange(vocab, dtype=mx.float32)[None] / vocab
    return logits


def trial(sampler, processors, vocab, context):
    """Why one sampling step, run as a batch row does, fails, or None. The random
    state is left as found."""
    key = random_key()
    try:
        logits = _row(vocab)
        for processor in processors:
            logits = processor(context, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token = sampler(logprobs)
        mx.eval(token, logprobs)
        if mx.isnan(logprobs).any().item():
            return "gives log-probabilities that are not numbers"
        ids = token.reshape(-1).tolist()
        if len(ids) != 1 or not 0 <= ids[0] < vocab:
            return f"samples {ids}, not one token of the vocabulary (0..{vocab - 1})"
        return None
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        restore_random(key)


def _fields(group):
    return (
        [f.name for f in dataclasses.fields(group)]
        if dataclasses.is_dataclass(group)
        else []
    )


def _zero(value):
    # Every knob's "off" value in mlx-lm's samplers is the zero of its type.
    return None if value is None else type(value)()


def sampling_problem(
    make_sampler, make_processors, tokenizer, args, vocab, prompt, state=None
):
    """Why a request's sampling arguments cannot be served, naming the field, or
    None. What the server's builders made is kept on ``state``, to hand out once."""
    context = mx.array(prompt)
    seed = getattr(args, "seed", None)
    if seed is not None:  # the single path seeds with it first
        key = random_key()
        try:
            mx.random.seed(seed)
        except Exception as e:
            return f"seed={seed!r} cannot be served: {type(e).__name__}: {e}"
        finally:
            restore_random(key)

    def run(a, keep=False):
        try:
            sampler, processors = make_sampler(a, tokenizer), make_processors(a)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        problem = trial(sampler, processors, vocab, context)
        if keep and problem is None and state is not None:
            state.sampler, state.processors = sampler, processors
        return problem

    problem = run(args, keep=True)
    if problem is None:
        return None
    # Name the field: from every field at its zero, put the request's values
    # back one at a time; the first that makes it fail is the one.
    groups = [g for g in ("sampling", "logits") if _fields(getattr(args, g, None))]
    values = {g: dataclasses.asdict(getattr(args, g)) for g in groups}
    current = {g: {k: _zero(v) for k, v in values[g].items()} for g in groups}

    def variant():
        changes = {
            g: dataclasses.replace(getattr(args, g), **current[g]) for g in groups
        }
        return dataclasses.replace(args, **changes)

    if groups and dataclasses.is_dataclass(args) and run(variant()) is None:
        for g in groups:
            for name in _fields(getattr(args, g)):
                current[g][name] = values[g][name]
                found = run(variant())
                if found is not None:
                    return f"{name}={values[g][name]!r} cannot be served: {found}"
    return f"the sampling arguments cannot be served: {problem}"


# --- rows of a batch --------------------------------------------------------


class RowSampler:
    """A request's sampler in a batch: on failure the row gets a stand-in token
    (its request ends at the next reply) and the random state is put back. The
    key before each call is its server's last good one."""

    def __init__(self, sampler, state, server):
        self.sampler = sampler
        self.state = state
        self.server = server

    def run(self, logprobs):
        return self.sampler(logprobs)

    def __call__(self, logprobs):
        key = self.server.last_key = random_key()
        try:
            return self.run(logprobs)
        except Exception as e:
            restore_random(key)
            self.state.fail(e)
            return mx.argmax(logprobs, axis=-1)


class RowProcessor:
    """A request's logits processor in a batch: a failure is the request's
    own, and its row's logits pass through unchanged."""

    def __init__(self, processor, state):
        self.processor = processor
        self.state = state

    def __call__(self, tokens, logits):
        key = random_key()
        try:
            return self.processor(tokens, logits)
        except Exception as e:
            restore_random(key)
            self.state.fail(e)
            return logits


def _shared(sampler):
    """Whether the builder hands this sampler to every request (greedy)."""
    qualname = getattr(sampler, "__qualname__", "<locals>")
    return (
        "<locals>" not in qualname
        and getattr(
            sys.modules.get(getattr(sampler, "__module__", None)), qualname, None
        )
        is sampler
    )


def guarded_make_sampler(original):
    """``mlx_lm.server._make_sampler`` whose sampler runs as a guarded row. A shared
    sampler (greedy) is left as it is: the batch samples all rows in one call."""

    def _make_sampler(args, tokenizer):
        server = served.current()
        state = server.requests.get(args) if server is not None else None
        if state is None:
            return original(args, tokenizer)
        sampler = state.take("sampler") or original(args, tokenizer)
        return sampler if _shared(sampler) else RowSampler(sampler, state, server)

    _make_sampler.mlx_lm_mla_original = original
    return _make_sampler


def guarded_make_logits_processors(original):
    """``mlx_lm.server._make_logits_processors`` whose processors run guarded."""

    def _make_logits_processors(args):
        server = served.current()
        state = server.requests.get(args) if server is not None else None
        if state is None:
            return original(args)
        processors = state.take("processors")
        if processors is None:
            processors = original(args)
        return [RowProcessor(p, state) for p in processors]

    _make_logits_processors.mlx_lm_mla_original = original
    return _make_logits_processors


def unguarded(function):
    """The server's own builder under our guard."""
    return getattr(function, "mlx_lm_mla_original", function)
