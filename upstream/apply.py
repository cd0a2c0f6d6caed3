"""Applies the upstream form of the fix, ``mla-latent-cache.patch``, to an
mlx-lm source tree:

    python upstream/apply.py DIR [--check]

DIR holds ``mlx_lm/`` of mlx-lm ``TARGET`` (an unpacked sdist or wheel, or a
git checkout at that tag). Where DIR also holds mlx-lm's ``tests/`` (the
sdist and the checkout do), the change's tests are added to them. A tree of
another release, one patched already, or one whose files are not the
release's is refused by name and left as it was. ``--check`` only says
whether the change fits.
"""

import argparse
import ast
import os
import subprocess
import sys
from pathlib import Path

TARGET = "0.32.2"  # the newest mlx-lm release, which the patch is written against
PATCH = Path(__file__).with_name("mla-latent-cache.patch")
BUDGET = {"mlx_lm": 300, "tests": 250}  # added lines the change may take, blank ones too


class UnfitTree(ValueError):
    pass


def release(root):
    """The ``__version__`` that ``mlx_lm/_version.py`` under root assigns."""
    tree = ast.parse((Path(root) / "mlx_lm" / "_version.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
            return ast.literal_eval(node.value)
    return None


def added_lines(patch=PATCH):
    """Lines the patch adds under each top folder (``mlx_lm``, ``tests``)."""
    added, top = {}, None
    for line in Path(patch).read_text(encoding="utf-8").splitlines():
        if line.startswith("+++ "):
            top = line[4:].split("/")[1]
            added.setdefault(top, 0)
        elif line.startswith("+"):
            added[top] += 1
    return added


def _git_apply(root, *args):
    # GIT_CEILING_DIRECTORIES: a repository around DIR must not re-root the paths.
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(Path(root).resolve().parent))
    return subprocess.run(["git", "apply", *args, str(PATCH)], cwd=root, env=env, capture_output=True, text=True)


def apply(root, check=False):
    """Applies the change to the tree at root (only checks, with check);
    returns the files it changes. Raises UnfitTree, naming why."""
    root = Path(root)
    if not (root / "mlx_lm" / "_version.py").is_file():
        raise UnfitTree(f"{root} is not an mlx-lm source tree: it has no mlx_lm/_version.py")
    version = release(root)
    if version != TARGET:
        raise UnfitTree(f"{root} is mlx-lm {version}; the change is written for mlx-lm {TARGET}")
    scope = [] if (root / "tests").is_dir() else ["--include=mlx_lm/*"]
    if _git_apply(root, "--check", "--reverse", *scope).returncode == 0:
        raise UnfitTree(f"{root} has the change already")
    fits = _git_apply(root, "--check", *scope)
    if fits.returncode != 0:
        why = [l.removeprefix("error: ") for l in fits.stderr.splitlines() if l.startswith("error:")]
        raise UnfitTree(f"{root} is not mlx-lm {TARGET} as released: " + "; ".join(why))
    changed = _git_apply(root, "--numstat", *scope).stdout.split("\n")
    if not check:
        done = _git_apply(root, *scope)
        if done.returncode != 0:  # checked just above: only a tree changed meanwhile
            raise UnfitTree(f"{root}: git apply failed: {done.stderr.strip()}")
    return [root / line.split("\t")[2] for line in changed if line]


def main(argv=None):
    p = argparse.ArgumentParser(prog="upstream/apply.py", description=__doc__.split("\n\n")[0])
    p.add_argument("dir", help=f"the folder that holds mlx_lm/ of mlx-lm {TARGET}")
    p.add_argument("--check", action="store_true", help="only say whether the change fits")
    args = p.parse_args(argv)
    try:
        changed = apply(args.dir, check=args.check)
    except UnfitTree as e:
        print(f"upstream/apply.py: {e}", file=sys.stderr)
        return 2
    print(*changed, sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
