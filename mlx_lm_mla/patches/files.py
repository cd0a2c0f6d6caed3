"""Patches on prompt cache files (``save_prompt_cache`` /
``load_prompt_cache`` of ``mlx_lm.models.cache``), so a damaged file is
refused by name instead of loading garbage, and a latent cache is saved
with a checksum."""

import functools
import io
import json
import os
import tempfile
import zlib
from copy import deepcopy

from safetensors import SafetensorError, safe_open

from ..mla import is_latent, leaves
from .table import Patch

CACHE = "mlx_lm.models.cache"

# The checksum of a saved latent cache, in the file's metadata: CRC-32 of
# the file's data (every tensor's bytes, after the header). The data does
# not depend on the metadata, so it is known before the file is written
# (``DataChecksum``), and the file is written once.
CHECKSUM = "mlx_lm_mla_crc32"


class CorruptCacheFile(ValueError):
    """A prompt cache file that cannot be what it claims to be."""


class DataChecksum(io.RawIOBase):
    """A sink for the bytes of a safetensors file (an 8-byte little-endian
    header length, the header, then the data) that keeps the CRC-32 of its
    data. ``mx.save_safetensors`` can write into it, so a file's checksum is
    known before the file is written, without holding its bytes."""

    def __init__(self):
        self.crc, self.position, self.prefix, self.header = 0, 0, b"", None

    def writable(self):
        return True

    def tell(self):
        return self.position

    def write(self, data):
        view = memoryview(data).cast("B")
        written = len(view)
        self.position += written
        if self.header is None:  # the length of the header comes first
            taken = 8 - len(self.prefix)
            self.prefix, view = self.prefix + bytes(view[:taken]), view[taken:]
            if len(self.prefix) < 8:
                return written
            self.header = int.from_bytes(self.prefix, "little")
        skipped = min(self.header, len(view))
        self.header -= skipped
        self.crc = zlib.crc32(view[skipped:], self.crc)
        return written

    def value(self):
        return f"crc32:{self.crc:08x}"


def check_cache_file(path):
    """Checks that a ``.safetensors`` prompt cache file is whole, with the
    safetensors library (a readable header, every tensor's bytes exactly
    inside the file), and, where the file has a checksum (latent caches
    saved with the package), the right checksum. Older MLX reads past the
    end of a truncated file without an error."""
    path = os.fspath(path)
    try:
        with safe_open(path, framework="numpy") as f:
            metadata = f.metadata() or {}
    except SafetensorError as e:
        raise CorruptCacheFile(
            f"prompt cache file {path} is truncated or corrupt (unreadable header "
            f"or data): {e}"
        )
    # Saved inside the caller's metadata, which save_prompt_cache nests.
    expected = [v for k, v in metadata.items() if k.rpartition(".")[2] == CHECKSUM]
    if not expected:
        return
    found = DataChecksum()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            found.write(chunk)
    if expected != [found.value()]:
        raise CorruptCacheFile(
            f"prompt cache file {path} is corrupt: its checksum does not match "
            "its contents (the file changed after it was saved)"
        )


# mlx before 0.32.4 cannot write a zero-size array, and mlx-lm 0.31's DSA
# indexer keeps its values as one (width 0), so stock cannot save a
# DeepSeek-V3.2 / GLM-5 cache there. Where mlx cannot, such an array is
# written as a stand-in, its shape and dtype recorded here, and put back on load.
EMPTY = "mlx_lm_mla_empty"


@functools.cache
def _mlx_writes_empty():
    # Known by trying once: which mlx release learned it is not documented.
    import mlx.core as mx

    with tempfile.TemporaryDirectory() as folder:
        try:
            mx.save_safetensors(os.path.join(folder, "probe.safetensors"), {"a": mx.zeros((0,))})
        except ValueError:
            return False
    return True


def _is_empty(x):
    import mlx.core as mx

    return isinstance(x, mx.array) and x.size == 0


def _stand_in(x):
    # A zero-size array as one of the same rank, so setters that read its
    # length (KVCache: keys.shape[2]) still take it until it is put back.
    import mlx.core as mx

    return mx.zeros([d or 1 for d in x.shape], x.dtype) if _is_empty(x) else x


def _writable(layer):
    """``layer``, or a copy of it whose state has no zero-size array; and
    where those arrays were."""
    from mlx.utils import tree_flatten, tree_map

    if _mlx_writes_empty():
        return layer, []
    state = layer.state
    empty = [(path, x) for path, x in tree_flatten(state) if _is_empty(x)]
    if not empty:
        return layer, []
    copy = deepcopy(layer)  # the caller's cache is left as it is
    copy.state = tree_map(_stand_in, state)
    return copy, [[path, list(x.shape), str(x.dtype).rsplit(".", 1)[-1]] for path, x in empty]


def _replace(tree, path, value):
    # A copy of a nested state with ``value`` at ``path``.
    if not path:
        return value
    items = list(tree)
    items[path[0]] = _replace(items[path[0]], path[1:], value)
    return items


def _put_back_empty(file_name, cache, record):
    """Restores the zero-size arrays ``_writable`` stood in for."""
    import mlx.core as mx

    try:
        for i, arrays in json.loads(record).items():
            layer = cache[int(i)]
            state = layer.state
            for path, shape, dtype in arrays:
                where = [int(p) for p in path.split(".")]  # tree_flatten's path
                state = _replace(state, where, mx.zeros(shape, getattr(mx, dtype)))
            layer.state = state
    except (ValueError, TypeError, LookupError, AttributeError) as e:
        raise CorruptCacheFile(
            f"prompt cache file {file_name}: its {EMPTY} record does not fit the "
            f"cache it was saved with ({type(e).__name__}: {e})"
        )


def table():
    return [
        Patch(CACHE, "load_prompt_cache", "rebind", checked_load),
        Patch(CACHE, "save_prompt_cache", "rebind", checked_save),
    ]


def add_checksum(save, cache, metadata):
    """Puts into ``metadata`` the CRC-32 of the data ``save`` (a
    ``save_prompt_cache``) writes for ``cache``, read from its own serialization."""
    checksum = DataChecksum()
    save(checksum, cache, metadata)
    metadata[CHECKSUM] = checksum.value()


def checked_save(original):
    """``save_prompt_cache`` that stores a checksum with a latent cache, and
    writes a cache holding zero-size arrays (see ``EMPTY``)."""

    def save_prompt_cache(file_name, cache, *args, **kwargs):
        layers, empty = [], {}
        for i, c in enumerate(cache):
            layer, found = _writable(c)
            layers.append(layer)
            if found:
                empty[str(i)] = found
        latent = any(is_latent(c) for c in leaves(cache))
        if not (latent or empty):
            return original(file_name, cache, *args, **kwargs)
        metadata = dict((args[0] if args else kwargs.get("metadata")) or {})
        if empty:
            metadata[EMPTY] = json.dumps(empty)
        if latent:
            add_checksum(original, layers, metadata)
        original(file_name, layers, metadata)

    save_prompt_cache.mlx_lm_mla_original = original
    return save_prompt_cache


def checked_load(original):
    """``load_prompt_cache`` that checks the file is whole first, puts back
    what ``checked_save`` stood in for, and hands back the caller's metadata
    without the package's own fields."""

    def load_prompt_cache(file_name, return_metadata=False):
        check_cache_file(file_name)
        cache, metadata = original(file_name, return_metadata=True)
        if isinstance(metadata, dict):
            metadata.pop(CHECKSUM, None)
            record = metadata.pop(EMPTY, None)
            if record is not None:
                _put_back_empty(file_name, cache, record)
        return (cache, metadata) if return_metadata else cache

    load_prompt_cache.mlx_lm_mla_original = original
    return load_prompt_cache
