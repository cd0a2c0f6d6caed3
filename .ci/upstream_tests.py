"""CI stage: mlx-lm's own model and prompt-cache tests on the upstream form.

Downloads the installed release's wheel and sdist, unpacks the wheel twice,
rewrites one copy with ``python -m mlx_lm_mla upstream-patch``, and runs the
sdist's tests/test_models.py and tests/test_prompt_cache.py against each
copy alone (the package switched off, the tree first on the path). Fails if
a test that passes on the release does not pass on the patched tree.
The Hugging Face model those tests load is stood in for by a tiny random
one of its architecture, written into a local hub cache under its id
(``tiny.write_hub_stand_in``), so they run offline.
"""

import shutil
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

import mlx_lm

from mlx_lm_mla import tiny

TESTS = ["test_models.py", "test_prompt_cache.py"]


def run(*cmd, **kwargs):
    print("+", " ".join(map(str, cmd)), flush=True)
    return subprocess.run(list(map(str, cmd)), check=True, **kwargs)


def outcomes(tree, tests, work):
    report = work / f"{tree.name}.xml"
    env = {
        "MLX_LM_MLA_DISABLE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(work / "hub"),
        "PYTHONPATH": str(tree),
        "PATH": "/usr/bin:/bin",
    }
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *TESTS],
        cwd=tests, env=env, timeout=1800,
    )
    result = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        bad = [c.tag for c in case if c.tag in ("failure", "error")]
        skipped = any(c.tag == "skipped" for c in case)
        result[f"{case.get('classname')}.{case.get('name')}"] = "fail" if bad else "skip" if skipped else "pass"
    return result


def main():
    version = mlx_lm.__version__
    work = Path(tempfile.mkdtemp(prefix="upstream-"))
    spec = f"mlx-lm=={version}"
    run(sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:", spec, "-d", work / "wheel")
    run(sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", spec, "-d", work / "sdist")
    release, patched = work / "release", work / "patched"
    with zipfile.ZipFile(next((work / "wheel").glob("*.whl"))) as z:
        z.extractall(release)
    shutil.copytree(release, patched)
    run(sys.executable, "-m", "mlx_lm_mla", "upstream-patch", patched)
    with tarfile.open(next((work / "sdist").glob("*.tar.gz"))) as t:
        t.extractall(work / "src")
    tiny.write_hub_stand_in(work / "hub")
    tests = work / "tests"
    shutil.copytree(next((work / "src").glob("*/tests")), tests)
    before, after = outcomes(release, tests, work), outcomes(patched, tests, work)
    lost = sorted(t for t, o in before.items() if o == "pass" and after.get(t) != "pass")
    counts = {k: sum(1 for o in before.values() if o == k) for k in ("pass", "fail", "skip")}
    print(f"mlx-lm {version} own tests on the release: {counts}; on the patched tree: "
          f"{sum(1 for o in after.values() if o == 'pass')} passed")
    if lost:
        print("passing on the release, not on the patched tree:", *lost, sep="\n  ")
        return 1
    print(f"upstream form: no test of mlx-lm's {', '.join(TESTS)} lost")
    return 0


if __name__ == "__main__":
    sys.exit(main())
