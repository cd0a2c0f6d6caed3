"""Should the RoPE key be quantized along with the latent?

Measures, on a tiny GLM-4.7-Flash shaped model with dense layers (so MoE
routing flips do not hide the cache's own error), the max |logit difference|
against the unquantized cache when only the latent is quantized and when the
RoPE key is quantized too, and the bytes per token either way at the real
GLM-4.7-Flash widths (kv_lora_rank 512, rope 64, bfloat16).

    python benchmarks/rope_precision.py
"""

import argparse
import time

import _common  # noqa: F401  (puts the repository root on sys.path)
from _common import write_json

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

import mlx_lm_mla
from mlx_lm_mla import QuantizedLatentCache
from mlx_lm_mla import tiny


class RopeQuantizedCache(QuantizedLatentCache):
    """For this measurement only: also rounds the RoPE key to bits."""

    rope_bits = None

    def update_and_fetch(self, latent, rope):
        latent, rope = super().update_and_fetch(latent, rope)
        # Round every cached position, as a quantized store would.
        q = mx.quantize(rope, group_size=self.group_size, bits=self.rope_bits)
        return latent, mx.dequantize(
            *q, group_size=self.group_size, bits=self.rope_bits
        )


def logits(model, tokens, prefill, bits, quantize_rope):
    cache = make_prompt_cache(model)
    model(mx.array([tokens[:prefill]]), cache=cache)
    for c in cache:
        if bits:
            c.to_quantized(group_size=64, bits=bits)  # in place
            if quantize_rope:
                c.__class__, c.rope_bits = RopeQuantizedCache, bits
    steps = [model(mx.array([[t]]), cache=cache) for t in tokens[prefill:]]
    return mx.concatenate(steps, axis=1)


def bytes_per_token(bits, quantize_rope, latent=512, rope=64, dtype_bytes=2, group=64):
    def packed(width, b):
        return width * b / 8 + 2 * (width // group) * dtype_bytes

    lat = packed(latent, bits) if bits else latent * dtype_bytes
    rp = packed(rope, bits) if bits and quantize_rope else rope * dtype_bytes
    return lat + rp


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    started = time.perf_counter()
    mlx_lm_mla.install()
    model, _ = tiny.build_model(
        "glm4_moe_lite", kv_lora_rank=128, qk_rope_head_dim=64, first_k_dense_replace=99
    )
    tokens = [(5 * i + 7) % 190 + 5 for i in range(args.tokens)]
    prefill = args.tokens // 2
    ref = logits(model, tokens, prefill, None, False)
    rows = []
    print(f"{'bits':>4}  {'RoPE key':<10}{'max |dlogit|':>13}{'bytes/token/layer':>19}")
    for bits in (8, 4):
        for quantize_rope in (False, True):
            diff = (
                mx.abs(logits(model, tokens, prefill, bits, quantize_rope) - ref)
                .max()
                .item()
            )
            size = bytes_per_token(bits, quantize_rope)
            rows.append(
                dict(
                    bits=bits,
                    quantize_rope=quantize_rope,
                    max_logit_diff=diff,
                    bytes_per_token_layer=size,
                )
            )
            label = "quantized" if quantize_rope else "bfloat16"
            print(f"{bits:>4}  {label:<10}{diff:>13.4f}{size:>19.0f}")
    exact = bytes_per_token(None, False)
    rows.append(
        dict(
            bits=None,
            quantize_rope=False,
            max_logit_diff=0.0,
            bytes_per_token_layer=exact,
        )
    )
    print(f"unquantized: {exact:.0f} bytes/token/layer")
    path = write_json(args.json, "rope_precision", args, {"rows": rows}, started)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
