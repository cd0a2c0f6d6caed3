"""The contract is complete: every name the package's source reads on mlx-lm's
modules, classes, models, model arguments, attention layers, caches and returned
tuples is a contract row (patches/contract.py) or a target the patch table
replaces, found by reading every module under mlx_lm_mla/.

How a read is recognised: a name bound by ``import mlx_lm...``, ``sys.modules``
or ``importlib.import_module`` of an mlx-lm module; the parameters of every
replacement the patch table installs (its ``self`` is the patched class, the
others what the original takes: ``HOLDS`` says what that is); what a read or a
call on those gives (``HOLDS`` again, else the read's own label, so a read on an
undeclared value fails by its chain); the package's own functions and
methods (a method only one of its classes has, on a value of unknown kind),
whose parameters take what their callers pass; the ``self`` of a class that
subclasses mlx-lm's (or is mixed into one). A read is ``x.name``, ``getattr``/``hasattr`` with a string, an item
by position (``x[0]``, ``x[1:]``, tuple unpacking), or iterating a list of them.
"""

import ast
import importlib
import importlib.util
import inspect
import re
from pathlib import Path

import mlx.nn as nn
import pytest

import mlx_lm_mla
from mlx_lm_mla import mla, patches
from mlx_lm_mla.patches import contract

PACKAGE = Path(mlx_lm_mla.__file__).parent

# What an mlx-lm value holds, where the package reads on it: another label, a
# list of one ("list:..."), or None for plain data (arrays, dicts, numbers).
# "<cache>" is a layer cache of any class, "<model>" any mlx-lm model.
CACHE, SERVER = "mlx_lm.models.cache", "mlx_lm.server"
_LRU = f"{CACHE}.LRUPromptCache"
_DATA = {
    f"{CACHE}.{cls}.{field}": None
    for cls in ("KVCache", "BatchKVCache", "RotatingKVCache")
    for field in ("keys", "values", "offset")
}
_DATA.update({f"<cache>.{field}": None for field in ("keys", "values", "offset")})
HOLDS = {
    **_DATA,
    "<model>.args": "<model-args>",
    "<model>.layers": "list:",
    "<model>.language_model": "<model>",  # a wrapper's (mistral3)
    "<model-args>.max_position_embeddings": None,
    "<model-args>.vocab_size": None,
    "<model-args>.rope_scaling": None,
    "<model-args>.rope_parameters": None,
    "<model-args>.text_config": "<model-args>",
    "<cache>.caches": "list:<cache>",
    "<cache>[]": "<cache>",  # a CacheList's member, by its __getitem__
    "<cache>.state": None,
    "<attention>.kv_lora_rank": None,
    "<attention>.qk_rope_head_dim": None,
    "<mla>.scaled_dot_product_attention(queries)": None,
    "<mla>.scaled_dot_product_attention(keys)": None,
    "<mla>.scaled_dot_product_attention(values)": None,
    "<mla>.scaled_dot_product_attention(cache)": "<cache>",
    "<mla>.scaled_dot_product_attention(scale)": None,
    "<mla>.scaled_dot_product_attention(mask)": None,
    "<mla>.__call__(x)": None,  # MultiLinear's input and output: arrays
    "<mla>.__call__()": None,
    "mlx_lm.load()[0]": "<model>",
    "mlx_lm.load()[1]": None,
    f"{CACHE}.make_prompt_cache(model)": "<model>",
    f"{CACHE}.make_prompt_cache()": "list:<cache>",
    f"{CACHE}.save_prompt_cache(file_name)": None,
    f"{CACHE}.save_prompt_cache(cache)": "list:<cache>",
    f"{CACHE}.load_prompt_cache(file_name)": None,
    f"{CACHE}.load_prompt_cache()[0]": "list:<cache>",
    f"{CACHE}.load_prompt_cache()[1]": None,
    f"{CACHE}.BatchKVCache.merge(caches)": "list:<cache>",
    f"{CACHE}.BatchKVCache.merge()": f"{CACHE}.BatchKVCache",
    f"{CACHE}.BatchKVCache.extend(other)": "<cache>",
    f"{CACHE}.BatchKVCache.extend()": None,
    f"{CACHE}.BatchKVCache.extract(idx)": None,
    f"{CACHE}.BatchKVCache.extract()": f"{CACHE}.KVCache",
    f"{CACHE}.BatchRotatingKVCache.merge(caches)": "list:<cache>",
    f"{CACHE}.KVCache.to_quantized(group_size)": None,
    f"{CACHE}.KVCache.to_quantized(bits)": None,
    f"{CACHE}.KVCache.to_quantized()": "<cache>",
    f"{CACHE}.CacheList.caches": "list:<cache>",
    f"{CACHE}.KVCache.state": None,
    f"{CACHE}.KVCache.meta_state": None,
    f"{CACHE}.KVCache.nbytes": None,
    f"{CACHE}.BatchKVCache.nbytes": None,
    f"{_LRU}.fetch_nearest_cache(model)": None,  # the model's key
    f"{_LRU}.fetch_nearest_cache(tokens)": None,
    f"{_LRU}.fetch_nearest_cache()[0]": "list:<cache>",
    f"{_LRU}.fetch_nearest_cache()[1]": None,
    f"{_LRU}.insert_cache(model)": None,
    f"{_LRU}.insert_cache(tokens)": None,
    f"{_LRU}.insert_cache(prompt_cache)": "list:<cache>",
    f"{_LRU}._trie": f"{CACHE}.PromptTrie",
    f"{_LRU}._lru": f"{_LRU}.CacheOrder",
    f"{_LRU}._n_bytes": None,
    f"{_LRU}._n_bytes_by_type": None,
    f"{CACHE}.PromptTrie.search()": f"{CACHE}.PromptTrieResult",
    f"{CACHE}.PromptTrie.get()": f"{_LRU}.CacheEntry",
    f"{CACHE}.PromptTrie.pop()": f"{_LRU}.CacheEntry",
    f"{CACHE}.PromptTrieResult.exact": None,
    f"{CACHE}.PromptTrieResult.shorter": None,
    f"{CACHE}.PromptTrieResult.longer": None,
    f"{_LRU}.CacheEntry.prompt_cache": "list:<cache>",
    f"{_LRU}.CacheEntry.nbytes": None,
    f"{_LRU}.CacheEntry.cache_type": None,
    "mlx_lm.generate.generate_step(prompt)": None,
    "mlx_lm.generate.generate_step(model)": "<model>",
    "mlx_lm.generate.generate_step(prompt_cache)": "list:<cache>",
    "mlx_lm.generate.generate_step(kv_bits)": None,
    "mlx_lm.generate.generate_step(kv_group_size)": None,
    "mlx_lm.generate.generate_step()[][0]": None,
    "mlx_lm.generate.BatchGenerator.model": "<model>",
    "mlx_lm.generate.BatchGenerator._unprocessed_sequences": None,  # tuples
    "mlx_lm.generate.BatchGenerator._prompt_batch": (
        "mlx_lm.generate.PromptProcessingBatch"
    ),
    "mlx_lm.generate.BatchGenerator._generation_batch": (
        "mlx_lm.generate.GenerationBatch"
    ),
    "mlx_lm.generate.PromptProcessingBatch.prompt_cache": "list:<cache>",
    "mlx_lm.generate.GenerationBatch.prompt_cache": "list:<cache>",
    "mlx_lm.models.cache.make_prompt_cache()[0]": "<cache>",
    f"{SERVER}.ResponseGenerator.model_provider": f"{SERVER}.ModelProvider",
    f"{SERVER}.ResponseGenerator.cli_args": "<cli-args>",
    f"{SERVER}.ResponseGenerator._is_batchable(args)": f"{SERVER}.GenerationArguments",
    f"{SERVER}.ResponseGenerator._tokenize(tokenizer)": (
        "mlx_lm.tokenizer_utils.TokenizerWrapper"
    ),
    f"{SERVER}.ResponseGenerator._tokenize(request)": f"{SERVER}.CompletionRequest",
    f"{SERVER}.ResponseGenerator._tokenize(args)": f"{SERVER}.GenerationArguments",
    f"{SERVER}.ResponseGenerator._tokenize()[0]": None,
    f"{SERVER}.ResponseGenerator._tokenize()[1]": None,
    f"{SERVER}.ResponseGenerator._next_request(timeout)": None,
    f"{SERVER}.ResponseGenerator._next_request()[0]": None,  # the reply queue
    f"{SERVER}.ResponseGenerator._next_request()[1]": None,
    f"{SERVER}.ResponseGenerator._stop": None,
    f"{SERVER}.APIHandler.response_generator": f"{SERVER}.ResponseGenerator",
    f"{SERVER}.ModelProvider.model": "<model>",
    f"{SERVER}.ModelProvider.cli_args": "<cli-args>",
    f"{SERVER}.ModelProvider.is_batchable": None,
    f"{SERVER}.ModelProvider.is_distributed": None,
    f"{SERVER}.ModelProvider.model_key": None,  # a tuple of paths (or None)
    f"{SERVER}.GenerationArguments.seed": None,
    f"{SERVER}.GenerationArguments.max_tokens": None,
    f"{SERVER}.GenerationArguments.logits": f"{SERVER}.LogitsProcessorArguments",
    f"{SERVER}.LogitsProcessorArguments.logit_bias": None,
    f"{SERVER}.CompletionRequest.request_type": None,
    f"{SERVER}.CompletionRequest.prompt": None,
    f"{SERVER}.CompletionRequest.messages": None,
    f"{SERVER}.APIHandler.handle_completion(request)": f"{SERVER}.CompletionRequest",
    f"{SERVER}.APIHandler.handle_completion(stop_words)": None,
    f"{SERVER}.APIHandler._set_completion_headers(status_code)": None,
    f"{SERVER}.APIHandler.body": None,
    f"{SERVER}.APIHandler.logit_bias": None,
    f"{SERVER}.APIHandler.stream": None,
    f"{SERVER}.APIHandler.stream_options": None,
    f"{SERVER}.run(host)": None,
    f"{SERVER}.run(port)": None,
    f"{SERVER}.run(model_provider)": f"{SERVER}.ModelProvider",
    f"{SERVER}._make_sampler(args)": f"{SERVER}.GenerationArguments",
    f"{SERVER}._make_sampler(tokenizer)": "mlx_lm.tokenizer_utils.TokenizerWrapper",
    f"{SERVER}._make_logits_processors(args)": f"{SERVER}.GenerationArguments",
    "mlx_lm.tokenizer_utils.TokenizerWrapper._tokenizer": None,
    "mlx_lm.utils._get_classes()[0]()": "<model>",
    "mlx_lm.utils._get_classes()[1]": "mlx_lm.models.base.BaseModelArgs",
    "mlx_lm.utils.quantize_model()[0]": "<model>",
    "mlx_lm.utils.quantize_model()[1]": None,
    "<model>.cast_predicate": None,
}

# What the package's own helpers return, where it reads on it.
RETURNS = {
    "mlx_lm_mla.mla.leaves": "list:<cache>",
    "mlx_lm_mla.mla.latent_modules": "list:<attention>",
    "mlx_lm_mla.mla.latent_layers": "list:<attention>",  # a dict: {index: module}
    "mlx_lm_mla.tiny._mlx_lm_utils": "mlx_lm.utils",
    "mlx_lm_mla.guards.requests._language_args": "<model-args>",
}

# Reads that are no row, and why.
NO_ROW = {
    "mlx_lm.__version__": "the release every row is checked against",
    "mlx_lm.models.__file__": "where the MLA models' sources are read",
    "<model-args>.get": "a text_config that is a dict (mistral3's): config.json's "
    "own keys, read as data",
}


def _module_of(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _stock(label):
    return label == "mlx_lm" or label.startswith("mlx_lm.")


def _is_module(label):
    try:
        return importlib.util.find_spec(label) is not None
    except (ImportError, ValueError):
        return False


def _resolve(label):
    module, _, rest = label.partition(".")
    found = importlib.import_module(module)
    for part in rest.split("."):
        if found is None:
            return None
        if isinstance(found, type(ast)) and _is_module(f"{found.__name__}.{part}"):
            found = importlib.import_module(f"{found.__name__}.{part}")
            continue
        found = getattr(found, part, None)
    return found


class Source:
    """One module of the package: its defs, classes and imports."""

    def __init__(self, path):
        self.path, self.name = path, _module_of(path)
        self.tree = ast.parse(path.read_text(encoding="utf-8"))
        self.defs = {
            n.name: n for n in self.tree.body if isinstance(n, ast.FunctionDef)
        }
        self.classes = {
            n.name: n for n in self.tree.body if isinstance(n, ast.ClassDef)
        }
        self.imports = {}  # local name: ("module", name) or ("from", module, name)
        self.strings = {}  # module-level NAME = "text"
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.imports[a.asname] = ("module", a.name)
                    else:
                        top = a.name.split(".")[0]
                        self.imports[top] = ("module", top)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package = self.name.split(".")
                    if path.name != "__init__.py":
                        package = package[:-1]
                    package = package[: len(package) - node.level + 1]
                    base = ".".join(package + ([base] if base else []))
                for a in node.names:
                    self.imports[a.asname or a.name] = ("from", base, a.name)
        for node in self.tree.body:
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        self.strings[t.id] = node.value.value


def _replacements():
    """{(file, line of its def): (target, the original's parameters, owner)} of
    every function the patch table installs, wrappers of wrappers too."""
    import mlx_lm.server  # noqa: F401 (its patches are applied with it)

    mlx_lm_mla.install()
    applied = []
    for owner, name, _, _, label, _ in patches._applied:
        value = getattr(owner, name, None)
        if isinstance(owner, type):
            value = inspect.getattr_static(owner, name, None)
            value = getattr(value, "__func__", getattr(value, "fget", value))
        applied.append((owner, name, label, value))
    found = {}
    for owner, name, label, value in applied:
        label = _as_read(label)
        cls = label.rpartition(".")[0] if isinstance(owner, type) else None
        chain = []
        while hasattr(value, "__code__") and Path(
            value.__code__.co_filename
        ).is_relative_to(PACKAGE):
            chain.append(value)
            value = getattr(value, "mlx_lm_mla_original", None)
        try:
            params = list(inspect.signature(value).parameters) if value else []
        except (TypeError, ValueError):
            params = []
        for f in chain:  # the first label: its home, where it is rebound
            code = f.__code__
            found.setdefault(
                (code.co_filename, code.co_firstlineno), (label, params, cls)
            )
    return found


def _attention():
    models = importlib.import_module("mlx_lm.models")
    found, _ = mla.find_attention(Path(models.__file__).parent)
    return found


def _as_read(label):
    """A replaced target's label as a read names it: an MLA attention's as
    ``<attention>.name``, another MLA model module's global as ``<mla>.name``."""
    owner, _, name = label.rpartition(".")
    if owner in {f"mlx_lm.models.{m}.{c}" for m, c, _ in _attention()}:
        return f"<attention>.{name}"
    if label.startswith("mlx_lm.models.") and ".cache." not in label:
        return f"<mla>.{name}"
    return label


def _defined_by(cls, name):
    """The class of ``cls``'s MRO that has ``name``, or None."""
    for base in cls.__mro__[:-1]:
        node = mla.definition(base)
        if name in vars(base) or node is not None and name in contract._declared(node):
            return base
    return None


def _own_cache_names():
    # What the package's caches have and no stock cache class has.
    import mlx_lm.models.cache as stock

    from mlx_lm_mla import cache as ours

    def names(module):
        found = set()
        for cls in vars(module).values():
            if isinstance(cls, type) and cls.__module__ == module.__name__:
                found |= set(dir(cls))
                node = mla.definition(cls)
                found |= contract._declared(node) if node is not None else set()
        return found

    return names(ours) - names(stock)


def _element(kind):
    # An item of a list of kind "list:X": X, or None for X empty.
    return kind[5:] or None


class Reads:
    """Walks every module, binding names to what they hold, and records each
    read: {(file:line, label)}."""

    def __init__(self, sources, roots):
        self.sources = {s.name: s for s in sources}
        self.roots = roots
        self.params = {}  # id(def node): {parameter: [kinds]}, from callers
        self.reads = set()
        self.changed = False
        self.own_cache = _own_cache_names()
        # {name: (def, 1, label)} of the methods one class of the package has
        # and no builtin type does: a call of one on a value of unknown kind.
        methods = {}
        for source in sources:
            for cls in source.classes.values():
                for n in cls.body:
                    if isinstance(n, ast.FunctionDef) and not n.name.startswith("__"):
                        label = f"{source.name}.{cls.name}.{n.name}"
                        methods.setdefault(n.name, []).append((n, 1, label))
        builtin = set().union(*(dir(t) for t in (dict, list, set, str, bytes)))
        self.methods = {
            name: found[0]
            for name, found in methods.items()
            if len(found) == 1 and name not in builtin
        }
        # Names read on a stock class to pick a path by release, not the
        # package's own though it defines them too.
        self.switches = {
            row.name.rpartition(".")[2]
            for row in contract.rows()
            if isinstance(row.expects, contract.Switch)
        }
        # Every attribute name the package sets or defines.
        self.own_names = {
            n.attr if isinstance(n, ast.Attribute) else n.name
            for source in sources
            for n in ast.walk(source.tree)
            if isinstance(n, ast.Attribute)
            and isinstance(n.ctx, ast.Store)
            or isinstance(n, (ast.FunctionDef, ast.ClassDef))
        }

    # --- what an expression holds -------------------------------------------

    def record(self, node, label):
        where = self.source.path.relative_to(PACKAGE.parent)
        if isinstance(node, ast.comprehension):  # no position of its own
            node = node.target
        self.reads.add((f"{where}:{node.lineno}", label))

    def holds(self, label):
        return HOLDS.get(label, label)

    def read(self, node, base, name):
        if base.startswith("list:") or base.endswith("(**)"):
            return None
        if name.startswith("__") or "mlx_lm_mla" in name:
            return None  # Python's, or the package's own
        if base == "<cache>" and name in self.own_cache:
            return None
        if base in ("<model>", "<attention>") and hasattr(nn.Module, name):
            return None  # mlx's, not mlx-lm's
        base, at, _ = base.partition("@")
        label = f"{base}.{name}"
        if _stock(base) and _is_module(label):
            return label
        cls = _resolve(base) if _stock(base) else None
        owner = _defined_by(cls, name) if isinstance(cls, type) else None
        if isinstance(cls, type) and owner is None and name in self.own_names:
            if at or name not in self.switches:
                return None  # the package's own, on its subclass of a stock class
        if owner is not None:
            where = owner.__module__
            if not _stock(where):
                if not name.startswith("_"):
                    return None  # the standard library's documented API
                label = f"{where}.{owner.__qualname__}.{name}"
        self.record(node, label)
        return self.holds(label)

    def kind(self, node, env):
        if isinstance(node, ast.Name):
            return env.get(node.id)
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            base = self.kind(node.value, env)
            return None if base is None else self.read(node, base, node.attr)
        if isinstance(node, ast.Subscript):
            return self.item(node, env)
        if isinstance(node, ast.Call):
            return self.call(node, env)
        if isinstance(node, ast.IfExp):
            return self.kind(node.body, env) or self.kind(node.orelse, env)
        if isinstance(node, ast.BoolOp):
            kinds = []
            for v in node.values:
                kinds.append(self.kind(v, env))
                if isinstance(node.op, ast.And):
                    env = self.narrowed(v, env)
            return next(filter(None, kinds), None)
        if isinstance(node, (ast.Starred, ast.NamedExpr)):
            return self.kind(node.value, env)
        return None

    def item(self, node, env):
        value, index = node.value, node.slice
        if (
            isinstance(value, ast.Attribute)
            and value.attr == "modules"
            and isinstance(value.value, ast.Name)
            and value.value.id == "sys"
        ):
            name = self.string(index)
            return name if name and _stock(name) else None
        base = self.kind(value, env)
        if base is None:
            return None
        if base.startswith("list:"):
            return _element(base)
        if isinstance(index, ast.Constant) and isinstance(index.value, int):
            label = f"{base}[{index.value}]"
            self.record(node, label)
            return self.holds(label)
        if isinstance(index, ast.Slice) and isinstance(index.lower, ast.Constant):
            self.record(node, f"{base}[{index.lower.value}:]")
            return None
        return self.holds(f"{base}[]")

    def string(self, node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name):
            return self.source.strings.get(node.id)
        return None

    def call(self, node, env):
        func, args = node.func, node.args
        name = func.id if isinstance(func, ast.Name) else None
        if name in ("getattr", "hasattr") and len(args) >= 2:
            attr, base = self.string(args[1]), self.kind(args[0], env)
            if attr and base:
                found = self.read(node, base, attr)
                return found if name == "getattr" else None
            return None
        if name == "super":
            return env.get("<super>")
        if name == "enumerate" and args:
            base = self.kind(args[0], env)
            return f"list:{base}" if base and base.startswith("list:") else None
        if isinstance(func, ast.Attribute):
            text = self.string(args[0]) if args else None
            if func.attr == "import_module" and _stock(text or ""):
                return text
            base = self.kind(func.value, env)
            if func.attr == "get" and base and base.endswith("(**)") and text:
                return self.holds(f"{base[:-3]}{text})")
            if func.attr == "items" and base and base.startswith("list:"):
                return f"list:{base}"  # (key, value) pairs, as enumerate's
        target = self.package_function(func, env)
        if target is not None:
            self.pass_arguments(target, node, env)
            return RETURNS.get(target[2])
        base = self.kind(func, env)
        if base is None:
            return None
        if _stock(base) and isinstance(_resolve(base.partition("@")[0]), type):
            return base
        return self.holds(f"{base}()")

    # --- the package's own functions ----------------------------------------

    def _in(self, module, name, skip=0):
        other = self.sources.get(module)
        if other is None:
            return None
        path = name.split(".")
        found = other.defs.get(path[0]) or other.classes.get(path[0])
        for part in path[1:]:
            body = getattr(found, "body", [])
            found = next(
                (n for n in body if isinstance(n, ast.FunctionDef) and n.name == part),
                None,
            )
        if isinstance(found, ast.FunctionDef):
            return found, skip, f"{module}.{name}"
        return None

    def _imported(self, local):
        found = self.source.imports.get(local)
        if found is None:
            here = local in self.source.defs or local in self.source.classes
            return (self.source.name, local) if here else None
        if found[0] == "from":
            module = f"{found[1]}.{found[2]}"
            return (module, None) if module in self.sources else (found[1], found[2])
        return (found[1], None)

    def package_function(self, func, env):
        """(def, parameters to skip, name) of a package function ``func`` calls."""
        if isinstance(func, ast.Name):
            if func.id in env:
                return None
            found = self._imported(func.id)
            return self._in(*found) if found and found[1] else None
        if not isinstance(func, ast.Attribute):
            return None
        value = func.value
        if isinstance(value, ast.Name) and value.id not in env:
            found = self._imported(value.id)
            if found is None:
                return None
            module, name = found
            if name is None:  # a module of the package
                return self._in(module, func.attr)
            return self._in(module, f"{name}.{func.attr}", skip=1)  # a class's
        if (
            isinstance(value, ast.Name)
            and env.get("<class>")
            and value.id in (env.get("<self>"),)
        ):
            return self._in(self.source.name, f"{env['<class>']}.{func.attr}", 1)
        if self.kind(value, env) is None:  # a method only one class of ours has
            return self.methods.get(func.attr)
        return None

    def pass_arguments(self, target, node, env):
        fn, skip, _ = target
        names = [a.arg for a in fn.args.posonlyargs + fn.args.args][skip:]
        known = self.params.setdefault(id(fn), {})
        given = list(zip(names, node.args)) + [
            (k.arg, k.value) for k in node.keywords if k.arg in names
        ]
        for param, arg in given:
            if isinstance(arg, ast.Starred):
                break
            kind = self.kind(arg, env)
            if kind is not None and kind not in known.setdefault(param, []):
                known[param].append(kind)
                self.changed = True

    # --- statements -----------------------------------------------------------

    def bind(self, target, kind, env, node):
        if isinstance(target, ast.Name):
            if kind is not None:
                env[target.id] = kind
            else:
                env.pop(target.id, None)
        elif isinstance(target, (ast.Tuple, ast.List)) and kind is not None:
            for i, elt in enumerate(target.elts):
                if kind.startswith("list:"):  # (i, item) of enumerate
                    self.bind(elt, _element(kind) if i else None, env, node)
                elif isinstance(elt, ast.Starred):
                    self.record(node, f"{kind}[{i}:]")
                elif not (isinstance(elt, ast.Name) and elt.id == "_"):
                    label = f"{kind}[{i}]"
                    self.record(node, label)
                    self.bind(elt, self.holds(label), env, node)

    def each(self, node, env):
        """The kinds a loop's target takes, one per item of a literal."""
        if isinstance(node, (ast.Tuple, ast.List)):
            return [self.kind(e, env) for e in node.elts] or [None]
        base = self.kind(node, env)
        if base is None:
            return [None]
        if base.startswith("list:"):
            return [_element(base)]
        return [self.holds(f"{base}[]")]

    def walk(self, node, env):
        """Binds and records through ``node``, statements in order."""
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            self.function(node, env)
            return
        if isinstance(node, ast.ClassDef):
            self.klass(node, env)
            return
        if isinstance(node, (ast.For, ast.comprehension)):
            kinds = self.each(node.iter, env)
            for kind in kinds:
                inner = env if len(kinds) == 1 else dict(env)
                self.bind(node.target, kind, inner, node)
                for child in ast.iter_child_nodes(node):
                    if child is not node.iter and child is not node.target:
                        self.walk(child, inner)
            return
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp)):
            inner = dict(env)
            for g in node.generators:
                self.walk(g, inner)
            self.walk(node.elt, inner)
            return
        if isinstance(node, ast.DictComp):
            inner = dict(env)
            for g in node.generators:
                self.walk(g, inner)
            self.walk(node.key, inner)
            self.walk(node.value, inner)
            return
        if isinstance(node, ast.Assign):
            kind = self.kind(node.value, env)
            for t in node.targets:
                if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    for a, b in zip(t.elts, node.value.elts):
                        self.bind(a, self.kind(b, env), env, node)
                else:
                    self.bind(t, kind, env, node)
        elif isinstance(node, ast.NamedExpr):
            self.bind(node.target, self.kind(node.value, env), env, node)
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            self.bind(node.optional_vars, self.kind(node.context_expr, env), env, node)
        elif isinstance(node, ast.expr):
            self.kind(node, env)
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.And):
            for v in node.values:
                self.walk(v, env)
                env = self.narrowed(v, env)
            return
        if isinstance(node, ast.If):
            self.walk(node.test, env)
            body = self.narrowed(node.test, env)
            for child in node.body:
                self.walk(child, body)
            for child in node.orelse:
                self.walk(child, env)
            return
        for child in ast.iter_child_nodes(node):
            self.walk(child, env)

    def narrowed(self, test, env):
        """``env`` where ``test`` holds: a name it finds an instance of a class
        of the package's is the package's own."""
        tests = test.values if isinstance(test, ast.BoolOp) else [test]
        env = dict(env)
        for t in tests:
            if (
                isinstance(t, ast.Call)
                and getattr(t.func, "id", None) == "isinstance"
                and isinstance(t.args[0], ast.Name)
                and self.packages_class(t.args[1])
            ):
                env.pop(t.args[0].id, None)
        return env

    def packages_class(self, node):
        names = node.elts if isinstance(node, ast.Tuple) else [node]
        for n in names:
            found = self._imported(n.id) if isinstance(n, ast.Name) else None
            if found and found[0].startswith("mlx_lm_mla"):
                return True
        return False

    def function(self, fn, env):
        env = dict(env)
        args = fn.args
        positional = [a.arg for a in args.posonlyargs + args.args]
        for p in positional + [a.arg for a in args.kwonlyargs]:
            env.pop(p, None)
        root = self.roots.get((str(self.source.path), fn.lineno))
        if root is not None:
            target, params, owner = root
            for i, p in enumerate(positional):
                if i == 0 and owner is not None:
                    env[p] = owner
                elif i < len(params):
                    env[p] = self.holds(f"{target}({params[i]})")
            if args.kwarg is not None:
                env[args.kwarg.arg] = f"{target}(**)"
        given = self.params.get(id(fn), {})
        envs = [dict(env, **{p: kinds[0] for p, kinds in given.items()})]
        for p, kinds in given.items():  # each other kind a caller passes
            envs += [dict(envs[0], **{p: k}) for k in kinds[1:]]
        for env in envs:
            if isinstance(fn, ast.Lambda):
                self.walk(fn.body, env)
                continue
            # A factory: its first parameter is the original its def replaces.
            for inner in fn.body:
                key = (str(self.source.path), getattr(inner, "lineno", None))
                if isinstance(inner, ast.FunctionDef) and key in self.roots:
                    if positional:
                        env[positional[0]] = self.roots[key][0]
            for child in fn.body:
                self.walk(child, env)

    def klass(self, cls, env):
        bases = [self.kind(b, env) for b in cls.bases]
        stock = next((b for b in bases if b and _stock(b)), None)
        if stock is None:  # a mixin: the stock base of a class that mixes it in
            stock = next(
                (
                    self.kind(b, env)
                    for other in self.source.classes.values()
                    if cls.name in [getattr(b, "id", None) for b in other.bases]
                    for b in other.bases
                    if _stock(self.kind(b, env) or "")
                ),
                None,
            )
        self.body(cls, cls.body, stock, env)

    def body(self, cls, body, stock, env):
        for node in body:
            if isinstance(node, ast.If):  # methods defined for one release
                self.walk(node.test, env)
                self.body(cls, node.body + node.orelse, stock, env)
            elif isinstance(node, ast.FunctionDef):
                inner = dict(env, **{"<class>": cls.name})
                first = node.args.args[0].arg if node.args.args else None
                inner["<self>"] = first
                if stock is not None:
                    inner["<super>"] = stock
                    if first:  # an instance of the package's class: "stock@own"
                        self.params.setdefault(id(node), {}).setdefault(
                            first, [f"{stock}@{cls.name}"]
                        )
                self.function(node, inner)
            else:
                self.walk(node, env)

    def module(self, source):
        self.source = source
        env = {}
        for local, found in source.imports.items():
            if found[0] == "module" and _stock(found[1]):
                env[local] = found[1]
            elif found[0] == "from" and _stock(found[1]):
                env[local] = f"{found[1]}.{found[2]}"
        for node in source.tree.body:
            self.walk(node, env)


def package_reads():
    sources = [Source(p) for p in sorted(PACKAGE.rglob("*.py"))]
    reads = Reads(sources, _replacements())
    for _ in range(10):  # until every helper's parameters are known
        reads.changed = False
        for source in sources:
            reads.module(source)
        if not reads.changed:
            break
    return reads.reads


def _replaced():
    """Labels of every target the patch table replaces, named as reads are."""
    import mlx_lm.server  # noqa: F401

    mlx_lm_mla.install()
    return {read for label in patches.installed() for read in (label, _as_read(label))}


def _flags():
    # The flags of mlx-lm's server main() that rows hold, and the package's own.
    from mlx_lm_mla.disk import hooks

    held = {
        row.expects.text
        for row in contract.NAMES
        if isinstance(row.expects, contract.Holds) and row.name == "main"
    }
    return held | {hooks.DIR, hooks.BYTES, hooks.MIN_TOKENS}


_POSITION = re.compile(r"^(.*\(\)(?:\[\])?)\[(\d+)(:?)\]$")


def uncovered(reads):
    """The reads that are no contract row, no replaced target and no NO_ROW."""
    rows = contract.rows()
    labels = {f"{r.module}.{r.name}" for r in rows} | _replaced() | set(NO_ROW)
    unpacked = {
        f"{r.module}.{r.name}": len(r.expects.names)
        for r in rows
        if isinstance(r.expects, contract.Unpacked)
    }
    classes = {c for _, c, _ in _attention()}
    named = {
        "<model>": {n for r in rows for n in [r.name] if n.startswith("Model.")},
        "<model-args>": {r.name for r in rows if r.name.startswith("ModelArgs.")},
    }
    flags = _flags()

    def covered(label):
        if label in labels:
            return True
        position = _POSITION.match(label)
        if position:
            tuple_, index, rest = position.groups()
            return int(index) + (not rest) <= unpacked.get(tuple_, -1)
        kind, _, name = label.partition(".")
        if kind == "<cache>":
            return any(
                r.startswith(f"{CACHE}.") and r.endswith(f".{name}") for r in labels
            )
        if kind == "<model>":
            return f"Model.{name}" in named["<model>"]
        if kind == "<model-args>":
            return f"ModelArgs.{name}" in named["<model-args>"]
        if kind == "<attention>":
            return any(
                r.module.startswith("mlx_lm.models.") and r.name == f"{c}.{name}"
                for r in rows
                for c in classes
            )
        if kind == "<cli-args>":
            return f"--{name.replace('_', '-')}" in flags
        return False

    return sorted(f"{where}: {label}" for where, label in reads if not covered(label))


@pytest.fixture(scope="module")
def reads():
    found = package_reads()
    yield found
    mlx_lm_mla.uninstall()


def test_every_read_of_mlx_lm_in_the_package_is_a_contract_row(reads):
    assert uncovered(reads) == []


@pytest.mark.parametrize(
    "label",
    [
        "<model>.layers",
        "<model>.args",
        "<model-args>.max_position_embeddings",
        "<model-args>.vocab_size",
        "<attention>.kv_lora_rank",
        "<attention>.qk_rope_head_dim",
        "mlx_lm.server.ResponseGenerator._tokenize()[0]",
        "mlx_lm.server.ResponseGenerator._next_request()[1]",
        "mlx_lm.models.cache.KVCache.meta_state",
        "mlx_lm.server.ResponseGenerator.model_provider",
        "<cache>.caches",
        "<cli-args>.kv_bits",
    ],
)
def test_the_reads_found_include_each_kind_of_read(reads, label):
    assert label in {found for _, found in reads}


def test_a_read_that_is_no_row_is_named_with_its_file_and_line(reads):
    where, label = "mlx_lm_mla/x.py:7", "mlx_lm.server.ResponseGenerator._renamed"
    assert uncovered(reads | {(where, label)}) == [f"{where}: {label}"]
