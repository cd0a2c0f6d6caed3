"""What a prompt cache depends on, as two digests: the model (its weights,
config and tokenizer files) and the cache (its settings and layout). A file
restores only where both are those of the running server."""

import hashlib
import json
import os
from pathlib import Path

# The format of the tier's folder, files and index; a change refuses old ones.
FORMAT = "mlx-lm-mla-disk-2"

# How a model is known; a change makes every stored cache another model's.
MODEL_FORM = "model-2"

# Files read whole (config, tokenizer, chat template); other files (the
# weights) are known by their size, safetensors header and sampled bytes.
_READ = (".json", ".jinja", ".model", ".txt", ".tiktoken", ".py")
_READ_LIMIT = 64 << 20
_ENDS = 1 << 20  # the first and last MiB of a weight file
_BETWEEN, _PIECE = 8, 64 << 10  # and 8 pieces of 64 KiB evenly between
_HEADER_LIMIT = 100 << 20  # safetensors' own limit on its header


def local_path(path):
    """The folder of a model the server loaded (a hub id from the local cache only)."""
    if path is None:
        return None
    if os.path.isdir(path):
        return Path(path).resolve()
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(path), local_files_only=True)).resolve()
    except Exception:
        return None


def _header(fd, size):
    """The JSON header of a safetensors file (tensor names, dtypes, shapes and
    offsets), after its 8-byte little-endian length; None if it is not one."""
    if size < 8:
        return None
    length = int.from_bytes(os.pread(fd, 8, 0), "little")
    if length > min(size - 8, _HEADER_LIMIT):
        return None
    header = os.pread(fd, length, 8)
    return header if header[:1] == b"{" else None


def _pieces(size):
    """(offset, length) of the bytes sampled from a file of ``size`` bytes."""
    if size <= 2 * _ENDS + _BETWEEN * _PIECE:
        return [(0, size)]
    step = (size - _PIECE) // (_BETWEEN + 1)
    middle = [(step * i, _PIECE) for i in range(1, _BETWEEN + 1)]
    return [(0, _ENDS), *middle, (size - _ENDS, _ENDS)]


def _sampled(path, size, digest):
    """A weight file by content, read in part: its safetensors header whole and
    the bytes of ``_pieces``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        header = _header(fd, size)
        digest.update(b"header" + hashlib.sha256(header or b"").digest())
        for offset, length in _pieces(size):
            digest.update(f"\0{offset}:".encode())
            end = offset + length
            while offset < end:  # pread may return less than asked
                chunk = os.pread(fd, min(end - offset, _ENDS), offset)
                if not chunk:
                    raise OSError(f"{path} ended before its size")
                digest.update(chunk)
                offset += len(chunk)
    finally:
        os.close(fd)


def _folder_digest(folder, digest):
    digest.update(str(folder).encode())
    for item in sorted(folder.iterdir()):
        if not item.is_file():
            continue
        size = item.stat().st_size
        digest.update(f"\0{item.name}\0{size}\0".encode())
        if item.suffix in _READ and size <= _READ_LIMIT:
            digest.update(hashlib.sha256(item.read_bytes()).digest())
        else:
            _sampled(item, size, digest)


def model_digest(model_key):
    """Digest of the server's model key's folders, or None if one is not on disk."""
    digest = hashlib.sha256(f"{FORMAT}\0{MODEL_FORM}".encode())
    for path in model_key if isinstance(model_key, (tuple, list)) else (model_key,):
        if path is None:
            digest.update(b"\0none")
            continue
        folder = local_path(path)
        if folder is None:
            return None
        _folder_digest(folder, digest)
    return digest.hexdigest()


def _listed(model_key):
    return list(model_key) if isinstance(model_key, (tuple, list)) else [model_key]


def model_form(model_key):
    """The model key's paths as the index keeps them (JSON): a folder resolved, so
    ``./model`` of two working folders is two models; a hub id as given, so its
    next revision is the same model, whose older caches go."""
    return json.dumps(
        [
            str(Path(p).resolve()) if p is not None and os.path.isdir(p) else p
            for p in _listed(model_key)
        ],
        default=str,
    )


def older_form(model_key):
    """The form rows kept before their paths were resolved (the paths as given),
    where it names the same folders as ``model_form`` (none is relative) and
    differs from it; else None. A relative one's rows may be another folder's."""
    listed = _listed(model_key)
    typed = json.dumps(listed, default=str)
    relative = any(
        p is not None and os.path.isdir(p) and not os.path.isabs(p) for p in listed
    )
    return None if relative or typed == model_form(model_key) else typed


class Fingerprint:
    """A model key's files as the server loaded them: taken at its load, so a
    change of the files after it is another model's, never this one's."""

    def __init__(self, key, paths):
        self.key = key
        self.model, self.older = model_form(paths), older_form(paths)
        self.digest = model_digest(paths)  # None: a folder not on disk


def cache_settings(cli_args):
    """The server's settings and library versions a stored cache depends on."""
    import mlx.core as mx
    import mlx_lm
    import mlx_lm.models.cache as cache_module

    from ..cache import LAYOUT

    active = hasattr(cache_module, "QuantizedLatentCache")
    # mlx-lm 0.31's server has no --kv-bits: its settings are None there.
    return {
        "format": FORMAT,
        "mlx_lm": mlx_lm.__version__,
        "mlx": mx.__version__,
        "latent_layout": LAYOUT if active else None,
        "kv_bits": getattr(cli_args, "kv_bits", None),
        "kv_group_size": getattr(cli_args, "kv_group_size", None),
        "quantized_kv_start": getattr(cli_args, "quantized_kv_start", None),
    }


def cache_digest(settings):
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
