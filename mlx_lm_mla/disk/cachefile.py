"""One prompt cache file of the disk tier: mlx-lm's ``save_prompt_cache`` format
with the package's checksum and a record of what it holds, enough to index it
again from the file alone."""

import base64
import copy
import json
import os

from safetensors import SafetensorError, safe_open

from ..checksum import (
    CHECKSUM,
    CorruptCacheFile,
    add_checksum,
    check_cache_file,
    whole_file,
)

RECORD = "mlx_lm_mla_disk"  # the file's record, in its metadata


def snapshot(cache):
    """Copies of a cache's layers holding evaluated, contiguous arrays, made on the
    generation thread: the writer thread computes nothing (MLX streams belong to
    the thread that made them) and never sees an array the server changes."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map

    layers = []
    for layer in cache:
        state = tree_map(
            lambda x: mx.contiguous(x) if isinstance(x, mx.array) else x, layer.state
        )
        mx.eval([x for _, x in tree_flatten(state) if isinstance(x, mx.array)])
        frozen = copy.copy(layer)
        frozen.state = state
        layers.append(frozen)
    return layers


def make_record(model, model_digest, cache_digest, settings, tokens, trimmable):
    """The record of a file: ``tokens`` as little-endian int32 bytes."""
    return {
        "model": model,
        "model_digest": model_digest,
        "cache_digest": cache_digest,
        "settings": settings,
        "tokens": tokens_text(tokens),
        "trimmable": bool(trimmable),
    }


def tokens_text(tokens):
    return base64.b64encode(tokens).decode()


def record_tokens(record):
    return base64.b64decode(record["tokens"], validate=True)


def prepare(cache, record):
    """The metadata to write ``cache`` with, and its file's size."""
    import mlx_lm.models.cache as cache_module

    metadata = {RECORD: json.dumps(record, sort_keys=True)}
    size = add_checksum(cache_module.save_prompt_cache, cache, metadata)
    return metadata, size


def write(path, cache, metadata):
    """Writes a new file (mode 0600) and syncs it; removes it if the write fails."""
    import mlx_lm.models.cache as cache_module

    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            cache_module.save_prompt_cache(f, cache, metadata)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        os.unlink(path)
        raise


def read_record(path):
    """The record in a file's header; CorruptCacheFile if none parses or no checksum."""
    try:
        with safe_open(os.fspath(path), framework="numpy") as f:
            metadata = f.metadata() or {}
    except SafetensorError as e:
        raise CorruptCacheFile(f"truncated or corrupt: unreadable header or data ({e})")
    # save_prompt_cache nests the caller's metadata under a prefix.
    found = [v for k, v in metadata.items() if k.rpartition(".")[2] == RECORD]
    sums = [v for k, v in metadata.items() if k.rpartition(".")[2] == CHECKSUM]
    if not sums:
        found = []
    elif not all(whole_file(v) for v in sums):
        # An older data-only form would let a changed header (two tensors'
        # offsets swapped) pass: the tier never wrote one, so none is trusted.
        raise CorruptCacheFile(
            f"its checksum is not of the whole file ({sums[0][:16]!r}); the tier "
            "writes and reads only that form"
        )
    try:
        record = json.loads(found[0]) if len(found) == 1 else None
        if not isinstance(record, dict):
            raise ValueError
        record_tokens(record)
    except (ValueError, TypeError, KeyError):
        raise CorruptCacheFile(
            "not a file of the disk tier (no record that reads, or no checksum)"
        )
    return record


def read(path, expected):
    """The cache at ``path`` once its record is ``expected`` and its checksum holds;
    else CorruptCacheFile naming what does not fit."""
    import mlx_lm.models.cache as cache_module

    record = read_record(path)
    for key, why in (
        ("model_digest", "another model's files (weights, config or tokenizer)"),
        (
            "cache_digest",
            "other cache settings (kv-bits, group size, quantized-kv-start) "
            "or another mlx-lm",
        ),
        ("tokens", "other tokens than its index entry"),
    ):
        if record.get(key) != expected[key]:
            raise CorruptCacheFile(f"the file holds a cache of {why}")
    if not hasattr(cache_module.load_prompt_cache, "mlx_lm_mla_original"):
        check_cache_file(path)  # the package's load_prompt_cache checks it itself
    try:
        return cache_module.load_prompt_cache(os.fspath(path))
    except CorruptCacheFile:
        raise
    except Exception as e:  # a layout this mlx-lm cannot read
        raise CorruptCacheFile(f"mlx-lm cannot load it ({type(e).__name__}: {e})")
