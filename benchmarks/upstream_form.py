"""The figures of the upstream form (docs/upstream-pr.md), measured on an
mlx-lm tree alone (this package switched off), so the release and the trees
with patch 1, or patches 1 and 2, of upstream/ can be run side by side:

    MLX_LM_MLA_DISABLE=1 python benchmarks/upstream_form.py            # release
    MLX_LM_MLA_DISABLE=1 PYTHONPATH=tree python benchmarks/upstream_form.py

- the reported failure: every MLA model (tiny random weights, the real
  architecture, the real latent widths 512 and 64) serves 6 requests with
  kv_bits 4, each crossing quantized_kv_start 48, and its cache's bytes
  against the unquantized one;
- the window: the most tokens a layer holds (of 160) with
  ``make_prompt_cache(model, max_kv_size=64)``;
- batching under kv_bits: ``BatchGenerator(kv_bits=4)`` serving 4 prompts
  at once (the release has no kv_bits there; patch 1 alone refuses nothing
  but cannot be asked), and the bytes its rows keep;
- fidelity: max |logit difference| against the unquantized cache over 24
  decode steps after a 40-token prompt, at 8 and 4 bits (patched trees);
- one layer at DeepSeek-V3's widths (latent 512, RoPE key 64, bfloat16)
  holding 16384 tokens: bytes per token, and the memory one decode step
  takes beyond the cache (the whole latent dequantized, for the quantized
  cache); and the same for a whole tiny model of 2 and of 8 layers, which
  dequantizes one layer's latent at a time;
- the share of codes that move when a dequantized latent is quantized
  again;
- decode time with the latent quantized against unquantized: 32 steps after
  a 1024-token prompt, the two interleaved over 3 rounds (patched trees, CPU).

``--json [PATH]`` adds the tree's run to PATH (default
``benchmarks/results/upstream_form.json``) beside the runs of the other
trees already there, so the three runs make one file:
``benchmarks/figures.py keep upstream_form`` renders it into the docs.
"""

import argparse
import inspect
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm.models.cache as cache
from mlx_lm.generate import BatchGenerator, generate_step, maybe_quantize_kv_cache
from mlx_lm.models.cache import make_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mlx_lm_mla import tiny  # noqa: E402

import _common  # noqa: E402

WIDE = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_head_dim": 64}
FIX = hasattr(cache, "MLALatentCache")
BATCH = hasattr(
    cache, "BatchQuantizedMLALatentCache"
)  # patch 2 (patch 1 has the exact batch)


def leaves(caches):
    return [m for c in caches for m in getattr(c, "caches", [c])]


def served(model_type, bits):
    """'ok' and the cache's bytes after 6 requests, or the error."""
    model, _ = tiny.build_model(model_type, **WIDE)
    prefix = [(3 * i + 11) % 190 + 5 for i in range(30)]
    try:
        for r in range(6):
            prompt = prefix + [(7 * r + j) % 190 + 5 for j in range(2 + 3 * r)]
            caches = make_prompt_cache(model)  # fresh: hybrids cannot be trimmed
            for _ in generate_step(
                mx.array(prompt),
                model,
                prompt_cache=caches,
                max_tokens=24,
                kv_bits=bits,
                kv_group_size=64,
                quantized_kv_start=48,
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
    held = [
        min(c.offset, c.keys.shape[2])
        for c in leaves(caches)
        if getattr(c, "keys", None) is not None
    ]
    return max(held)


def batched(model_type, bits):
    """'ok' and the rows' bytes after 4 prompts served at once, or the error."""
    if (
        bits is not None
        and "kv_bits" not in inspect.signature(BatchGenerator).parameters
    ):
        return "BatchGenerator takes no kv_bits", None
    model, _ = tiny.build_model(model_type, **WIDE)
    prompts = [[(5 * i + 7 * r) % 190 + 5 for i in range(40 + 9 * r)] for r in range(4)]
    try:
        kwargs = {} if bits is None else {"kv_bits": bits, "quantized_kv_start": 48}
        gen = BatchGenerator(model, max_tokens=16, **kwargs)
        uids = gen.insert(prompts)
        rows = {}
        while responses := gen.next_generated():
            rows.update((r.uid, r.prompt_cache) for r in responses if r.finish_reason)
        gen.close()
    except Exception as e:
        return f"{type(e).__name__}: {e}", None
    return "ok", sum(c.nbytes for u in uids for c in rows[u])


def fidelity(model_type, bits):
    model, _ = tiny.build_model(model_type, **WIDE)
    prompt = [(5 * i + 7) % 190 + 5 for i in range(64)]
    out = []
    for b in (None, bits):
        caches = make_prompt_cache(model)
        model(mx.array([prompt[:40]]), cache=caches)
        maybe_quantize_kv_cache(caches, 0, 64, b)
        out.append(
            mx.concatenate(
                [model(mx.array([[t]]), cache=caches) for t in prompt[40:]], axis=1
            )
        )
    return mx.abs(out[0] - out[1]).max().item()


def transient(step):
    """The bytes ``step()`` takes at its peak beyond what was held before."""
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(step())
    return mx.get_peak_memory() - before


def one_layer(bits, tokens=16383):
    """Bytes per token of one DeepSeek-V3 layer holding ``tokens`` (its
    buffer then full), and the bytes one decode step (write a token, read
    the cache, attend with 16 heads) takes beyond what the cache holds."""
    c = cache.MLALatentCache()
    c.update_and_fetch(
        mx.random.normal((1, 1, tokens, 512)).astype(mx.bfloat16),
        mx.random.normal((1, 1, tokens, 64)).astype(mx.bfloat16),
    )
    if bits is not None:
        c = c.to_quantized(group_size=64, bits=bits)
    q = mx.random.normal((1, 16, 1, 512)).astype(mx.bfloat16)
    token = (
        mx.zeros((1, 1, 1, 512), mx.bfloat16),
        mx.zeros((1, 1, 1, 64), mx.bfloat16),
    )
    mx.eval(c.keys, c.values, q, token)
    per_token = c.nbytes / (tokens + 1)

    def step():
        latent, _ = c.update_and_fetch(*token)
        return mx.fast.scaled_dot_product_attention(q, latent, latent, scale=0.1)

    return per_token, transient(step)


def model_step(layers, bits, tokens=8191):
    """A tiny GLM-4.7-Flash of ``layers`` layers (float32, latent 512) that
    holds ``tokens``: its cache's bytes, and the bytes one decode step takes
    beyond them."""
    model, _ = tiny.build_model("glm4_moe_lite", num_hidden_layers=layers, **WIDE)
    caches = make_prompt_cache(model)
    for i in range(0, tokens, 2048):
        model(
            mx.array(
                [[(5 * j + 7) % 190 + 5 for j in range(i, min(tokens, i + 2048))]]
            ),
            cache=caches,
        )
        mx.eval([c.state for c in caches])
    maybe_quantize_kv_cache(caches, 0, 64, bits)
    mx.eval([c.state for c in caches])
    return sum(c.nbytes for c in caches), transient(
        lambda: model(mx.array([[7]]), cache=caches)
    )


def requantized(bits, dtype, tokens=4096):
    """The share of a random latent's codes that move when its dequantized
    values are quantized again (why a batch never dequantizes a row)."""
    codes = mx.quantize(
        mx.random.normal((1, 1, tokens, 512)).astype(dtype), group_size=64, bits=bits
    )
    again = mx.quantize(
        mx.dequantize(*codes, group_size=64, bits=bits), group_size=64, bits=bits
    )
    shift = 32 - bits  # compare code by code: bits at a time out of each uint32
    moved = [
        (codes[0] << (i * bits)) >> shift != (again[0] << (i * bits)) >> shift
        for i in range(32 // bits)
    ]
    return mx.stack(moved).mean().item()


def decode_seconds(model, bits, prompt=1024, steps=32):
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


def measure(form):
    """Every figure this tree gives, printed as it comes."""
    run = {"served": [], "batched": []}
    print(f"tree: {Path(cache.__file__).parents[2]} ({form})")
    print(
        f"{'model':<20} {'kv_bits 4, 6 requests':<44} {'bytes vs exact':>14} {'max_kv_size 64':>15}"
    )
    for t in tiny.MLA_MODEL_TYPES:
        result, nbytes = served(t, 4)
        _, exact = served(t, None)
        ratio = nbytes / exact if nbytes else None
        run["served"].append(
            dict(model=t, result=result, bytes_ratio=ratio, window=window(t))
        )
        shown = f"{ratio:.2f}" if ratio else "-"
        print(
            f"{t:<20} {result[:44]:<44} {shown:>14} {run['served'][-1]['window']:>15}"
        )
    print(
        f"\n{'model':<20} {'BatchGenerator, kv_bits 4, 4 prompts':<44} {'bytes vs exact':>14}"
    )
    for t in ("glm4_moe_lite", "deepseek_v3", "kimi_linear", "deepseek_v32"):
        result, nbytes = batched(t, 4)
        _, exact = batched(t, None)
        ratio = nbytes / exact if nbytes else None
        run["batched"].append(dict(model=t, result=result, bytes_ratio=ratio))
        print(f"{t:<20} {result[:44]:<44} {f'{ratio:.2f}' if ratio else '-':>14}")
    if not FIX:
        return run
    print(f"\n{'model':<20} {'max |dlogit| 8 bits':>20} {'4 bits':>10}")
    run["fidelity"] = [
        dict(model=t, bits8=fidelity(t, 8), bits4=fidelity(t, 4))
        for t in tiny.MLA_MODEL_TYPES
    ]
    for r in run["fidelity"]:
        print(f"{r['model']:<20} {r['bits8']:>20.4f} {r['bits4']:>10.4f}")
    print("\nDeepSeek-V3 widths, one layer of 16384 tokens (bfloat16):")
    run["one_layer"] = []
    for b in (None, 8, 4):
        per_token, step = one_layer(b)
        run["one_layer"].append(dict(bits=b, bytes_per_token=per_token, step=step))
        print(
            f"  {b or 'exact':>5}: {per_token:.0f} bytes a token, a decode step takes {step / 2**20:.1f} MiB more"
        )
    print("A tiny glm4_moe_lite holding 8192 tokens (float32, latent 512):")
    run["model_step"] = []
    for layers in (2, 8):
        for b in (None, 4):
            held, step = model_step(layers, b)
            run["model_step"].append(dict(layers=layers, bits=b, cache=held, step=step))
            print(
                f"  {layers} layers, {b or 'exact':>5}: cache {held / 2**20:.1f} MiB, "
                f"a decode step takes {step / 2**20:.1f} MiB more"
            )
    run["requantized"] = [
        dict(bits=b, dtype=str(d).split(".")[-1], moved=requantized(b, d))
        for b in (4, 8)
        for d in (mx.bfloat16, mx.float16, mx.float32)
    ]
    print(
        "Codes that move when a dequantized latent is quantized again: "
        + ", ".join(
            f"{r['bits']} bits {r['dtype']} {r['moved']:.0%}"
            for r in run["requantized"]
        )
    )
    run["decode_ratio"] = []
    for t in ("glm4_moe_lite", "deepseek_v3"):
        run["decode_ratio"].append(dict(model=t, ratio=decode_ratio(t, 4)))
        print(
            f"{t}: decode time, 4-bit latent / unquantized: {run['decode_ratio'][-1]['ratio']:.2f}"
        )
    return run


def main():
    # The tree measured is the one on PYTHONPATH.
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", nargs="?", const="", default=None, metavar="PATH")
    args = p.parse_args()
    started = time.perf_counter()
    form = "patches 1 and 2" if BATCH else "patch 1" if FIX else "release"
    run = measure(form)
    if args.json is None:
        return
    path = Path(args.json or _common.RESULTS / "upstream_form.json")
    runs = json.loads(path.read_text()).get("runs", {}) if path.is_file() else {}
    here = _common.versions()
    for other in list(runs):  # the trees' runs are compared: one mlx, one machine
        theirs = runs[other].get("versions", {})
        if any(theirs.get(k) != here[k] for k in ("mlx", "mlx_lm", "machine")):
            print(f"dropped the {other} run of {path}: another mlx or machine")
            del runs[other]
    runs[form] = dict(
        run,
        tree=str(Path(cache.__file__).parents[2]),
        versions=here,
        git=_common.git_state(),
        seconds=round(time.perf_counter() - started, 1),
    )
    order = ["release", "patch 1", "patches 1 and 2"]
    runs = {f: runs[f] for f in order if f in runs}
    print(
        f"wrote {_common.write_json(path, 'upstream_form', args, {'runs': runs}, started)}"
    )


if __name__ == "__main__":
    main()
