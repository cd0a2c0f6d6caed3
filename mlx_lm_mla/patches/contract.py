"""The private names of mlx-lm (and one of ``http.server``) the package
relies on, each with what it expects of it and why no public hook serves.

``install()`` checks every entry against the installed code before it
applies a patch that needs it (``Patch.needs``); one that does not match is
named in ``missing()``, warned once, and the patches that need it are not
applied, so their feature is off, loudly, never half on.
"""

import ast
import functools
import importlib
import inspect
import sys
from dataclasses import dataclass
from typing import Tuple

from ..mla import self_fields


@dataclass(frozen=True)
class Method:
    """A function or method whose leading parameters are ``params``."""

    params: Tuple[str, ...]


@dataclass(frozen=True)
class Field:
    """An instance attribute: assigned as ``self.<name>`` in the class's
    source; with ``methods``, on an instance made with no arguments, an
    object that has those methods."""

    methods: Tuple[str, ...] = ()


@dataclass(frozen=True)
class Calls:
    """A module global holding the module ``module``, through which the
    same module's ``function`` makes each of ``calls`` (dotted names; a
    leading dot: that method of any object)."""

    module: str
    function: str
    calls: Tuple[str, ...]


@dataclass(frozen=True)
class Private:
    module: str
    name: str  # "Class.attribute" or "function"
    expects: object  # Method, Field or Calls
    why: str  # why no public hook serves

    @property
    def label(self):
        return f"{self.module}.{self.name}"


_TOKENIZE = Method(("self", "tokenizer", "request", "args"))

PRIVATE = (
    Private("mlx_lm.models.cache", "LRUPromptCache._trie", Field(("search", "get", "pop")),
            "the reuse guard checks every candidate entry before fetch_nearest_cache picks one"),
    Private("mlx_lm.models.cache", "LRUPromptCache._lru", Field(("remove",)),
            "a bad entry is evicted; LRUPromptCache can only trim by size"),
    Private("mlx_lm.models.cache", "LRUPromptCache._n_bytes", Field(),
            "evicting an entry keeps the store's byte count true"),
    Private("mlx_lm.models.cache", "LRUPromptCache._n_bytes_by_type", Field(),
            "evicting an entry keeps the store's byte count per type true"),
    Private("mlx_lm.generate", "BatchGenerator._next", Method(("self",)),
            "the one step of BatchGenerator after which its caches can be quantized"),
    Private("mlx_lm.generate", "BatchGenerator._prompt_batch", Field(),
            "the caches of the rows being prefilled"),
    Private("mlx_lm.generate", "BatchGenerator._generation_batch", Field(),
            "the caches of the rows being decoded"),
    Private("mlx_lm.server", "ResponseGenerator._is_batchable", Method(("self", "args")),
            "upstream refuses to batch under --kv-bits; MLA models can"),
    Private("mlx_lm.server", "ResponseGenerator._tokenize", _TOKENIZE,
            "a request is checked once its tokens are known, before it joins a batch"),
    Private("mlx_lm.server", "ResponseGenerator._next_request", Method(("self", "timeout")),
            "the open requests are tracked, to answer them if the loop fails"),
    Private("mlx_lm.server", "ResponseGenerator._generate", Method(("self",)),
            "the generation loop is restarted after a failure"),
    Private("mlx_lm.server", "ResponseGenerator._stop", Field(),
            "a restarted loop ends when the server stops"),
    Private("mlx_lm.server", "_make_sampler", Method(("args", "tokenizer")),
            "a request's sampler is built by the server's own builder to validate it"),
    Private("mlx_lm.server", "_make_logits_processors", Method(("args",)),
            "a request's logits processors, likewise"),
    Private("mlx_lm.server", "argparse",
            Calls("argparse", "main", ("argparse.ArgumentParser", ".parse_args")),
            "main() makes its parser and reads the command line in one call; "
            "flags join mlx-lm's own only through the parser class it makes"),
    Private("mlx_lm.server", "APIHandler._set_completion_headers", Method(("self", "status_code")),
            "upstream answers every error of generate() with 404"),
    Private("mlx_lm.models.base", "scaled_dot_product_attention",
            Method(("queries", "keys", "values", "cache", "scale", "mask", "sinks")),
            "an MLA model's decode attention is this function of its module"),
    Private("mlx_lm.tokenizer_utils", "TokenizerWrapper._tokenizer", Field(),
            "the vocabulary size where the model's config does not give one"),
    Private("http.server", "BaseHTTPRequestHandler._headers_buffer", Field(),
            "a buffered 200 is dropped so a failed request gets one 500"),
)
BY_LABEL = {p.label: p for p in PRIVATE}


def _resolve(module, dotted):
    owner = importlib.import_module(module)
    for part in dotted.split("."):
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    return owner


@functools.lru_cache(maxsize=None)
def _fields(module_name, class_name):
    """The names a top-level class of a module assigns as ``self.<name>``,
    read from the module's source once."""
    try:
        tree = ast.parse(inspect.getsource(sys.modules[module_name]))
    except (KeyError, OSError, TypeError, SyntaxError):
        return frozenset()
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return frozenset(self_fields(node))
    return frozenset()


def _assigned(cls, name):
    # Whether the class's own source assigns self.<name>.
    return cls.__qualname__ == cls.__name__ and name in _fields(cls.__module__, cls.__name__)


def _dotted(node):
    # "a.b.c" of an attribute chain on a name; ".c" where it starts elsewhere.
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([getattr(node, "id", ""), *parts[::-1]])


def _calls_problem(entry):
    expects, module = entry.expects, importlib.import_module(entry.module)
    value = getattr(module, entry.name, None)
    wanted = importlib.import_module(expects.module)
    if getattr(value, "mlx_lm_mla_original", value) is not wanted:
        return f"not the {expects.module} module"
    try:
        tree = ast.parse(inspect.getsource(getattr(module, expects.function)))
    except (AttributeError, OSError, TypeError, SyntaxError):
        return f"{expects.function}() not found"
    made = {_dotted(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    lacking = [c for c in expects.calls
               if not any(m == c or c[0] == "." and m.endswith(c) for m in made)]
    if lacking:
        return f"{expects.function}() makes no call to {', '.join(lacking)}"
    return None


def problem(entry):
    """Why the installed code does not meet ``entry``, or None."""
    owner_path, _, name = entry.name.rpartition(".")
    expects = entry.expects
    if isinstance(expects, Calls):
        return _calls_problem(entry)
    if isinstance(expects, Method):
        found = _resolve(entry.module, entry.name)
        if not callable(found):
            return "not found"
        params = tuple(inspect.signature(found).parameters)
        if params[: len(expects.params)] != expects.params:
            return f"takes ({', '.join(params)}), expected ({', '.join(expects.params)}, ...)"
        return None
    cls = _resolve(entry.module, owner_path)
    if not isinstance(cls, type) or not _assigned(cls, name):
        return "not found"
    if expects.methods:
        value = getattr(cls(), name, None)
        lacking = [m for m in expects.methods if not callable(getattr(value, m, None))]
        if lacking:
            return f"has no {', '.join(lacking)}"
    return None
