"""Which models are MLA, and which caches hold their latent.

Widths say nothing reliable (a latent may be as wide as its RoPE key), so the
installed mlx-lm's model sources are read once for the MLA attention classes and
the cache each writes; ``install()`` wraps their ``__call__`` to mark that cache
(an attribute, so copies keep it). Marked True: an MLA attention wrote it; False:
its model has none; unmarked (bare, or restored from a file): ``is_latent_layout``.
"""

import ast
import functools
import importlib
import inspect
import re
import textwrap
import weakref
from pathlib import Path

from .cache import _PackedLatent, is_latent_layout

MARK = "_mlx_lm_mla_latent"
# The absorbed projections of an MLA attention that attends over its latent;
# DeepSeek-V2 and MiniCPM3 expand the latent to per-head K/V and have neither.
_LATENT_FIELDS = {"kv_lora_rank", "embed_q"}

# {attention class: None for the cache it is handed, or its CacheList member}.
ATTENTION = {}


def self_fields(tree):
    """Every name assigned as ``self.<name>`` in an AST node (tuple targets too)."""
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }


_DEFS = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


@functools.lru_cache(maxsize=None)
def source_tree(path):
    """The parsed source of a file, parsed once (the contract reads it too)."""
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read())


def definition(obj):
    """The ``class`` or ``def`` of ``obj`` in its module's source, or None."""
    try:
        node = source_tree(inspect.getsourcefile(obj))
    except (TypeError, OSError, SyntaxError):
        return None
    for part in getattr(obj, "__qualname__", "<none>").split("."):
        node = next(
            (n for n in node.body if isinstance(n, _DEFS) and n.name == part), None
        )
        if node is None:
            return None
    return node


def _written(call, name):
    """What ``call`` writes through ``name``: None for ``name.update_and_fetch``,
    i for ``name[i].update_and_fetch``."""
    found = set()
    for node in ast.walk(call):
        if not (isinstance(node, ast.Attribute) and node.attr == "update_and_fetch"):
            continue
        target = node.value
        if isinstance(target, ast.Name) and target.id == name:
            found.add(None)
        elif (
            isinstance(target, ast.Subscript)
            and isinstance(target.value, ast.Name)
            and target.value.id == name
            and isinstance(target.slice, ast.Constant)
            and isinstance(target.slice.value, int)
        ):
            found.add(target.slice.value)
    return found


def scan_source(source):
    """{MLA attention class name: the cache it writes}, and those it cannot tell."""
    return _scan(ast.parse(source))


def _scan(tree):
    found, unclear = {}, []
    for cls in tree.body:
        if not isinstance(cls, ast.ClassDef):
            continue
        methods = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}
        init, call = methods.get("__init__"), methods.get("__call__")
        if init is None or call is None or not _LATENT_FIELDS <= self_fields(init):
            continue
        written = _written(call, "cache")
        if len(written) == 1:
            found[cls.name] = written.pop()
        else:
            unclear.append(cls.name)
    return found, unclear


def find_attention(models_dir):
    """[(module, class, member)] of the MLA attentions in a ``models`` folder, and
    [(module, class)] it could not read."""
    found, unclear = [], []
    for path in sorted(Path(models_dir).glob("*.py")):
        source = path.read_text(encoding="utf-8")
        if not all(f in source for f in _LATENT_FIELDS):
            continue
        classes, unknown = _scan(source_tree(str(path)))
        found += [(path.stem, name, member) for name, member in classes.items()]
        unclear += [(path.stem, name) for name in unknown]
    return found, unclear


def sibling_imports(tree):
    """The modules of its own package a source imports: ``from .m import X`` and
    ``from . import m, n`` (the form mistral3 uses)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module is None:
                found.update(alias.name for alias in node.names)
            else:
                found.add(node.module.split(".")[0])
    return found


def model_types(models_dir):
    """{model type: the module of its MLA attention}, wrappers included: a model
    module that imports an MLA one (Kimi-VL imports DeepSeek-V3's). A wrapper may
    build another language model too (mistral3 builds llama, ministral3 or
    mistral4 as its config says): which models are MLA is decided per built
    model, by its layers (``has_latent_attention``)."""
    found, _ = find_attention(models_dir)
    types = {m: m for m, _, _ in found}
    mla_modules = set(types.values())
    if not mla_modules:  # no MLA module for a wrapper to import
        return types
    named = re.compile(r"\b(?:%s)\b" % "|".join(map(re.escape, sorted(mla_modules))))
    for path in sorted(Path(models_dir).glob("*.py")):
        if path.stem in types:
            continue
        # Parsed only where an MLA module is named: a parse of every model
        # file would cost a second at every import of mlx_lm.
        text = path.read_text(encoding="utf-8")
        if not named.search(text):
            continue
        try:
            imported = sibling_imports(source_tree(str(path)))
        except SyntaxError:  # not a model mlx-lm can import either
            continue
        inner = sorted(imported & mla_modules)
        if inner:
            types[path.stem] = inner[0]
    return dict(sorted(types.items()))


def calls(cls, name):
    """Whether ``cls.__call__`` calls the global function ``name``."""
    node = definition(cls)
    if node is None:  # a class made at run time: read its own source
        try:
            node = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
        except (OSError, TypeError, SyntaxError):
            return False
    call = next(
        (
            f
            for f in node.body
            if isinstance(f, ast.FunctionDef) and f.name == "__call__"
        ),
        None,
    )
    return call is not None and any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == name
        for node in ast.walk(call)
    )


def installed_model_types(package="mlx_lm"):
    models = importlib.import_module(f"{package}.models")
    return model_types(Path(models.__file__).parent)


def load_attention(package="mlx_lm"):
    """``{class: member}`` of the installed MLA attentions, and what failed, by name."""
    models = importlib.import_module(f"{package}.models")
    found, unclear = find_attention(Path(models.__file__).parent)
    classes, problems = {}, [f"{package}.models.{m}.{c}" for m, c in unclear]
    for module_name, name, member in found:
        try:
            module = importlib.import_module(f"{package}.models.{module_name}")
            classes[getattr(module, name)] = member
        except (ImportError, AttributeError) as e:
            problems.append(f"{package}.models.{module_name}.{name} ({e})")
    return classes, problems


def mark(cache, value=True):
    if cache is None or getattr(cache, MARK, None) is value:
        return
    try:
        setattr(cache, MARK, value)
    except AttributeError:  # a cache class with __slots__: the shape rule applies
        pass


def marking_call(original, member):
    """``__call__`` of an MLA attention that marks the cache it writes."""
    names = list(inspect.signature(original).parameters)
    position = names.index("cache") - 1  # the arguments after self

    def __call__(self, *args, **kwargs):
        cache = args[position] if len(args) > position else kwargs.get("cache")
        if cache is not None:
            mark(cache if member is None else cache[member])
        return original(self, *args, **kwargs)

    __call__.mlx_lm_mla_original = original
    return __call__


def is_latent(cache) -> bool:
    if isinstance(cache, _PackedLatent):
        return True
    known = getattr(cache, MARK, None)
    return is_latent_layout(cache) if known is None else known


def carry_mark(sources, target):
    """Marks ``target``, made from ``sources`` (merge, extract), as they were."""
    marks = {getattr(c, MARK, None) for c in sources}
    if True in marks:
        mark(target, True)
    elif marks == {False}:
        mark(target, False)


def latent_modules(layer):
    """The MLA attention modules of one decoder layer (LongCat-Flash has two)."""
    return [m for _, m in layer.named_modules() if type(m) in ATTENTION]


# id(model) -> {name: (its layers' identities, value)}, dropped with the model.
_FOUND = {}


def found_once(model, name, find):
    """``find()``, remembered for ``model`` while the package is installed and
    its layers are the same (pipelining a model keeps only some of them)."""
    if not ATTENTION:
        return find()
    found = _FOUND.get(id(model))
    if found is None:
        found = _FOUND[id(model)] = {}
        weakref.finalize(model, _FOUND.pop, id(model), None)
    layers = tuple(map(id, getattr(model, "layers", None) or ()))
    if name not in found or found[name][0] != layers:
        found[name] = (layers, find())
    return found[name][1]


def latent_layers(model):
    """{layer index: its MLA attention module} of the layers with one (LongCat's
    two-module layers are left out), found once for the layers it has."""

    def find():
        found = {}
        for i, layer in enumerate(getattr(model, "layers", [])):
            mods = latent_modules(layer)
            if len(mods) == 1:
                found[i] = mods[0]
        return found

    return found_once(model, "latent_layers", find)


def has_latent_attention(model) -> bool:
    return found_once(
        model,
        "has_latent",
        lambda: any(latent_modules(layer) for layer in getattr(model, "layers", [])),
    )


def leaves(caches):
    for c in caches:
        inner = getattr(c, "caches", None)
        if isinstance(inner, (list, tuple)):
            yield from leaves(inner)
        else:
            yield c


def mark_model_caches(model, caches):
    """Marks the caches of a model with no MLA attention as holding no latent,
    and an MLA model's as its layers will write them: a cache quantized before
    its first token (``quantized_kv_start=0``) is then known for a latent."""
    # Nothing is known while uninstalled (a wrapper someone bound by name).
    if not (ATTENTION and isinstance(caches, (list, tuple))):
        return caches
    if not has_latent_attention(model):
        for c in leaves(caches):
            if getattr(c, MARK, None) is None:
                mark(c, False)
        return caches
    if len(caches) == len(getattr(model, "layers", [])):  # LongCat-ngram has more
        for i, module in latent_layers(model).items():
            c = caches[i]
            member = ATTENTION[type(module)]
            if member is not None:
                inner = getattr(c, "caches", None)
                ok = isinstance(inner, (list, tuple)) and member < len(inner)
                c = inner[member] if ok else None
            if c is not None and getattr(c, MARK, None) is None:
                mark(c)
    return caches
