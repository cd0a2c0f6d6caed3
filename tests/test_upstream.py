"""The upstream form of the fix: ``upstream/mla-latent-cache.patch``, applied
to an mlx-lm tree by ``upstream/apply.py``, and tested on its own.

The tree is the installed mlx-lm release, copied as its wheel unpacked it
(no ``tests/``, so only the change's ``mlx_lm/`` part applies; CI applies the
whole patch to the release's sdist and runs mlx-lm's suite on it). The checks
in ``upstream_form/`` then run against the patched tree alone, with this
package switched off. Where the installed release is not the one the patch is
written for, only the refusals are tested.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx_lm
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "upstream"))
import apply  # noqa: E402  (upstream/apply.py)

TARGET = mlx_lm.__version__ == apply.TARGET


def release_tree(dest, version=None):
    shutil.copytree(Path(mlx_lm.__file__).parent, dest / "mlx_lm", ignore=shutil.ignore_patterns("__pycache__"))
    if version is not None:
        (dest / "mlx_lm/_version.py").write_text(f'__version__ = "{version}"\n')
    return dest


def test_a_tree_that_is_not_mlx_lm_is_refused(tmp_path):
    with pytest.raises(apply.UnfitTree, match="not an mlx-lm source tree"):
        apply.apply(tmp_path)


def test_another_release_is_refused_by_name_and_left_as_it_was(tmp_path):
    tree = release_tree(tmp_path, "0.31.3")
    before = (tree / "mlx_lm/models/cache.py").read_text()
    with pytest.raises(apply.UnfitTree, match=rf"is mlx-lm 0\.31\.3; the change is written for mlx-lm {apply.TARGET}"):
        apply.apply(tree)
    assert (tree / "mlx_lm/models/cache.py").read_text() == before


def test_the_command_refuses_an_unknown_tree_clearly(tmp_path):
    out = subprocess.run(
        [sys.executable, str(HERE.parent / "upstream/apply.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2 and "is not an mlx-lm source tree" in out.stderr


@pytest.mark.parametrize("under", ["mlx_lm", "tests"])
def test_the_change_stays_within_the_budget(under):
    assert 0 < apply.added_lines()[under] <= apply.BUDGET[under]


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


if TARGET:

    @pytest.fixture(scope="module")
    def patched(tmp_path_factory):
        tree = release_tree(tmp_path_factory.mktemp("upstream"))
        return tree, apply.apply(tree)

    def test_it_changes_the_cache_module_generate_server_and_every_mla_model(patched):
        from mlx_lm_mla import mla

        tree, changed = patched
        names = {p.relative_to(tree / "mlx_lm").as_posix() for p in changed}
        models = mla.model_types(tree / "mlx_lm" / "models")
        # glm_moe_dsa and longcat_flash_ngram's relatives inherit their caches.
        own = {f"models/{t}.py" for t in models} - {"models/glm_moe_dsa.py"}
        assert own <= names
        assert names - own == {"models/cache.py", "models/base.py", "generate.py", "server.py"}

    def test_a_patched_tree_is_refused(patched):
        with pytest.raises(apply.UnfitTree, match="has the change already"):
            apply.apply(patched[0])

    def test_a_tree_whose_files_differ_from_the_release_is_refused_by_file(tmp_path):
        tree = release_tree(tmp_path)
        base = tree / "mlx_lm/models/base.py"
        base.write_text(base.read_text().replace('hasattr(cache, "bits")', 'hasattr(cache, "bits") '))
        before = (tree / "mlx_lm/models/cache.py").read_text()
        with pytest.raises(apply.UnfitTree, match=r"not mlx-lm .* as released: .*mlx_lm/models/base\.py"):
            apply.apply(tree)
        assert (tree / "mlx_lm/models/cache.py").read_text() == before

    def test_the_command_prints_the_files_it_changed(tmp_path):
        tree = release_tree(tmp_path)
        out = subprocess.run(
            [sys.executable, str(HERE.parent / "upstream/apply.py"), str(tree)],
            capture_output=True, text=True, timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert str(tree / "mlx_lm/models/cache.py") in out.stdout.splitlines()

    def test_the_patched_tree_passes_on_its_own(patched, tmp_path):
        env = {**os.environ, "MLX_LM_MLA_DISABLE": "1", "PYTHONPATH": str(patched[0])}
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "python_files=check_*.py",
             str(HERE / "upstream_form")],
            capture_output=True, text=True, timeout=1200, env=env, cwd=tmp_path,
        )
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
        assert " passed" in out.stdout.splitlines()[-1]
