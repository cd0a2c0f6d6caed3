"""BatchGenerator and batch_generate with MLA models: stock batch caches,
quantized in place under --kv-bits."""

import contextlib
import copy

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from mlx_lm_mla import QuantizedLatentCache
from mlx_lm_mla import tiny

PROMPTS = [[(3 * i + 5) % 190 + 5 for i in range(n)] for n in (5, 17, 9, 12)]


def alone(model, prompt, n):
    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def cached(model, prompt, n):
    """A prompt cache holding the first n tokens of prompt."""
    cache = make_prompt_cache(model)
    if n:
        model(mx.array([prompt[:n]]), cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def drain(gen, uids):
    """Runs gen to the end: the tokens of each uid, and the prompt caches
    handed back with the finished rows."""
    got, caches = {uid: [] for uid in uids}, {}
    while responses := gen.next_generated():
        for r in responses:
            got[r.uid].append(r.token)
            if r.finish_reason is not None:
                caches[r.uid] = r.prompt_cache
    gen.close()
    return [got[uid] for uid in uids], [caches[uid] for uid in uids]


@pytest.mark.parametrize("model_type", ["glm4_moe_lite", "deepseek_v32"])
def test_batch_generator_matches_each_sequence_alone(model_type, installed):
    model, _ = tiny.build_model(model_type)
    expected = [alone(model, p, 8) for p in PROMPTS]
    # prompts 1 and 3 come with prompt caches of different lengths
    held = [0, 11, 0, 4]
    caches = [cached(model, p, n) for p, n in zip(PROMPTS, held)]
    rests = [p[n:] for p, n in zip(PROMPTS, held)]
    gen = BatchGenerator(
        model, max_tokens=8, completion_batch_size=4, prefill_batch_size=4
    )
    uids = gen.insert(rests, [8] * 4, caches=caches)
    assert drain(gen, uids)[0] == expected


def test_a_batch_of_mla_caches_is_the_stock_batch_cache(installed):
    model, _ = tiny.build_model("glm4_moe_lite")
    singles = [cached(model, p, len(p)) for p in PROMPTS[:2]]
    merged = singles[0][0].merge([s[0] for s in singles])
    assert type(merged) is BatchKVCache
    assert merged.offset.tolist() == [5, 17]
    assert type(merged.extract(1)) is KVCache


def test_exact_and_quantized_prompt_caches_batch_together_each_at_its_own_precision(
    installed,
):
    model, _ = tiny.build_model("glm4_moe_lite")
    caches = [cached(model, p, 4) for p in PROMPTS[:2]]
    for c in caches[1]:
        c.to_quantized(group_size=32, bits=8)
    quantized_alone = [
        t
        for t, _ in generate_step(
            mx.array(PROMPTS[1][4:]),
            model,
            max_tokens=6,
            prompt_cache=copy.deepcopy(caches[1]),
        )
    ]
    gen = BatchGenerator(
        model, max_tokens=6, completion_batch_size=2, prefill_batch_size=2
    )
    uids = gen.insert([p[4:] for p in PROMPTS[:2]], [6, 6], caches=caches)
    got, handed_back = drain(gen, uids)
    assert [{type(c) for c in row} for row in handed_back] == [
        {KVCache},
        {QuantizedLatentCache},
    ]
    assert got == [alone(model, PROMPTS[0], 6), quantized_alone]


def test_batch_generate_with_prompt_caches(installed, tmp_path):
    from mlx_lm import batch_generate

    model, tokenizer = tiny.load(tiny.save_model(tmp_path / "m", "glm4_moe_lite"))
    caches = [cached(model, p, 3) for p in PROMPTS[:2]]
    expected = [tokenizer.decode(alone(model, p, 6)) for p in PROMPTS[:2]]
    # batch_generate stops at EOS; compare with what alone produced up to it
    out = batch_generate(
        model,
        tokenizer,
        [p[3:] for p in PROMPTS[:2]],
        prompt_caches=caches,
        max_tokens=6,
    )
    assert all(t and e.startswith(t) for e, t in zip(expected, out.texts))


def batchable_with_kv_bits(model, bits=4, start=12):
    """Whether mlx_lm.server with --kv-bits batches ``model``."""
    from types import SimpleNamespace

    from mlx_lm_mla.patches.server import batchable_with_kv_bits

    server = SimpleNamespace(
        cli_args=SimpleNamespace(
            kv_bits=bits, kv_group_size=64, quantized_kv_start=start
        ),
        model_provider=SimpleNamespace(model=model, is_batchable=True),
    )

    def refuse(self, args):  # upstream refuses to batch with kv_bits
        return False

    return batchable_with_kv_bits(refuse)(server, SimpleNamespace(seed=None))


@contextlib.contextmanager
def serving_kv_bits(bits=4, start=12):
    """The settings the server's generation thread runs its BatchGenerators
    with under --kv-bits, and the server's patches, which quantize them."""
    import mlx_lm.server  # noqa: F401 (its patches are applied with it)

    from types import SimpleNamespace

    from mlx_lm_mla.guards.state import ServerState, running

    cli_args = SimpleNamespace(kv_bits=bits, kv_group_size=64, quantized_kv_start=start)
    with running(ServerState(cli_args)):
        yield


def test_kv_bits_keep_mla_models_batchable(installed):
    model, _ = tiny.build_model("glm4_moe_lite", kv_lora_rank=128)
    assert batchable_with_kv_bits(model)
    assert all(type(c) is KVCache for c in make_prompt_cache(model))


def test_kv_bits_do_not_make_other_models_batchable(installed):
    model, _ = tiny.build_model("deepseek_v2")
    assert not batchable_with_kv_bits(model)


def test_a_batch_served_with_kv_bits_quantizes_each_row_once_it_crosses(installed):
    model, _ = tiny.build_model("glm4_moe_lite", kv_lora_rank=128)
    expected = [
        [
            t
            for t, _ in generate_step(
                mx.array(p),
                model,
                max_tokens=8,
                kv_bits=8,
                kv_group_size=64,
                quantized_kv_start=12,
                prompt_cache=make_prompt_cache(model),
            )
        ]
        for p in PROMPTS
    ]
    gen = BatchGenerator(
        model, max_tokens=8, completion_batch_size=4, prefill_batch_size=4
    )
    with serving_kv_bits(bits=8, start=12):
        got, handed_back = drain(gen, gen.insert(PROMPTS, [8] * 4))
    # every row crossed 12 tokens, so every cache handed back is quantized
    assert all(type(c) is QuantizedLatentCache for row in handed_back for c in row)
    assert all(c.latent_bits == 8 for row in handed_back for c in row)
    # a prompt in one segment quantizes where generate_step quantizes it alone
    assert got == expected


def test_a_row_that_crosses_the_start_first_keeps_every_token_of_a_padded_chunk(
    installed,
):
    # Row 0 holds 8 tokens and crosses 10 in its first chunk of 4; row 1 has
    # all 12 to prefill, so row 0's last chunk is padded on the right.
    model, _ = tiny.build_model("glm4_moe_lite", kv_lora_rank=128)
    prompts = [PROMPTS[1][:14], PROMPTS[3]]

    def handed_back(kv_bits):
        gen = BatchGenerator(
            model,
            max_tokens=3,
            completion_batch_size=2,
            prefill_batch_size=2,
            prefill_step_size=4,
        )
        caches = [cached(model, prompts[0], 8), cached(model, prompts[1], 0)]
        rest = [prompts[0][8:], prompts[1]]
        with serving_kv_bits(bits=8, start=10) if kv_bits else contextlib.nullcontext():
            _, back = drain(gen, gen.insert(rest, [3, 3], caches=caches))
        return [[(type(c).__name__, c.offset) for c in row] for row in back]

    exact, quantized = handed_back(False), handed_back(True)
    assert [{o for _, o in row} for row in exact] == [{17}, {15}]
    assert [[o for _, o in row] for row in quantized] == [
        [o for _, o in row] for row in exact
    ]
    assert {t for row in quantized for t, _ in row} == {"QuantizedLatentCache"}


def generating(model, cache):
    """A generator decoding PROMPTS[0] from ``cache``, two steps in."""
    gen = BatchGenerator(model, max_tokens=8)
    uids = gen.insert([PROMPTS[0][4:]], caches=[cache])
    gen.next_generated()
    gen.next_generated()
    return gen, uids


def quantized(model, prompt, bits, max_kv_size=None):
    cache = make_prompt_cache(model, max_kv_size)
    model(mx.array([prompt[:4]]), cache=cache)
    for c in cache:
        c.to_quantized(group_size=32, bits=bits)
    return cache


@pytest.mark.parametrize(
    "refused,message",
    [
        (dict(bits=8), "quantized in more than one format"),
        (dict(bits=4, max_kv_size=64), "a quantized rolling window"),
    ],
)
def test_a_row_that_cannot_join_the_batch_is_refused_at_insert_and_the_rest_run_on(
    refused, message, installed
):
    model, _ = tiny.build_model("glm4_moe_lite")
    gen, uids = generating(model, quantized(model, PROMPTS[0], 4))
    with pytest.raises(ValueError, match=f"BatchGenerator.insert: .*{message}"):
        gen.insert([PROMPTS[1][4:]], caches=[quantized(model, PROMPTS[1], **refused)])
    got, _ = drain(gen, uids)
    expected, _ = drain(*generating(model, quantized(model, PROMPTS[0], 4)))
    assert got == expected and len(got[0]) > 0


def test_a_row_that_cannot_join_a_row_still_queued_is_refused_at_insert(installed):
    model, _ = tiny.build_model("glm4_moe_lite")
    gen = BatchGenerator(model, max_tokens=8)
    uids = gen.insert([PROMPTS[0][4:]], caches=[quantized(model, PROMPTS[0], 4)])
    with pytest.raises(ValueError, match="quantized in more than one format"):
        gen.insert([PROMPTS[1][4:]], caches=[quantized(model, PROMPTS[1], 8)])
    got, _ = drain(gen, uids)  # the row queued first is served, nothing broke
    assert got == [alone_from(model, quantized(model, PROMPTS[0], 4), PROMPTS[0][4:])]


def alone_from(model, cache, rest, n=8):
    steps = generate_step(mx.array(rest), model, max_tokens=n, prompt_cache=cache)
    return [t for t, _ in steps]
