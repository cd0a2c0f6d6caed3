"""Checks on prompt cache files (``save_prompt_cache`` / ``load_prompt_cache``)
and on a loaded cache meeting its model, so a damaged or foreign file is
refused by name instead of loading garbage or failing deep in the model."""

import functools
import json
import os
import re
import struct
import tempfile
import zlib

from safetensors import SafetensorError, safe_open

# The checksum of a saved latent cache, in the file's metadata. It is
# written as a placeholder of the same length first, then filled in place.
CHECKSUM = "mlx_lm_mla_crc32"
_PENDING = b"crc32:????????"
_FIELD = re.compile(
    rb'"(?:\d+\.)?' + CHECKSUM.encode() + rb'"\s*:\s*"(crc32:[0-9a-f?]{8})"'
)


class CorruptCacheFile(ValueError):
    """A prompt cache file that cannot be what it claims to be."""


def _raw_header(path):
    """The header's bytes, where the checksum field sits (the file was
    checked by safetensors first: its length prefix is sound)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return f.read(length)


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
    if not any(k.rpartition(".")[2] == CHECKSUM for k in metadata):
        return
    found = _FIELD.search(_raw_header(path))
    if found is None or found.group(1) != _file_checksum(path, found.span(1)):
        raise CorruptCacheFile(
            f"prompt cache file {path} is corrupt: its checksum does not match "
            "its contents (the file changed after it was saved)"
        )


def _file_checksum(path, span):
    # CRC-32 of the whole file with the checksum field itself read as pending.
    crc, (a, b) = 0, span
    with open(path, "rb") as f:
        crc = zlib.crc32(f.read(8 + a), crc)
        f.seek(8 + b)
        crc = zlib.crc32(_PENDING, crc)
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return f"crc32:{crc:08x}".encode()


def _stamp(path):
    """Fills in the checksum placeholder of a file just saved."""
    found = _FIELD.search(_raw_header(path))
    if found is None or found.group(1) != _PENDING:
        return
    value = _file_checksum(path, found.span(1))
    with open(path, "r+b") as f:
        f.seek(8 + found.start(1))
        f.write(value)


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
    """``layer``, or a stand-in under its class name whose state has no
    zero-size array; and where those arrays were."""
    from mlx.utils import tree_flatten, tree_map

    if _mlx_writes_empty():
        return layer, []
    state = layer.state
    empty = [(path, x) for path, x in tree_flatten(state) if _is_empty(x)]
    if not empty:
        return layer, []
    fields = {"state": tree_map(_stand_in, state)}
    if hasattr(layer, "meta_state"):  # mlx-lm 0.31 saves it
        fields["meta_state"] = layer.meta_state
    stand_in = type(type(layer).__name__, (), fields)()
    return stand_in, [[path, list(x.shape), str(x.dtype).rsplit(".", 1)[-1]] for path, x in empty]


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


def checked_save(original, is_latent):
    """``save_prompt_cache`` that stores a checksum with a latent cache, and
    writes a cache holding zero-size arrays (see ``EMPTY``)."""

    def save_prompt_cache(file_name, cache, *args, **kwargs):
        from .latent import leaves

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
            metadata[CHECKSUM] = _PENDING.decode()
        original(file_name, layers, metadata)
        if latent:
            _stamp(os.fspath(file_name))

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


# --- a cache meeting its model ---------------------------------------------


def _latent_widths(model):
    """{layer index: (latent width, RoPE width, CacheList member or None)}
    for the layers with one MLA attention. Found once per model instance."""
    from .latent import ATTENTION, latent_modules

    found = vars(model).get("_mlx_lm_mla_widths")
    if found is None:
        found = {}
        for i, layer in enumerate(getattr(model, "layers", [])):
            mods = latent_modules(layer)
            rope = getattr(mods[0], "qk_rope_head_dim", None) if len(mods) == 1 else None
            if isinstance(rope, int):
                found[i] = (mods[0].kv_lora_rank, rope, ATTENTION[type(mods[0])])
        object.__setattr__(model, "_mlx_lm_mla_widths", found)
    return found


def cache_mismatch(model, cache):
    """Why ``cache`` cannot serve ``model``, or None. Checks the layers that
    cache an MLA latent: a cache of per-head K/V (saved from a model with
    full attention, such as DeepSeek-V2) or of other widths is named."""
    import mlx.core as mx

    widths = _latent_widths(model) if cache else {}
    if not widths or len(cache) != len(model.layers):
        return None
    for i, (latent, rope, member) in widths.items():
        c, inner = cache[i], getattr(cache[i], "caches", None)
        if member is not None and isinstance(inner, (list, tuple)) and len(inner) > member:
            c = inner[member]
        fmt = getattr(c, "_format", None)
        if fmt is not None:
            held = (fmt[2], fmt[4])
            heads = 1
        else:
            k, v = getattr(c, "keys", None), getattr(c, "values", None)
            if not (
                isinstance(k, mx.array) and isinstance(v, mx.array) and k.ndim == 4
            ):
                continue
            held, heads = (k.shape[-1], v.shape[-1]), k.shape[1]
        if heads != 1:
            return (
                f"prompt cache layer {i} ({type(c).__name__}) holds per-head keys and "
                f"values ({heads} heads, widths {held[0]} and {held[1]}), as a model "
                "with full attention saves them; this model caches one MLA latent "
                f"per layer (1 head, widths {latent} and {rope})"
            )
        if held != (latent, rope):
            return (
                f"prompt cache layer {i} ({type(c).__name__}) holds a latent of width "
                f"{held[0]} and a RoPE key of width {held[1]}; this model caches "
                f"widths {latent} and {rope}: the cache is from another model"
            )
    return None


def checked_generate_step(original):
    """``generate_step`` that refuses a prompt cache its model cannot use, or
    one quantized otherwise than ``kv_bits`` asks, before the first step."""

    def generate_step(prompt, model, *args, **kwargs):
        from .latent import mark_model_caches

        cache = kwargs.get("prompt_cache")
        if isinstance(cache, (list, tuple)):
            mark_model_caches(model, cache)
            bits, group_size = kwargs.get("kv_bits"), kwargs.get("kv_group_size", 64)
            problem = cache_mismatch(model, cache) or settings_mismatch(cache, bits, group_size)
            if problem:
                raise ValueError(problem)
        return original(prompt, model, *args, **kwargs)

    generate_step.mlx_lm_mla_original = original
    return generate_step


def settings_mismatch(cache, bits, group_size):
    """Why a cache whose latent is quantized cannot continue under ``kv_bits``
    / ``kv_group_size``, or None. Refused up front, as ``mlx_lm.generate``
    refuses a loaded ``QuantizedKVCache`` of other bits: otherwise it would
    fail only once ``quantized_kv_start`` is reached (``to_quantized`` does
    not requantize), and until then decode at the cache's own bits."""
    from .cache import _PackedLatent
    from .latent import leaves

    if bits is None:
        return None
    for c in leaves(cache):
        if isinstance(c, _PackedLatent) and (c.group_size, c.latent_bits) != (int(group_size), int(bits)):
            return (
                f"prompt cache: its MLA latent is quantized with group_size "
                f"{c.group_size} and {c.latent_bits} bits; kv_bits {bits} with "
                f"kv_group_size {group_size} was asked for, and a quantized cache "
                "is not requantized"
            )
    return None
