"""The command line: ``python -m mlx_lm_mla`` / ``mlx-lm-mla``."""

import json
import os
import re
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from mlx_lm_mla.__main__ import COMMANDS

from conftest import SWAPAXES


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


def test_the_servers_kv_bits_help_says_mla_models_keep_batching():
    stock = [sys.executable, "-m", "mlx_lm.server", "--help"]
    for disabled in (None, "1"):
        env = {k: v for k, v in os.environ.items() if k != "MLX_LM_MLA_DISABLE"}
        env.update({"MLX_LM_MLA_DISABLE": disabled} if disabled else {})
        out = subprocess.run(stock, env=env, capture_output=True, text=True)
        said = "MLA models keep batching" in " ".join(out.stdout.split())
        # mlx-lm 0.31.2's server has no --kv-bits: nothing to say there.
        has_flag = "--kv-bits" in out.stdout
        assert out.returncode == 0 and said == (disabled is None and has_flag)


def test_mlx_lm_mla_disable_keeps_the_fix_off_mlx_lm_but_not_off_serve():
    env = {**os.environ, "MLX_LM_MLA_DISABLE": "1"}
    stock = [sys.executable, "-m", "mlx_lm.server", "--help"]
    serve = [sys.executable, "-m", "mlx_lm_mla", "serve", "--help"]
    for command, fixed in ((stock, False), (serve, True)):
        out = subprocess.run(command, env=env, capture_output=True, text=True)
        assert out.returncode == 0 and "--prompt-cache-size" in out.stdout
        assert ("--prompt-cache-dir" in out.stdout) == fixed


def test_an_unknown_command_is_named_in_an_error_line_after_the_usage():
    out = run("frob")
    usage = "usage: mlx-lm-mla {" + ",".join(COMMANDS) + "}"
    assert out.returncode == 2 and usage in out.stderr
    assert out.stderr.splitlines()[-1] == "mlx-lm-mla: error: unknown command 'frob'"


def test_no_command_is_an_error_line_after_the_usage():
    out = run()
    assert out.returncode == 2
    assert out.stderr.splitlines()[-1] == "mlx-lm-mla: error: no command given"


def unexplained(help_text):
    """The arguments an argparse --help lists with no text after them."""
    lines = help_text.splitlines() + [""]
    missing = []
    for line, after in zip(lines, lines[1:]):
        if re.match(r"  \S", line):  # an argument, in any section
            name, _, text = line.strip().partition("  ")
            if not text.strip() and not re.match(r"   +\S", after):
                missing.append(name)
    return missing


@pytest.mark.parametrize("command", list(COMMANDS))
def test_each_commands_help_names_it_and_explains_each_argument(command):
    out = run(command, "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: mlx-lm-mla {command} ")
    assert unexplained(out.stdout) == []


def test_the_help_check_catches_an_argument_without_text():
    help_text = """usage: x [-h] [--seed SEED] dir

positional arguments:
  dir          a folder

options:
  -h, --help   show this help message and exit
  --very-long-option VERY_LONG_OPTION
  --seed SEED
"""
    assert unexplained(help_text) == [
        "--very-long-option VERY_LONG_OPTION",
        "--seed SEED",
    ]


def test_repro_shows_stock_failing_and_the_fix_serving():
    out = run("repro", "--json", "--requests", "6", "--kv-bits", "4")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["fixed"]["errors"] == 0 and result["fixed"]["served"] == 6
    assert result["stock"]["errors"] > 0
    assert SWAPAXES in result["stock"]["first_error"]
