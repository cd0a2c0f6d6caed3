"""The checksum of the package's prompt cache files (``patches/files.py``, ``disk/``):
a metadata entry holding the CRC-32 of the whole file, header included, with its
own digits read as zeros. A save into a sink learns it (and the size) first.
"""

import io
import os
import zlib

from safetensors import SafetensorError, safe_open

CHECKSUM = "mlx_lm_mla_crc32"
_FORM = "file-crc32:"
BLANK = _FORM + "0" * 8  # the value while the checksum is computed
# Files saved before the header was covered: a CRC-32 of the data only.
_DATA_FORM = "crc32:"


def whole_file(value):
    """Whether a checksum value is of the form that covers the header too (the
    disk tier's files were never written in another)."""
    return isinstance(value, str) and value.startswith(_FORM)


class CorruptCacheFile(ValueError, RuntimeError):
    """A prompt cache file that cannot be what it claims to be (a RuntimeError
    too: what stock's load raises for a file it cannot read)."""


class _Sink(io.RawIOBase):
    """Counts and checksums what is written to it, keeping nothing."""

    def __init__(self):
        self.crc, self.size = 0, 0

    def writable(self):
        return True

    def tell(self):
        return self.size

    def write(self, data):
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.size += len(view)
        return len(view)


def add_checksum(save, cache, metadata):
    """Puts into ``metadata`` the checksum of what ``save`` writes; returns its size."""
    metadata[CHECKSUM] = BLANK
    sink = _Sink()
    save(sink, cache, metadata)
    metadata[CHECKSUM] = f"{_FORM}{sink.crc:08x}"
    return sink.size


def check_cache_file(path):
    """Checks a prompt cache file is whole, with safetensors (older MLX reads past
    the end of a truncated file), and that its checksum, if any, matches."""
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
    found = [v for k, v in metadata.items() if k.rpartition(".")[2] == CHECKSUM]
    if not found:
        return
    value = found[0]
    with open(path, "rb") as f:
        head = f.read(8)
        header = f.read(int.from_bytes(head, "little"))
        crc = _crc_before_data(value, len(found), head, header)
        while crc is not None and (chunk := f.read(1 << 24)):
            crc = zlib.crc32(chunk, crc)
    form = _FORM if value.startswith(_FORM) else _DATA_FORM
    if crc is None or f"{form}{crc:08x}" != value:
        raise CorruptCacheFile(
            f"prompt cache file {path} is corrupt: its checksum does not match "
            "its contents (the file changed after it was saved, or was saved "
            f"without mlx-lm-mla with the {CHECKSUM} metadata of another file)"
        )


def _crc_before_data(value, count, head, header):
    """The CRC-32 of what precedes the data as ``value``'s form counts it, or None."""
    quoted = f'"{value}"'.encode()
    if count != 1:
        return None
    if value.startswith(_DATA_FORM):
        return 0
    if not value.startswith(_FORM) or header.count(quoted) != 1:
        return None
    return zlib.crc32(head + header.replace(quoted, f'"{BLANK}"'.encode()))
