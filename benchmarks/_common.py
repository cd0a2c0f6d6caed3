"""Helpers shared by the benchmark scripts (not a benchmark itself).

Each script runs as ``python benchmarks/NAME.py`` from the repository root.
The package does not have to be installed: the repository root goes first on
``sys.path``, so the working tree's ``mlx_lm_mla`` is the one measured. If a
copy is also installed in the virtualenv, its start-up hook
(``mlx_lm_mla.pth`` -> ``activate.watch()``) has already imported that copy
and would call ``install()`` when ``mlx_lm`` is imported; both are undone
here, so each benchmark installs (or not) explicitly and measures this tree.
"""

import json
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
for _name in [
    m for m in sys.modules if m == "mlx_lm_mla" or m.startswith("mlx_lm_mla.")
]:
    if not str(getattr(sys.modules[_name], "__file__", "")).startswith(str(ROOT)):
        del sys.modules[_name]
sys.meta_path[:] = [
    f for f in sys.meta_path if type(f).__module__ != "mlx_lm_mla.importhook"
]

# One copy of what every run records, `mlx-lm-mla bench`'s.
from mlx_lm_mla.bench import git_state, load_average, table, versions  # noqa: E402, F401

RESULTS = ROOT / "benchmarks" / "results"

# Real layer shapes (config.json of the released checkpoints).
GLM_4_7_FLASH = dict(
    name="GLM-4.7-Flash",
    layers=47,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    heads=20,
    qk_nope_head_dim=192,
    v_head_dim=256,
)
DEEPSEEK_V3 = dict(
    name="DeepSeek-V3",
    layers=61,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    heads=128,
    qk_nope_head_dim=128,
    v_head_dim=128,
)
# The DSA models keep a CacheList per layer: the latent and the indexer's keys.
# Widths from the published configs (transformers' DeepseekV32Config for
# deepseek-ai/DeepSeek-V3.2-Exp, GlmMoeDsaConfig for zai-org/GLM-5).
DEEPSEEK_V3_2 = dict(DEEPSEEK_V3, name="DeepSeek-V3.2", index_head_dim=128)
GLM_5 = dict(
    name="GLM-5",
    layers=78,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    heads=64,
    qk_nope_head_dim=192,
    v_head_dim=256,
    index_head_dim=128,
)


def glm_attention_model(layers, dtype, hidden_size=256, q_lora_rank=64, moe=False):
    """A glm4_moe_lite with GLM-4.7-Flash's attention widths, small MLPs and
    random weights (dense layers unless moe: the CPU runs MoE in float32 only)."""
    from mlx_lm_mla import tiny

    shape = GLM_4_7_FLASH
    overrides = dict(
        kv_lora_rank=shape["kv_lora_rank"],
        qk_rope_head_dim=shape["qk_rope_head_dim"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["heads"],
        qk_nope_head_dim=shape["qk_nope_head_dim"],
        v_head_dim=shape["v_head_dim"],
        hidden_size=hidden_size,
        q_lora_rank=q_lora_rank,
        num_hidden_layers=layers,
    )
    if not moe:
        overrides["first_k_dense_replace"] = 99
    return tiny.build_model("glm4_moe_lite", dtype=dtype, **overrides)


def cache_arrays(cache):
    """Every array in a cache's state (what save_prompt_cache stores)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    return [x for _, x in tree_flatten(cache.state) if isinstance(x, mx.array)]


def active_memory():
    import mlx.core as mx

    get = getattr(mx, "get_active_memory", None) or mx.metal.get_active_memory
    return get()


def median(xs):
    return statistics.median(xs)


def write_json(path, name, args, payload, started):
    path = Path(path) if path else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": name,
        "command": " ".join(
            ["python", f"benchmarks/{name}.py", *map(shlex.quote, sys.argv[1:])]
        ),
        "versions": versions(),
        "git": git_state(),
        "args": vars(args),
        "seconds": round(time.perf_counter() - started, 1),
        "load_average_1min_at_end": load_average(),
        **payload,
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, default=str)
    return path


def progress(iterable=None, total=None, desc=None):
    """tqdm on stderr if it is installed (it comes with mlx-lm), else a plain
    counter."""
    try:
        from tqdm import tqdm

        return tqdm(iterable, total=total, desc=desc, file=sys.stderr, leave=False)
    except ImportError:  # pragma: no cover
        return _Plain(iterable, total, desc)


class _Plain:
    def __init__(self, iterable, total, desc):
        self.iterable, self.total, self.desc, self.n = iterable, total, desc, 0

    def __iter__(self):
        for x in self.iterable:
            yield x
            self.update()

    def update(self, n=1):
        self.n += n
        print(f"\r{self.desc}: {self.n}/{self.total}", end="", file=sys.stderr)

    def set_postfix_str(self, s):
        pass

    def close(self):
        print(file=sys.stderr)

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()
