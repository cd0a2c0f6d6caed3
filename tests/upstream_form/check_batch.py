"""The batch variant: an mlx-lm tree with both patches of ``upstream/``
applied, first on the path, with this package switched off (run by
``tests/test_upstream.py`` as ``check_fix.py`` is).
"""

import json
import sys
import threading
import time
import urllib.request
from pathlib import Path

import mlx.core as mx
import mlx_lm.models.cache as cache
import pytest
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import make_prompt_cache

from mlx_lm_mla import tiny

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from serving import Server  # noqa: E402  (tests/serving.py)

WIDE = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_head_dim": 64}
PROMPT = [(5 * i + 7) % 190 + 5 for i in range(23)]


LATENT = (cache.MLALatentCache, cache.QuantizedMLALatentCache)


def leaves(caches):
    return [m for c in caches for m in getattr(c, "caches", [c])]


def prefilled(model, tokens):
    caches = make_prompt_cache(model)
    model(mx.array([tokens]), cache=caches)
    return caches


def run(gen, prompts, caches=None):
    """Tokens and last caches of each prompt, served by gen to the end."""
    uids = gen.insert(prompts, caches=caches)
    tokens, last = {u: [] for u in uids}, {}
    while responses := gen.next_generated():
        for r in responses:
            tokens[r.uid].append(r.token)
            last[r.uid] = r.prompt_cache
    return [tokens[u] for u in uids], [last[u] for u in uids]


@pytest.mark.parametrize("model_type", ["glm4_moe_lite", "deepseek_v32", "kimi_linear"])
def test_batching_without_kv_bits_decodes_as_alone(model_type):
    model, _ = tiny.build_model(model_type)
    prompts = [PROMPT[:7], PROMPT[3:15]]
    alone = [
        [t for t, _ in generate_step(mx.array(p), model, max_tokens=4)] for p in prompts
    ]
    tokens, caches = run(BatchGenerator(model, max_tokens=4), prompts)
    assert tokens == alone
    made = [type(c) for c in leaves(make_prompt_cache(model))]
    assert [[type(c) for c in leaves(row)] for row in caches] == [made, made]


@pytest.mark.parametrize("model_type", tiny.MLA_MODEL_TYPES)
def test_merged_rows_extract_as_latent_caches_and_decode_quantized(model_type):
    """Rows made, filled, merged as ``_merge_caches`` does, extracted, then
    decoded with kv_bits 4 from position 0: each latent a layer holds is
    quantized."""
    model, _ = tiny.build_model(model_type, **WIDE)
    rows = [prefilled(model, PROMPT[:n]) for n in (5, 9, 3)]
    batch = [type(layer[0]).merge(list(layer)) for layer in zip(*rows)]
    for i, row in enumerate(rows):
        got = [c.extract(i) for c in batch]
        assert [type(c) for c in leaves(got)] == [type(c) for c in leaves(row)]
        steps = generate_step(
            mx.array([7]),
            model,
            prompt_cache=got,
            max_tokens=3,
            kv_bits=4,
            quantized_kv_start=0,
        )
        assert len(list(steps)) == 3
        assert all(
            type(c) is cache.QuantizedMLALatentCache
            for c in got
            if isinstance(c, LATENT)
        )


@pytest.mark.parametrize("start", [16, 0])  # at 0, a hybrid's SSM state too
@pytest.mark.parametrize("model_type", ["glm4_moe_lite", "kimi_linear"])
def test_batch_generator_quantizes_every_row_of_a_batch(model_type, start):
    model, _ = tiny.build_model(model_type, **WIDE)
    gen = BatchGenerator(
        model, max_tokens=6, kv_bits=8, quantized_kv_start=start, prefill_step_size=8
    )
    tokens, caches = run(gen, [PROMPT, PROMPT[:5]])
    assert [len(t) for t in tokens] == [6, 6]
    for row in caches:  # the short row too: it shared the batch
        latent = [c for c in row if isinstance(c, LATENT)]
        assert latent and all(
            type(c) is cache.QuantizedMLALatentCache and c.bits == 8 for c in latent
        )


def test_an_exact_batch_that_takes_a_quantized_row_is_quantized():
    model, _ = tiny.build_model("glm4_moe_lite", **WIDE)
    gen = BatchGenerator(model, max_tokens=8, kv_bits=8, quantized_kv_start=1000)
    first = gen.insert([PROMPT[:5]])[0]
    gen.next_generated()  # the first row decodes, exact: it is short
    stored = prefilled(model, PROMPT)
    quantized = [c.to_quantized(group_size=64, bits=8) for c in stored]
    second = gen.insert([[7, 9]], caches=[quantized])[0]
    last = {}
    while responses := gen.next_generated():
        last.update((r.uid, r.prompt_cache) for r in responses)
    assert [type(c) for c in last[first]] == [cache.QuantizedMLALatentCache] * 2
    # It holds the stored tokens, its prompt and the 8 generated.
    assert [c.offset for c in last[second]] == [len(PROMPT) + 2 + 8] * 2


def test_rows_of_two_formats_are_refused_by_name():
    def row(bits, group_size):
        c = cache.MLALatentCache()
        c.update_and_fetch(mx.ones((1, 1, 3, 512)), mx.ones((1, 1, 3, 64)))
        return c.to_quantized(group_size=group_size, bits=bits)

    with pytest.raises(
        ValueError,
        match=r"MLA latent rows quantized differently: \[\(32, 4\), \(64, 8\)\]",
    ):
        cache.MLALatentCache.merge([row(8, 64), cache.MLALatentCache(), row(4, 32)])


def test_float32_and_bfloat16_rows_decode_in_one_batch():
    model, _ = tiny.build_model("glm4_moe_lite", dtype=mx.bfloat16, **WIDE)
    rows = [prefilled(model, PROMPT[:9]), prefilled(model, PROMPT[:4])]
    for c in rows[0]:  # as a float32 run of the model saved it
        c.keys, c.values = c.keys.astype(mx.float32), c.values.astype(mx.float32)
    for bits in (None, 8):
        layers = (
            rows
            if bits is None
            else [[c.to_quantized(group_size=64, bits=8) for c in r] for r in rows]
        )
        batch = [type(layer[0]).merge(list(layer)) for layer in zip(*layers)]
        logits = model(mx.array([[3], [5]]), cache=batch)
        assert mx.isfinite(logits).all().item()
        assert [batch[0].extract(i).offset for i in range(2)] == [10, 5]


REFUSED = r"These caches do not quantize \(kv_bits\) in a batch"


def test_batch_generator_refuses_kv_bits_where_a_cache_cannot_quantize_in_a_batch():
    model, _ = tiny.build_model("glm4_moe_lite")
    with pytest.raises(ValueError, match=REFUSED):
        BatchGenerator(model, kv_bits=4, max_kv_size=64)  # windows do not quantize
    qwen, _ = tiny.build_model("qwen2")
    with pytest.raises(ValueError, match=REFUSED):
        BatchGenerator(qwen, kv_bits=4)


def test_batch_generator_refuses_kv_bits_where_it_would_quantize_nothing():
    # DeepSeek-V3.2 keeps its latents in a CacheList, which does not quantize.
    model, _ = tiny.build_model("deepseek_v32")
    with pytest.raises(ValueError, match=REFUSED):
        BatchGenerator(model, kv_bits=4)


def test_a_plain_kv_cache_row_is_refused_by_name_when_inserted():
    model, _ = tiny.build_model("glm4_moe_lite", **WIDE)
    gen = BatchGenerator(model, max_tokens=2, kv_bits=4)
    try:
        with pytest.raises(ValueError, match="caches an MLA latent"):
            gen.insert([[3]], caches=[[cache.KVCache() for _ in model.layers]])
        assert gen.insert([[3]]) == [0]  # nothing of the refused row was kept
    finally:
        gen.close()


def _stream(port, prompt, times, together):
    body = {
        "prompt": prompt,
        "max_tokens": 400,
        "temperature": 0.0,
        "stream": True,
        "logit_bias": {str(tiny.EOS_TOKEN_ID): -100},
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    together.wait()
    with urllib.request.urlopen(request, timeout=120) as response:
        for line in response:
            if line.startswith(b"data: {"):
                times.setdefault(prompt, []).append(time.monotonic())


def test_the_server_batches_concurrent_requests_under_kv_bits(tmp_path):
    """``mlx_lm.server --kv-bits 4 --decode-concurrency 4``: four requests sent
    together all stream their first token before any streams its last."""
    model = tiny.save_model(tmp_path / "glm", "glm4_moe_lite", **WIDE)
    flags = ["--kv-bits", "4", "--quantized-kv-start", "0", "--decode-concurrency", "4"]
    with Server(model, *flags, disabled=True) as server:
        times, together = {}, threading.Barrier(4)
        args = [(server.port, f"request {i} says", times, together) for i in range(4)]
        threads = [threading.Thread(target=_stream, args=a) for a in args]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(times) == 4 and all(len(t) > 5 for t in times.values())
    assert max(t[0] for t in times.values()) < min(t[-1] for t in times.values())
