"""Every mlx-lm name the package reads, subclasses or looks up by string (and the
few of mlx and the standard library outside their documented API), with what it
expects, the features relying on it and why. A wrapped target is checked against
its replacement's parameters (``signature_problem``) and has a row only where
other code calls it too. A row that does not hold switches its features off.
``rows()`` adds what the package reads on each installed MLA model
(``model_rows``); tests/test_contract_complete.py checks every read is a row.
"""

import ast
import functools
import importlib
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple

from packaging.version import Version

from ..mla import definition, find_attention, model_types, self_fields
from .table import (
    BAD_REQUESTS,
    CACHE_CHECKS,
    DISK,
    EVERYTHING,
    FILES,
    KV_BATCHING,
    QUANTIZE,
    RECOVERY,
    REQUEST_CHECKS,
    REUSE,
    SAMPLING,
    TINY,
)


@dataclass(frozen=True)
class Method:
    """A function or method whose leading parameters are ``params``."""

    params: Tuple[str, ...]


@dataclass(frozen=True)
class Keywords:
    """A function that takes each of ``names`` as a keyword-only parameter."""

    names: Tuple[str, ...]


@dataclass(frozen=True)
class Field:
    """An instance attribute (``self.<name>`` or a dataclass field); with ``of``,
    on a default instance, an instance of that class of the same module."""

    of: Optional[str] = None


@dataclass(frozen=True)
class Property:
    """A property of the class; ``settable``: one with a setter."""

    settable: bool = False


@dataclass(frozen=True)
class Exists:
    """A class, or a module's global, that has each of ``methods``."""

    methods: Tuple[str, ...] = ()


@dataclass(frozen=True)
class Calls:
    """A global holding ``module``, through which ``function`` makes each of
    ``calls`` (a leading dot: that method of any object)."""

    module: str
    function: str
    calls: Tuple[str, ...]


@dataclass(frozen=True)
class Holds:
    """A string in the source of a function or class: a dict key, or a flag it
    defines (``--kv-bits`` is read back as ``cli_args.kv_bits``)."""

    text: str


@dataclass(frozen=True)
class Member:
    """An attribute of the class's instances however it is made: a property, a
    method, a class attribute, or a field its or a base class's source sets."""


@dataclass(frozen=True)
class Unpacked:
    """A tuple the function returns, read by position: mlx-lm's own ``by``
    unpacks it into ``names`` (leading), which says what each position holds."""

    by: str
    names: Tuple[str, ...]
    module: Optional[str] = None  # of ``by``, if not the row's


@dataclass(frozen=True)
class Switch:
    """A name the package picks its path by: there before mlx-lm ``until``,
    gone from it on."""

    until: str


@dataclass(frozen=True)
class Name:
    module: str
    name: str  # "Class.attribute", "Class", "function", "module.attribute"
    expects: object  # one of the kinds above
    features: Tuple[str, ...]  # what is off when it does not hold
    why: str
    since: Optional[str] = None  # the first mlx-lm release that has it

    @property
    def label(self):
        where = f"{self.module}.{self.name}"
        if isinstance(self.expects, Holds):
            return f'{where} "{self.expects.text}"'
        return where


def _rows(module, features, *rows):
    return tuple(Name(module, *row[:2], features, *row[2:]) for row in rows)


CACHE = "mlx_lm.models.cache"
GENERATE = "mlx_lm.generate"
SERVER = "mlx_lm.server"
_PARAMS = ("self", "keys", "values")
_STATE = "a layer's arrays are read and set through it"
_KEY = ("self", "model", "tokens")

NAMES = (
    # --- the stock caches the package's caches subclass (cache.py) ------------
    *_rows(
        CACHE,
        (EVERYTHING,),
        ("KVCache", Exists(), "the package's caches subclass it"),
        ("BatchKVCache", Exists(), "the package's caches subclass it"),
        ("RotatingKVCache", Exists(), "the package's caches subclass it"),
    ),
    *_rows(
        CACHE,
        (QUANTIZE,),
        ("KVCache.keys", Field(), "an MLA latent, quantized in place"),
        ("KVCache.values", Field(), "an MLA layer's RoPE key"),
        ("KVCache.offset", Field(), "tokens held"),
        ("KVCache.update_and_fetch", Method(_PARAMS), "stores the packed latent"),
        ("KVCache.make_mask", Method(("self",)), "a packed cache's mask"),
        ("KVCache.empty", Method(("self",)), "an empty cache merges unquantized"),
        ("KVCache.state", Property(settable=True), "the packed format joins it"),
        ("BatchKVCache.keys", Field(), "a batch's latent, quantized in place"),
        ("BatchKVCache.values", Field(), "a batch's RoPE keys"),
        ("BatchKVCache.offset", Field(), "each row's length, to quantize it"),
        ("BatchKVCache.left_padding", Field(), "a mixed batch's halves, each its own"),
        ("BatchKVCache.update_and_fetch", Method(_PARAMS), "stores packed rows"),
        ("BatchKVCache.make_mask", Method(("self", "N")), "a packed batch's mask"),
        ("BatchKVCache.filter", Method(("self", "batch_indices")), "drops rows"),
        ("BatchKVCache.prepare", Method(("self",)), "a mixed batch's two halves"),
        ("BatchKVCache.finalize", Method(("self",)), "a mixed batch's two halves"),
        ("BatchKVCache.trim", Method(("self", "n")), "a mixed batch's two halves"),
        ("BatchKVCache.state", Property(settable=True), "the packed format joins it"),
        ("BatchKVCache.nbytes", Property(), "a mixed batch counts both halves"),
        ("RotatingKVCache.update_and_fetch", Method(_PARAMS), "stores the window"),
        ("RotatingKVCache.make_mask", Method(("self", "N")), "a window's mask"),
        ("RotatingKVCache.trim", Method(("self", "n")), "a packed window trims"),
        ("RotatingKVCache.state", Property(settable=True), "the packed format"),
    ),
    *_rows(
        CACHE,
        (QUANTIZE, REUSE),
        ("KVCache.trim", Method(("self", "n")), "a packed cache; an exact hit"),
    ),
    *_rows(
        CACHE,
        (QUANTIZE, CACHE_CHECKS),
        ("CacheList.caches", Field(), "a CacheList's latent is one of its members"),
    ),
    *_rows(
        CACHE,
        (QUANTIZE,),
        (
            "KVCache.meta_state",
            Switch("0.32.0"),
            "the packed format travels in it where it is, else at the end of state",
        ),
    ),
    *_rows(
        CACHE,
        (REUSE,),
        ("_BaseCache.is_trimmable", Method(("self",)), "whether it can step back"),
        ("LRUPromptCache._trie", Field(of="PromptTrie"), "candidates are checked"),
        ("LRUPromptCache._lru", Field(of="LRUPromptCache.CacheOrder"), "eviction"),
        ("LRUPromptCache._n_bytes", Field(), "eviction keeps the byte count true"),
        ("LRUPromptCache._n_bytes_by_type", Field(), "eviction keeps it true"),
        ("PromptTrie.search", Method(_KEY), "the candidates of a fetch"),
        ("PromptTrie.get", Method(_KEY), "a candidate's entry, to check it"),
        ("PromptTrie.pop", Method(_KEY), "evicts a bad entry"),
        ("PromptTrieResult.exact", Field(), "a candidate of a fetch"),
        ("PromptTrieResult.shorter", Field(), "a candidate of a fetch"),
        ("PromptTrieResult.longer", Field(), "a candidate of a fetch"),
        ("LRUPromptCache.CacheOrder.remove", Method(_KEY), "evicts a bad entry"),
        ("LRUPromptCache.CacheEntry.prompt_cache", Field(), "the cache checked"),
        ("LRUPromptCache.CacheEntry.nbytes", Field(), "eviction keeps counts true"),
        ("LRUPromptCache.CacheEntry.cache_type", Field(), "eviction, likewise"),
    ),
    *_rows(
        CACHE,
        (REUSE, DISK),
        ("QuantizedKVCache.bits", Field(), "its keys are lists, not a bad cache"),
    ),
    *_rows(
        SERVER,
        (REUSE,),
        ("ModelProvider.draft_model", Field(), "a drafting server's draft caches"),
        ("ModelProvider.model_key", Field(), "the key those caches are stored under"),
    ),
    *_rows(
        CACHE,
        (FILES, REUSE, DISK),
        ("_BaseCache.state", Property(settable=True), _STATE),
    ),
    *_rows(
        CACHE,
        (FILES, DISK),
        (
            "save_prompt_cache",
            Method(("file_name", "cache", "metadata")),
            "a file is written once into a checksum's sink, then to disk",
        ),
    ),
    *_rows(
        CACHE,
        (FILES,),
        (
            "load_prompt_cache()",
            Unpacked("main", ("prompt_cache", "metadata"), GENERATE),
            "with return_metadata: the metadata loses the package's entries",
        ),
    ),
    *_rows(
        CACHE,
        (REUSE, DISK),
        (
            "LRUPromptCache.fetch_nearest_cache()",
            Unpacked("ResponseGenerator._serve_single", ("cache", "rest"), SERVER),
            "a fetched cache is checked against the tokens it leaves",
        ),
    ),
    *_rows(
        CACHE,
        (DISK,),
        ("load_prompt_cache", Method(("file_name",)), "a file of the tier is read"),
        ("can_trim_prompt_cache", Method(("cache",)), "a restored cache is cut"),
        ("trim_prompt_cache", Method(("cache", "num_tokens")), "to the prompt"),
    ),
    # --- generation (mlx_lm.generate) ----------------------------------------
    *_rows(
        GENERATE,
        (CACHE_CHECKS,),
        (
            "generate_step",
            Keywords(("prompt_cache", "kv_bits", "kv_group_size")),
            "the cache and settings are checked before the first step",
        ),
    ),
    *_rows(
        GENERATE,
        (KV_BATCHING,),
        ("BatchGenerator.model", Field(), "only an MLA model's batches quantize"),
        # insert's check reads them too, where they are (patches/generate.py).
        ("BatchGenerator._prompt_batch", Field(), "the rows being prefilled"),
        (
            "BatchGenerator._unprocessed_sequences",
            Field(),
            "the rows queued: insert checks their caches (an entry's fourth)",
        ),
        ("BatchGenerator._generation_batch", Field(), "the rows being decoded"),
        ("PromptProcessingBatch.prompt_cache", Field(), "its caches quantize"),
        ("GenerationBatch.prompt_cache", Field(), "its caches quantize"),
    ),
    *_rows(
        GENERATE,
        (CACHE_CHECKS,),
        (
            "BatchGenerator.insert_segments",
            Method(("self", "segments", "max_tokens", "caches")),
            "rows are checked before the generator takes them",
        ),
    ),
    # --- the server (mlx_lm.server) ------------------------------------------
    # One server's state hangs on its ModelProvider (guards/state.py).
    *_rows(
        SERVER,
        (REQUEST_CHECKS, BAD_REQUESTS, REUSE, RECOVERY, SAMPLING, DISK, KV_BATCHING),
        (
            "ModelProvider.cli_args",
            Field(),
            "a server's flags; its state is made there",
        ),
        (
            "ResponseGenerator.model_provider",
            Field(),
            "the model being served; the generator's way to its server's state",
        ),
        (
            "APIHandler.response_generator",
            Field(),
            "a handler's way to its server's state",
        ),
    ),
    *_rows(
        SERVER,
        (KV_BATCHING,),
        ("ResponseGenerator.cli_args", Property(), "the server's --kv-bits"),
        ("ModelProvider.is_batchable", Field(), "a model upstream would batch"),
    ),
    *_rows(
        SERVER,
        (KV_BATCHING, REQUEST_CHECKS),
        ("ModelProvider.model", Field(), "its vocabulary, context and attention"),
        ("GenerationArguments.seed", Field(), "a seeded request runs alone"),
    ),
    *_rows(
        SERVER,
        (KV_BATCHING, DISK),
        ("main", Holds("--kv-bits"), "read back as cli_args.kv_bits", "0.32.0"),
        ("main", Holds("--kv-group-size"), "as cli_args.kv_group_size", "0.32.0"),
        ("main", Holds("--quantized-kv-start"), "likewise", "0.32.0"),
    ),
    *_rows(
        SERVER,
        (REQUEST_CHECKS,),
        ("APIHandler.body", Field(), "NaN, infinity and cache_prompt are read"),
        ("APIHandler.stream", Field(), "a failed stream gets an error event"),
        ("APIHandler.stream_options", Field(), "include_usage gets its default"),
        ("APIHandler.logit_bias", Field(), "ids are checked against the vocab"),
        (
            "APIHandler._set_completion_headers",
            Method(("self", "status_code")),
            "a refusal's status line and headers, CORS included, as stock's",
        ),
        ("CompletionRequest.request_type", Field(), "which fields to check"),
        ("CompletionRequest.prompt", Field(), "an empty prompt is refused"),
        ("CompletionRequest.messages", Field(), "malformed messages are refused"),
        ("GenerationArguments.max_tokens", Field(), "checked against the context"),
        ("GenerationArguments.logits", Field(), "its logit_bias is checked"),
        ("GenerationArguments.sampling", Field(), "fields named when refused"),
        ("LogitsProcessorArguments.logit_bias", Field(), "ids are checked"),
        (
            "_make_sampler",
            Method(("args", "tokenizer")),
            "a request's sampler is built by the server's own builder to check it",
        ),
        (
            "_make_logits_processors",
            Method(("args",)),
            "a request's logits processors, likewise",
        ),
    ),
    *_rows(
        SERVER,
        (REQUEST_CHECKS,),
        (
            "ResponseGenerator._tokenize()",
            Unpacked(
                "ResponseGenerator._generate", ("prompt", "segments", "segment_types")
            ),
            "the prompt's tokens are checked; a no-store request's segment types "
            "are dropped",
        ),
    ),
    *_rows(
        SERVER,
        (RECOVERY,),
        (
            "ResponseGenerator._next_request()",
            Unpacked("ResponseGenerator._generate", ("rqueue", "request", "args")),
            "the reply queue is watched, the request's state found",
        ),
        ("ResponseGenerator._stop", Field(), "a restarted loop ends with it"),
        ("GenerationContext", Exists(("stop",)), "a failed request's row ends"),
        ("Response.token", Field(), "the tokens a cancelled request got"),
        (
            "ResponseGenerator.generation_available",
            Method(("self",)),
            "a loop that keeps failing ends as upstream's does",
            "0.32.0",
        ),
    ),
    *_rows(
        SERVER,
        (DISK,),
        ("ModelProvider.is_distributed", Field(), "no tier for a distributed one"),
        ("ModelProvider.model", Field(), "a new one: its files are fingerprinted"),
        ("ModelProvider.model_key", Field(), "the key its fingerprint is for"),
        ("main", Holds("--model"), "read as cli_args.model"),
        ("main", Holds("--adapter-path"), "read as cli_args.adapter_path"),
        ("main", Holds("--draft-model"), "read as cli_args.draft_model"),
        (
            "ModelProvider.__init__",
            Holds("default_model"),
            "mlx-lm 0.31 keys the command line's model so: its files are found",
        ),
    ),
    *_rows(
        SERVER,
        (DISK, KV_BATCHING),  # KV_BATCHING: its --kv-bits help says it batches
        (
            "argparse",
            Calls("argparse", "main", ("argparse.ArgumentParser", ".parse_args")),
            "main() makes its parser and reads the command line in one call; "
            "flags join mlx-lm's own, and help changes, only through the parser "
            "class it makes",
        ),
    ),
    *_rows(
        "mlx_lm.tokenizer_utils",
        (REQUEST_CHECKS,),
        (
            "TokenizerWrapper._tokenizer",
            Field(),
            "the vocabulary size where the model's config does not give one",
        ),
    ),
    # --- the MLA models' arguments (each MLA model's own: model_rows) ---------
    *(
        row
        for module in ("mlx_lm.models.deepseek_v3", "mlx_lm.models.glm4_moe_lite")
        for row in _rows(
            module,
            (REQUEST_CHECKS,),
            (
                "ModelArgs.max_position_embeddings",
                Field(),
                "max_tokens is checked against the context (none given: the "
                "ceiling alone)",
            ),
            (
                "ModelArgs.vocab_size",
                Field(),
                "logit_bias ids are checked against it (else the tokenizer's)",
            ),
            (
                "ModelArgs.rope_scaling",
                Field(),
                "a context its config keeps unscaled is counted scaled",
            ),
        )
    ),
    *(
        row
        for module in ("mlx_lm.models.kimi_vl", "mlx_lm.models.mistral3")
        for row in _rows(
            module,
            (REQUEST_CHECKS,),
            (
                "ModelArgs.text_config",
                Field(),
                "the language model's arguments (mistral3's: a dict): its context "
                "and vocabulary",
            ),
        )
    ),
    *_rows(
        "mlx_lm.models.ministral3",
        (REQUEST_CHECKS,),
        (
            "ModelArgs.rope_parameters",
            Field(),
            "its YaRN set-up (it has no rope_scaling): the context it reaches",
        ),
    ),
    *_rows(
        "mlx_lm.models.mistral3",
        (REQUEST_CHECKS,),
        (
            "Model.language_model",
            Field(),
            "mistral3's text_config is a dict: the arguments its language model "
            "was built from give the context and vocabulary",
        ),
    ),
    # --- mlx and the standard library -----------------------------------------
    *_rows(
        "mlx.core",
        (REQUEST_CHECKS, RECOVERY, SAMPLING),
        (
            "random.state",
            Exists(("__getitem__",)),
            "a failed sampler's random key is put back (a list before mlx "
            "0.32.4, a read-only view after)",
        ),
    ),
    *_rows(
        "http.server",
        (REQUEST_CHECKS,),
        (
            "BaseHTTPRequestHandler._headers_buffer",
            Field(),
            "a buffered 200 is dropped so a failed request gets one 500",
        ),
    ),
    *_rows(
        "mlx_lm",
        (TINY,),
        ("load", Method(("path_or_hf_repo",)), "a tiny model is loaded back"),
        (
            "load()",
            Unpacked("main", ("model", "tokenizer"), GENERATE),
            "bench and the tiny tools take the model it loads",
        ),
    ),
    *_rows(
        CACHE,
        (TINY,),
        ("KVCache.nbytes", Property(), "repro and the model table count bytes"),
    ),
    *_rows(
        GENERATE,
        (TINY,),
        (
            "generate_step()[]",
            Unpacked("stream_generate", ("token", "logprobs")),
            "repro reads each step's token",
        ),
    ),
    *_rows(
        "mlx_lm.utils",
        (TINY,),
        (
            "_get_classes",
            Method(("config",)),
            "a tiny model is built from a config dict as load builds it",
        ),
        (
            "quantize_model",
            Method(("model", "config", "group_size", "bits")),
            "a tiny model is quantized as mlx_lm.convert quantizes",
        ),
        (
            "_get_classes()",
            Unpacked("load_model", ("model_class", "model_args_class")),
            "the classes a tiny model is built of",
        ),
        (
            "quantize_model()",
            Unpacked("convert", ("model", "config"), "mlx_lm.convert"),
            "the quantized tiny model and its config",
        ),
    ),
    *_rows(
        "mlx_lm.models.base",
        (TINY,),
        ("BaseModelArgs.from_dict", Method(("params",)), "a tiny model's arguments"),
    ),
    *(
        row
        for module in ("mlx_lm.models.deepseek_v3", "mlx_lm.models.glm4_moe_lite")
        for row in _rows(
            module,
            (TINY,),
            ("Model.cast_predicate", Member(), "a tiny model is cast as convert does"),
        )
    ),
    *_rows(
        "socketserver",
        (REQUEST_CHECKS,),
        ("StreamRequestHandler.connection", Field(), "polled: has the client left"),
    ),
)
BY_LABEL = {row.label: row for row in NAMES}

# What the package reads on any model, in each installed MLA model's module.
_MODEL = (
    ("Model.layers", Member(), (QUANTIZE, CACHE_CHECKS, KV_BATCHING), "its layers"),
    ("Model.args", Member(), (REQUEST_CHECKS,), "its context and vocabulary"),
)
_ATTENTION = (
    ("kv_lora_rank", "a cached latent's width"),
    ("qk_rope_head_dim", "a cached RoPE key's width"),
)


@functools.lru_cache(maxsize=None)
def _model_rows(folder):
    found, _ = find_attention(folder)
    rows = [
        Name(f"mlx_lm.models.{model_type}", name, expects, features, why)
        for model_type in model_types(folder)
        if _imports(f"mlx_lm.models.{model_type}")
        for name, expects, features, why in _MODEL
    ]
    rows += [
        Name(f"mlx_lm.models.{module}", f"{cls}.{field}", Field(), (CACHE_CHECKS,), why)
        for module, cls, _ in found
        if _imports(f"mlx_lm.models.{module}")
        for field, why in _ATTENTION
    ]
    return tuple(rows)


def _imports(module):
    # A model module that cannot be imported here (a dependency it lacks) loads
    # no model: nothing of it is read.
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def model_rows():
    """Rows for the installed MLA models: each model type's ``Model`` and each MLA
    attention class (a prompt cache is checked against its widths)."""
    models = importlib.import_module("mlx_lm.models")
    return _model_rows(str(Path(models.__file__).parent))


def rows():
    """Every row at this mlx-lm: ``NAMES`` and the MLA models' own."""
    return NAMES + model_rows()


def unmet(feature):
    """``{label: problem}`` of the rows of ``feature`` that do not hold."""
    relied = [row for row in NAMES if feature in row.features and applies(row)]
    return {row.label: p for row in relied if (p := problem(row)) is not None}


def applies(row):
    """Whether the installed mlx-lm should have ``row``'s name."""
    import mlx_lm

    return row.since is None or Version(mlx_lm.__version__) >= Version(row.since)


def _resolve(module, dotted):
    # What the name holds, under the package's own replacement of it if any.
    owner = importlib.import_module(module)
    for part in dotted.split("."):
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    while hasattr(owner, "mlx_lm_mla_original"):  # wrapped more than once
        owner = owner.mlx_lm_mla_original
    return owner


@functools.lru_cache(maxsize=None)
def _declared(node):
    # What a class's source assigns as self.<name> or declares as a field.
    fields = {
        n.target.id
        for n in node.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    return fields | self_fields(node)


@functools.lru_cache(maxsize=None)
def _strings(node):
    return {
        n.value
        for n in ast.walk(node)
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


def _dotted(node):
    # "a.b.c" of an attribute chain on a name; ".c" where it starts elsewhere.
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([getattr(node, "id", ""), *parts[::-1]])


def _calls_problem(row):
    expects, module = row.expects, importlib.import_module(row.module)
    value = getattr(module, row.name, None)
    wanted = importlib.import_module(expects.module)
    if getattr(value, "mlx_lm_mla_original", value) is not wanted:
        return f"not the {expects.module} module"
    node = definition(getattr(module, expects.function, None))
    if node is None:
        return f"{expects.function}() not found"
    made = {_dotted(n.func) for n in ast.walk(node) if isinstance(n, ast.Call)}
    lacking = [
        c
        for c in expects.calls
        if not any(m == c or c[0] == "." and m.endswith(c) for m in made)
    ]
    if lacking:
        return f"{expects.function}() makes no call to {', '.join(lacking)}"
    return None


def _params(found):
    try:
        return tuple(inspect.signature(found).parameters.values())
    except (TypeError, ValueError):
        return None


def problem(row):
    """Why the installed code does not meet ``row``, or None."""
    owner_path, _, name = row.name.rpartition(".")
    expects = row.expects
    if isinstance(expects, Calls):
        return _calls_problem(row)
    found = _resolve(row.module, row.name)
    if isinstance(expects, (Method, Keywords)):
        params = _params(found) if callable(found) else None
        if params is None:
            return "not found"
        names = tuple(p.name for p in params)
        lead = getattr(expects, "params", ())
        if names[: len(lead)] != lead:
            return f"takes ({', '.join(names)}), expected ({', '.join(lead)}, ...)"
        if isinstance(expects, Keywords):
            keyword = {p.name for p in params if p.kind is p.KEYWORD_ONLY}
            lacking = [n for n in expects.names if n not in keyword]
            if lacking:
                return f"takes no keyword-only {', '.join(lacking)}"
        return None
    if isinstance(expects, Exists):
        lacking = [m for m in expects.methods if not hasattr(found, m)]
        if found is None or lacking:
            return f"has no {', '.join(lacking)}" if found is not None else "not found"
        return None
    if isinstance(expects, Holds):
        node = definition(found) if found is not None else None
        if node is None or expects.text not in _strings(node):
            return f"its source has no {expects.text!r}"
        return None
    if isinstance(expects, Switch):
        there = found is not None
        import mlx_lm

        if there != (Version(mlx_lm.__version__) < Version(expects.until)):
            return f"{'there' if there else 'gone'}; expected gone from {expects.until}"
        return None
    if isinstance(expects, Unpacked):
        return _unpacked_problem(row)
    cls = _resolve(row.module, owner_path) if owner_path else None
    if not isinstance(cls, type):
        return "not found"
    if isinstance(expects, Member):
        return None if _member(cls, name) else "not found"
    if isinstance(expects, Property):
        prop = inspect.getattr_static(cls, name, None)
        if not isinstance(prop, property) or expects.settable and prop.fset is None:
            return "not a property" + (" with a setter" if expects.settable else "")
        return None
    node = definition(cls)
    if node is None or name not in _declared(node):
        return "not found"
    if expects.of:
        kind = _resolve(row.module, expects.of)
        if not isinstance(getattr(cls(), name, None), kind or ()):
            return f"not a {expects.of}"
    return None


def _member(cls, name):
    for base in cls.__mro__[:-1]:  # not object
        node = definition(base)
        if name in vars(base) or node is not None and name in _declared(node):
            return True
    return False


def _unpacked_problem(row):
    by = _resolve(row.expects.module or row.module, row.expects.by)
    node = definition(by) if by is not None else None
    if node is None:
        return f"{row.expects.by} not found"
    wanted = list(row.expects.names)
    for n in ast.walk(node):
        if isinstance(n, ast.Tuple) and isinstance(n.ctx, ast.Store):
            names = [getattr(e, "id", None) for e in n.elts]
            if names[: len(wanted)] == wanted:
                return None
    return f"{row.expects.by} unpacks no ({', '.join(wanted)}, ...)"


_P = inspect.Parameter
_POSITIONAL = (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)


def signature_problem(replacement, original):
    """Why ``replacement`` cannot stand for ``original``, from their parameters,
    or None: its positional ones lead the original's; without ``*args`` or
    ``**kwargs`` it takes all the original's positional or keyword ones; the
    defaults it gives are the original's."""
    mine, theirs = _params(replacement), _params(original)
    if theirs is None:
        return "its parameters cannot be read"
    lead = [p for p in mine if p.kind in _POSITIONAL]
    kinds = {p.kind for p in mine}
    positional = [p for p in theirs if p.kind in _POSITIONAL]
    names = [p.name for p in positional]
    expected = [p.name for p in lead]
    if names[: len(expected)] != expected or (
        _P.VAR_POSITIONAL not in kinds and len(names) > len(expected)
    ):
        return f"takes ({', '.join(names)}), its replacement ({', '.join(expected)})"
    for p, q in zip(lead, positional):
        if p.default is not p.empty and p.default != q.default:
            return f"{q.name} defaults to {q.default!r}, not {p.default!r}"
    taken = {p.name for p in mine}
    lacking = [
        q.name
        for q in theirs
        if q.kind is q.VAR_POSITIONAL
        and _P.VAR_POSITIONAL not in kinds
        or q.kind in (q.KEYWORD_ONLY, q.VAR_KEYWORD)
        and _P.VAR_KEYWORD not in kinds
        and q.name not in taken
    ]
    if lacking:
        return f"takes {', '.join(lacking)}, its replacement does not"
    return None
