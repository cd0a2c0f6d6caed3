"""The index of a prompt cache directory, in SQLite: one row per cache
file, keyed by the model and cache digests and the tokens it holds, with
its size and last use. SQLite's locking lets several servers share it."""

import contextlib
import os
import sqlite3
import threading
import time

NAME = "index.sqlite"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    name TEXT PRIMARY KEY,          -- the cache file, in the directory
    model TEXT NOT NULL,            -- the model's path as the server names it
    model_digest TEXT NOT NULL,     -- fingerprint.model_digest
    cache_digest TEXT NOT NULL,     -- fingerprint.cache_digest
    n_tokens INTEGER NOT NULL,
    tokens BLOB NOT NULL,           -- int32, little-endian
    nbytes INTEGER NOT NULL,        -- the file's size
    trimmable INTEGER NOT NULL,
    last_used REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS entries_by_key ON entries (model_digest, cache_digest);
CREATE INDEX IF NOT EXISTS entries_by_use ON entries (last_used);
"""


class Index:
    """The index of one directory. Each thread (the server's generation
    thread, the tier's writer) has its own connection, so a lookup never
    waits on a write of this process beyond SQLite's own short locks."""

    def __init__(self, folder):
        self.path = os.path.join(folder, NAME)
        # Created empty with the user's permissions only; SQLite gives its
        # journal the database file's permissions.
        os.close(os.open(self.path, os.O_CREAT | os.O_RDWR, 0o600))
        self._local = threading.local()
        self._all = []
        self.db.executescript(_SCHEMA)

    @property
    def db(self):
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, timeout=60, isolation_level=None, check_same_thread=False)
            self._local.db = db
            self._all.append(db)
        return db

    def close(self):
        for db in self._all:
            db.close()
        self._all.clear()
        self._local = threading.local()

    @contextlib.contextmanager
    def transaction(self):
        """A write transaction: other processes' writes wait until it ends."""
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def rows(self, model_digest, cache_digest):
        """(name, tokens, trimmable) of every entry for these digests."""
        return self.db.execute(
            "SELECT name, tokens, trimmable FROM entries WHERE model_digest = ? AND cache_digest = ?",
            (model_digest, cache_digest),
        ).fetchall()

    def others(self, model, model_digest, cache_digest):
        """(name, tokens, model_digest, cache_digest) of the entries of the
        same model path made with other files or settings."""
        return self.db.execute(
            "SELECT name, tokens, model_digest, cache_digest FROM entries "
            "WHERE model = ? AND NOT (model_digest = ? AND cache_digest = ?)",
            (model, model_digest, cache_digest),
        ).fetchall()

    def touch(self, name):
        self.db.execute("UPDATE entries SET last_used = ? WHERE name = ?", (time.time(), name))

    def has(self, name):
        return self.db.execute("SELECT 1 FROM entries WHERE name = ?", (name,)).fetchone() is not None

    def total_bytes(self):
        return self.db.execute("SELECT COALESCE(SUM(nbytes), 0) FROM entries").fetchone()[0]

    # Inside a transaction:

    @staticmethod
    def add(db, name, model, model_digest, cache_digest, tokens, nbytes, trimmable):
        db.execute(
            "INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (name, model, model_digest, cache_digest, len(tokens) // 4, tokens, nbytes,
             int(trimmable), time.time()),
        )

    @staticmethod
    def remove(db, name):
        return db.execute("DELETE FROM entries WHERE name = ?", (name,)).rowcount

    @staticmethod
    def prefixes(db, model_digest, cache_digest, tokens):
        """Names of the entries for these digests whose tokens are a strict
        prefix of ``tokens``."""
        found = db.execute(
            "SELECT name, tokens FROM entries WHERE model_digest = ? AND cache_digest = ? AND n_tokens < ?",
            (model_digest, cache_digest, len(tokens) // 4),
        )
        return [name for name, t in found if tokens.startswith(t)]

    @staticmethod
    def oldest(db):
        """(name, nbytes, total bytes) of the least recently used entry."""
        row = db.execute("SELECT name, nbytes FROM entries ORDER BY last_used LIMIT 1").fetchone()
        total = db.execute("SELECT COALESCE(SUM(nbytes), 0) FROM entries").fetchone()[0]
        return (row[0], row[1], total) if row else (None, 0, total)
