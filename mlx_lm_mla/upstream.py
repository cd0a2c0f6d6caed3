"""The upstream form of the fix: rewrites an mlx-lm source tree in place.

``python -m mlx_lm_mla upstream-patch DIR`` takes the root of an mlx-lm 0.32
tree (the folder holding ``mlx_lm/``: an unpacked wheel or sdist) and:

- appends the code below the marker line of ``upstream_cache.py`` to
  ``mlx_lm/models/cache.py`` (``LatentKVCache``, ``QuantizedLatentKVCache``,
  ``LatentCacheList``), and lets ``make_prompt_cache`` pass ``max_kv_size``
  to a model whose ``make_cache`` takes it;
- gives every MLA model (an attention with ``kv_lora_rank`` and the absorbed
  ``embed_q``, or a model wrapping one) a ``make_cache(max_kv_size=None)``
  whose latent caches are ``LatentKVCache``s, in a ``LatentCacheList`` where
  the model keeps a ``CacheList`` (a DSA indexer's keys stay ``KVCache``);
- where DIR holds mlx-lm's tests (the sdist does), adds the test cases of
  ``upstream_tests.py`` to ``tests/test_prompt_cache.py`` and
  ``tests/test_models.py``.

A tree it does not recognise, an older release, or one patched already is
refused by name.
"""

import argparse
import difflib
import re
import sys
from pathlib import Path

from packaging.version import Version

from . import mla

HERE = Path(__file__).parent
MARKER = "# --- upstream: "
SIGNATURE = "class LatentKVCache("  # present once the tree is patched
OLDEST = Version("0.32.0")  # state without meta_state; older trees are refused
BUDGET = {"mlx_lm": 250, "tests": 200}  # added lines the change may take, blank ones too

MAKE_PROMPT_CACHE = (
    (
        "If provided and the model does not have a\n"
        "            ``make_cache`` method, a ``RotatingKVCache`` is used with a maximum\n"
        "            size of ``max_kv_size``",
        "If provided, a ``RotatingKVCache`` of this\n"
        "            size is used, unless the model has a ``make_cache`` that does\n"
        "            not take ``max_kv_size``",
    ),
    (
        "    if hasattr(model, \"make_cache\"):\n"
        "        return model.make_cache()\n"
        "\n"
        "    num_layers = len(model.layers)\n"
        "    if max_kv_size is not None:\n"
        "        return [\n"
        "            RotatingKVCache(max_size=max_kv_size, keep=4) for _ in range(num_layers)\n"
        "        ]\n"
        "    else:\n"
        "        return [KVCache() for _ in range(num_layers)]\n",
        "    if hasattr(model, \"make_cache\"):\n"
        "        # A model that knows its caches (MLA models do) sizes them itself.\n"
        "        if \"max_kv_size\" in inspect.signature(model.make_cache).parameters:\n"
        "            return model.make_cache(max_kv_size=max_kv_size)\n"
        "        return model.make_cache()\n"
        "    return [make_kv_cache(max_kv_size) for _ in model.layers]\n",
    ),
    ("import copy\n", "import copy\nimport inspect\n"),
)

METHOD = """
    def make_cache(self, max_kv_size=None):
        return [make_latent_cache(max_kv_size) for _ in self.layers]
"""

INDEXER_NOTE = "# The indexer's keys stay exact: they pick the tokens attended.\n"


class UnknownTree(ValueError):
    pass


def applies(version):
    """Whether upstream-patch writes the change for this mlx-lm version."""
    return Version(str(version)) >= OLDEST


def added_lines(original, patched, under):
    """Lines added to the .py files under ``under`` (blank lines counted)."""
    added = 0
    for new in sorted((Path(patched) / under).rglob("*.py")):
        old = Path(original) / new.relative_to(patched)
        a = old.read_text(encoding="utf-8").splitlines() if old.exists() else []
        diff = difflib.unified_diff(a, new.read_text(encoding="utf-8").splitlines(), lineterm="", n=0)
        added += sum(1 for line in diff if line.startswith("+") and not line.startswith("+++"))
    return added


def sections(name):
    """The parts of ``name`` (a file of this package) after each marker
    line, keyed by the rest of that line."""
    text = (HERE / name).read_text(encoding="utf-8")
    parts = re.split(r"^" + re.escape(MARKER) + r"(.*) ---\n", text, flags=re.M)
    return {parts[i]: parts[i + 1].strip("\n") + "\n" for i in range(1, len(parts), 2)}


def cache_code():
    """The code appended to mlx_lm/models/cache.py."""
    return sections("upstream_cache.py")["appended to mlx_lm/models/cache.py by upstream-patch"]


def _models(root):
    """(path, source) of each MLA model module of the tree, as ``mla.py``
    finds them: an attention that caches a latent, or a model wrapping one."""
    models = root / "mlx_lm" / "models"
    paths = [models / f"{name}.py" for name in mla.model_types(models)]
    return [(p, p.read_text(encoding="utf-8")) for p in paths]


def add_import(source, names, module=r"\.cache"):
    """source with ``names`` in its ``from <module> import`` line or block
    (sorted as isort does), or in a new line among the relative imports."""
    m = re.search(rf"^from {module} import (\(\n(?:    .*\n)+\)|.+)$", source, re.M)
    if m:
        old = [n.strip() for n in m.group(1).strip("()").replace("\n", " ").split(",")]
        new = sorted(set(filter(None, old)) | set(names), key=lambda n: (n[:1].islower(), n))
        line = f"from {module.replace(chr(92), '')} import {', '.join(new)}"
        if len(line) > 88 or m.group(1).startswith("("):
            line = line.split(" import ")[0] + " import (\n" + "".join(f"    {n},\n" for n in new) + ")"
        return source[: m.start()] + line + source[m.end() :]
    # In the sorted run of relative imports, as isort places it.
    imports = list(re.finditer(r"^from \.(\w+) import .*(?:\n    .*)*(?:\n\))?$", source, re.M))
    later = [m for m in imports if m.group(1) > "cache"]
    at = later[0].start() if later else imports[-1].end() + 1
    return source[:at] + f"from .cache import {', '.join(sorted(names))}\n" + source[at:]


def _drop_unused(source, unused):
    m = re.search(r"^from \.cache import (.+)$", source, re.M)
    rest = source[m.end() :]
    names = [n for n in m.group(1).split(", ") if n not in unused or re.search(rf"\b{n}\b", rest)]
    return source[: m.start()] + f"from .cache import {', '.join(names)}" + rest


MAKE_CACHE = re.compile(r"^    def make_cache\(self\):\n(?:(?:        .*)?\n)+", re.M)
PLAIN_MODEL = re.compile(r"^class Model\((?:PipelineMixin, )?nn\.Module\):\n", re.M)
CACHE_LIST = re.compile(
    r"return (?P<pre>(?:\[\w+\(size=\d+\)\] \+ )?)\[\s*"
    r"CacheList\(KVCache\(\), KVCache\(\)\) for _ in (?P<layers>[\w.]+)\s*\]"
)


def _cache_list(m, indexer):
    """The return of a ``make_cache`` with a ``LatentCacheList`` per layer."""
    second = "make_kv_cache" if indexer else "make_latent_cache"
    args = f"make_latent_cache(max_kv_size), {second}(max_kv_size)"
    item = f"            LatentCacheList({args})\n"
    if len(item) > 89:
        item = f"            LatentCacheList(\n                {args}\n            )\n"
    text = f"return {m['pre']}[\n{item}            for _ in {m['layers']}\n        ]"
    return (INDEXER_NOTE + "        " if indexer else "") + text


def patch_model(path, source):
    """source with latent caches from ``make_cache(max_kv_size=None)``, or
    None when there is nothing to change (it inherits its ``make_cache``)."""
    blocks = list(MAKE_CACHE.finditer(source))
    for m in reversed(blocks):
        block = m.group(0).replace("(self):", "(self, max_kv_size=None):", 1)
        block = block.replace(".make_cache()", ".make_cache(max_kv_size)")
        if "CacheList(" in block:
            indexer = "self.indexer(" in source
            block, n = CACHE_LIST.subn(lambda c: _cache_list(c, indexer), block)
            if n != 1:
                raise UnknownTree(f"{path}: a make_cache with a CacheList of another form")
        else:
            block = block.replace("KVCache()", "make_latent_cache(max_kv_size)")
        if "max_kv_size)" not in block:
            raise UnknownTree(f"{path}: a make_cache with no KVCache() to change")
        source = source[: m.start()] + block + source[m.end() :]
    if blocks:
        names = {"LatentCacheList", "make_kv_cache", "make_latent_cache"}
        source = add_import(source, {n for n in names if n + "(" in source})
        return _drop_unused(source, ("KVCache", "CacheList"))
    model = PLAIN_MODEL.search(source)
    if model is None:
        return None
    end = re.search(r"^\S", source[model.end() :], re.M)
    end = model.end() + end.start() if end else len(source)
    body = source[model.end() : end].rstrip("\n") + "\n" + METHOD
    rest = source[end:]
    source = source[: model.end()] + body + ("\n\n" + rest if rest else "")
    return add_import(source, {"make_latent_cache"})


def _version(root):
    text = (root / "mlx_lm" / "_version.py").read_text(encoding="utf-8")
    m = re.search(r"__version__ = [\"']([^\"']+)[\"']", text)
    return Version(m.group(1)) if m else None


def check_tree(root):
    cache = root / "mlx_lm" / "models" / "cache.py"
    if not cache.is_file() or not (root / "mlx_lm" / "_version.py").is_file():
        raise UnknownTree(f"{root} is not an mlx-lm source tree: no mlx_lm/models/cache.py")
    text = cache.read_text(encoding="utf-8")
    if SIGNATURE in text:
        raise UnknownTree(f"{root} is patched already ({cache} has {SIGNATURE!r})")
    version = _version(root)
    if version is None or not applies(version):
        raise UnknownTree(
            f"{root} is mlx-lm {version}: upstream-patch writes the change for mlx-lm "
            f"{OLDEST.major}.{OLDEST.minor} and later (0.31's caches have a meta_state)"
        )
    for old, _ in MAKE_PROMPT_CACHE:
        if text.count(old) != 1:
            raise UnknownTree(f"{cache} is not mlx-lm {version}'s cache module: no {old.splitlines()[0]!r}")
    return cache, text


# The names each test file's added cases import from mlx_lm.models.cache.
TEST_IMPORTS = {
    "test_prompt_cache.py": {"LatentCacheList", "LatentKVCache", "QuantizedLatentKVCache"},
    "test_models.py": {"LatentKVCache", "QuantizedLatentKVCache"},
}


def _tests(root):
    """(path, new source) of mlx-lm's test files with the added cases, if
    root holds them."""
    code = sections("upstream_tests.py")
    changed = []
    for name, names in TEST_IMPORTS.items():
        path = root / "tests" / name
        if not path.is_file():
            continue
        source = add_import(path.read_text(encoding="utf-8"), names, r"mlx_lm\.models\.cache")
        main = source.rfind('\nif __name__ == "__main__":')
        if main < 0:
            raise UnknownTree(f"{path} has no unittest main block")
        added = code[f"added to tests/{name} by upstream-patch"]
        changed.append((path, source[:main].rstrip("\n") + "\n\n\n" + added + "\n" + source[main:]))
    return changed


def patch_tree(root):
    """Rewrites the tree at root; returns the files it changed."""
    root = Path(root)
    cache, text = check_tree(root)
    for old, new in MAKE_PROMPT_CACHE:
        text = text.replace(old, new)
    changed = [(cache, text.rstrip("\n") + "\n\n\n" + cache_code())]
    for path, source in _models(root):
        new = patch_model(path, source)
        if new is not None and new != source:
            changed.append((path, new))
    changed += _tests(root)
    for path, new in changed:  # written once every file is known to patch
        path.write_text(new, encoding="utf-8")
    return [path for path, _ in changed]


def main(argv):
    p = argparse.ArgumentParser(
        prog="mlx-lm-mla upstream-patch",
        description="Rewrite an mlx-lm source tree into the upstream form of the fix.",
    )
    p.add_argument("dir", help="the folder that holds mlx_lm/ (an unpacked wheel or sdist)")
    args = p.parse_args(argv)
    try:
        changed = patch_tree(args.dir)
    except UnknownTree as e:
        print(f"upstream-patch: {e}", file=sys.stderr)
        return 2
    for path in changed:
        print(path)
    return 0
