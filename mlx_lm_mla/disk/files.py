"""One prompt cache file of the disk tier: mlx-lm's own
``save_prompt_cache`` format (safetensors), with the package's CRC-32 of its
data and a record of what it holds, written to a temporary file first."""

import copy
import hashlib
import json
import os
import uuid

from safetensors import SafetensorError, safe_open

from ..mla import is_latent, leaves
from ..patches.files import CHECKSUM, CorruptCacheFile, add_checksum, check_cache_file

RECORD = "mlx_lm_mla_disk"  # the file's own record, in its metadata
TEMP = ".tmp-"  # temporary files: .tmp-<pid>-<random>.safetensors


def tokens_digest(tokens):
    return hashlib.sha256(tokens).hexdigest()


def snapshot(cache):
    """Copies of a cache's layers holding its state as evaluated, contiguous
    arrays, so the writer thread only writes bytes: it computes nothing
    (MLX streams belong to the thread that made them) and never sees an
    array the server changes later. Made on the server's generation thread;
    the arrays are shared, not copied, where they are contiguous already."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map

    layers = []
    for layer in cache:
        state = tree_map(lambda x: mx.contiguous(x) if isinstance(x, mx.array) else x, layer.state)
        mx.eval([x for _, x in tree_flatten(state) if isinstance(x, mx.array)])
        frozen = copy.copy(layer)
        frozen.state = state
        layers.append(frozen)
    return layers


def write_temp(folder, cache, record):
    """Writes ``cache`` with ``record`` (a dict) to a new temporary file in
    ``folder``, readable by the user only, flushed to disk. Returns its path
    and size; the caller renames it into place."""
    import mlx_lm.models.cache as cache_module

    metadata = {RECORD: json.dumps(record, sort_keys=True)}
    # The package's save_prompt_cache gives a latent cache its checksum.
    patched = hasattr(cache_module.save_prompt_cache, "mlx_lm_mla_original")
    if not (patched and any(is_latent(c) for c in leaves(cache))):
        add_checksum(cache_module.save_prompt_cache, cache, metadata)
    path = os.path.join(folder, f"{TEMP}{os.getpid()}-{uuid.uuid4().hex}.safetensors")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            cache_module.save_prompt_cache(f, cache, metadata)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        os.unlink(path)
        raise
    return path, os.path.getsize(path)


def read(path, record):
    """The cache in the file at ``path``, after checking that the file says
    it holds ``record`` (the digests and tokens looked up) and that its data
    has its checksum. Raises CorruptCacheFile naming what does not fit."""
    import mlx_lm.models.cache as cache_module

    try:
        with safe_open(path, framework="numpy") as f:
            metadata = f.metadata() or {}
    except SafetensorError as e:
        raise CorruptCacheFile(f"truncated or corrupt: unreadable header or data ({e})")
    # save_prompt_cache nests the caller's metadata under a prefix.
    found = {k.rpartition(".")[2]: v for k, v in metadata.items()}
    if RECORD not in found or CHECKSUM not in found:
        raise CorruptCacheFile("not a file of the disk tier (no record or no checksum)")
    try:
        saved = json.loads(found[RECORD])
    except ValueError:
        raise CorruptCacheFile("its record is not JSON")
    for key, why in (
        ("model_digest", "another model's files (weights, config or tokenizer)"),
        ("cache_digest", "other cache settings (kv-bits, group size, quantized-kv-start) or another mlx-lm"),
        ("tokens", "other tokens than its index entry"),
    ):
        if saved.get(key) != record[key]:
            raise CorruptCacheFile(f"the file holds a cache of {why}")
    if not hasattr(cache_module.load_prompt_cache, "mlx_lm_mla_original"):
        check_cache_file(path)  # the package's load_prompt_cache checks it itself
    try:
        return cache_module.load_prompt_cache(path)
    except CorruptCacheFile:
        raise
    except Exception as e:  # a layout this mlx-lm cannot read
        raise CorruptCacheFile(f"mlx-lm cannot load it ({type(e).__name__}: {e})")
