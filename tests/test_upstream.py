"""``upstream-patch``: the fix as a small mlx-lm change, with its own code
(``upstream_cache.py``, ``upstream_tests.py``), tested on its own.

The tree is the installed mlx-lm release, copied as it was unpacked from its
wheel, with stand-ins for the two test files of mlx-lm's sdist that the
change adds cases to. The checks in ``upstream_form/`` then run against the
patched tree alone, with this package switched off. Where upstream-patch
does not write the change (mlx-lm 0.31), only its refusal is tested.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx_lm
import pytest

from mlx_lm_mla import upstream

HERE = Path(__file__).resolve().parent
APPLIES = upstream.applies(mlx_lm.__version__)


# mlx-lm's test files as far as the change touches them: the imports its
# cases use (both files have them), a block of names from mlx_lm.models.cache
# and the unittest main block. CI counts the lines on the real files too.
TEST_FILE = """import importlib
import os
import tempfile
import unittest

import mlx.core as mx

from mlx_lm.models.cache import (
    KVCache,
    RotatingKVCache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
)


class TestExisting(unittest.TestCase):
    def test_kv_cache(self):
        self.assertEqual(KVCache().offset, 0)


if __name__ == "__main__":
    unittest.main()
"""


def release_tree(dest):
    shutil.copytree(Path(mlx_lm.__file__).parent, dest / "mlx_lm", ignore=shutil.ignore_patterns("__pycache__"))
    (dest / "tests").mkdir()
    for name in upstream.TEST_IMPORTS:
        (dest / "tests" / name).write_text(TEST_FILE)
    return dest


def test_a_tree_that_is_not_mlx_lm_is_refused(tmp_path):
    with pytest.raises(upstream.UnknownTree, match="not an mlx-lm source tree"):
        upstream.patch_tree(tmp_path)


def test_an_older_release_is_refused_by_name(tmp_path):
    tree = release_tree(tmp_path)
    (tree / "mlx_lm/_version.py").write_text('__version__ = "0.31.3"\n')
    with pytest.raises(upstream.UnknownTree, match=r"is mlx-lm 0\.31\.3: .* for mlx-lm 0\.32 and later"):
        upstream.patch_tree(tree)


def test_a_refused_tree_is_left_as_it_was(tmp_path):
    tree = release_tree(tmp_path)
    (tree / "mlx_lm/_version.py").write_text('__version__ = "0.31.3"\n')
    before = (tree / "mlx_lm/models/cache.py").read_text()
    with pytest.raises(upstream.UnknownTree):
        upstream.patch_tree(tree)
    assert (tree / "mlx_lm/models/cache.py").read_text() == before


def test_the_command_refuses_an_unknown_tree_clearly(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "mlx_lm_mla", "upstream-patch", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2 and "is not an mlx-lm source tree" in out.stderr


def run_pytest(tree, target, cwd, *args):
    env = {**os.environ, "MLX_LM_MLA_DISABLE": "1", "PYTHONPATH": str(tree)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, str(target)],
        capture_output=True, text=True, timeout=1200, env=env, cwd=cwd,
    )


def test_the_hub_stand_in_loads_offline(tmp_path):
    from mlx_lm_mla.testing import tiny

    tiny.write_hub_stand_in(tmp_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)}
    code = (
        "import mlx_lm; m, t = mlx_lm.load('mlx-community/Qwen1.5-0.5B-Chat-4bit'); "
        "print(type(m).__module__, m.layers[0].self_attn.q_proj.bits)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["mlx_lm.models.qwen2", "4"]


# Where upstream-patch writes the change (mlx-lm 0.32 on). Older trees are
# refused, which the tests above check at every leg.
if APPLIES:

    @pytest.fixture(scope="module")
    def trees(tmp_path_factory):
        base = tmp_path_factory.mktemp("upstream")
        original = release_tree(base / "original")
        patched = release_tree(base / "patched")
        changed = upstream.patch_tree(patched)
        return original, patched, changed

    @pytest.mark.parametrize("under", ["mlx_lm", "tests"])
    def test_the_change_stays_within_the_budget(trees, under):
        original, patched, _ = trees
        assert 0 < upstream.added_lines(original, patched, under) <= upstream.BUDGET[under]

    def test_it_changes_the_cache_module_mla_models_and_two_test_files(trees):
        _, patched, changed = trees
        names = {p.name for p in changed}
        assert {"cache.py", "deepseek_v3.py", "deepseek_v32.py", "longcat_flash.py"} <= names
        assert {"test_prompt_cache.py", "test_models.py"} <= names
        assert not names & {"deepseek_v2.py", "minicpm3.py", "llama.py", "generate.py", "glm_moe_dsa.py"}

    def test_the_cache_module_carries_the_upstream_code(trees):
        _, patched, _ = trees
        assert (patched / "mlx_lm/models/cache.py").read_text().endswith(upstream.cache_code())

    def test_the_added_tests_join_mlx_lms_test_files(trees):
        _, patched, _ = trees
        text = (patched / "tests/test_models.py").read_text()
        assert text.index("class TestLatentModels(") < text.index('if __name__ == "__main__":')
        assert "    LatentKVCache,\n    QuantizedLatentKVCache,\n" in text

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

    def test_the_patched_tree_passes_on_its_own(trees, tmp_path):
        _, patched, _ = trees
        out = run_pytest(patched, HERE / "upstream_form", tmp_path, "-o", "python_files=check_*.py")
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
        assert " passed" in out.stdout.splitlines()[-1]

    def test_the_added_mlx_lm_tests_pass_on_the_patched_tree(trees):
        _, patched, _ = trees
        tests = patched / "tests"
        out = run_pytest(patched, tests, tests, "-k", "TestLatent")
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
        assert out.stdout.splitlines()[-1].startswith("7 passed")
