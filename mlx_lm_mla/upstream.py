"""The upstream form of the fix: rewrites an mlx-lm source tree in place.

``python -m mlx_lm_mla upstream-patch DIR`` takes the root of an mlx-lm
tree (the folder holding ``mlx_lm/``, e.g. an unpacked release wheel) and:

- appends the part of ``mlx_lm_mla/cache.py`` below its marker line to
  ``mlx_lm/models/cache.py``, so what CI tests at run time is what goes
  upstream;
- gives every MLA model that caches a latent in a plain ``KVCache`` a
  ``LatentKVCache`` from ``make_cache``: a new ``make_cache`` where the model
  has none, ``LatentKVCache()`` for ``KVCache()`` where it has one.

``CacheList`` models (DeepSeek-V3.2, LongCat-Flash) are left alone: mlx-lm
never quantizes a ``CacheList``, so their latent is not at risk.
"""

import argparse
import re
import sys
from pathlib import Path

MARKER = "# --- upstream: appended to mlx_lm/models/cache.py by upstream-patch ---"
SIGNATURE = "LatentKVCache"  # present once the tree is patched
METHOD = """
    def make_cache(self):
        return [LatentKVCache() for _ in self.layers]
"""


class UnknownTree(ValueError):
    pass


def cache_code():
    """The upstream part of this package's cache module."""
    text = (Path(__file__).parent / "cache.py").read_text(encoding="utf-8")
    return text.split(MARKER, 1)[1].lstrip("\n")


def _models(root):
    """(path, source) of each model module whose attention caches a latent
    (absorbed ``embed_q``), or that wraps one (imports from such a module)."""
    models = root / "mlx_lm" / "models"
    sources = {p: p.read_text(encoding="utf-8") for p in sorted(models.glob("*.py"))}
    found = {p for p, s in sources.items() if "kv_lora_rank" in s and "embed_q" in s}
    wrappers = {
        p
        for p, s in sources.items()
        if p not in found and any(f"from .{f.stem} import" in s for f in found)
    }
    return [(p, sources[p]) for p in sorted(found | wrappers)]


def _add_import(source):
    m = re.search(r"^from \.cache import (.+)$", source, re.M)
    if m:
        names = [n.strip() for n in m.group(1).split(",")]
        if not re.search(r"\bKVCache\b", source[m.end() :]):
            names.remove("KVCache")
        line = f"from .cache import {', '.join(sorted(set(names) | {'LatentKVCache'}))}"
        return source[: m.start()] + line + source[m.end() :]
    # In the sorted run of relative imports, as isort places it.
    imports = list(re.finditer(r"^from \.(\w+) import .*(?:\n    .*)*(?:\n\))?$", source, re.M))
    later = [m for m in imports if m.group(1) > "cache"]
    at = later[0].start() if later else imports[-1].end() + 1
    return source[:at] + "from .cache import LatentKVCache\n" + source[at:]


MAKE_CACHE = re.compile(r"^    def make_cache\(self\):\n(?:(?:        .*)?\n)+", re.M)
PLAIN_MODEL = re.compile(r"^class Model\((?:PipelineMixin, )?nn\.Module\):\n", re.M)


def patch_model(source):
    """source with ``LatentKVCache`` from ``make_cache``, or None when there
    is nothing to change: a ``CacheList`` model, or one that inherits its
    ``make_cache``."""
    blocks = [m for m in MAKE_CACHE.finditer(source) if "KVCache()" in m.group(0)]
    if any("CacheList(" in m.group(0) for m in blocks):
        return None
    if blocks:
        for m in reversed(blocks):
            new = m.group(0).replace("KVCache()", "LatentKVCache()")
            source = source[: m.start()] + new + source[m.end() :]
        return _add_import(source)
    model = PLAIN_MODEL.search(source)
    if model is None or MAKE_CACHE.search(source):
        return None
    end = re.search(r"^\S", source[model.end() :], re.M)
    end = model.end() + end.start() if end else len(source)
    body = source[model.end() : end].rstrip("\n") + "\n" + METHOD
    rest = source[end:]
    source = source[: model.end()] + body + ("\n\n" + rest if rest else "")
    return _add_import(source)


def check_tree(root):
    cache = root / "mlx_lm" / "models" / "cache.py"
    if not cache.is_file():
        raise UnknownTree(f"{root} is not an mlx-lm source tree: no mlx_lm/models/cache.py")
    text = cache.read_text(encoding="utf-8")
    for needed in ("class KVCache(", "class BatchKVCache(", "import mlx.core as mx", "import copy"):
        if needed not in text:
            raise UnknownTree(f"{cache} is not mlx-lm's cache module: no {needed!r}")
    if SIGNATURE in text:
        raise UnknownTree(f"{root} is patched already ({cache} has {SIGNATURE})")
    return cache, text


def patch_tree(root):
    """Rewrites the tree at root; returns the files it changed."""
    root = Path(root)
    cache, text = check_tree(root)
    changed = []
    cache.write_text(text.rstrip("\n") + "\n\n\n" + cache_code(), encoding="utf-8")
    changed.append(cache)
    for path, source in _models(root):
        new = patch_model(source)
        if new is not None and new != source:
            path.write_text(new, encoding="utf-8")
            changed.append(path)
    return changed


def main(argv):
    p = argparse.ArgumentParser(
        prog="mlx-lm-mla upstream-patch",
        description="Rewrite an mlx-lm source tree into the upstream form of the fix.",
    )
    p.add_argument("dir", help="the folder that holds mlx_lm/ (e.g. an unpacked wheel)")
    args = p.parse_args(argv)
    try:
        changed = patch_tree(args.dir)
    except UnknownTree as e:
        print(f"upstream-patch: {e}", file=sys.stderr)
        return 2
    for path in changed:
        print(path)
    return 0
