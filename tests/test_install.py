"""Both ways of installing the package turn the fix on in a new process:
a wheel (what this test run was installed from) and ``pip install -e .``."""

import os
import shutil
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


def python_c(code, *flags, python=sys.executable, **env):
    """``python [flags] -c code`` in a new process, outside the checkout (so
    only the install can be imported), the package's switch unset unless
    ``env`` sets it."""
    environ = {k: v for k, v in os.environ.items() if k != "MLX_LM_MLA_DISABLE"}
    return subprocess.run(
        [str(python), *flags, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",
        env={**environ, **env},
    )


def activated(python, **env):
    out = python_c(CHECK, python=python, **env)
    assert out.returncode == 0, out.stderr
    where, patched = out.stdout.split()
    return where, int(patched)


def test_this_install_activates_in_a_new_process():
    where, patched = activated(sys.executable)
    assert patched > 0


def test_the_switch_turns_it_off():
    assert activated(sys.executable, MLX_LM_MLA_DISABLE="1")[1] == 0


# What a checkout holds beside its sources: environments, caches, builds.
NOT_SOURCE = shutil.ignore_patterns(
    ".*", "__pycache__", "*.egg-info", "build", "dist", "results"
)


@pytest.fixture(scope="module")
def editable(tmp_path_factory):
    """A fresh virtual environment with ``pip install -e`` of a copy of this
    checkout (an editable install writes its metadata into the folder)."""
    folder = tmp_path_factory.mktemp("editable")
    checkout = folder / "checkout"
    shutil.copytree(REPO, checkout, ignore=NOT_SOURCE)
    venv.create(folder / "venv", with_pip=True)
    python = folder / "venv" / "bin" / "python"
    extra = "" if sys.platform == "darwin" else "[cpu]"
    out = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "-e", f"{checkout}{extra}"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return python, checkout


def test_an_editable_install_activates_in_a_new_process(editable):
    python, checkout = editable
    where, patched = activated(python)
    assert Path(where).resolve().is_relative_to(checkout) and patched > 0


def test_an_editable_install_has_the_switch_too(editable):
    python, _ = editable
    assert activated(python, MLX_LM_MLA_DISABLE="1")[1] == 0


def run_fresh(code):
    """code in a new process with every warning an error; its stdout."""
    out = python_c(code, "-W", "error")
    assert out.returncode == 0 and not out.stderr, out.stderr
    return out.stdout.split()


def test_install_before_mlx_lm_is_imported_activates_without_a_warning():
    assert int(run_fresh("import mlx_lm_mla; print(len(mlx_lm_mla.install()))")[0]) > 0


@pytest.mark.parametrize(
    "first",
    [
        "mlx_lm_mla.tiny",
        "mlx_lm_mla.cache",
        "mlx_lm_mla.mla",
        "mlx_lm_mla.patches.quantize",
    ],
)
def test_importing_a_module_of_the_package_first_activates_without_a_warning(first):
    code = f"import {first}, mlx_lm_mla; print(len(mlx_lm_mla.installed()))"
    assert int(run_fresh(code)[0]) > 0


def test_the_server_is_guarded_when_imported_and_not_imported_before():
    code = (
        "import sys, mlx_lm, mlx_lm_mla; "
        "server = lambda: any(p.startswith('mlx_lm.server.') for p in mlx_lm_mla.installed()); "
        "print('mlx_lm.server' in sys.modules, server()); "
        "import mlx_lm.server; print(server())"
    )
    assert run_fresh(code) == ["False", "False", "True"]


def test_a_bad_decode_setting_is_named_when_mlx_lm_is_imported():
    out = python_c(CHECK, MLX_LM_MLA_DECODE="fastest")
    # Still active: a decode step refuses the setting with the same words.
    assert out.returncode == 0 and int(out.stdout.split()[1]) > 0, out.stderr
    assert "MLX_LM_MLA_DECODE='fastest' is not a decode path" in out.stderr


def kernel_switched(value):
    """(decode_cuda.ENABLED, stderr) in a new process with MLX_LM_MLA_CUDA_KERNEL."""
    code = (
        "import mlx_lm; from mlx_lm_mla import decode_cuda; print(decode_cuda.ENABLED)"
    )
    out = python_c(code, "-W", "always", MLX_LM_MLA_CUDA_KERNEL=value)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()[-1], out.stderr


@pytest.mark.parametrize("value", ["0", "false", " Off ", "no"])
def test_each_word_for_off_switches_the_cuda_kernel_off(value):
    enabled, errors = kernel_switched(value)
    assert enabled == "False" and "MLX_LM_MLA_CUDA_KERNEL" not in errors


def test_a_kernel_setting_that_is_no_switch_is_named_and_leaves_it_on():
    enabled, errors = kernel_switched("of")
    assert enabled == "True"
    assert "MLX_LM_MLA_CUDA_KERNEL='of' is not a switch" in errors


def test_a_disable_setting_that_is_no_switch_is_named_and_leaves_the_fix_on():
    out = python_c(CHECK, "-W", "always", MLX_LM_MLA_DISABLE="y")
    assert out.returncode == 0 and int(out.stdout.split()[1]) > 0, out.stderr
    assert "MLX_LM_MLA_DISABLE='y' is not a switch" in out.stderr
    assert "the fix stays on" in out.stderr


def test_a_broken_module_of_the_package_never_breaks_importing_mlx_lm():
    # The start-up hook is watching; the package then loses a name activation needs.
    code = (
        "import warnings, mlx_lm_mla; del mlx_lm_mla.__version__; "
        "warnings.simplefilter('always'); import mlx_lm; print(mlx_lm.__name__)"
    )
    out = python_c(code)
    assert out.returncode == 0 and out.stdout.split() == ["mlx_lm"], out.stderr
    assert "mlx-lm-mla could not activate" in out.stderr


def run_as(run_name):
    """``python -m mlx_lm.server --help`` as runpy runs it under ``run_name``:
    whether the server's ``main()`` ran (it prints its usage)."""
    code = (
        "import runpy, sys; sys.argv = ['server', '--help']; "
        f"runpy.run_module('mlx_lm.server', run_name={run_name!r}, alter_sys=True); "
        "print('imported')"
    )
    out = python_c(code)
    return "usage:" in out.stdout, out


def test_python_m_mlx_lm_server_runs_the_servers_main():
    ran, out = run_as("__main__")
    assert ran and out.returncode == 0, out.stderr


def test_a_spawned_child_of_a_server_imports_it_without_starting_another():
    # multiprocessing's spawn runs the parent's main module as "__mp_main__".
    ran, out = run_as("__mp_main__")
    assert not ran and out.stdout.split() == ["imported"], out.stderr


def test_a_module_of_the_package_that_fails_to_import_holds_back_no_activation(
    tmp_path,
):
    # The module imports mlx_lm (activation waits for it), then fails.
    (tmp_path / "broken.py").write_text("import mlx_lm\nraise ImportError('no')\n")
    code = (
        "import mlx_lm_mla\n"
        f"mlx_lm_mla.__path__.append({str(tmp_path)!r})\n"
        "try:\n    import mlx_lm_mla.broken\nexcept ImportError:\n    pass\n"
        "print(len(mlx_lm_mla.installed()))"
    )
    assert int(run_fresh(code)[0]) > 0
