"""Prompt caches an older mlx-lm-mla left, which this one does not read: the
first layout (an ``index.sqlite`` and its files straight in DIR, before the
tier had a folder of its own) and a folder of the tier marked with an older
format. Found at start and named once; ``mlx-lm-mla cache-dir clear``
removes them, and only files of the tier's own names."""

import contextlib
import logging
import os
import re
import sqlite3
from pathlib import Path

from .index import read_only_uri
from .folder import (
    INDEX,
    MARKER,
    NotOurs,
    _write_marker,
    alive,
    aside_stamp,
    is_cache_name,
    is_regular,
    lock_owner,
    temp_owner,
)

logger = logging.getLogger(__name__)

# The first layout's index: its table, exactly these columns.
_FIRST_COLUMNS = {
    "name",
    "model",
    "model_digest",
    "cache_digest",
    "n_tokens",
    "tokens",
    "nbytes",
    "trimmable",
    "last_used",
}
_FIRST_FILE = re.compile(r"[0-9a-f]{40}\.safetensors")
_FIRST_TEMP = re.compile(r"\.tmp-[0-9]+-[0-9a-f]{32}\.safetensors")


def _rollback_database(path):
    """Whether ``path`` is an SQLite database in rollback-journal mode, from its
    header: the first layout never used WAL, and opening a database in WAL mode,
    read-only too, makes its ``-wal`` and ``-shm`` beside it."""
    try:
        with open(path, "rb") as f:
            header = f.read(20)
    except OSError:
        return False
    # Bytes 18 and 19: the versions that write and read it, 1 legacy, 2 WAL.
    return header[:16] == b"SQLite format 3\0" and header[18:20] == b"\1\1"


def first_layout(directory):
    """The files of the first layout in ``directory``: its index (and journal),
    the cache files its rows name, its temporary files. Empty if none; another
    program's ``index.sqlite`` is only read, never opened where SQLite would
    write beside it."""
    directory = Path(directory)
    index = directory / INDEX
    if not is_regular(index) or not _rollback_database(index):
        return []
    try:
        db = sqlite3.connect(read_only_uri(index), uri=True)
        try:
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master")}
            columns = {r[1] for r in db.execute("PRAGMA table_info(entries)")}
            if "meta" in tables or columns != _FIRST_COLUMNS:
                return []
            named = [r[0] for r in db.execute("SELECT name FROM entries")]
        finally:
            db.close()
    except sqlite3.Error:
        return []
    files = [index] + [
        directory / n for n in (f"{INDEX}-journal",) if is_regular(directory / n)
    ]
    files += [
        directory / n
        for n in sorted(set(named))
        if isinstance(n, str) and _FIRST_FILE.fullmatch(n) and is_regular(directory / n)
    ]
    with contextlib.suppress(OSError):
        files += [
            directory / n
            for n in sorted(os.listdir(directory))
            if _FIRST_TEMP.fullmatch(n) and is_regular(directory / n)
        ]
    return files


def older_folder(folder):
    """The files of the tier's own names in a folder of an older format."""
    return [
        folder / n
        for n in sorted(os.listdir(folder))
        if (
            is_cache_name(n)
            or temp_owner(n)
            or lock_owner(n)
            or aside_stamp(n)
            or n in (INDEX, f"{INDEX}-journal", f"{INDEX}-wal", f"{INDEX}-shm")
        )
        and is_regular(folder / n)
    ]


def _cache(name):
    return bool(_FIRST_FILE.fullmatch(name) or is_cache_name(name))


def describe(files):
    nbytes = sum(p.stat().st_size for p in files if is_regular(p))
    caches = sum(1 for p in files if _cache(p.name))
    return f"{caches} cache files, {nbytes / 1e6:,.1f} MB"


def note_first_layout(directory):
    """One INFO line where ``directory`` holds the first layout's caches."""
    files = first_layout(directory)
    if files:
        logger.info(
            "mlx-lm-mla: %s holds prompt caches of an older mlx-lm-mla (%s, beside "
            "%s), which this one does not read; `mlx-lm-mla cache-dir clear %s` "
            "removes them",
            directory,
            describe(files),
            INDEX,
            directory,
        )
    return files


def remove(files, why):
    """Deletes ``files`` (found by the functions above); their count and bytes."""
    count, nbytes = 0, 0
    for path in files:
        if not is_regular(path):
            continue
        size = path.stat().st_size
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            count += _cache(path.name)
            nbytes += size
            logger.info("mlx-lm-mla: deleted %s: %s", path, why)
    return count, nbytes


def clear_older_folder(folder):
    """Deletes an older format's files of the tier's names, then marks the
    folder with this format; its count and bytes."""
    for name in os.listdir(folder):
        if lock_owner(name) and alive(folder, lock_owner(name)):
            raise NotOurs(
                f"{folder} is in use by a running server of an older mlx-lm-mla; "
                "stop it first"
            )
    done = remove(older_folder(folder), "a prompt cache of an older format")
    _write_marker(Path(folder) / MARKER)
    return done
