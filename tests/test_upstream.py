"""The upstream form of the fix: the patch series in ``upstream/``, applied to
an mlx-lm tree by ``upstream/apply.py`` in order, and tested on its own.

The tree is the installed mlx-lm release, copied as its wheel unpacked it
(no ``tests/``, so only the patches' ``mlx_lm/`` parts apply; CI applies the
whole series to the release's sdist and runs mlx-lm's suite on it). The
checks in ``upstream_form/`` then run against the patched tree alone, with
this package switched off: those of the fix (``check_fix.py``) on a tree with
patch 1 alone, and with both patches; those of the batch variant
(``check_batch.py``) on a tree with both. Where the installed release is not
the one the series is written for, only the refusals are tested.
"""

import os
import re
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
    shutil.copytree(
        Path(mlx_lm.__file__).parent,
        dest / "mlx_lm",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    if version is not None:
        (dest / "mlx_lm/_version.py").write_text(f'__version__ = "{version}"\n')
    return dest


def run_apply(*args):
    return subprocess.run(
        [sys.executable, str(HERE.parent / "upstream/apply.py"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_refused_and_left_as_it_was(tree, match):
    """apply.apply(tree) refuses it, with ``match`` in the message, and leaves
    the file the first patch changes as it was."""
    before = (tree / "mlx_lm/models/cache.py").read_text()
    with pytest.raises(apply.UnfitTree, match=match):
        apply.apply(tree)
    assert (tree / "mlx_lm/models/cache.py").read_text() == before


def edited(path, old, new):
    path.write_text(path.read_text().replace(old, new))


def test_a_tree_that_is_not_mlx_lm_is_refused(tmp_path):
    with pytest.raises(apply.UnfitTree, match="not an mlx-lm source tree"):
        apply.apply(tmp_path)


def test_another_release_is_refused_by_name_and_left_as_it_was(tmp_path):
    tree = release_tree(tmp_path, "0.31.3")
    assert_refused_and_left_as_it_was(
        tree, rf"is mlx-lm 0\.31\.3; the change is written for mlx-lm {apply.TARGET}"
    )


def test_the_command_refuses_an_unknown_tree_clearly(tmp_path):
    out = run_apply(tmp_path)
    assert out.returncode == 2 and "is not an mlx-lm source tree" in out.stderr


def test_a_patch_outside_the_series_is_refused_by_number(tmp_path):
    out = run_apply(release_tree(tmp_path), "--patches", "3")
    assert out.returncode == 2 and "the series has patches 1 to 2, not 3" in out.stderr


@pytest.mark.parametrize("patch", apply.SERIES, ids=lambda p: p.name)
def test_each_patch_stays_within_its_budget(patch):
    added = apply.added_lines(patch)
    assert set(added) == {"mlx_lm", "tests"} and all(added.values())
    assert apply.over_budget(patch) == {}


def test_the_fix_adds_at_most_200_lines_under_mlx_lm():
    assert apply.added_lines(apply.SERIES[0])["mlx_lm"] <= 200


@pytest.mark.parametrize("patch", apply.SERIES, ids=lambda p: p.name)
def test_the_summary_gives_each_patchs_added_lines_as_counted(patch):
    text = (HERE.parent / "docs" / "upstream-pr.md").read_text(encoding="utf-8")
    said = re.search(
        rf"\[`{re.escape(patch.name)}`\].*?(\d+)\s+(?:added\s+lines\s+)?under"
        r"\s+`mlx_lm/`,\s+(\d+)\s+under\s+`tests/`",
        text,
        re.DOTALL,
    )
    added = apply.added_lines(patch)
    assert said and said.groups() == (str(added["mlx_lm"]), str(added["tests"]))


def test_the_hub_stand_in_loads_offline(tmp_path):
    from mlx_lm_mla import tiny

    tiny.write_hub_stand_in(tmp_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)}
    code = (
        "import mlx_lm; m, t = mlx_lm.load('mlx-community/Qwen1.5-0.5B-Chat-4bit'); "
        "print(type(m).__module__, m.layers[0].self_attn.q_proj.bits)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["mlx_lm.models.qwen2", "4"]


if TARGET:

    @pytest.fixture(scope="module")
    def fix_only(tmp_path_factory):
        tree = release_tree(tmp_path_factory.mktemp("fix"))
        return tree, apply.apply(tree, patches=1)

    @pytest.fixture(scope="module")
    def series(tmp_path_factory):
        tree = release_tree(tmp_path_factory.mktemp("series"))
        return tree, apply.apply(tree)

    def names(tree, changed):
        return {p.relative_to(tree / "mlx_lm").as_posix() for p in changed}

    def test_the_fix_changes_the_cache_module_generate_and_every_mla_model(fix_only):
        from mlx_lm_mla import mla

        tree, changed = fix_only
        models = mla.model_types(tree / "mlx_lm" / "models")
        # glm_moe_dsa takes DeepSeek-V3.2's caches: it defines none of its own.
        own = {f"models/{t}.py" for t in models} - {"models/glm_moe_dsa.py"}
        assert own <= names(*fix_only)
        assert names(*fix_only) - own == {
            "models/cache.py",
            "models/base.py",
            "generate.py",
        }

    def test_the_batch_variant_adds_the_server_and_nothing_outside(fix_only, series):
        assert names(*series) - names(*fix_only) == {"server.py"}

    def test_a_tree_with_the_fix_takes_the_batch_variant(tmp_path, series):
        tree = release_tree(tmp_path)
        apply.apply(tree, patches=1)
        changed = apply.apply(tree)
        assert names(tree, changed) == {"models/cache.py", "generate.py", "server.py"}
        for name in names(*series):
            assert (tree / "mlx_lm" / name).read_text() == (
                series[0] / "mlx_lm" / name
            ).read_text()
        with pytest.raises(
            apply.UnfitTree, match=r"has patch 1 .* and patch 2 .* already"
        ):
            apply.apply(tree, patches=1)

    def test_a_patched_tree_is_refused(fix_only):
        with pytest.raises(
            apply.UnfitTree, match=r"has patch 1 \(1-mla-latent-cache.patch\) already"
        ):
            apply.apply(fix_only[0], patches=1)

    def test_a_tree_whose_files_differ_from_the_release_is_refused_by_file(tmp_path):
        tree = release_tree(tmp_path)
        bits = 'hasattr(cache, "bits")'
        edited(tree / "mlx_lm/models/base.py", bits, bits + " ")
        assert_refused_and_left_as_it_was(
            tree, r"not mlx-lm .* as released: patch 1 .*mlx_lm/models/base\.py"
        )

    def test_a_tree_that_fails_the_second_patch_is_left_without_the_first(tmp_path):
        tree = release_tree(tmp_path)
        edited(
            tree / "mlx_lm/server.py",
            "and self.cli_args.kv_bits is None",
            "and not self.cli_args.kv_bits",
        )
        assert_refused_and_left_as_it_was(
            tree, r"as released: patch 2 .*mlx_lm/server\.py"
        )

    def test_the_command_prints_the_files_it_changed(tmp_path):
        tree = release_tree(tmp_path)
        out = run_apply(tree, "--patches", "1")
        assert out.returncode == 0, out.stderr
        assert str(tree / "mlx_lm/models/cache.py") in out.stdout.splitlines()
        assert str(tree / "mlx_lm/server.py") not in out.stdout.splitlines()

    def checks(tree, tmp_path, *files):
        env = {**os.environ, "MLX_LM_MLA_DISABLE": "1", "PYTHONPATH": str(tree)}
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-o",
                "python_files=check_*.py",
                *(str(HERE / "upstream_form" / f) for f in files),
            ],
            capture_output=True,
            text=True,
            timeout=1200,
            env=env,
            cwd=tmp_path,
        )
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
        assert " passed" in out.stdout.splitlines()[-1]

    def test_the_fix_alone_passes_its_checks(fix_only, tmp_path):
        checks(fix_only[0], tmp_path, "check_fix.py")

    def test_the_series_passes_the_checks_of_both_patches(series, tmp_path):
        checks(series[0], tmp_path, "check_fix.py", "check_batch.py")
