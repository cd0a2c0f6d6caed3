"""Checks on the paths where a cache is reused, so a bad cache is refused
with a clear error instead of poisoning later requests."""

import json
import math
import os
import struct

_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8, "C64": 8,
}


class CorruptCacheFile(ValueError):
    """A prompt cache file that cannot be what it claims to be."""


def check_cache_file(path):
    """Checks that a ``.safetensors`` prompt cache file is whole: a readable
    header, and every tensor's bytes inside the file. Older MLX reads past
    the end of a truncated file without an error, which would load garbage.
    """
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CorruptCacheFile(f"prompt cache file {path} is too short ({size} bytes)")
        (header_len,) = struct.unpack("<Q", head)
        if 8 + header_len > size:
            raise CorruptCacheFile(
                f"prompt cache file {path} is truncated: its header needs "
                f"{8 + header_len} bytes, the file has {size}"
            )
        try:
            header = json.loads(f.read(header_len))
        except ValueError as e:
            raise CorruptCacheFile(f"prompt cache file {path} has an unreadable header: {e}")
    if not isinstance(header, dict):
        raise CorruptCacheFile(f"prompt cache file {path} has an unreadable header")
    data = size - 8 - header_len
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = info["data_offsets"]
            expected = math.prod(info["shape"]) * _DTYPE_BYTES.get(info["dtype"], 0)
        except (KeyError, TypeError, ValueError):
            raise CorruptCacheFile(f"prompt cache file {path}: tensor {name!r} is malformed")
        if end > data or end - start < 0 or (expected and end - start != expected):
            raise CorruptCacheFile(
                f"prompt cache file {path} is truncated or corrupt: tensor "
                f"{name!r} needs bytes {start}..{end} of {data}"
            )
