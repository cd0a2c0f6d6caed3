"""Applies the upstream form of the fix, a series of patches for mlx-lm, in
order, to an mlx-lm source tree:

    python upstream/apply.py DIR [--patches N] [--check]

The series (``SERIES``): 1, the fix (``MLALatentCache`` from the MLA models'
``make_cache``); 2, its batch variant (``BatchQuantizedMLALatentCache``,
batching under ``kv_bits``). ``--patches 1`` applies the first alone; the
default, all.

DIR holds ``mlx_lm/`` of mlx-lm ``TARGET`` (an unpacked sdist or wheel, or a
git checkout at that tag). Where DIR also holds mlx-lm's ``tests/`` (the
sdist and the checkout do), each patch's tests are added to them. A tree
that has the first patches already takes the rest. A tree of another
release, one that has the patches asked for already, or one whose files are
not the release's is refused by name and left as it was. ``--check`` only
says whether the patches fit.
"""

import argparse
import ast
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TARGET = "0.32.2"  # the newest mlx-lm release, which the series is written against
HERE = Path(__file__).resolve().parent
SERIES = [HERE / "1-mla-latent-cache.patch", HERE / "2-batch-mla-latent-cache.patch"]
# Added lines each patch may take under each top folder, blank ones too (the
# fix is held to 200 under mlx_lm/; the tests' bound only keeps them lean).
BUDGET = {
    SERIES[0].name: {"mlx_lm": 200, "tests": 240},
    SERIES[1].name: {"mlx_lm": 200, "tests": 240},
}


class UnfitTree(ValueError):
    pass


def release(root):
    """The ``__version__`` that ``mlx_lm/_version.py`` under root assigns."""
    tree = ast.parse(
        (Path(root) / "mlx_lm" / "_version.py").read_text(encoding="utf-8")
    )
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) == "__version__" for t in node.targets
        ):
            return ast.literal_eval(node.value)
    return None


def added_lines(patch):
    """Lines a patch adds under each top folder (``mlx_lm``, ``tests``)."""
    added, top = {}, None
    for line in Path(patch).read_text(encoding="utf-8").splitlines():
        if line.startswith("+++ "):
            top = line[4:].split("/")[1]
            added.setdefault(top, 0)
        elif line.startswith("+"):
            added[top] += 1
    return added


def over_budget(patch):
    """The folders where a patch adds more lines than its budget allows."""
    budget = BUDGET[Path(patch).name]
    return {k: n for k, n in added_lines(patch).items() if n > budget.get(k, 0)}


def _git_apply(root, patch, *args):
    # GIT_CEILING_DIRECTORIES: a repository around DIR must not re-root the paths.
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(Path(root).resolve().parent))
    return subprocess.run(
        ["git", "apply", *args, str(patch)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    )


def _errors(out):
    return "; ".join(
        line.removeprefix("error: ")
        for line in out.stderr.splitlines()
        if line.startswith("error:")
    )


def _names(patches):
    return " and ".join(f"patch {SERIES.index(p) + 1} ({p.name})" for p in patches)


def _has(root, scope):
    """How many patches of the series the tree has: the last one it has
    applies in reverse."""
    return next(
        (
            n
            for n in range(len(SERIES), 0, -1)
            if _git_apply(
                root, SERIES[n - 1], "--check", "--reverse", *scope
            ).returncode
            == 0
        ),
        0,
    )


def _fits(root, patches, scope):
    """Applies the patches in order to a copy of the tree; the first that
    does not apply, and why, or None."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "tree"
        for top in ("mlx_lm", "tests"):
            if (root / top).is_dir():
                shutil.copytree(
                    root / top, copy / top, ignore=shutil.ignore_patterns("__pycache__")
                )
        for patch in patches:
            out = _git_apply(copy, patch, *scope)
            if out.returncode != 0:
                return patch, _errors(out)
    return None


def apply(root, patches=len(SERIES), check=False):
    """Applies the first ``patches`` patches of the series to the tree at root
    (only checks, with check); returns the files they change. Raises
    UnfitTree, naming why, and then leaves the tree as it was."""
    root = Path(root)
    if not 1 <= patches <= len(SERIES):
        raise UnfitTree(f"the series has patches 1 to {len(SERIES)}, not {patches}")
    if not (root / "mlx_lm" / "_version.py").is_file():
        raise UnfitTree(
            f"{root} is not an mlx-lm source tree: it has no mlx_lm/_version.py"
        )
    version = release(root)
    if version != TARGET:
        raise UnfitTree(
            f"{root} is mlx-lm {version}; the change is written for mlx-lm {TARGET}"
        )
    scope = [] if (root / "tests").is_dir() else ["--include=mlx_lm/*"]
    have = _has(root, scope)
    if have >= patches:
        raise UnfitTree(f"{root} has {_names(SERIES[:have])} already")
    todo = SERIES[have:patches]
    failed = _fits(root, todo, scope)
    if failed is not None:
        base = (
            f"mlx-lm {TARGET} as released"
            if have == 0
            else f"mlx-lm {TARGET} with {_names(SERIES[:have])}"
        )
        raise UnfitTree(f"{root} is not {base}: {_names([failed[0]])}: {failed[1]}")
    changed = []
    for patch in todo:
        changed += [
            root / line.split("\t")[2]
            for line in _git_apply(root, patch, "--numstat", *scope).stdout.splitlines()
            if line
        ]
    if not check:
        for i, patch in enumerate(todo):
            done = _git_apply(root, patch, *scope)
            if (
                done.returncode != 0
            ):  # fitted a copy just above: only a tree changed meanwhile
                for undo in reversed(todo[:i]):
                    _git_apply(root, undo, "--reverse", *scope)
                raise UnfitTree(f"{root}: git apply failed: {done.stderr.strip()}")
    return sorted(set(changed))


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="upstream/apply.py", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("dir", help=f"the folder that holds mlx_lm/ of mlx-lm {TARGET}")
    p.add_argument(
        "--patches",
        type=int,
        default=len(SERIES),
        metavar="N",
        help=f"apply the first N patches of the series (default: all {len(SERIES)})",
    )
    p.add_argument(
        "--check", action="store_true", help="only say whether the patches fit"
    )
    args = p.parse_args(argv)
    try:
        changed = apply(args.dir, patches=args.patches, check=args.check)
    except UnfitTree as e:
        print(f"upstream/apply.py: {e}", file=sys.stderr)
        return 2
    print(*changed, sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
