"""The command line: ``python -m mlx_lm_mla`` / ``mlx-lm-mla``."""

import json
import subprocess
import sys
from importlib.metadata import entry_points

from mlx_lm_mla.__main__ import COMMANDS


def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "mlx_lm_mla", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_console_script_is_declared():
    scripts = {e.name: e.value for e in entry_points(group="console_scripts")}
    assert scripts.get("mlx-lm-mla") == "mlx_lm_mla.__main__:main"


def test_serve_takes_mlx_lm_server_flags():
    out = run("serve", "--help")
    assert out.returncode == 0
    assert "--decode-concurrency" in out.stdout and "--prompt-cache-size" in out.stdout


def test_unknown_command_prints_usage():
    out = run("frobnicate")
    usage = "usage: mlx-lm-mla {" + ",".join(COMMANDS) + "}"
    assert out.returncode == 2 and usage in out.stderr


def test_repro_shows_stock_failing_and_the_fix_serving():
    out = run("repro", "--json", "--requests", "6", "--kv-bits", "4")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["fixed"]["errors"] == 0 and result["fixed"]["served"] == 6
    assert result["stock"]["errors"] > 0
    assert "'list' object has no attribute 'swapaxes'" in result["stock"]["first_error"]
