"""``mlx-lm-mla cache-dir stats|clear DIR``: what the disk tier keeps in DIR, and
``clear``, which deletes only the tier's own files."""

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from . import older
from .folder import (
    INDEX,
    MARKER,
    SUBFOLDER,
    NotOurs,
    OlderFormat,
    Presence,
    aside_stamp,
    is_cache_name,
    is_regular,
    lock_owner,
    maintenance,
    open_folder,
    temp_owner,
)
from .index import Index
from . import index as rows
from .tier import open_index, sweep, unlink

logger = logging.getLogger(__name__)


def _size(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024


def _path(directory):
    return Path(directory).expanduser().absolute()


def _files(folder):
    """(cache files, temporary files, indexes moved aside by name, other names)
    in the folder, with bytes."""
    caches, temps, asides, other = [], [], {}, []
    for name in sorted(os.listdir(folder)):
        path = folder / name
        size = os.lstat(path).st_size
        if is_cache_name(name) and is_regular(path):
            caches.append(size)
        elif temp_owner(name) and is_regular(path):
            temps.append(size)
        elif aside_stamp(name) and is_regular(path):
            asides[name] = size
        elif not (lock_owner(name) or name == MARKER or name.startswith(INDEX)):
            other.append(name)
    return caches, temps, asides, other


def stats(directory, out=None):
    """Prints what the tier's folder in ``directory`` holds; writes nothing."""
    out = out or sys.stdout
    first = older.first_layout(_path(directory))
    if first:
        print(
            f"{_path(directory)}: prompt caches of an older mlx-lm-mla "
            f"({older.describe(first)}, beside {INDEX}), not read by this one; "
            "`clear` deletes them",
            file=out,
        )
    try:
        folder = open_folder(directory, create=False)
    except OlderFormat as e:
        found = older.describe(older.older_folder(_path(directory) / SUBFOLDER))
        print(f"{e} ({found})", file=out)
        return
    except NotOurs:
        if first:
            return
        raise
    caches, temps, asides, other = _files(folder)
    print(f"{folder}: {len(caches)} cache files, {_size(sum(caches))}", file=out)
    if asides:
        print(
            f"  index moved aside: {', '.join(asides)}, {_size(sum(asides.values()))} "
            "(counted toward the bound; `clear` deletes it)",
            file=out,
        )
    if temps:
        print(
            f"  being written (or left by a crash): {len(temps)} temporary files, "
            f"{_size(sum(temps))}",
            file=out,
        )
    if other:
        print(f"  not the tier's, left alone: {', '.join(other)}", file=out)
    index = Index(folder, read_only=True)  # a stray journal is left as it is
    why = index.problem()
    if why not in (None, rows.PREVIOUS):  # the previous schema reads alike
        print(
            f"  index: {why}; the next server start builds it again from the files",
            file=out,
        )
        return
    index.db.execute("PRAGMA query_only = ON")
    for model, settings, n, nbytes, fewest, most, used in index.summary():
        paths = ", ".join(p for p in json.loads(model) if p)
        settings = json.loads(settings)
        kv = (
            f"kv-bits {settings.get('kv_bits')}" if settings.get("kv_bits") else "exact"
        )
        print(
            f"  model {paths} ({kv}, mlx-lm {settings.get('mlx_lm')}): {n} files, "
            f"{_size(nbytes)}, {fewest:,}-{most:,} tokens, last used "
            f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(used))}",
            file=out,
        )
    index.close()


def clear(directory, out=None):
    """Deletes the tier's cache files (and dead processes' temporary files) in
    ``directory``; its folder, marker and index stay."""
    out = out or sys.stdout
    first = older.first_layout(_path(directory))
    if first:
        n, nbytes = older.remove(first, "mlx-lm-mla cache-dir clear (an older layout)")
        print(
            f"{_path(directory)}: deleted {n} cache files of an older mlx-lm-mla, "
            f"{_size(nbytes)}",
            file=out,
        )
    try:
        folder = open_folder(directory, create=False)
    except OlderFormat:
        folder = _path(directory) / SUBFOLDER
        n, nbytes = older.clear_older_folder(folder)
        print(
            f"{folder}: deleted {n} cache files of an older format, {_size(nbytes)}",
            file=out,
        )
        return
    except NotOurs:
        if first:
            return
        raise
    index = Index(folder)
    with maintenance(folder):
        open_index(folder, index)
        presence = Presence(folder)
        try:
            with index.transaction() as db:
                sweep(folder, db, presence)
                names = rows.names(db)
                db.execute("DELETE FROM entries")
                rows.set_aside_bytes(db, 0)
        finally:
            presence.release()
        asides = _files(folder)[2]
        for name in asides:
            unlink(folder, name, "mlx-lm-mla cache-dir clear")
    freed = 0
    for name in names:
        size = os.lstat(folder / name).st_size if is_regular(folder / name) else 0
        if unlink(folder, name, "mlx-lm-mla cache-dir clear"):
            freed += size
    index.close()
    moved = len({aside_stamp(name) for name in asides})
    print(
        f"{folder}: deleted {len(names)} cache files, {_size(freed)}"
        + (
            f", and {moved} index moved aside, {_size(sum(asides.values()))}"
            if moved
            else ""
        ),
        file=out,
    )


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="mlx-lm-mla cache-dir",
        description="The prompt caches a server keeps on disk "
        "(--prompt-cache-dir DIR).",
    )
    parser.add_argument(
        "action",
        choices=["stats", "clear"],
        help="stats: what is stored, for which model, how big; clear: delete "
        "the tier's cache files (nothing else)",
    )
    parser.add_argument(
        "directory", metavar="DIR", help="the folder given to --prompt-cache-dir"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        (stats if args.action == "stats" else clear)(args.directory)
    except NotOurs as e:
        print(f"mlx-lm-mla cache-dir: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a read-only file system, a folder not ours to write
        print(
            f"mlx-lm-mla cache-dir: error: cannot {args.action} "
            f"{_path(args.directory)}: {e.strerror or e}",
            file=sys.stderr,
        )
        return 2
    return 0
