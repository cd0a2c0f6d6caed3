"""The SQLite index of the tier's folder: a row per cache file and the chained
hashes of its tokens' whole blocks, so a prompt's longest stored prefix takes a
few indexed lookups (as in vLLM's and LMCache's prefix caches). SQLite's locking
lets several servers share it."""

import contextlib
import hashlib
import json
import logging
import os
import sqlite3
import stat
import threading
import time
import uuid
from urllib.parse import quote

from .fingerprint import FORMAT
from .folder import ASIDE, INDEX

logger = logging.getLogger(__name__)

BLOCK = 64  # tokens per hashed block
_CANDIDATES = 64  # files compared past a shared block, at most

_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE entries (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,      -- the cache file, in the tier's folder
    model TEXT NOT NULL,            -- JSON: the paths the server loads
    model_digest TEXT NOT NULL,     -- fingerprint.model_digest
    cache_digest TEXT NOT NULL,     -- fingerprint.cache_digest
    settings TEXT NOT NULL,         -- JSON: fingerprint.cache_settings
    n_tokens INTEGER NOT NULL,
    tokens BLOB NOT NULL,           -- int32, little-endian
    last_block INTEGER,             -- the hash of its last whole block
    nbytes INTEGER NOT NULL,        -- the file's size
    trimmable INTEGER NOT NULL,
    last_used REAL NOT NULL
);
CREATE INDEX entries_by_last_block ON entries (last_block);
CREATE INDEX entries_by_model ON entries (model, cache_digest);
CREATE TABLE blocks (
    hash INTEGER NOT NULL,          -- chained hash of a whole block of tokens
    entry INTEGER NOT NULL,         -- entries.id of a file holding it
    PRIMARY KEY (hash, entry)
) WITHOUT ROWID;
CREATE TABLE pending (              -- temporary files being written
    name TEXT PRIMARY KEY,
    owner TEXT NOT NULL,            -- the writing process's id (folder.Presence)
    nbytes INTEGER NOT NULL
);
"""

# Added by schema 2, on a new index or over one of schema 1: sizes and the
# order of use read from an index alone (a row's size lies past its tokens),
# a running total of the files' bytes, and a row's blocks found by its id.
_SCHEMA_2 = """
DROP INDEX IF EXISTS entries_by_use;
CREATE INDEX entries_by_use ON entries (last_used, nbytes);
DROP INDEX IF EXISTS entries_by_model;
CREATE INDEX entries_by_model ON entries (model, cache_digest, model_digest);
CREATE INDEX blocks_by_entry ON blocks (entry);
CREATE TABLE totals (what TEXT PRIMARY KEY, bytes INTEGER NOT NULL);
INSERT INTO totals SELECT 'entries', COALESCE(SUM(nbytes), 0) FROM entries;
INSERT INTO totals VALUES ('aside', 0);
CREATE TRIGGER entries_added AFTER INSERT ON entries BEGIN
    UPDATE totals SET bytes = bytes + new.nbytes WHERE what = 'entries';
END;
CREATE TRIGGER entries_removed AFTER DELETE ON entries BEGIN
    UPDATE totals SET bytes = bytes - old.nbytes WHERE what = 'entries';
    DELETE FROM blocks WHERE entry = old.id;
END;
CREATE TRIGGER entries_resized AFTER UPDATE OF nbytes ON entries BEGIN
    UPDATE totals SET bytes = bytes - old.nbytes + new.nbytes WHERE what = 'entries';
END;
INSERT OR REPLACE INTO meta VALUES ('schema', '2');
"""
SCHEMA = "2"
PREVIOUS = "of the previous schema"


def run_script(db, script):
    """Runs ``script``'s statements one at a time, inside the caller's
    transaction (``executescript`` would commit it first)."""
    statement = ""
    for line in script.splitlines(keepends=True):
        statement += line
        if sqlite3.complete_statement(statement):
            db.execute(statement)
            statement = ""


def aside_name():
    """A new name for an index moved aside (its journals' add their tails)."""
    return f"{ASIDE}{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"


def root(model_digest, cache_digest):
    """Where the chain of a model's and settings' blocks starts."""
    return hashlib.blake2b(
        f"{model_digest}{cache_digest}".encode(), digest_size=8
    ).digest()


def block_hashes(start, tokens):
    """Chained hashes of the whole blocks of ``tokens`` (int32 bytes): the
    i-th stands for all tokens up to the end of block i."""
    out, h, size = [], start, BLOCK * 4
    for i in range(0, len(tokens) - size + 1, size):
        h = hashlib.blake2b(h + tokens[i : i + size], digest_size=8).digest()
        out.append(int.from_bytes(h, "little", signed=True))
    return out


def read_only_uri(path):
    """SQLite's URI opening ``path`` read-only, never creating it; quoted, as a
    "?", "#" or "%xx" in a folder's name would name another file."""
    return f"file:{quote(str(path))}?mode=ro"


class Index:
    """The index of one folder, a connection per thread; the generation thread
    only reads, so a lookup never waits on a write beyond SQLite's short locks."""

    def __init__(self, folder, timeout=60.0, read_only=False):
        self.path = os.path.join(folder, INDEX)
        self.timeout, self.read_only = timeout, read_only
        self._local = threading.local()
        self._all = []

    @property
    def db(self):
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(
                read_only_uri(self.path) if self.read_only else self.path,
                uri=self.read_only,
                timeout=self.timeout,
                isolation_level=None,
                check_same_thread=False,
            )
            # Room for an eviction's pages (its rows' blocks lie all over the
            # index): SQLite's default 2 MB made a large one re-read them.
            db.execute("PRAGMA cache_size = -65536")
            self._local.db = db
            self._all.append(db)
        return db

    def close(self):
        for db in self._all:
            db.close()
        self._all.clear()
        self._local = threading.local()

    # --- whether it can be used, and a new one ---------------------------

    def problem(self):
        """Why the index cannot be used ("missing" where there is none), or None."""
        try:
            info = os.lstat(self.path)
        except FileNotFoundError:
            return "missing"
        except OSError as e:
            return f"unreadable ({e.strerror or e})"
        if not stat.S_ISREG(info.st_mode):
            return "not a regular file"
        if info.st_size == 0:
            return "missing"
        if not self.read_only:
            self.set_journal_aside()
        try:
            # Not a whole quick_check: it reads every page (0.3 s at 10,000
            # rows). A damaged page found later marks it for the next start.
            # Read under a shared lock, so no other server's commit grows the
            # file between the two.
            self.db.execute("BEGIN")
            self.db.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
            pages = self.db.execute("PRAGMA page_count").fetchone()[0]
            pages *= self.db.execute("PRAGMA page_size").fetchone()[0]
            size = os.stat(self.path).st_size
            self.db.execute("COMMIT")
            if pages > size:
                return f"damaged (truncated to {size} of {pages} bytes)"
            if not self.db.execute(
                "SELECT 1 FROM sqlite_master WHERE name = 'meta'"
            ).fetchone():
                return "of another schema"
            found = dict(self.db.execute("SELECT key, value FROM meta"))
        except (sqlite3.Error, OSError) as e:
            return f"unreadable or damaged ({e})"
        finally:
            self.close()
        if found.get("format") != FORMAT:
            return f"of another format ({found.get('format')})"
        if "damaged" in found:
            return f"damaged (found while serving: {found['damaged']})"
        if "schema" not in found:
            return PREVIOUS
        return None if found["schema"] == SCHEMA else f"of schema {found['schema']}"

    def set_journal_aside(self):
        """Renames a ``-journal`` that is not a plain file (a directory, a link):
        SQLite cannot open or delete it, and would take the index as unusable.
        A plain file is SQLite's own (a hot journal to roll back, or junk it
        deletes)."""
        journal = self.path + "-journal"
        aside = os.path.join(os.path.dirname(self.path), f"{aside_name()}-journal")
        try:
            if stat.S_ISREG(os.lstat(journal).st_mode):
                return
            os.rename(journal, aside)
        except OSError:
            return  # none, or it cannot be moved: SQLite says what it finds
        logger.warning(
            "mlx-lm-mla: %s was not a journal of the index (not a regular file); "
            "moved aside to %s, the index is kept",
            journal,
            os.path.basename(aside),
        )

    def migrate(self):
        """Brings an index of schema 1 to this one, in one transaction."""
        with self.transaction() as db:
            run_script(db, _SCHEMA_2)

    def move_aside(self):
        """Renames the index and its journals out of the way (a journal left
        beside a new index would be rolled into it); returns the new name or
        None. An empty index is left to ``create``."""
        empty = False
        aside, moved = aside_name(), False
        folder = os.path.dirname(self.path)
        with contextlib.suppress(OSError):
            info = os.lstat(self.path)
            empty = stat.S_ISREG(info.st_mode) and info.st_size == 0
        tails = (
            ("-journal", "-wal", "-shm") if empty else ("", "-journal", "-wal", "-shm")
        )
        for tail in tails:
            with contextlib.suppress(FileNotFoundError):
                os.rename(self.path + tail, os.path.join(folder, aside + tail))
                moved = True
        return aside if moved else None

    def create(self):
        """A new, empty index in place of a missing or empty one."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # an empty file: SQLite would take it as a database
        os.close(os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
        with self.transaction() as db:
            run_script(db, _SCHEMA)
            db.execute("INSERT INTO meta VALUES ('format', ?)", (FORMAT,))
            run_script(db, _SCHEMA_2)

    @contextlib.contextmanager
    def transaction(self):
        """A write transaction: other processes' writes wait until it ends."""
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            # SQLite ends the transaction itself on some errors (a full disk):
            # a ROLLBACK then fails and would hide the error that ended it.
            if db.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
            raise
        try:
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
            raise

    # --- reads (the generation thread) -----------------------------------

    def has(self, name):
        return (
            self.db.execute("SELECT 1 FROM entries WHERE name = ?", (name,)).fetchone()
            is not None
        )

    def deepest(self, hashes):
        """How many leading blocks of ``hashes`` some file holds: a file that
        holds block i holds every block before it, so a binary search."""
        low, high = 0, len(hashes)
        while low < high:
            mid = (low + high + 1) // 2
            found = self.db.execute(
                "SELECT 1 FROM blocks WHERE hash = ? LIMIT 1", (hashes[mid - 1],)
            )
            if found.fetchone():
                low = mid
            else:
                high = mid - 1
        return low

    def candidates(self, hashes, depth):
        """(name, n_tokens, trimmable, next tokens) of files that hold the
        first ``depth`` blocks, with the block of tokens after them."""
        return self.db.execute(
            "SELECT e.name, e.n_tokens, e.trimmable, substr(e.tokens, ?, ?) "
            "FROM blocks b JOIN entries e ON e.id = b.entry WHERE b.hash = ? LIMIT ?",
            (depth * BLOCK * 4 + 1, BLOCK * 4, hashes[depth - 1], _CANDIDATES),
        ).fetchall()

    def tokens(self, name):
        row = self.db.execute(
            "SELECT tokens FROM entries WHERE name = ?", (name,)
        ).fetchone()
        return row[0] if row else None

    def changed(self, model, model_digest, cache_digest):
        """Files of this model path and settings written for another model digest."""
        return [
            r[0]
            for r in self.db.execute(
                "SELECT name FROM entries WHERE model = ? AND cache_digest = ? "
                "AND model_digest != ?",
                (model, cache_digest, model_digest),
            )
        ]

    def total_bytes(self):
        return total_bytes(self.db)

    def summary(self):
        """(model, settings, files, bytes, min/max tokens, last use) per model."""
        return self.db.execute(
            "SELECT model, settings, COUNT(*), SUM(nbytes), MIN(n_tokens), "
            "MAX(n_tokens), "
            "MAX(last_used) FROM entries GROUP BY model, settings ORDER BY model"
        ).fetchall()


# --- inside a write transaction ------------------------------------------


def add(db, name, record, tokens, nbytes, last_used=None):
    """Adds the entry of a file, given its record (``cachefile.make_record``)."""
    hashes = block_hashes(root(record["model_digest"], record["cache_digest"]), tokens)
    remove(db, name)
    entry = db.execute(
        "INSERT INTO entries (name, model, model_digest, cache_digest, settings, "
        "n_tokens, tokens, last_block, nbytes, trimmable, last_used) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            name,
            json.dumps(record["model"]),
            record["model_digest"],
            record["cache_digest"],
            json.dumps(record["settings"], sort_keys=True),
            len(tokens) // 4,
            tokens,
            hashes[-1] if hashes else None,
            nbytes,
            int(record["trimmable"]),
            time.time() if last_used is None else last_used,
        ),
    ).lastrowid
    db.executemany(
        "INSERT OR IGNORE INTO blocks VALUES (?, ?)", [(h, entry) for h in hashes]
    )


def remove(db, name):
    """Removes a file's entry (its blocks go with it); whether there was one."""
    return db.execute("DELETE FROM entries WHERE name = ?", (name,)).rowcount > 0


def remove_ids(db, ids):
    """Removes the entries of ``ids`` in one statement."""
    db.execute(
        "DELETE FROM entries WHERE id IN (SELECT value FROM json_each(?))",
        (json.dumps(list(ids)),),
    )


def prefixes(db, model_digest, cache_digest, tokens):
    """Files of these digests whose tokens are a strict prefix of ``tokens``."""
    hashes = block_hashes(root(model_digest, cache_digest), tokens)
    found = []
    for i in range(0, len(hashes), 500):  # under SQLite's limit of parameters
        part = hashes[i : i + 500]
        found += db.execute(
            "SELECT name, tokens FROM entries WHERE last_block IN "
            f"({','.join('?' * len(part))}) "
            "AND model_digest = ? AND cache_digest = ? AND n_tokens < ?",
            (*part, model_digest, cache_digest, len(tokens) // 4),
        ).fetchall()
    return [name for name, t in found if tokens.startswith(t)]


def total_bytes(db):
    """Bytes of the files, of the temporary files being written and of the index
    moved aside, from the running totals: no row of a file is read."""
    kept = db.execute("SELECT COALESCE(SUM(bytes), 0) FROM totals").fetchone()[0]
    return kept + pending_bytes(db)


def set_aside_bytes(db, nbytes):
    db.execute("UPDATE totals SET bytes = ? WHERE what = 'aside'", (nbytes,))


def least_used(db, nbytes, most=None):
    """(ids, names) of the least recently used files that hold ``nbytes`` bytes
    together (``most`` files at most), read in order of use until they do."""
    ids, names, freed = [], [], 0
    if nbytes <= 0:
        return ids, names
    for entry, name, size in db.execute(
        "SELECT id, name, nbytes FROM entries ORDER BY last_used"
    ):
        ids.append(entry)
        names.append(name)
        freed += size
        if freed >= nbytes or len(ids) == most:
            break
    return ids, names


def pending_bytes(db):
    return db.execute("SELECT COALESCE(SUM(nbytes), 0) FROM pending").fetchone()[0]


def names(db):
    return [row[0] for row in db.execute("SELECT name FROM entries")]


def pending(db):
    return db.execute("SELECT name, owner FROM pending").fetchall()
