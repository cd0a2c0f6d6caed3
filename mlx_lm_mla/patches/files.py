"""Patches on ``save_prompt_cache``/``load_prompt_cache``: a latent cache is saved
with a checksum, and a damaged file is refused by name instead of loading garbage."""

import contextlib
import functools
import inspect
import json
import os
import stat
import tempfile
import uuid
from copy import deepcopy

from ..cache import BatchMixedLatentCache
from ..checksum import BLANK, CHECKSUM, CorruptCacheFile, add_checksum, check_cache_file
from ..mla import is_latent, leaves
from .table import FILES, Patch

CACHE = "mlx_lm.models.cache"


# mlx < 0.32.4 cannot write a zero-size array, which mlx-lm 0.31's DSA indexer
# keeps as values: such an array is written as a stand-in, recorded here.
EMPTY = "mlx_lm_mla_empty"


@functools.cache
def _mlx_writes_empty():
    # Known by trying once: which mlx release learned it is not documented.
    import mlx.core as mx

    with tempfile.TemporaryDirectory() as folder:
        try:
            mx.save_safetensors(
                os.path.join(folder, "probe.safetensors"), {"a": mx.zeros((0,))}
            )
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
    """``layer``, or a copy with no zero-size array, and where those were."""
    from mlx.utils import tree_flatten, tree_map

    if _mlx_writes_empty():
        return layer, []
    state = layer.state
    empty = [(path, x) for path, x in tree_flatten(state) if _is_empty(x)]
    if not empty:
        return layer, []
    copy = deepcopy(layer)  # the caller's cache is left as it is
    copy.state = tree_map(_stand_in, state)
    return copy, [
        [path, list(x.shape), str(x.dtype).rsplit(".", 1)[-1]] for path, x in empty
    ]


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
        Patch(CACHE, "load_prompt_cache", "rebind", checked_load, FILES),
        Patch(CACHE, "save_prompt_cache", "rebind", checked_save, FILES),
    ]


def _write_whole(original, file_name, cache, metadata):
    """``original``'s save to a path whole or not at all: into a new file beside
    it, renamed over it once written, so a failed save (a full disk) leaves the
    file that was there. A file object is written as it is."""
    if not isinstance(file_name, (str, os.PathLike)):
        return original(file_name, cache, metadata)
    path = os.fspath(file_name)
    if not path.endswith(".safetensors"):
        path += ".safetensors"  # as mlx names the file it writes
    path = os.path.realpath(path)  # a link is kept: its target is written
    folder, name = os.path.split(path)
    temp = os.path.join(folder, f".{name}.{uuid.uuid4().hex}.safetensors")
    try:
        os.close(os.open(temp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    except OSError:  # a folder it may not write in: in place, as stock writes
        return original(file_name, cache, metadata)
    try:
        original(temp, cache, metadata)
        with contextlib.suppress(FileNotFoundError):  # the mode it had, as stock
            os.chmod(temp, stat.S_IMODE(os.stat(path).st_mode))
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def checked_save(original):
    """``save_prompt_cache`` that stores a checksum with a latent cache, writes
    zero-size arrays (``EMPTY``) and replaces a file only once written whole."""
    # Its own default (0.31: {}, 0.32: None): the signature stays stock's.
    default = inspect.signature(original).parameters["metadata"].default

    def save_prompt_cache(file_name, cache, metadata=default):
        for c in leaves(cache):
            if isinstance(c, BatchMixedLatentCache):
                # Its state is the rows as read, without their bytes: the file
                # would not load back. Its rows can: each is a cache alone.
                raise ValueError(
                    "save_prompt_cache: a BatchMixedLatentCache (a batch whose "
                    "rows differ in precision) cannot be saved; save the cache "
                    "of each row (extract(i)) instead"
                )
        layers, empty = [], {}
        for i, c in enumerate(cache):
            layer, found = _writable(c)
            layers.append(layer)
            if found:
                empty[str(i)] = found
        latent = any(is_latent(c) for c in leaves(cache))
        if not (latent or empty):
            return original(file_name, cache, metadata)
        metadata = dict(metadata or {})
        if empty:
            metadata[EMPTY] = json.dumps(empty)
        # This cache's own: a checksum in the caller's metadata may be carried
        # over from a file loaded without the package. BLANK: one being made.
        if latent and metadata.get(CHECKSUM) != BLANK:
            add_checksum(original, layers, metadata)
        _write_whole(original, file_name, layers, metadata)

    save_prompt_cache.mlx_lm_mla_original = original
    return save_prompt_cache


def checked_load(original):
    """``load_prompt_cache`` that checks the file first, puts back the stand-ins and
    drops the package's own metadata."""

    def load_prompt_cache(file_name, return_metadata=False):
        import mlx.core as mx
        from mlx.utils import tree_flatten

        # A file object, which safetensors cannot open, is read unchecked; a
        # missing file gets stock's own error.
        path = isinstance(file_name, (str, os.PathLike)) and os.path.isfile(file_name)
        if path:
            check_cache_file(file_name)
        cache, metadata = original(file_name, return_metadata=True)
        if path:  # mx.load reads lazily: read now the bytes just checked
            arrays = tree_flatten([c.state for c in cache])
            mx.eval([x for _, x in arrays if isinstance(x, mx.array)])
        if isinstance(metadata, dict):
            metadata.pop(CHECKSUM, None)
            record = metadata.pop(EMPTY, None)
            if record is not None:
                _put_back_empty(file_name, cache, record)
        return (cache, metadata) if return_metadata else cache

    load_prompt_cache.mlx_lm_mla_original = original
    return load_prompt_cache
