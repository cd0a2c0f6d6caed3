"""The disk tier: the server's prompt caches written to a folder in the
background, found again by their tokens' block hashes, evicted least recently
used past the folder's bound. Opening the folder repairs what a crash left."""

import contextlib
import errno
import hashlib
import json
import logging
import os
import queue
import sqlite3
import threading
import time

import numpy as np

from ..checksum import CorruptCacheFile
from ..guards.reuse import cache_problem, main_layers
from . import cachefile, older
from . import index as rows
from .fingerprint import Fingerprint, cache_digest
from .folder import (
    ASIDE,
    INDEX,
    NotOurs,
    TRANSIENT,
    Presence,
    aside_stamp,
    alive,
    cache_name,
    is_cache_name,
    is_regular,
    lock_owner,
    maintenance,
    open_folder,
    temp_name,
    temp_owner,
)
from .index import BLOCK, Index, block_hashes, root

logger = logging.getLogger(__name__)

DEFAULT_MIN_TOKENS = 256
EVICTED = "least recently used, the folder was over its bound"
SHRINK_STEP = 512  # files evicted in one transaction at start


def _common(a, b):
    """Length, in tokens, of the common prefix of two int32 byte strings."""
    a, b = np.frombuffer(a, dtype="<i4"), np.frombuffer(b, dtype="<i4")
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _token_bytes(tokens):
    try:
        return np.asarray(tokens, dtype="<i4").tobytes()
    except (TypeError, ValueError, OverflowError):
        return None  # a key that is not plain token ids (images)


def unlink(folder, name, why, level=logging.INFO):
    """Deletes one of the tier's own plain files, logged with ``why``."""
    path = folder / name
    own = (
        is_cache_name(name) or temp_owner(name) or lock_owner(name) or aside_stamp(name)
    )
    if not own or os.path.basename(name) != name:
        logger.warning(
            "mlx-lm-mla: the index names %r, not a file of the tier; nothing deleted",
            name,
        )
        return False
    if not is_regular(path):
        if os.path.lexists(path):
            logger.warning("mlx-lm-mla: %s is not a regular file; left alone", path)
        return False
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    logger.log(level, "mlx-lm-mla: deleted %s: %s", path, why)
    return True


def open_index(folder, index):
    """Moves an unreadable ``index`` aside and builds it again from the files'
    records. Call in maintenance."""
    why = index.problem()
    if why is None:
        return
    if why == rows.PREVIOUS:
        index.migrate()
        logger.info(
            "mlx-lm-mla: the index of %s was brought to schema %s", folder, rows.SCHEMA
        )
        return
    aside = index.move_aside()  # with a journal of its own, where one is left
    if aside:
        keep_one_aside(folder, aside)
    index.create()
    with index.transaction() as db:
        found = [n for n in sorted(os.listdir(folder)) if is_cache_name(n)]
        adopted = sum(adopt(folder, db, name) for name in found)
    if why != "missing":
        logger.warning(
            "mlx-lm-mla: the index of %s was %s; moved aside to %s and built again "
            "from %d cache files",
            folder,
            why,
            aside,
            adopted,
        )
    elif found:
        logger.warning(
            "mlx-lm-mla: %s had no index; built one from %d cache files",
            folder,
            adopted,
        )


def keep_one_aside(folder, newest):
    """Deletes the indexes moved aside before ``newest``: one is kept to look
    into, and it counts toward the bound."""
    for name in sorted(os.listdir(folder)):
        stamp = aside_stamp(name)
        if stamp and stamp != newest[len(ASIDE) :]:
            unlink(folder, name, "an older index moved aside; the newest is kept")


def aside_bytes(folder, names=None):
    """Bytes of the indexes moved aside (and of their journals)."""
    total = 0
    for name in os.listdir(folder) if names is None else names:
        if aside_stamp(name) and is_regular(folder / name):
            with contextlib.suppress(OSError):
                total += os.lstat(folder / name).st_size
    return total


def adopt(folder, db, name):
    """Adds a cache file's row from its record; deletes a file whose record does
    not read or fit its name."""
    path = folder / name
    if not is_regular(path):
        logger.warning("mlx-lm-mla: %s is not a regular file; left alone", path)
        return False
    try:
        record = cachefile.read_record(path)
        tokens = cachefile.record_tokens(record)
        if name != file_name(record["model_digest"], record["cache_digest"], tokens):
            raise CorruptCacheFile("its record is not that of its name")
        rows.add(
            db, name, record, tokens, os.stat(path).st_size, os.stat(path).st_mtime
        )
    except (CorruptCacheFile, KeyError, TypeError, ValueError) as e:
        unlink(folder, name, f"refused: {e}", logging.WARNING)
        return False
    except FileNotFoundError:
        return False
    return True


def file_name(model_digest, cache_digest, tokens):
    return cache_name(
        hashlib.sha256(f"{model_digest}{cache_digest}".encode() + tokens).hexdigest()
    )


def sweep(folder, db, presence):
    """Removes what a crash can leave (files and locks of gone processes, rows of
    missing files) and indexes files whose row was not committed. Call in
    maintenance, inside a write transaction. One listing of the folder and the
    index's names (from its own index), compared as sets: no row is read, and
    only the few names that differ are looked at one by one."""
    known = set(rows.names(db))
    found = set(os.listdir(folder))
    special = [n for n in found if n.startswith((ASIDE, *TRANSIENT))]
    asides = sorted({aside_stamp(n) for n in special} - {None})
    if len(asides) > 1:
        keep_one_aside(folder, ASIDE + asides[-1])
    rows.set_aside_bytes(
        db, aside_bytes(folder, [n for n in special if n.startswith(ASIDE)])
    )
    for name in sorted(n for n in special if n.startswith(TRANSIENT)):
        owner = temp_owner(name) or lock_owner(name)
        if owner and owner != presence.id and not alive(folder, owner):
            why = (
                "a temporary file of a process that ended before it finished it"
                if temp_owner(name)
                else "the lock of a process that ended"
            )
            unlink(
                folder, name, why, logging.WARNING if temp_owner(name) else logging.INFO
            )
    for name in sorted(found - known):
        if is_cache_name(name):
            adopt(folder, db, name)
    drop_dead_writes(folder, db, presence)
    # A name in place but not a regular file (a directory, a link) is refused
    # when a restore finds it: no file is looked at one by one here.
    for name in sorted(known - found):
        if not is_cache_name(name):
            logger.warning(
                "mlx-lm-mla: the index of %s names %r, not a file of the tier; "
                "its row is removed, nothing deleted",
                folder,
                name,
            )
        else:
            logger.warning(
                "mlx-lm-mla: %s is missing; its row is removed", folder / name
            )
        rows.remove(db, name)


def drop_dead_writes(folder, db, presence):
    """Removes the pending rows of processes that ended while writing (killed),
    and their temporary files; inside a write transaction."""
    for name, owner in rows.pending(db):
        if owner != presence.id and not alive(folder, owner):
            db.execute("DELETE FROM pending WHERE name = ?", (name,))
            unlink(
                folder,
                name,
                "a temporary file of a process that ended before it finished it",
                logging.WARNING,
            )


def evict(db, max_bytes, room=0):
    """Removes least recently used rows, in one statement, until the files, those
    being written, the index moved aside and ``room`` fit in ``max_bytes``;
    returns their names, to delete once committed."""
    ids, names = rows.least_used(db, rows.total_bytes(db) + room - max_bytes)
    if ids:
        rows.remove_ids(db, ids)
    return names


def full(error):
    """Whether an error is a full disk (or quota), from SQLite or the system."""
    if isinstance(error, sqlite3.Error):
        return getattr(error, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or (
            "disk is full" in str(error)
        )
    return isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)


def unwritten(job):
    """What a writer's job that failed leaves undone, in words."""
    if job[0] == "write":
        return f"a prompt cache of {len(job[3]) // 4} tokens (it stays in RAM only)"
    return {
        "touch": "the time a cache file was last used",
        "delete": f"the removal of the index row of {job[1]}",
        "changed": "the removal of the caches of a model whose files changed",
        "sweep": "the removal of what a crash left, at start",
        "shrink": "the eviction down to the bound at start",
    }.get(job[0], job[0])


class DiskTier:
    """The tier's folder in ``directory``, for one server's settings.

    ``store`` (generation thread) queues a snapshot of a cache; the writer thread
    makes room, writes a temporary file, then renames it into place and adds its
    row in one transaction. ``restore`` only reads; the writer does the rest.
    """

    def __init__(
        self,
        directory,
        max_bytes,
        settings,
        min_tokens=DEFAULT_MIN_TOKENS,
        pending=8,
        paths=None,
        timeout=60.0,
        loaded=None,
    ):
        self.folder = open_folder(directory)
        older.note_first_layout(self.folder.parent)
        self.max_bytes, self.min_tokens = int(max_bytes), int(min_tokens)
        self.settings, self.cache_digest = settings, cache_digest(settings)
        self._paths = paths or (lambda model: model)  # model key: the paths it loads
        # () -> the Fingerprint the server took at its last load, or None.
        self._loaded = loaded
        self._models = {}  # model key: (Fingerprint, (model JSON, digest) or None)
        self._refused = set()  # files found bad, until the writer writes them again
        self._warned = set()
        self.off = None  # why the tier turned itself off while running
        # A folder that cannot be written: restores from what it holds, no
        # write of any kind (no repair, sweep, eviction, use noted).
        self.read_only = not os.access(self.folder, os.W_OK | os.X_OK)
        self.index = Index(self.folder, timeout, read_only=self.read_only)
        self.presence = None
        if self.read_only:
            why = self.index.problem()
            if why not in (None, rows.PREVIOUS):  # the previous one reads alike
                raise NotOurs(f"{self.folder} cannot be written and its index is {why}")
            logger.warning(
                "mlx-lm-mla: %s cannot be written: its prompt caches are restored, "
                "none is written or deleted",
                self.folder,
            )
        else:
            with maintenance(self.folder):
                open_index(self.folder, self.index)
                self.presence = Presence(self.folder)
        self._pending, self._writes, self._lock = pending, 0, threading.Lock()
        self._closing = False
        self._queue = queue.Queue()
        # What a crash left, then a bound lowered since the last start: the
        # writer's first jobs, so neither keeps the server from listening (a
        # restore meanwhile refuses a row whose file is gone).
        self._queue.put(("sweep",))
        self._queue.put(("shrink",))
        self._writer = threading.Thread(
            target=self._write_loop, name="mlx-lm-mla disk tier", daemon=True
        )
        self._writer.start()

    # --- the generation thread -------------------------------------------

    def _model(self, model):
        """(model JSON, model digest) of a model key, or None: the fingerprint
        the server took when it loaded the model (``loaded``); without a
        server, taken the first time the key is seen."""
        if self._loaded is not None:
            taken = self._loaded()
            if taken is None or taken.key != model:
                self._warn(
                    ("unloaded", model),
                    "mlx-lm-mla: model %s has no fingerprint taken at its load; "
                    "its prompt caches stay in RAM",
                    model,
                )
                return None
        elif model in self._models:
            taken = self._models[model][0]
        else:
            taken = Fingerprint(model, self._paths(model))
        if model in self._models and self._models[model][0] is taken:
            return self._models[model][1]
        # Loaded again (or first seen): what was known of it before is not kept.
        found = None if taken.digest is None else (taken.model, taken.digest)
        self._models[model] = (taken, found)
        if found is None:
            logger.warning(
                "mlx-lm-mla: the files of model %s are not on disk; its "
                "prompt caches stay in RAM",
                model,
            )
        else:
            self._queue.put(("changed", *found, taken.older))
        return found

    def store(self, model, tokens, cache):
        """Queues ``cache`` (holding exactly ``tokens``) for writing, where it
        is long enough to be read back (``min_tokens``)."""
        import mlx_lm.models.cache as cache_module

        if self.off or self.read_only or self._closing or len(tokens) < self.min_tokens:
            return
        found, blob = self._model(model), _token_bytes(tokens)
        if found is None or blob is None:
            return
        name = file_name(found[1], self.cache_digest, blob)
        if self.index.has(name):  # stored already, by this server or another
            self._queue.put(("touch", name))
            return
        with self._lock:
            if self._writes >= self._pending:
                self._warn(
                    "behind",
                    "mlx-lm-mla: disk writes fall behind; a prompt cache of "
                    "%d tokens stays in RAM only",
                    len(tokens),
                )
                return
            self._writes += 1
        try:
            trimmable = cache_module.can_trim_prompt_cache(cache)
            frozen = cachefile.snapshot(cache)
        except BaseException:
            with self._lock:
                self._writes -= 1  # nothing queued: the writer gives back no place
            raise
        self._queue.put(("write", *found, blob, name, frozen, trimmable))

    def restore(self, model, tokens, have=0):
        """``(cache, tokens[n:])`` from the file covering the longest prefix ``n``
        of ``tokens`` (all but the last at most), if ``n`` is ``min_tokens`` more
        than ``have`` (what RAM holds); else None."""
        import mlx_lm.models.cache as cache_module

        found = self.lookup(model, tokens, have)
        if found is None:
            return None
        name, n, digest, saved = found
        cache = self._read(name, digest, saved, main_layers(model))
        if cache is None:
            return None
        if n < len(saved) // 4:
            if not cache_module.can_trim_prompt_cache(cache):
                return None
            cache_module.trim_prompt_cache(cache, len(saved) // 4 - n)
        self._queue.put(("touch", name))
        logger.info("mlx-lm-mla: restored a prompt cache of %d tokens from disk", n)
        return cache, tokens[n:]

    def lookup(self, model, tokens, have=0):
        """``(name, n, model digest, its tokens)`` of the file ``restore`` would
        read, from the index alone: the deepest block some file holds (a binary
        search over block hashes), then the file that goes furthest."""
        limit, need = len(tokens) - 1, have + max(self.min_tokens, 1)
        found = self._model(model) if not self.off and limit >= need else None
        blob = _token_bytes(tokens) if found else None
        if blob is None:
            return None
        prompt = blob[: limit * 4]
        hashes = block_hashes(root(found[1], self.cache_digest), prompt)
        depth = self.index.deepest(hashes)
        if depth == 0 or min(limit, (depth + 1) * BLOCK - 1) < need:
            return None
        best, name, rest = 0, None, prompt[depth * BLOCK * 4 :]
        for candidate, n_tokens, trimmable, after in self.index.candidates(
            hashes, depth
        ):
            n = min(depth * BLOCK + _common(after, rest), n_tokens)
            usable = (n == n_tokens or trimmable) and candidate not in self._refused
            if usable and n > best:
                best, name = n, candidate
        saved = self.index.tokens(name) if name and best >= need else None
        if saved is None or not is_cache_name(name):
            return None
        n = _common(saved, prompt)  # the whole prefix, not its hashes only
        return (name, n, found[1], saved) if n >= need else None

    def _read(self, name, digest, saved, main=None):
        path = self.folder / name
        expected = {
            "model_digest": digest,
            "cache_digest": self.cache_digest,
            "tokens": cachefile.tokens_text(saved),
        }
        if not is_regular(path):
            self._refuse(
                name, "its file is missing or not a regular file", delete=False
            )
            return None
        try:
            cache = cachefile.read(path, expected)
            problem = cache_problem(cache, len(saved) // 4, main)
            if problem:
                raise CorruptCacheFile(problem)
        except FileNotFoundError:
            self._refuse(name, "deleted by another process", delete=False)
            return None
        except (CorruptCacheFile, OSError) as e:
            logger.warning(
                "mlx-lm-mla: refused prompt cache file %s on disk: %s; the "
                "prompt is prefilled",
                path,
                e,
            )
            self._refuse(name, f"refused: {e}", delete=isinstance(e, CorruptCacheFile))
            return None
        return cache

    def _refuse(self, name, why, delete):
        self._refused.add(name)
        self._queue.put(("delete", name, why, delete))

    def _warn(self, key, message, *args):
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message, *args)

    # --- the writer thread -----------------------------------------------

    def _write_loop(self):
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                if not (self.off or self.read_only):
                    getattr(self, f"_{job[0]}")(*job[1:])
            except (sqlite3.DatabaseError, OSError) as e:
                if full(e):
                    self._warn(
                        ("full", job[0]),
                        "mlx-lm-mla: the disk of %s is full: %s was not written",
                        self.folder,
                        unwritten(job),
                    )
                elif isinstance(e, OSError):
                    self._warn(
                        ("write", type(e)),
                        "mlx-lm-mla: could not write a prompt cache to %s: %s",
                        self.folder,
                        e,
                    )
                elif isinstance(e, sqlite3.OperationalError):  # locked, read-only
                    self._warn(
                        ("index", job[0]),
                        "mlx-lm-mla: could not update the index of %s: %s",
                        self.folder,
                        e,
                    )
                else:
                    self._damaged(e)
            except Exception as e:
                self._warn(
                    ("write", type(e)),
                    "mlx-lm-mla: could not write a prompt cache to %s: %s",
                    self.folder,
                    e,
                )
            finally:
                if job and job[0] == "write":
                    with self._lock:
                        self._writes -= 1
                self._queue.task_done()

    def _write(self, model, digest, blob, name, cache, trimmable):
        record = cachefile.make_record(
            json.loads(model), digest, self.cache_digest, self.settings, blob, trimmable
        )
        metadata, size = cachefile.prepare(cache, record)
        if size > self.max_bytes:
            self._warn(
                "large",
                "mlx-lm-mla: a prompt cache of %d bytes is larger than "
                "--prompt-cache-dir-bytes; not kept",
                size,
            )
            return
        temp = temp_name(self.presence.id)
        with self.index.transaction() as db:
            if db.execute("SELECT 1 FROM entries WHERE name = ?", (name,)).fetchone():
                return  # written meanwhile by another server
            if rows.total_bytes(db) + size > self.max_bytes:
                # Before refusing or evicting: a writer killed mid-write left
                # its bytes pending, which only a start's sweep would drop.
                drop_dead_writes(self.folder, db, self.presence)
            if rows.pending_bytes(db) + size > self.max_bytes:
                self._warn(
                    "crowded",
                    "mlx-lm-mla: no room in %s while other processes write to it; "
                    "a prompt cache of %d bytes stays in RAM only",
                    self.folder,
                    size,
                )
                return
            evicted = evict(db, self.max_bytes, room=size)
            db.execute(
                "INSERT INTO pending VALUES (?, ?, ?)", (temp, self.presence.id, size)
            )
        for old in evicted:
            unlink(self.folder, old, EVICTED)
        renamed = False
        try:
            cachefile.write(self.folder / temp, cache, metadata)
            with self.index.transaction() as db:
                db.execute("DELETE FROM pending WHERE name = ?", (temp,))
                rows.add(db, name, record, blob, size)
                # As in RAM: a trimmable cache makes the ones of its prefixes redundant.
                gone = (
                    rows.prefixes(db, digest, self.cache_digest, blob)
                    if trimmable
                    else []
                )
                for old in gone:
                    rows.remove(db, old)
                os.replace(self.folder / temp, self.folder / name)
                renamed = True
        except BaseException:
            if os.path.lexists(self.folder / temp):
                unlink(self.folder, temp, "its write failed")
            elif renamed:
                with contextlib.suppress(sqlite3.Error):
                    if not self.index.has(name):  # its row was not committed
                        unlink(self.folder, name, "its index row could not be written")
            with contextlib.suppress(sqlite3.Error), self.index.transaction() as db:
                db.execute("DELETE FROM pending WHERE name = ?", (temp,))
            raise
        self._refused.discard(name)  # a file of its own, no longer the one refused
        for old in gone:
            unlink(self.folder, old, "a newer file holds its tokens and more")

    def _damaged(self, error):
        """Off for this server; the index marked for the next start to rebuild
        (a start reads no page it does not need, so it would not see it)."""
        self.off = f"its index is damaged ({error}); the next start builds it again"
        try:
            with self.index.transaction() as db:
                db.execute(
                    "INSERT OR REPLACE INTO meta VALUES ('damaged', ?)", (str(error),)
                )
        except sqlite3.Error:
            self.off = (
                f"its index is damaged ({error}); delete {self.folder / INDEX} and "
                "the next start builds it again"
            )
        logger.warning("mlx-lm-mla: prompt caches on disk are off: %s", self.off)

    def _sweep(self):
        if self._closing:  # stopped at once: the next start sweeps
            return
        with maintenance(self.folder), self.index.transaction() as db:
            sweep(self.folder, db, self.presence)

    def _shrink(self):
        """Evicts down to the bound in steps of at most ``SHRINK_STEP`` files, so
        no other server's write waits long on the index's lock; a server that
        stops leaves the rest to the next start."""
        while True:
            with self.index.transaction() as db:
                excess = rows.total_bytes(db) - self.max_bytes
                ids, gone = rows.least_used(db, excess, SHRINK_STEP)
                if ids:
                    rows.remove_ids(db, ids)
            for name in gone:
                unlink(self.folder, name, EVICTED)
            if len(ids) < SHRINK_STEP or self._closing:
                return

    def _touch(self, name):
        self.index.db.execute(
            "UPDATE entries SET last_used = ? WHERE name = ?", (time.time(), name)
        )

    def _delete(self, name, why, delete):
        with self.index.transaction() as db:
            removed = rows.remove(db, name)
        if delete and removed:
            unlink(self.folder, name, why, logging.WARNING)
        elif removed:
            logger.warning(
                "mlx-lm-mla: removed the index row of %s: %s", self.folder / name, why
            )

    def _changed(self, model, digest, older=None):
        stale = self.index.changed(model, digest, self.cache_digest)
        if older is not None:  # rows written before the paths were resolved
            stale += self.index.changed(older, digest, self.cache_digest)
        for name in stale:
            with self.index.transaction() as db:
                removed = rows.remove(db, name)
            if removed:
                unlink(
                    self.folder,
                    name,
                    "written when the model's files (weights, config or "
                    "tokenizer) were others",
                    logging.WARNING,
                )

    # --- either thread ---------------------------------------------------

    def flush(self):
        self._queue.join()

    def close(self, timeout=120):
        """Finishes the queued writes, then lets the folder go."""
        if self._closing:
            return
        self._closing = True
        self._queue.put(None)
        self._writer.join(timeout)
        if self.closed:
            if self.presence:
                self.presence.release()
            self.index.close()

    @property
    def closed(self):
        """Whether ``close`` ran and the writer finished every queued write."""
        return self._closing and not self._writer.is_alive()

    def total_bytes(self):
        return self.index.total_bytes()


__all__ = ["DiskTier", "DEFAULT_MIN_TOKENS"]
