"""The disk tier: prompt caches of the server written to a directory in the
background, found again by their tokens and restored, the directory kept
under its byte bound by evicting the least recently used."""

import hashlib
import logging
import os
import queue
import threading
from pathlib import Path

import numpy as np

from ..guards.reuse import cache_problem
from ..patches.files import CorruptCacheFile
from . import files
from .fingerprint import cache_digest, model_digest
from .index import NAME, Index

logger = logging.getLogger(__name__)

SUFFIX = ".safetensors"


def open_folder(folder):
    """Creates the directory (the user's only) or checks an existing one."""
    folder = Path(folder).expanduser().resolve()
    if not folder.exists():
        folder.mkdir(mode=0o700, parents=True)
    elif not folder.is_dir():
        raise NotADirectoryError(f"{folder} is not a directory")
    if folder.stat().st_mode & 0o077:
        logger.warning("mlx-lm-mla: %s can be read by other users; prompt caches hold your prompts", folder)
    probe = folder / f"{files.TEMP}{os.getpid()}-probe"
    probe.touch(mode=0o600)  # fails here, at start, where it is not writable
    probe.unlink()
    return folder


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def _common(a, b):
    """Length of the common prefix of two int arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class DiskTier:
    """A directory of prompt caches for one server's settings.

    ``store`` (generation thread) takes a snapshot of a cache and queues it;
    the writer thread writes it to a temporary file, then renames it into
    place and adds its index row in one index transaction, so a crash leaves
    either both or a stray file that the next ``sweep`` removes.
    """

    def __init__(self, folder, max_bytes, settings, pending=8, paths=None):
        self.folder = open_folder(folder)
        self._paths = paths or (lambda model: model)  # model key: the paths it loads
        self.max_bytes = int(max_bytes)
        self.cache_digest = cache_digest(settings)
        self.index = Index(self.folder)
        self._digests = {}  # model key: model digest (None: not on disk)
        self._queue = queue.Queue(maxsize=pending)
        self.sweep()
        self._writer = threading.Thread(target=self._write_loop, name="mlx-lm-mla disk tier", daemon=True)
        self._writer.start()

    # --- the generation thread -------------------------------------------

    def model_digest(self, model):
        if model not in self._digests:
            digest = model_digest(self._paths(model))
            if digest is None:
                logger.warning("mlx-lm-mla: the files of model %s are not on disk; its prompt caches stay in RAM", model)
            self._digests[model] = digest
        return self._digests[model]

    def _key(self, model, tokens):
        digest = self.model_digest(model)
        if digest is None:
            return None
        try:
            blob = np.asarray(tokens, dtype="<i4").tobytes()
        except (TypeError, ValueError, OverflowError):
            return None  # a key that is not plain token ids (images)
        name = hashlib.sha256(f"{digest}{self.cache_digest}".encode() + blob).hexdigest()[:40]
        return digest, blob, name + SUFFIX

    def store(self, model, tokens, cache):
        """Queues ``cache`` (holding exactly ``tokens``) for writing."""
        import mlx_lm.models.cache as cache_module

        key = self._key(model, tokens)
        if key is None or not tokens:
            return
        digest, blob, name = key
        if self.index.has(name):
            self.index.touch(name)  # stored already, by this server or another
            return
        behind = "mlx-lm-mla: disk writes fall behind; a prompt cache of %d tokens stays in RAM only"
        if self._queue.full():  # checked first: a snapshot costs a copy
            logger.warning(behind, len(tokens))
            return
        trimmable = cache_module.can_trim_prompt_cache(cache)
        try:
            self._queue.put_nowait((repr(model), digest, blob, name, files.snapshot(cache), trimmable))
        except queue.Full:
            logger.warning(behind, len(tokens))

    def restore(self, model, tokens, have=0):
        """``(cache, tokens[n:])`` for the cache on disk that covers the
        longest prefix ``n`` of ``tokens`` (at most all but the last token),
        where ``n > have``; else None. A file that is not what its index row
        says is refused with a warning and deleted."""
        import mlx_lm.models.cache as cache_module

        if len(tokens) - 1 <= have:
            return None
        key = self._key(model, tokens)
        if key is None:
            return None
        digest, blob, _ = key
        prompt = np.frombuffer(blob, dtype="<i4")
        limit = len(prompt) - 1
        best = (have, None, None)
        for name, saved, trimmable in self.index.rows(digest, self.cache_digest):
            saved = np.frombuffer(saved, dtype="<i4")
            n = min(_common(saved, prompt), limit)
            if n > best[0] and (n == len(saved) or trimmable):
                best = (n, name, saved)
        self._refuse_others(model, digest, prompt, best[0])
        n, name, saved = best
        if name is None:
            return None
        record = {"model_digest": digest, "cache_digest": self.cache_digest,
                  "tokens": files.tokens_digest(saved.tobytes())}
        try:
            cache = files.read(str(self.folder / name), record)
            problem = cache_problem(cache, len(saved))
            if problem:
                raise CorruptCacheFile(problem)
        except FileNotFoundError:
            self._delete([name])  # deleted by another server in between
            return None
        except CorruptCacheFile as e:
            logger.warning("mlx-lm-mla: refused prompt cache file %s on disk: %s; deleted, the prompt is prefilled", name, e)
            self._delete([name])
            return None
        if n < len(saved):
            cache_module.trim_prompt_cache(cache, len(saved) - n)
        self.index.touch(name)
        logger.info("mlx-lm-mla: restored a prompt cache of %d tokens from disk", n)
        return cache, tokens[n:]

    def _refuse_others(self, model, digest, prompt, reach):
        """Deletes, with a warning, the files of this model path made with
        other model files or settings that would have covered more of the
        prompt than what is restored."""
        stale = []
        for name, saved, other_model, other_cache in self.index.others(repr(model), digest, self.cache_digest):
            if _common(np.frombuffer(saved, dtype="<i4"), prompt) > max(reach, 0):
                why = (
                    "the model's files (weights, config or tokenizer) changed since it was written"
                    if other_model != digest
                    else "it was written with other cache settings (--kv-bits, --kv-group-size, "
                    "--quantized-kv-start) or another mlx/mlx-lm"
                )
                logger.warning("mlx-lm-mla: refused prompt cache file %s on disk: %s; deleted", name, why)
                stale.append(name)
        if stale:
            self._delete(stale)

    # --- the writer thread -----------------------------------------------

    def _write_loop(self):
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._write(*job)
            except Exception as e:
                logger.warning("mlx-lm-mla: could not write a prompt cache to %s: %s", self.folder, e)
            finally:
                self._queue.task_done()

    def _write(self, model, digest, blob, name, cache, trimmable):
        record = {"model_digest": digest, "cache_digest": self.cache_digest, "tokens": files.tokens_digest(blob)}
        temp, size = files.write_temp(str(self.folder), cache, record)
        try:
            if size > self.max_bytes:
                logger.warning("mlx-lm-mla: a prompt cache of %d bytes is larger than --prompt-cache-dir-bytes; not kept", size)
                return
            with self.index.transaction() as db:
                os.replace(temp, self.folder / name)
                Index.add(db, name, model, digest, self.cache_digest, blob, size, trimmable)
                # As in RAM: a trimmable cache makes the ones of its prefixes redundant.
                gone = Index.prefixes(db, digest, self.cache_digest, blob) if trimmable else []
                for old in gone:
                    Index.remove(db, old)
                gone += self._evict(db)
        finally:
            if os.path.exists(temp):
                os.unlink(temp)
        self._unlink(gone)

    def _evict(self, db):
        gone = []
        while True:
            name, _, total = Index.oldest(db)
            if name is None or total <= self.max_bytes:
                return gone
            Index.remove(db, name)
            gone.append(name)

    # --- either thread ---------------------------------------------------

    def _delete(self, names):
        with self.index.transaction() as db:
            for name in names:
                Index.remove(db, name)
        self._unlink(names)

    def _unlink(self, names):
        for name in names:
            try:
                os.unlink(self.folder / name)
            except FileNotFoundError:
                pass

    def sweep(self):
        """Removes what a crash can leave: temporary files of processes that
        are gone, cache files without an index row, rows without a file."""
        with self.index.transaction() as db:
            names = {row[0] for row in db.execute("SELECT name FROM entries")}
            for item in self.folder.iterdir():
                if item.name.startswith(files.TEMP):
                    pid = item.name[len(files.TEMP):].split("-")[0]
                    if not (pid.isdigit() and _alive(int(pid))):
                        item.unlink()
                elif item.name.endswith(SUFFIX) and item.name not in names:
                    item.unlink()
            for name in names:
                if not (self.folder / name).is_file():
                    Index.remove(db, name)

    def flush(self):
        """Waits until every queued write is done."""
        self._queue.join()

    def close(self, timeout=120):
        """Finishes the queued writes, then closes the index."""
        self._queue.put(None)
        self._writer.join(timeout)
        if not self._writer.is_alive():
            self.index.close()

    def total_bytes(self):
        return self.index.total_bytes()


__all__ = ["DiskTier", "NAME", "open_folder"]
