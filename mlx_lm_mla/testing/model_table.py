"""The README's model table (``python -m mlx_lm_mla.testing.model_table``): what
``kv_bits`` does to each installed MLA model, found by running its tiny model
through ``maybe_quantize_kv_cache``; ``tests/test_readme.py`` checks they agree.
"""

import sys

import mlx.core as mx

BEGIN = (
    "<!-- model-table: python -m mlx_lm_mla.testing.model_table (mlx-lm {version}) -->"
)
END = "<!-- /model-table -->"

# The real checkpoints' latent widths, in bfloat16.
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
GROUP_SIZE = 64
# A multiple of the 256 a stock cache grows by: its bytes are the tokens'.
POSITIONS = 4096

# The tiny models' latent is 64 wide (tiny._MLA_DIMS): groups of 32 divide it.
TINY_GROUP_SIZE = 32
TINY_BITS = 4
TINY_TOKENS = [[1, 2, 3, 4, 5, 6, 7, 8]]


def describe(cache) -> str:
    """A cache's class, with the members of a ``CacheList``."""
    inner = getattr(cache, "caches", None)
    if isinstance(inner, (list, tuple)):
        return f"{type(cache).__name__}({', '.join(describe(c) for c in inner)})"
    return type(cache).__name__


def transitions(model_type: str) -> list[tuple[str, str]]:
    """The distinct (before, after) cache classes of the tiny model's layers."""
    from mlx_lm.generate import maybe_quantize_kv_cache
    from mlx_lm.models.cache import make_prompt_cache

    from .. import tiny

    model, _ = tiny.build_model(model_type)
    cache = make_prompt_cache(model)
    before = [describe(c) for c in cache]
    mx.eval(model(mx.array(TINY_TOKENS), cache=cache))
    maybe_quantize_kv_cache(
        cache, quantized_kv_start=0, kv_group_size=TINY_GROUP_SIZE, kv_bits=TINY_BITS
    )
    seen = []
    for pair in zip(before, (describe(c) for c in cache)):
        if pair not in seen:
            seen.append(pair)
    return seen


def _class_name(text: str) -> str:
    return f"`{text}`"


def cell(pairs) -> str:
    """The table cell: the caches that change first, then those that do not."""
    changed = [f"{_class_name(a)} → {_class_name(b)}" for a, b in pairs if a != b]
    kept = [f"{_class_name(a)} unchanged" for a, b in pairs if a == b]
    return "; ".join(changed + kept)


def bytes_per_token(bits=None) -> float:
    """Bytes per token of one MLA layer at the real widths, at ``bits`` or exact."""
    import mlx_lm_mla
    from mlx_lm.models.cache import KVCache

    cache = KVCache()
    cache.update_and_fetch(
        mx.zeros((1, 1, POSITIONS, KV_LORA_RANK), dtype=mx.bfloat16),
        mx.zeros((1, 1, POSITIONS, QK_ROPE_HEAD_DIM), dtype=mx.bfloat16),
    )
    if bits is not None:
        cache = mlx_lm_mla.quantize_latent(cache, GROUP_SIZE, bits)
    return cache.nbytes / POSITIONS


def _number(x: float) -> str:
    return f"{x:,.0f}" if x == int(x) else f"{x:,.1f}"


def table() -> str:
    import mlx_lm

    import mlx_lm_mla
    from mlx_lm_mla import mla

    mx.random.seed(0)
    mlx_lm_mla.install()
    exact, eight, four = bytes_per_token(), bytes_per_token(8), bytes_per_token(4)
    lines = [
        BEGIN.format(version=mlx_lm.__version__),
        "",
        f"One MLA layer caches a latent of `kv_lora_rank` values and a RoPE key of "
        f"`qk_rope_head_dim` values per token. At the real checkpoints' widths "
        f"({KV_LORA_RANK} and {QK_ROPE_HEAD_DIM}, bfloat16, groups of {GROUP_SIZE}) "
        f"that is {_number(exact)} bytes per token per MLA layer unquantized, "
        f"{_number(eight)} at `--kv-bits 8` and {_number(four)} at `--kv-bits 4`. "
        f"What `kv_bits` does to each layer's cache (tiny random models, "
        f"`maybe_quantize_kv_cache` at {TINY_BITS} bits):",
        "",
        "| model type | MLA attention from | what `kv_bits` does |",
        "|---|---|---|",
    ]
    for model_type, module in sorted(mla.installed_model_types().items()):
        lines.append(
            f"| `{model_type}` | `{module}` | {cell(transitions(model_type))} |"
        )
    lines += ["", END]
    return "\n".join(lines)


def main(argv=None) -> int:
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
