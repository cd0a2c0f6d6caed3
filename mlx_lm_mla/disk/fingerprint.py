"""What a prompt cache depends on, as two digests: the model (its weights,
config and tokenizer files) and the cache (its settings and layout). A file
restores only where both are those of the running server."""

import hashlib
import json
import os
from pathlib import Path

# The format of the tier's folder, files and index; a change refuses old ones.
FORMAT = "mlx-lm-mla-disk-2"

# Files read whole (config, tokenizer, chat template); other files (the
# weights) are known by name, size and modification time.
_READ = (".json", ".jinja", ".model", ".txt", ".tiktoken", ".py")
_READ_LIMIT = 64 << 20


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


def _folder_digest(folder, digest):
    digest.update(str(folder).encode())
    for item in sorted(folder.iterdir()):
        if not item.is_file():
            continue
        stat = item.stat()
        digest.update(f"\0{item.name}\0{stat.st_size}".encode())
        if item.suffix in _READ and stat.st_size <= _READ_LIMIT:
            digest.update(hashlib.sha256(item.read_bytes()).digest())
        else:
            digest.update(str(stat.st_mtime_ns).encode())


def model_digest(model_key):
    """Digest of the server's model key's folders, or None if one is not on disk."""
    digest = hashlib.sha256(FORMAT.encode())
    for path in model_key if isinstance(model_key, (tuple, list)) else (model_key,):
        if path is None:
            digest.update(b"\0none")
            continue
        folder = local_path(path)
        if folder is None:
            return None
        _folder_digest(folder, digest)
    return digest.hexdigest()


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
