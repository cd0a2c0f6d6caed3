"""CI stage: mlx-lm's own offline tests, from the sdist of the installed
release, three ways:

- ``release``: the installed mlx-lm with the package switched off (the
  reference);
- ``active``: the installed mlx-lm with the package active, as users run it;
- ``upstream form``: the release's wheel rewritten by
  ``python -m mlx_lm_mla upstream-patch``, with the package switched off.

Fails if a test that passes on the release does not pass the other two ways,
except, for ``active``, the tests the README lists under
``<!-- changed-upstream-tests -->`` (behaviour the package changes on
purpose); a listed test that passes anyway fails the stage too, so the list
stays true. The Hugging Face model most of these tests load is stood in for
by a tiny random one of its architecture, written into a local hub cache
under its id (``tiny.write_hub_stand_in``), so they run offline.
"""

import re
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

TESTS = ["test_models.py", "test_prompt_cache.py", "test_generate.py", "test_server.py"]
ROOT = Path(__file__).resolve().parent.parent


def run(*cmd, **kwargs):
    print("+", " ".join(map(str, cmd)), flush=True)
    return subprocess.run(list(map(str, cmd)), check=True, **kwargs)


def changed_on_purpose():
    """Test ids listed in the README as changed by the package on purpose."""
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- changed-upstream-tests -->", 1)[1].split("\n\n", 1)[0]
    return set(re.findall(r"^- `([^`]+)`", block, re.M))


def outcomes(name, tests, work, tree=None, active=False):
    report = work / f"{name}.xml"
    env = {
        "MLX_LM_MLA_DISABLE": "0" if active else "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(work / "hub"),
        "PATH": "/usr/bin:/bin",
    }
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *TESTS],
        cwd=tests, env=env, timeout=1800,
    )
    result = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        bad = [c.tag for c in case if c.tag in ("failure", "error")]
        skipped = any(c.tag == "skipped" for c in case)
        test_id = f"{case.get('classname')}.{case.get('name')}"
        result[test_id] = "fail" if bad else "skip" if skipped else "pass"
    return result


def short(test_id):
    # "test_server.TestLRUPromptCache.test_lru" -> "test_server.py::TestLRUPromptCache::test_lru"
    module, cls, name = test_id.rsplit(".", 2)
    return f"{module}.py::{cls}::{name}"


def main():
    version = mlx_lm.__version__
    work = Path(tempfile.mkdtemp(prefix="mlx-lm-tests-"))
    spec = f"mlx-lm=={version}"
    run(sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:", spec, "-d", work / "wheel")
    run(sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", spec, "-d", work / "sdist")
    patched = work / "patched"
    with zipfile.ZipFile(next((work / "wheel").glob("*.whl"))) as z:
        z.extractall(patched)
    run(sys.executable, "-m", "mlx_lm_mla", "upstream-patch", patched)
    with tarfile.open(next((work / "sdist").glob("*.tar.gz"))) as t:
        t.extractall(work / "src")
    tiny.write_hub_stand_in(work / "hub")
    tests = work / "tests"
    shutil.copytree(next((work / "src").glob("*/tests")), tests)

    release = outcomes("release", tests, work)
    ways = {"active": outcomes("active", tests, work, active=True), "upstream form": outcomes("patched", tests, work, patched)}
    listed = changed_on_purpose()
    counts = {k: sum(1 for o in release.values() if o == k) for k in ("pass", "fail", "skip")}
    print(f"mlx-lm {version}, {', '.join(TESTS)}: on the release {counts}")
    status = 0
    for way, got in ways.items():
        lost = sorted(short(t) for t, o in release.items() if o == "pass" and got.get(t) != "pass")
        allowed = listed if way == "active" else set()
        print(f"{way}: {sum(1 for o in got.values() if o == 'pass')} passed")
        if set(lost) - allowed:
            print(f"passing on the release, not {way}:", *sorted(set(lost) - allowed), sep="\n  ")
            status = 1
        stale = sorted(t for t in allowed if t not in lost and any(short(r) == t for r in release))
        if stale:
            print("listed in the README as changed, but they pass:", *stale, sep="\n  ")
            status = 1
        if way == "active" and set(lost) & allowed:
            print("changed on purpose (README):", *sorted(set(lost) & allowed), sep="\n  ")
    return status


if __name__ == "__main__":
    sys.exit(main())
