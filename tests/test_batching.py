"""BatchGenerator and batch_generate with MLA latent caches."""

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import make_prompt_cache

from mlx_lm_mla import BatchMLALatentCache, MLALatentCache, tiny

PROMPTS = [
    [(3 * i + 5) % 190 + 5 for i in range(n)] for n in (5, 17, 9, 12)
]


def alone(model, prompt, n):
    return [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def cached(model, prompt, n):
    """A prompt cache holding the first n tokens of prompt."""
    cache = make_prompt_cache(model)
    if n:
        model(mx.array([prompt[:n]]), cache=cache)
        mx.eval([c.state for c in cache])
    return cache


@pytest.mark.parametrize("model_type", ["glm4_moe_lite", "deepseek_v32"])
def test_batch_generator_matches_each_sequence_alone(model_type, installed):
    model, _ = tiny.build_model(model_type)
    expected = [alone(model, p, 8) for p in PROMPTS]
    # prompts 1 and 3 come with prompt caches of different lengths
    held = [0, 11, 0, 4]
    caches = [cached(model, p, n) for p, n in zip(PROMPTS, held)]
    rests = [p[n:] for p, n in zip(PROMPTS, held)]
    gen = BatchGenerator(model, max_tokens=8, completion_batch_size=4, prefill_batch_size=4)
    uids = gen.insert(rests, [8] * 4, caches=caches)
    got = {uid: [] for uid in uids}
    while responses := gen.next_generated():
        for r in responses:
            got[r.uid].append(r.token)
    gen.close()
    assert [got[uid] for uid in uids] == expected


def test_batch_cache_is_built_from_latent_caches(installed):
    model, _ = tiny.build_model("glm4_moe_lite")
    singles = [cached(model, p, len(p)) for p in PROMPTS[:2]]
    merged = singles[0][0].merge([s[0] for s in singles])
    assert isinstance(merged, BatchMLALatentCache)
    assert merged.offset.tolist() == [5, 17]
    assert isinstance(merged.extract(1), MLALatentCache)


def test_batch_generate_with_prompt_caches(installed, tmp_path):
    from mlx_lm import batch_generate

    model, tokenizer = tiny.load(tiny.save_model(tmp_path / "m", "glm4_moe_lite"))
    caches = [cached(model, p, 3) for p in PROMPTS[:2]]
    expected = [tokenizer.decode(alone(model, p, 6)) for p in PROMPTS[:2]]
    # batch_generate stops at EOS; compare with what alone produced up to it
    out = batch_generate(
        model, tokenizer, [p[3:] for p in PROMPTS[:2]], prompt_caches=caches, max_tokens=6
    )
    assert all(t and e.startswith(t) for e, t in zip(expected, out.texts))


def test_batch_cache_construction_knows_latent_caches(installed):
    import mlx_lm.generate as generate

    model, _ = tiny.build_model("deepseek_v32")
    if hasattr(generate, "_make_cache"):  # mlx-lm 0.31 builds batch caches by type
        batch = generate._make_cache(model, [1, 0], None)
        assert all(isinstance(c.caches[0], BatchMLALatentCache) for c in batch)
        assert batch[0].caches[0].left_padding.tolist() == [1, 0]
        assert type(batch[0].caches[1]).__name__ == "BatchKVCache"
    else:  # later versions merge single caches, which the hook already made
        singles = [make_prompt_cache(model) for _ in range(2)]
        merged = [a.merge([a, b]) for a, b in zip(*singles)]
        assert all(isinstance(c.caches[0], BatchMLALatentCache) for c in merged)


def serve_settings(model, bits=4, start=12):
    """What the server hook does when mlx_lm.server runs with --kv-bits."""
    from types import SimpleNamespace

    from mlx_lm_mla.hooks import batchable_with_kv_bits

    server = SimpleNamespace(
        cli_args=SimpleNamespace(kv_bits=bits, kv_group_size=64, quantized_kv_start=start),
        model_provider=SimpleNamespace(model=model, is_batchable=True),
    )
    refuse = lambda self, args: False  # upstream refuses to batch with kv_bits
    return batchable_with_kv_bits(refuse)(server, SimpleNamespace(seed=None))


def test_kv_bits_keep_mla_models_batchable(installed):
    model, _ = tiny.build_model("glm4_moe_lite", kv_lora_rank=128)
    assert serve_settings(model)
    cache = make_prompt_cache(model)
    assert (cache[0].quantize_bits, cache[0].quantize_after) == (4, 12)


def test_kv_bits_do_not_make_other_models_batchable(installed):
    model, _ = tiny.build_model("deepseek_v2")
    assert not serve_settings(model)


def test_batched_rows_quantized_one_by_one_match_each_sequence_alone(installed):
    model, _ = tiny.build_model("glm4_moe_lite", kv_lora_rank=128)
    serve_settings(model, bits=8, start=12)
    expected = [
        [
            t
            for t, _ in generate_step(
                mx.array(p), model, max_tokens=8, kv_bits=8, kv_group_size=64,
                quantized_kv_start=12, prompt_cache=make_prompt_cache(model),
            )
        ]
        for p in PROMPTS
    ]
    gen = BatchGenerator(model, max_tokens=8, completion_batch_size=4, prefill_batch_size=4)
    uids = gen.insert(PROMPTS, [8] * 4)
    got = {uid: [] for uid in uids}
    while responses := gen.next_generated():
        for r in responses:
            got[r.uid].append(r.token)
            if r.finish_reason is not None:
                # every row crossed 12 tokens, so every cache handed back is quantized
                assert all(c.quantized for c in r.prompt_cache)
    gen.close()
    assert [got[uid] for uid in uids] == expected
