"""What the start-up hook costs a Python process that never imports mlx_lm.

Runs ``python -c pass`` with the hook on and off (MLX_LM_MLA_DISABLE=1),
interleaved, and reports the medians, plus what ``-X importtime`` says the
hook's own imports take. "Off" still reads the .pth and imports
``mlx_lm_mla.activate`` to see the variable, so the import time is the
better figure for the whole cost. Needs the package installed (pip install .).

    python benchmarks/startup_cost.py
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

import _common  # noqa: F401  (puts the repository root on sys.path)
from _common import write_json


def run(disabled):
    env = dict(os.environ)
    env.pop("MLX_LM_MLA_DISABLE", None)
    if disabled:
        env["MLX_LM_MLA_DISABLE"] = "1"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    started = time.perf_counter()
    on, off = [], []
    for i in range(args.runs):
        on.append(run(False))
        off.append(run(True))
        print(f"\r{i + 1}/{args.runs}", end="", file=sys.stderr)
    print(file=sys.stderr)
    trace = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "pass"],
        capture_output=True,
        text=True,
    ).stderr.splitlines()
    hook_us = sum(
        int(line.split("|")[0].split(":")[1]) for line in trace if "mlx_lm_mla" in line
    )
    result = {
        "hook_on_ms": statistics.median(on) * 1e3,
        "hook_off_ms": statistics.median(off) * 1e3,
        "hook_imports_self_ms": hook_us / 1e3,
        "mlx_imported_at_startup": any(
            " mlx.core" in line or "| mlx\n" in line for line in trace
        ),
    }
    result["difference_ms"] = result["hook_on_ms"] - result["hook_off_ms"]
    print(
        f"python -c pass, median of {args.runs}: hook on {result['hook_on_ms']:.1f} ms, "
        f"off {result['hook_off_ms']:.1f} ms, difference {result['difference_ms']:+.1f} ms"
    )
    print(
        f"the hook's own imports (-X importtime, self): {result['hook_imports_self_ms']:.2f} ms; "
        f"mlx imported at start-up: {result['mlx_imported_at_startup']}"
    )
    print(f"wrote {write_json(args.json, 'startup_cost', args, result, started)}")


if __name__ == "__main__":
    main()
