"""Random sequences of cache operations, checked against a plain model.

The model of a cache is what it should hold: for every sequence, the latent
and RoPE rows written to it so far, in order, as float32 numpy arrays (exact
copies of the model-dtype values that went in), and whether that sequence is
quantized. After every operation the cache must agree with the model on
offsets, sizes, masks and content: bit for bit while a row is plain, its
latent within one quantization step once the row is quantized (the RoPE key
is never quantized, so it stays exact).
"""

import copy
import os
import tempfile
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

import mlx_lm_mla
from mlx_lm_mla import BatchMLALatentCache, MLALatentCache

from conftest import LATENT, ROPE

GROUP_SIZE = 64
STEP = MLALatentCache.step  # buffers grow by this many tokens
MAX_ROWS = 6  # a batch grows by extend; keep it small

# Reproducible (derandomized, no example database) and about 8 s per state
# machine on two cores while the caches behave; a failure costs more, since
# Hypothesis then shrinks the program to a minimal one.
SETTINGS = settings(
    max_examples=150,
    stateful_step_count=20,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

DTYPES = st.sampled_from([mx.float32, mx.bfloat16])
BITS = st.sampled_from([4, 8])
SEEDS = st.integers(0, 2**16)
# quantize_after: None, or the length at which a sequence gets quantized.
THRESHOLDS = st.none() | st.integers(0, 8)

# Besides the quantization step, a bfloat16 latent carries the rounding of
# bfloat16 scales, biases and output: up to two bfloat16 epsilons of the
# group's largest magnitude (1.3 measured over 20k groups at 8 bits).
ROUNDING = {mx.float32: 0.0, mx.bfloat16: 2 * 2.0**-7}


@pytest.fixture(scope="module", autouse=True)
def class_names_registered():
    """load_prompt_cache looks cache classes up by name in mlx_lm.models.cache.
    Left as found: the start-up hook may have installed the package already."""
    was_installed = bool(mlx_lm_mla.installed())
    mlx_lm_mla.install()
    yield
    if not was_installed:
        mlx_lm_mla.uninstall()


# --- the model -------------------------------------------------------------


@dataclass(frozen=True)
class Seq:
    """What one sequence should hold: its latent and RoPE rows, in order,
    and the bits its latent is quantized with (None while plain)."""

    latent: np.ndarray  # (n, LATENT) float32
    rope: np.ndarray  # (n, ROPE) float32
    bits: Optional[int] = None

    @staticmethod
    def empty(bits=None):
        return Seq(
            np.zeros((0, LATENT), np.float32), np.zeros((0, ROPE), np.float32), bits
        )

    def __len__(self):
        return len(self.latent)

    def append(self, latent, rope):
        return Seq(
            np.concatenate([self.latent, latent]),
            np.concatenate([self.rope, rope]),
            self.bits,
        )

    def trim(self, n):
        keep = max(0, len(self) - max(0, n))
        return Seq(self.latent[:keep], self.rope[:keep], self.bits)

    def quantized(self, bits):
        """This sequence quantized with bits; one that is stays as it is."""
        return Seq(self.latent, self.rope, self.bits or bits)


def to_np(x):
    return np.array(x.astype(mx.float32))  # exact for float32 and bfloat16


def tokens(seed, B, L, dtype):
    """L random tokens for B sequences: the (B, 1, L, D) arrays fed to a
    cache, and the (B, L, D) float32 rows the model keeps of them."""
    rng = np.random.default_rng(seed)
    latent = mx.array(rng.standard_normal((B, 1, L, LATENT), np.float32)).astype(dtype)
    rope = mx.array(rng.standard_normal((B, 1, L, ROPE), np.float32)).astype(dtype)
    return latent, rope, to_np(latent)[:, 0], to_np(rope)[:, 0]


def file_round_trip(caches):
    """Saves caches with mlx-lm's save_prompt_cache and loads them back."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "prompt_cache.safetensors")
        save_prompt_cache(path, caches)
        loaded = load_prompt_cache(path)
        mx.eval([c.state for c in loaded])
    return loaded


# --- checks ----------------------------------------------------------------


def assert_two_arrays(out):
    """update_and_fetch gives two mx.arrays in every mode, never packed tuples."""
    assert len(out) == 2
    assert all(isinstance(x, mx.array) for x in out), [type(x).__name__ for x in out]


def assert_within_one_step(got, want, bits, dtype):
    """MLX affine quantization keeps zero exact, so its error stays within one
    step, (group max - group min) / (2**bits - 1), not half a step."""
    shape = (len(want), LATENT // GROUP_SIZE, GROUP_SIZE)
    want_groups, err = want.reshape(shape), np.abs(got - want).reshape(shape)
    step = (want_groups.max(-1) - want_groups.min(-1)) / (2**bits - 1)
    bound = 1.01 * step + ROUNDING[dtype] * np.abs(want_groups).max(-1)
    worst = (err.max(-1) - bound).max(initial=-np.inf)
    assert worst <= 0, f"{bits}-bit latent off by {worst} more than one step"


def assert_rows_match(latent, rope, seq, dtype):
    """(n, LATENT) and (n, ROPE) arrays hold exactly the rows of seq."""
    assert latent.dtype == dtype and rope.dtype == dtype
    got_latent, got_rope = to_np(latent), to_np(rope)
    assert got_latent.shape == seq.latent.shape and got_rope.shape == seq.rope.shape
    np.testing.assert_array_equal(got_rope, seq.rope)
    if seq.bits is None:
        np.testing.assert_array_equal(got_latent, seq.latent)
    else:
        assert_within_one_step(got_latent, seq.latent, seq.bits, dtype)


def saved_rows(state, bits):
    """The (latent, rope) rows in a single cache's state, (n, D) each, the
    latent dequantized; None for a state with no arrays. The state is the
    config array first, maybe flags, then the arrays: [latent, rope] when
    plain, [packed, scales, biases, rope] when quantized."""
    group_size = int(state[0].tolist()[0])
    parts = [x for x in state[1:] if x.ndim == 4]
    if not parts:
        return None
    assert len(parts) == (2 if bits is None else 4)
    if bits is None:
        latent, rope = parts
    else:
        packed, scales, biases, rope = parts
        assert packed.dtype == mx.uint32
        if rope.shape[2] == 0:
            latent = mx.zeros((1, 1, 0, LATENT), scales.dtype)
        else:
            latent = mx.dequantize(
                packed, scales, biases, group_size=group_size, bits=bits
            )
    assert latent.shape[:2] == (1, 1) and rope.shape[:2] == (1, 1)
    return latent[0, 0], rope[0, 0]


def assert_single_holds(cache, seq, dtype):
    """A single cache: offset, size, precision, and the rows it gives back
    and saves in its state."""
    assert type(cache.offset) is int and cache.offset == len(seq) >= 0
    assert cache.size() == len(seq)
    assert cache.quantized == (seq.bits is not None)
    assert cache.latent_bits == seq.bits
    assert not hasattr(cache, "bits")
    saved = saved_rows(cache.state, seq.bits)
    if saved is None:
        assert len(seq) == 0
    else:
        assert_rows_match(*saved, seq, dtype)
    if not cache.empty():
        latent, rope = cache.keys_and_values()
        assert_rows_match(latent[0, 0], rope[0, 0], seq, dtype)


def causal(N, offset):
    """(N, offset + N): query q sees keys up to offset + q."""
    return np.arange(offset + N)[None] <= offset + np.arange(N)[:, None]


def assert_single_mask(cache):
    """None for one new token, else causal over the cached ones."""
    assert cache.make_mask(1) is None
    mask = cache.make_mask(3)
    assert isinstance(mask, mx.array) and mask.dtype == mx.bool_
    np.testing.assert_array_equal(np.array(mask), causal(3, cache.offset))


def assert_batch_offsets(cache, seqs):
    offsets = cache.offset.tolist()
    assert offsets == [len(s) for s in seqs]
    assert cache.size() >= max(offsets, default=0)


def assert_batch_mask(cache, seqs):
    """Row i sees its own len(seqs[i]) tokens and the new ones, never padding."""
    size, B = cache.size(), len(seqs)
    padding = size - np.array([len(s) for s in seqs])
    for N in (1, 3):
        not_padding = np.arange(size + N)[None, None] >= padding[:, None, None]
        expected = causal(N, size)[None] & not_padding
        mask = cache.make_mask(N)
        assert mask.shape == (B, 1, N, size + N)
        np.testing.assert_array_equal(np.array(mask)[:, 0], expected)


def assert_batch_precision(cache, seqs, bits, after):
    """The batch's quantization setting, and quantized only if every row is."""
    assert cache.latent_bits == bits and not hasattr(cache, "bits")
    assert cache.quantize_after == after
    assert cache.quantized == all(s.bits is not None for s in seqs)


def assert_batch_rows(cache, seqs, dtype):
    for i, seq in enumerate(seqs):
        assert_single_holds(cache.extract(i), seq, dtype)


def assert_batch_holds(cache, seqs, bits, after, dtype):
    assert_batch_offsets(cache, seqs)
    assert_batch_mask(cache, seqs)
    assert_batch_precision(cache, seqs, bits, after)
    assert_batch_rows(cache, seqs, dtype)


def assert_update_result(out, seqs, dtype, size):
    """What a batch update returns: every row's own tokens at its end."""
    assert_two_arrays(out)
    latent, rope = out
    assert latent.shape == (len(seqs), 1, size, LATENT)
    assert rope.shape == (len(seqs), 1, size, ROPE)
    for i, seq in enumerate(seqs):
        start = size - len(seq)
        assert_rows_match(latent[i, 0, start:], rope[i, 0, start:], seq, dtype)


# --- building caches -------------------------------------------------------


def prompt_lengths(B):
    """Prompt lengths for B sequences; a sequence may have none this time
    (BatchGenerator prompts all but the last token), but not every one."""
    return st.lists(st.integers(0, 5), min_size=B, max_size=B).map(
        lambda lengths: lengths if max(lengths) else [1] + lengths[1:]
    )


# (length, extra tokens written and trimmed off again, precision, seed). Half
# the singles are empty, since that is where the edge cases are: a fresh one
# holds no arrays, a trimmed one holds zero-length arrays. Precision is
# "plain", "quantized" (to_quantized after the writes) or "threshold" (made
# with quantize_after, so quantized only once long enough).
SINGLE_SPECS = st.tuples(
    st.just(0) | st.integers(1, 6),
    st.integers(0, 2),
    st.sampled_from(["plain", "quantized", "threshold"]),
    SEEDS,
)


def build_single(spec, dtype, bits, after):
    """A single cache and its model from a spec. "threshold" singles use
    quantize_after=after (plain singles when after is None)."""
    length, extra, precision, seed = spec
    if precision == "threshold" and after is not None:
        cache = MLALatentCache(GROUP_SIZE, bits, quantize_after=after)
    else:
        cache = MLALatentCache(GROUP_SIZE)
    latent, rope, ref_latent, ref_rope = tokens(seed, 1, length + extra, dtype)
    seq = Seq(ref_latent[0, :length], ref_rope[0, :length])
    if length + extra:
        cache.update_and_fetch(latent, rope)
        cache.trim(extra)
        if precision == "threshold" and after is not None and length + extra >= after:
            seq = seq.quantized(bits)  # crossed the threshold with that update
    if precision == "quantized":
        cache.to_quantized(group_size=GROUP_SIZE, bits=bits)
        seq = seq.quantized(bits)
    return cache, seq


def merged(specs, dtype, bits, after):
    """A batch merged from singles built from specs. Returns the batch, its
    sequences, and the batch's bits and quantize_after: those of any
    quantized single or single with a threshold."""
    built = [build_single(spec, dtype, bits, after) for spec in specs]
    batch = BatchMLALatentCache.merge([cache for cache, _ in built])
    for cache, seq in built:  # merge leaves its inputs alone
        assert_single_holds(cache, seq, dtype)
    with_threshold = after is not None and any(s[2] == "threshold" for s in specs)
    quantizes = with_threshold or any(s[2] == "quantized" for s in specs)
    return (
        batch,
        [seq for _, seq in built],
        bits if quantizes else None,
        after if with_threshold else None,
    )


# --- the single cache ------------------------------------------------------


class SingleCacheModel(RuleBasedStateMachine):
    """One MLALatentCache under random operations, next to its model."""

    @initialize(dtype=DTYPES, bits=st.none() | BITS, after=THRESHOLDS)
    def start(self, dtype, bits, after):
        """Plain (bits None), quantized from the start, or quantized once
        it holds `after` tokens."""
        self.dtype, self.set_aside = dtype, []
        self.after = after if bits is not None else None
        self.qbits = bits
        self.cache = MLALatentCache(GROUP_SIZE, bits, quantize_after=after)
        self.seq = Seq.empty(bits if self.after is None else None)

    def keep(self, cache):
        """A cache we stop using must keep what it holds now, whatever
        happens to the one we go on with (at most two are watched)."""
        self.set_aside = self.set_aside[-1:] + [(cache, self.seq)]

    @rule(L=st.integers(1, 5), seed=SEEDS)
    def update_and_fetch(self, L, seed):
        latent, rope, ref_latent, ref_rope = tokens(seed, 1, L, self.dtype)
        out = self.cache.update_and_fetch(latent, rope)
        self.seq = self.seq.append(ref_latent[0], ref_rope[0])
        assert_two_arrays(out)
        assert_rows_match(out[0][0, 0], out[1][0, 0], self.seq, self.dtype)
        # Like quantized_kv_start: the step that crosses the threshold runs
        # exact, and the cache is quantized for the steps after it.
        if self.after is not None and len(self.seq) >= self.after:
            self.seq = self.seq.quantized(self.qbits)

    @rule(extra=st.integers(0, 2), seed=SEEDS)
    def update_across_a_growth_step(self, extra, seed):
        """Writes past the end of the buffer, which grows by whole steps."""
        self.update_and_fetch(STEP - len(self.seq) % STEP + extra, seed)

    @rule(n=st.integers(0, 8))
    def trim(self, n):
        assert self.cache.trim(n) == min(n, len(self.seq))
        self.seq = self.seq.trim(n)

    @rule(go_on_with_the_copy=st.booleans())
    def deepcopy(self, go_on_with_the_copy):
        clone = copy.deepcopy(self.cache)
        if go_on_with_the_copy:
            self.keep(self.cache)
            self.cache = clone
        else:
            self.keep(clone)

    @rule()
    def state_round_trip(self):
        loaded = MLALatentCache.from_state(list(self.cache.state))
        self.keep(self.cache)
        self.cache = loaded

    @rule()
    def file_round_trip(self):
        self.keep(self.cache)
        (self.cache,) = file_round_trip([self.cache])
        assert isinstance(self.cache, MLALatentCache)

    @rule(bits=BITS)
    def to_quantized(self, bits):
        assert self.cache.to_quantized(group_size=GROUP_SIZE, bits=bits) is self.cache
        self.seq = self.seq.quantized(bits)  # never requantized

    @rule()
    def through_a_batch(self):
        """Merged into a batch of one and extracted again."""
        batch = BatchMLALatentCache.merge([self.cache])
        self.keep(self.cache)
        self.cache = batch.extract(0)

    @invariant()
    def holds_the_model_rows(self):
        assert_single_holds(self.cache, self.seq, self.dtype)

    @invariant()
    def mask_is_causal_over_the_cached_tokens(self):
        assert_single_mask(self.cache)

    @invariant()
    def caches_set_aside_are_unchanged(self):
        for cache, seq in self.set_aside:
            assert_single_holds(cache, seq, self.dtype)


def test_single_cache_holds_exactly_the_rows_written_and_not_trimmed():
    """update (also across a buffer growth step), trim, deepcopy, state and
    file round trips, to_quantized and a trip through a batch, in any order:
    offset, size, precision, mask and content always match the model."""
    run_state_machine_as_test(SingleCacheModel, settings=SETTINGS)


# --- the batch cache -------------------------------------------------------


class BatchCacheModel(RuleBasedStateMachine):
    """One BatchMLALatentCache under random operations, next to a model
    sequence per row."""

    @initialize(
        dtype=DTYPES,
        qbits=BITS,
        after=THRESHOLDS,
        specs=st.lists(SINGLE_SPECS, min_size=1, max_size=4),
        left_padded=st.none()
        | st.tuples(st.integers(1, 4).flatmap(prompt_lengths), st.booleans(), SEEDS),
    )
    def start(self, dtype, qbits, after, specs, left_padded):
        """A merge of singles (mlx-lm 0.32) or, when left_padded is drawn, a
        fresh batch cache with left padding given a left padded prompt
        (mlx-lm 0.31's BatchGenerator)."""
        # One quantization setting and threshold per run: caches that differ
        # in them cannot be batched, by design (tested elsewhere).
        self.dtype, self.qbits, self.run_after, self.set_aside = dtype, qbits, after, []
        if left_padded is None:
            self.cache, self.seqs, self.bits, self.after = merged(
                specs, dtype, qbits, after
            )
            return
        lengths, quantized, seed = left_padded
        L = max(lengths)
        self.bits = qbits if quantized else None
        self.after = after if quantized else None
        self.cache = BatchMLALatentCache(
            [L - n for n in lengths], GROUP_SIZE, self.bits, quantize_after=self.after
        )
        self.seqs = [Seq.empty() for _ in lengths]
        if quantized and self.after is None:
            self.seqs = [s.quantized(qbits) for s in self.seqs]
        latent, rope, ref_latent, ref_rope = tokens(seed, len(lengths), L, dtype)
        out = self.cache.update_and_fetch(latent, rope)
        self.seqs = [
            s.append(ref_latent[i, L - n :], ref_rope[i, L - n :])
            for i, (s, n) in enumerate(zip(self.seqs, lengths))
        ]
        assert_update_result(out, self.seqs, dtype, L)
        self.cross_thresholds(lengths)

    def keep(self, cache):
        self.set_aside = [(cache, list(self.seqs), self.bits, self.after)]

    def cross_thresholds(self, held):
        """Like quantized_kv_start: a write that leaves a row holding
        quantize_after tokens (held[i] for row i) runs exact, and the row is
        quantized for the writes after it."""
        if self.after is not None:
            self.seqs = [
                s.quantized(self.bits) if n >= self.after else s
                for s, n in zip(self.seqs, held)
            ]

    @rule(L=st.integers(1, 3), seed=SEEDS)
    def update_and_fetch(self, L, seed):
        B = len(self.seqs)
        latent, rope, ref_latent, ref_rope = tokens(seed, B, L, self.dtype)
        out = self.cache.update_and_fetch(latent, rope)
        self.seqs = [
            s.append(ref_latent[i], ref_rope[i]) for i, s in enumerate(self.seqs)
        ]
        assert_update_result(out, self.seqs, self.dtype, self.cache.size())
        self.cross_thresholds([len(s) for s in self.seqs])

    @rule(extra=st.integers(0, 2), seed=SEEDS)
    def update_across_a_growth_step(self, extra, seed):
        """Writes past the end of the buffer, which grows by whole steps."""
        self.update_and_fetch(STEP - self.cache.size() % STEP + extra, seed)

    @rule(n=st.integers(0, 8))
    def trim(self, n):
        longest = max(len(s) for s in self.seqs)
        assert self.cache.trim(n) == min(n, longest)
        self.seqs = [s.trim(n) for s in self.seqs]

    @rule(data=st.data())
    def filter(self, data):
        B = len(self.seqs)
        keep = data.draw(
            st.lists(st.integers(0, B - 1), min_size=1, max_size=B, unique=True).map(
                sorted
            ),
            label="keep",
        )
        self.cache.filter(keep)
        self.seqs = [self.seqs[i] for i in keep]

    @precondition(lambda self: len(self.seqs) < MAX_ROWS)
    @rule(specs=st.lists(SINGLE_SPECS, min_size=1, max_size=3), n=st.integers(0, 3))
    def extend(self, specs, n):
        """Extends with a merged batch, trimmed by n so that it may hold stale
        tokens past its end and more padding than any row needs."""
        specs = specs[: MAX_ROWS - len(self.seqs)]
        other, seqs, bits, after = merged(
            specs, self.dtype, self.bits or self.qbits, self.run_after
        )
        other.trim(n)
        self.cache.extend(other)
        self.seqs = self.seqs + [s.trim(n) for s in seqs]
        self.bits = self.bits or bits
        self.after = self.after if self.after is not None else after

    @rule(data=st.data(), seed=SEEDS)
    def prompt_right_padded(self, data, seed):
        """As BatchGenerator.prompt: prompts right padded to the longest,
        prefilled in chunks, then finalize turns the padding into left padding."""
        B = len(self.seqs)
        lengths = data.draw(prompt_lengths(B), label="lengths")
        L = max(lengths)
        cuts = data.draw(
            (
                st.lists(st.integers(1, L - 1), max_size=2, unique=True).map(sorted)
                if L > 1
                else st.just([])
            ),
            label="chunk boundaries",
        )
        latent, rope, ref_latent, ref_rope = tokens(seed, B, L, self.dtype)
        self.cache.prepare(lengths=lengths, right_padding=[L - n for n in lengths])
        for a, b in zip([0] + cuts, cuts + [L]):
            out = self.cache.update_and_fetch(latent[:, :, a:b], rope[:, :, a:b])
            assert_two_arrays(out)
            # What a row holds is its own tokens, never the padding after them.
            self.cross_thresholds(
                [len(s) + min(b, n) for s, n in zip(self.seqs, lengths)]
            )
        self.cache.finalize()
        self.seqs = [
            s.append(ref_latent[i, :n], ref_rope[i, :n])
            for i, (s, n) in enumerate(zip(self.seqs, lengths))
        ]

    @rule(data=st.data())
    def extract_and_merge_again(self, data):
        """As a prompt cache does: rows taken out one by one and batched
        again, in any order."""
        order = data.draw(st.permutations(range(len(self.seqs))), label="order")
        self.cache = BatchMLALatentCache.merge([self.cache.extract(i) for i in order])
        self.seqs = [self.seqs[i] for i in order]

    @rule(go_on_with_the_copy=st.booleans())
    def deepcopy(self, go_on_with_the_copy):
        clone = copy.deepcopy(self.cache)
        if go_on_with_the_copy:
            self.keep(self.cache)
            self.cache = clone
        else:
            self.keep(clone)

    @rule()
    def state_round_trip(self):
        self.cache = BatchMLALatentCache.from_state(list(self.cache.state))

    @rule()
    def file_round_trip(self):
        (self.cache,) = file_round_trip([self.cache])
        assert isinstance(self.cache, BatchMLALatentCache)

    @rule(bits=BITS)
    def to_quantized(self, bits):
        assert self.cache.to_quantized(group_size=GROUP_SIZE, bits=bits) is self.cache
        self.bits = self.bits or bits
        self.seqs = [s.quantized(self.bits) for s in self.seqs]

    @precondition(lambda self: self.bits is not None)
    @rule(data=st.data())
    def quantize_rows(self, data):
        """Some rows quantized with the batch's setting, the others left alone."""
        rows = data.draw(st.sets(st.integers(0, len(self.seqs) - 1)), label="rows")
        self.cache.quantize_rows(sorted(rows))
        self.seqs = [
            s.quantized(self.bits) if i in rows else s for i, s in enumerate(self.seqs)
        ]

    @invariant()
    def offsets_are_the_row_lengths(self):
        assert_batch_offsets(self.cache, self.seqs)

    @invariant()
    def mask_hides_exactly_the_padding(self):
        assert_batch_mask(self.cache, self.seqs)

    @invariant()
    def quantized_exactly_where_the_model_says(self):
        assert_batch_precision(self.cache, self.seqs, self.bits, self.after)

    @invariant()
    def every_row_extracts_to_its_model_rows(self):
        assert_batch_rows(self.cache, self.seqs, self.dtype)

    @invariant()
    def caches_set_aside_are_unchanged(self):
        for cache, seqs, bits, after in self.set_aside:
            assert_batch_holds(cache, seqs, bits, after, self.dtype)


def test_batch_cache_rows_hold_exactly_the_rows_written_and_not_trimmed():
    """merge or a left padded prompt, then update, trim, filter, extend, right
    padded prompts with finalize, extract and merge again, deepcopy, state and
    file round trips, to_quantized and quantize_rows, in any order: every
    row's offset, mask, precision and extracted content always match its
    model sequence."""
    run_state_machine_as_test(BatchCacheModel, settings=SETTINGS)


# --- quantize_after during a right padded prefill --------------------------


@settings(SETTINGS, max_examples=100)
@given(
    data=st.data(),
    bits=BITS,
    after=st.integers(0, 6),
    held=st.lists(st.integers(0, 4), min_size=2, max_size=4),
)
def test_a_row_is_quantized_once_it_holds_quantize_after_of_its_own_tokens(
    data, bits, after, held
):
    """The right padding a chunked prefill writes after a short prompt is not
    part of that row: it must not push the row over quantize_after early."""
    B = len(held)
    singles = []
    for n in held:
        single = MLALatentCache(GROUP_SIZE, bits, quantize_after=after)
        if n:
            single.update_and_fetch(*tokens(n, 1, n, mx.float32)[:2])
        singles.append(single)
    batch = BatchMLALatentCache.merge(singles)
    lengths = data.draw(prompt_lengths(B), label="lengths")
    L = max(lengths)
    starts = data.draw(
        (
            st.lists(st.integers(1, L - 1), max_size=3, unique=True).map(sorted)
            if L > 1
            else st.just([])
        ),
        label="chunk starts",
    )
    latent, rope, _, _ = tokens(0, B, L, mx.float32)
    batch.prepare(lengths=lengths, right_padding=[L - n for n in lengths])
    for a, b in zip([0] + starts, starts + [L]):
        batch.update_and_fetch(latent[:, :, a:b], rope[:, :, a:b])
    batch.finalize()
    # Each update quantizes the rows it leaves holding `after` tokens.
    expected = [(0 < h and after <= h) or after <= h + n for h, n in zip(held, lengths)]
    assert [batch.extract(i).quantized for i in range(B)] == expected
