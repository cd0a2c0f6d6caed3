"""``upstream-patch``: the fix as a small mlx-lm change, made from this
package's own cache code and tested on its own.

The tree is the installed mlx-lm release, copied as it was unpacked from its
wheel. The checks in ``upstream_form/`` then run against the patched tree
alone, with this package switched off.
"""

import difflib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx_lm
import pytest

from mlx_lm_mla import upstream

HERE = Path(__file__).resolve().parent
BUDGET = 300  # added lines the upstream change may take


def release_tree(dest):
    shutil.copytree(Path(mlx_lm.__file__).parent, dest / "mlx_lm", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    base = tmp_path_factory.mktemp("upstream")
    original = release_tree(base / "original")
    patched = release_tree(base / "patched")
    changed = upstream.patch_tree(patched)
    return original, patched, changed


def added_lines(original, patched):
    added = 0
    for new in patched.rglob("*.py"):
        old = original / new.relative_to(patched)
        a = old.read_text().splitlines() if old.exists() else []
        diff = difflib.unified_diff(a, new.read_text().splitlines(), lineterm="", n=0)
        added += sum(1 for line in diff if line.startswith("+") and not line.startswith("+++"))
    return added


def test_the_change_stays_within_the_budget(trees):
    original, patched, _ = trees
    assert 0 < added_lines(original, patched) <= BUDGET


def test_it_changes_the_cache_module_and_mla_models_only(trees):
    _, patched, changed = trees
    names = {p.name for p in changed}
    assert "cache.py" in names and {"deepseek_v3.py", "glm4_moe_lite.py"} <= names
    assert not names & {"deepseek_v2.py", "deepseek_v32.py", "llama.py", "generate.py"}


def test_the_cache_module_carries_this_packages_code(trees):
    _, patched, _ = trees
    assert (patched / "mlx_lm/models/cache.py").read_text().endswith(upstream.cache_code())


def test_a_tree_that_is_not_mlx_lm_is_refused(tmp_path):
    with pytest.raises(upstream.UnknownTree, match="not an mlx-lm source tree"):
        upstream.patch_tree(tmp_path)


def test_a_patched_tree_is_refused(trees):
    with pytest.raises(upstream.UnknownTree, match="patched already"):
        upstream.patch_tree(trees[1])


def test_the_command_prints_the_files_it_changed(tmp_path):
    tree = release_tree(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "mlx_lm_mla", "upstream-patch", str(tree)],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert str(tree / "mlx_lm/models/cache.py") in out.stdout.splitlines()


def test_the_command_refuses_an_unknown_tree_clearly(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "mlx_lm_mla", "upstream-patch", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2 and "is not an mlx-lm source tree" in out.stderr


def test_the_patched_tree_passes_on_its_own(trees, tmp_path):
    _, patched, _ = trees
    env = {**os.environ, "MLX_LM_MLA_DISABLE": "1", "PYTHONPATH": str(patched)}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "-o", "python_files=check_*.py", str(HERE / "upstream_form")],
        capture_output=True, text=True, timeout=1200, env=env, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout.splitlines()[-1]


def test_the_hub_stand_in_loads_offline(tmp_path):
    from mlx_lm_mla import tiny

    tiny.write_hub_stand_in(tmp_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)}
    code = (
        "import mlx_lm; m, t = mlx_lm.load('mlx-community/Qwen1.5-0.5B-Chat-4bit'); "
        "print(type(m).__module__, m.layers[0].self_attn.q_proj.bits)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["mlx_lm.models.qwen2", "4"]
