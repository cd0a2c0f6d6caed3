"""A request's sampling in a batch row: a failure is the request's own,
and mx.random's state is left as it was (sampling.py)."""

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler

import pytest

from mlx_lm_mla.guards import sampling
from mlx_lm_mla.guards.state import RequestState, ServerState, running

VOCAB = 64


class Args:
    """Stands for a request's GenerationArguments."""


@pytest.fixture
def server():
    """A server's state, as its generation thread sees it."""
    with running(ServerState(cli_args=None)) as server:
        yield server


@pytest.fixture
def served(server):
    """Generation arguments of a request the server is serving, and its state."""
    args = Args()
    state = server.requests.open(args)
    yield args, state
    server.requests.close(args)


def row():
    logits = -mx.arange(VOCAB, dtype=mx.float32)[None] / VOCAB
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def draws(n=4, seed=3):
    mx.random.seed(seed)
    sampler = make_sampler(0.8)
    return [sampler(row()).item() for _ in range(n)]


def test_a_sampler_failing_inside_its_compiled_call_breaks_the_random_state_on_stock():
    key = sampling.random_key()
    try:
        make_sampler(0.8, top_k=VOCAB * 10)(row())
    except ValueError:
        pass
    try:
        mx.eval(sampling.random_key())
        broken = False
    except RuntimeError:
        broken = True
    sampling.restore_random(key)
    assert broken


def test_a_failing_row_answers_with_a_stand_in_and_keeps_the_random_state():
    expected = draws()
    mx.random.seed(3)
    state = RequestState()
    row_sampler = sampling.RowSampler(
        make_sampler(0.8, top_k=VOCAB * 10), state, ServerState(cli_args=None)
    )
    token = row_sampler(row())
    sampler = make_sampler(0.8)
    assert token.item() == 0 and "top_k" in str(state.failure)
    assert [sampler(row()).item() for _ in range(4)] == expected


def test_a_failing_processor_passes_the_row_through():
    def bad(tokens, logits):
        raise ValueError("this penalty cannot be applied")

    state, logits = RequestState(), row()
    out = sampling.RowProcessor(bad, state)(mx.array([[1, 2]]), logits)
    assert out is logits and state.failure is not None


def test_a_trial_leaves_the_random_state_as_it_found_it():
    expected = draws()
    mx.random.seed(3)
    assert sampling.trial(make_sampler(0.8), [], VOCAB, mx.array([1, 2])) is None
    assert "top_k" in sampling.trial(
        make_sampler(0.8, top_k=VOCAB * 10), [], VOCAB, mx.array([1])
    )
    sampler = make_sampler(0.8)
    assert [sampler(row()).item() for _ in range(4)] == expected


def counting(builder, calls):
    def build(*args):
        calls.append(args)
        return builder(*args)

    return build


def test_a_request_s_sampler_is_built_once_by_its_validation_and_run_as_its_row(served):
    calls, (args, state) = [], served
    make = counting(lambda args, tokenizer: make_sampler(0.8), calls)
    assert (
        sampling.sampling_problem(make, lambda a: [], None, args, VOCAB, [1, 2], state)
        is None
    )
    row_sampler = sampling.guarded_make_sampler(make)(args, None)
    assert (
        len(calls) == 1
        and isinstance(row_sampler, sampling.RowSampler)
        and row_sampler.state is state
    )


def test_a_request_s_processors_are_built_once_by_its_validation(served):
    calls, (args, state) = [], served
    penalty = counting(lambda args: [lambda tokens, logits: logits], calls)
    assert (
        sampling.sampling_problem(
            lambda a, t: make_sampler(0.8), penalty, None, args, VOCAB, [1, 2], state
        )
        is None
    )
    processors = sampling.guarded_make_logits_processors(penalty)(args)
    assert len(calls) == 1 and [type(p) for p in processors] == [sampling.RowProcessor]


def test_the_greedy_sampler_every_request_shares_is_left_unwrapped(served):
    greedy = make_sampler(0.0)
    built = sampling.guarded_make_sampler(lambda args, tokenizer: greedy)(
        served[0], None
    )
    shared = (
        "<locals>" not in greedy.__qualname__
    )  # mlx-lm 0.32: one module-level function
    assert (built is greedy) == shared and isinstance(
        built, sampling.RowSampler
    ) != shared


def test_the_server_s_builder_takes_request_arguments_of_any_kind():
    class AsAClass:  # mlx-lm's own test passes a class for the request's arguments
        pass

    sampler = sampling.guarded_make_sampler(lambda args, tokenizer: make_sampler(0.8))(
        AsAClass, None
    )
    assert sampler(row()).shape == (1,)


def test_a_sampler_made_outside_a_served_request_is_the_builders_own():
    made = make_sampler(0.8)
    assert (
        sampling.guarded_make_sampler(lambda args, tokenizer: made)(Args(), None)
        is made
    )


def test_a_closed_request_leaves_no_state_behind(server, served):
    args, state = served
    request = Args()
    server.requests.bind(request, state)
    server.requests.close(args)
    assert server.requests.get(args) is None and server.requests.get(request) is None
