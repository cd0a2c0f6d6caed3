"""CI stage: mlx-lm's own offline tests, from the sdist of the installed
release, three ways:

- ``release``: the installed mlx-lm with the package switched off (the
  reference);
- ``active``: the installed mlx-lm with the package active, as users run it,
  on ``TESTS``;
- ``upstream form``: the sdist with the patch series of ``upstream/``
  applied by ``upstream/apply.py`` (their ``mlx_lm/`` and their ``tests/``,
  which gain each patch's own cases), with the package switched off, twice:
  with patch 1 alone, and with patches 1 and 2. Only for the release the
  series is written for (``apply.TARGET``); there the release and both
  patched trees run the whole offline suite, every test file of the sdist,
  and each patch must stay within its line budget.

Fails if a test that passes on the release does not pass the other two ways,
except, for ``active``, the tests the README lists under
``<!-- changed-upstream-tests -->`` (behaviour the package changes on
purpose); a listed test that passes anyway fails the stage too, so the list
stays true. Every test a patched tree adds must pass on it, and fail on
the tree before its patch (the release, or patch 1 alone). The Hugging
Face model most of these tests load is stood in for by a tiny random one of
its architecture, written into a local hub cache under its id
(``tiny.write_hub_stand_in``), so they run offline; the tests that need the
network, Metal or a missing extra fail on the release and are not counted.
"""

import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx_lm

from mlx_lm_mla import tiny

TESTS = ["test_models.py", "test_prompt_cache.py", "test_generate.py", "test_server.py"]
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "upstream"))
import apply  # noqa: E402  (upstream/apply.py)

# The runs are independent processes: two at a time, one a core here. Each
# one's output is printed whole when it ends, not interleaved.
PRINTING = threading.Lock()


def run(*cmd, **kwargs):
    print("+", " ".join(map(str, cmd)), flush=True)
    return subprocess.run(list(map(str, cmd)), check=True, **kwargs)


def changed_on_purpose():
    """Test ids listed in the README as changed by the package on purpose."""
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- changed-upstream-tests -->", 1)[1].split("\n\n", 1)[0]
    return set(re.findall(r"^- `([^`]+)`", block, re.M))


def outcomes(name, tests, work, files, tree=None, active=False):
    report = work / f"{name}.xml"
    env = {
        "MLX_LM_MLA_DISABLE": "0" if active else "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(work / "hub"),
        "PATH": "/usr/bin:/bin",
    }
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    try:
        ran = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "--continue-on-collection-errors",
                f"--junitxml={report}",
                *files,
            ],
            cwd=tests,
            env=env,
            timeout=1800,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    except subprocess.TimeoutExpired as e:  # what it printed, then the failure
        out = e.output or b""  # bytes, whatever text=True asked
        with PRINTING:
            print(f"--- {name}: timed out", out.decode(errors="replace"), sep="\n")
        raise
    with PRINTING:
        print(f"--- {name}: mlx-lm's tests {' '.join(files)}", ran.stdout, sep="\n")
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


def in_files(results, files):
    modules = {f.removesuffix(".py") for f in files}
    return {t: o for t, o in results.items() if t.split(".")[0] in modules}


def main():
    with tempfile.TemporaryDirectory(prefix="mlx-lm-tests-") as work:
        return check(Path(work))


def check(work):
    version = mlx_lm.__version__
    spec = f"mlx-lm=={version}"
    run(
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        "--no-binary",
        ":all:",
        spec,
        "-d",
        work / "sdist",
    )
    with tarfile.open(next((work / "sdist").glob("*.tar.gz"))) as t:
        t.extractall(work / "src")
    source = next((work / "src").glob("*/mlx_lm")).parent
    tiny.write_hub_stand_in(work / "hub")
    tests = work / "tests"
    shutil.copytree(source / "tests", tests)

    status = 0
    form = version == apply.TARGET
    trees = {}  # the upstream form's trees: way -> the sdist with the first n patches
    if form:
        for n in range(1, len(apply.SERIES) + 1):
            way = (
                "upstream form, patch 1" if n == 1 else f"upstream form, patches 1-{n}"
            )
            trees[way] = work / f"patched-{n}"
            shutil.copytree(source, trees[way])
            run(
                sys.executable,
                ROOT / "upstream" / "apply.py",
                trees[way],
                "--patches",
                n,
            )
        for patch in apply.SERIES:
            print(
                f"{patch.name}: added lines {apply.added_lines(patch)}, budget {apply.BUDGET[patch.name]}"
            )
            if apply.over_budget(patch):
                print(f"{patch.name} is over its budget: {apply.over_budget(patch)}")
                status = 1
    else:
        print(
            f"mlx-lm {version}: the upstream form is written for mlx-lm {apply.TARGET}; not tested here"
        )

    whole = sorted(p.name for p in tests.glob("test_*.py")) if form else TESTS
    runs = {"release": (tests, whole, None), "active": (tests, TESTS, None)}
    for way, tree in trees.items():
        # Run apart from the tree, as the release's are, so test ids match.
        shutil.copytree(tree / "tests", work / f"{tree.name}-tests")
        runs[way] = (work / f"{tree.name}-tests", whole, tree)
    with ThreadPoolExecutor(2) as pool:
        got = {
            way: pool.submit(
                outcomes,
                tree.name if tree else way,
                where,
                work,
                files,
                tree,
                active=way == "active",
            )
            for way, (where, files, tree) in runs.items()
        }
        release = got.pop("release").result()
        ways = {way: (f.result(), runs[way][1]) for way, f in got.items()}
    listed = changed_on_purpose()
    added = {}  # way -> the test ids its tree has and the release has not
    counts = {
        k: sum(1 for o in release.values() if o == k) for k in ("pass", "fail", "skip")
    }
    print(f"mlx-lm {version}, {len(whole)} test files: on the release {counts}")
    for way, (got, files) in ways.items():
        reference = in_files(release, files)
        lost = sorted(
            short(t)
            for t, o in reference.items()
            if o == "pass" and got.get(t) != "pass"
        )
        allowed = listed if way == "active" else set()
        new = {t: o for t, o in got.items() if t not in release}
        print(
            f"{way}: {sum(1 for o in got.values() if o == 'pass')} passed of {len(got)}, {len(new)} added"
        )
        if new:
            print(*sorted(f"  + {short(t)}: {o}" for t, o in new.items()), sep="\n")
        if set(lost) - allowed:
            print(
                f"passing on the release, not {way}:",
                *sorted(set(lost) - allowed),
                sep="\n  ",
            )
            status = 1
        if way in trees and (not new or any(o != "pass" for o in new.values())):
            print(
                f"{way}: its own tests do not all pass:",
                *sorted(f"{t} {o}" for t, o in new.items()),
                sep="\n  ",
            )
            status = 1
        stale = sorted(
            t
            for t in allowed
            if t not in lost and any(short(r) == t for r in reference)
        )
        if stale:
            print("listed in the README as changed, but they pass:", *stale, sep="\n  ")
            status = 1
        if way == "active" and set(lost) & allowed:
            print(
                "changed on purpose (README):", *sorted(set(lost) & allowed), sep="\n  "
            )
        added[way] = set(new)
    if trees and not added_tests_fail_before_their_patch(trees, added, work):
        status = 1
    return status


def added_tests_fail_before_their_patch(trees, added, work):
    """Each patch's added tests fail on the tree before it (the release for
    patch 1): they test what the patch brings."""
    ok, before, known, runs = True, None, set(), {}
    with ThreadPoolExecutor(2) as pool:
        for way, tree in trees.items():
            mine = added[way] - known
            # The patched tree's files that hold them, run against the tree before it.
            files = sorted({t.split(".")[0] + ".py" for t in mine})
            tests = work / f"{tree.name}-tests"
            job = pool.submit(
                outcomes, f"{tree.name}-before", tests, work, files, before
            )
            runs[way] = (mine, job)
            known |= added[way]
            before = tree
    for way, (mine, job) in runs.items():
        got = job.result()
        passing = sorted(short(t) for t in mine if got.get(t) != "fail")
        print(
            f"{way}: {len(mine) - len(passing)} of its {len(mine)} added tests fail without it"
        )
        if not mine:
            print(f"{way}: its patch adds no test of its own")
            ok = False
        elif passing:
            print(
                f"{way}: added tests that do not fail without it:", *passing, sep="\n  "
            )
            ok = False
    return ok


if __name__ == "__main__":
    sys.exit(main())
