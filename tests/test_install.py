"""Both ways of installing the package turn the fix on in a new process:
a wheel (what this test run was installed from) and ``pip install -e .``."""

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CHECK = (
    "import mlx_lm, mlx_lm_mla; "
    "print(mlx_lm_mla.__file__); print(len(mlx_lm_mla.installed()))"
)


def activated(python, **env):
    out = subprocess.run(
        [str(python), "-c", CHECK],
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",  # not the checkout, so only the install can be imported
        env={**os.environ, **env},
    )
    assert out.returncode == 0, out.stderr
    where, patched = out.stdout.split()
    return where, int(patched)


def test_this_install_activates_in_a_new_process():
    where, patched = activated(sys.executable)
    assert patched > 0


def test_the_switch_turns_it_off():
    assert activated(sys.executable, MLX_LM_MLA_DISABLE="1")[1] == 0


@pytest.fixture(scope="module")
def editable(tmp_path_factory):
    """A fresh virtual environment with ``pip install -e`` of this checkout."""
    env_dir = tmp_path_factory.mktemp("editable") / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    extra = "" if sys.platform == "darwin" else "[cpu]"
    out = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "-e", f"{REPO}{extra}"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return python


def test_an_editable_install_activates_in_a_new_process(editable):
    where, patched = activated(editable)
    assert Path(where).resolve().is_relative_to(REPO) and patched > 0


def test_an_editable_install_has_the_switch_too(editable):
    assert activated(editable, MLX_LM_MLA_DISABLE="1")[1] == 0
