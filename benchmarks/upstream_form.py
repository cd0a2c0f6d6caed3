"""The figures of the upstream form's PR text, measured on an mlx-lm tree
alone (this package switched off), so the release and the patched tree can
be run side by side:

    MLX_LM_MLA_DISABLE=1 python benchmarks/upstream_form.py            # release
    MLX_LM_MLA_DISABLE=1 PYTHONPATH=tree python benchmarks/upstream_form.py

- the reported failure: every MLA model (tiny random weights, the real
  architecture) serves 6 requests with kv_bits 4, each crossing
  quantized_kv_start 48, and its cache's bytes against the unquantized one
  (``tests/upstream_form`` checks the reuse of one cache across requests);
- the window: the most tokens a layer holds (of 160) with
  ``make_prompt_cache(model, max_kv_size=64)``;
- fidelity: max |logit difference| against the unquantized cache over 24
  decode steps after a 40-token prompt, at 8 and 4 bits (patched tree);
- bytes per token of one layer at DeepSeek-V3's widths (latent 512, RoPE key
  64, bfloat16) after 4096 tokens (patched tree);
- decode time with the latent quantized against unquantized: 32 steps after
  a 1024-token prompt, the two interleaved over 3 rounds (patched tree, CPU).
"""

import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm.models.cache as cache
from mlx_lm.generate import generate_step, maybe_quantize_kv_cache
from mlx_lm.models.cache import make_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mlx_lm_mla import tiny  # noqa: E402

WIDE = {"kv_lora_rank": 128, "qk_rope_head_dim": 64, "index_head_dim": 64}
PATCHED = hasattr(cache, "MLALatentCache")


def leaves(caches):
    return [m for c in caches for m in getattr(c, "caches", [c])]


def served(model_type, bits):
    """'ok' and the cache's bytes after 6 requests, or the error."""
    model, _ = tiny.build_model(model_type, **WIDE)
    caches = make_prompt_cache(model)
    prefix = [(3 * i + 11) % 190 + 5 for i in range(30)]
    try:
        for r in range(6):
            prompt = prefix + [(7 * r + j) % 190 + 5 for j in range(2 + 3 * r)]
            caches = make_prompt_cache(model)  # fresh: hybrids cannot be trimmed
            for _ in generate_step(
                mx.array(prompt), model, prompt_cache=caches, max_tokens=24,
                kv_bits=bits, kv_group_size=64, quantized_kv_start=48,
            ):
                pass
    except Exception as e:  # the reported failure is an AttributeError
        return f"{type(e).__name__}: {e}", None
    return "ok", sum(c.nbytes for c in caches)


def window(model_type):
    model, _ = tiny.build_model(model_type)
    caches = make_prompt_cache(model, max_kv_size=64)
    model(mx.array([[5 + i % 190 for i in range(159)]]), cache=caches)
    model(mx.array([[7]]), cache=caches)
    held = [min(c.offset, c.keys.shape[2]) for c in leaves(caches) if getattr(c, "keys", None) is not None]
    return max(held)


def fidelity(model_type, bits):
    model, _ = tiny.build_model(model_type)
    prompt = [(5 * i + 7) % 190 + 5 for i in range(64)]
    out = []
    for b in (None, bits):
        caches = make_prompt_cache(model)
        model(mx.array([prompt[:40]]), cache=caches)
        maybe_quantize_kv_cache(caches, 0, 64, b)
        out.append(mx.concatenate([model(mx.array([[t]]), cache=caches) for t in prompt[40:]], axis=1))
    return mx.abs(out[0] - out[1]).max().item()


def bytes_per_token(bits, tokens=4096):
    c = cache.MLALatentCache()
    for _ in range(tokens // 2048):
        c.update_and_fetch(mx.zeros((1, 1, 2048, 512), mx.bfloat16), mx.zeros((1, 1, 2048, 64), mx.bfloat16))
    if bits is not None:
        c = c.to_quantized(group_size=64, bits=bits)
    mx.eval(c.state[0], c.state[1])
    return c.nbytes / tokens


def decode_seconds(model, bits, prompt=1024, steps=32):
    import time

    caches = make_prompt_cache(model)
    model(mx.array([[(5 * i + 7) % 190 + 5 for i in range(prompt)]]), cache=caches)
    maybe_quantize_kv_cache(caches, 0, 64, bits)
    mx.eval([c.state for c in leaves(caches)])
    tic = time.perf_counter()
    for _ in range(steps):
        mx.eval(model(mx.array([[7]]), cache=caches))
    return time.perf_counter() - tic


def decode_ratio(model_type, bits, rounds=3):
    model, _ = tiny.build_model(model_type, **WIDE)
    times = {None: 0.0, bits: 0.0}
    for _ in range(rounds):
        for b in times:
            times[b] += decode_seconds(model, b)
    return times[bits] / times[None]


def main():
    print(f"tree: {Path(cache.__file__).parents[2]} ({'patched' if PATCHED else 'release'})")
    print(f"{'model':<20} {'kv_bits 4, 6 requests':<52} {'bytes vs exact':>14} {'max_kv_size 64':>15}")
    for t in tiny.MLA_MODEL_TYPES:
        result, nbytes = served(t, 4)
        _, exact = served(t, None)
        ratio = f"{nbytes / exact:.2f}" if nbytes else "-"
        print(f"{t:<20} {result[:52]:<52} {ratio:>14} {window(t):>15}")
    if not PATCHED:
        return
    print(f"\n{'model':<20} {'max |dlogit| 8 bits':>20} {'4 bits':>10}")
    for t in tiny.MLA_MODEL_TYPES:
        print(f"{t:<20} {fidelity(t, 8):>20.4f} {fidelity(t, 4):>10.4f}")
    print("\nDeepSeek-V3 widths, one layer, bytes per token: "
          + ", ".join(f"{b or 'bf16'}: {bytes_per_token(b):.0f}" for b in (None, 8, 4)))
    for t in ("glm4_moe_lite", "deepseek_v3"):
        print(f"{t}: decode time, 4-bit latent / unquantized: {decode_ratio(t, 4):.2f}")


if __name__ == "__main__":
    main()
