"""The disk tier's index at many files: a size is read without reading a row,
an eviction is one statement run after the start, an index of the previous
schema is migrated; what the tier leaves beside it (an index moved aside, a
stray journal) and a full disk."""

import argparse
import contextlib
import ctypes
import errno
import json
import logging
import os
import signal
import sqlite3
import subprocess
import threading

import pytest
from disk_child import prompt, random_cache
from serving import SYSTEM, Server, cached_tokens
from test_disk_cache import (
    answer,
    cache_files,
    caches,
    consistent,
    fake_model,
    filled,
    rows,
    stored,
    warnings_of,
)

from mlx_lm_mla.__main__ import main as mlx_lm_mla_main
from mlx_lm_mla.disk import hooks
from mlx_lm_mla.disk.folder import INDEX, MARKER


@pytest.fixture
def statements(monkeypatch):
    """(statement, thread name) of every SQL statement any connection runs from
    now on (Python traces a statement again as each trigger it fires starts)."""
    seen, real = [], sqlite3.connect

    def connect(*args, **kwargs):
        db = real(*args, **kwargs)
        db.set_trace_callback(
            lambda sql: (
                sql.startswith("--")
                or seen.append((sql, threading.current_thread().name))
            )
        )
        return db

    monkeypatch.setattr(sqlite3, "connect", connect)
    return seen


def plans(folder, seen):
    """The query plan of each statement seen, as run on the folder's index."""
    db = sqlite3.connect(
        f"file:{caches(folder) / INDEX}?mode=ro", uri=True, isolation_level=None
    )
    try:
        out = {}
        for sql, _ in seen:
            if sql.split()[0].upper() in ("SELECT", "INSERT", "UPDATE", "DELETE"):
                out[sql] = [r[3] for r in db.execute(f"EXPLAIN QUERY PLAN {sql}")]
        return out
    finally:
        db.close()


def test_no_write_and_no_start_reads_every_row_of_the_index(
    tiers, tmp_path, statements
):
    key = fake_model(tmp_path / "model")
    size = stored(tiers, key, folder=tmp_path / "probe").total_bytes()
    tier = tiers(max_bytes=int(size * 2.5))
    for start in range(4):  # the last two each evict one
        tier.store(key, prompt(300, start), random_cache(300, seed=start))
        tier.flush()
    tier.close()
    tiers(max_bytes=int(size * 1.5)).flush()  # a start that evicts
    scans = {
        sql: plan
        for sql, plan in plans(tmp_path / "caches", statements).items()
        if "SCAN entries" in plan  # the whole table, tokens and all
    }
    assert scans == {} and len(cache_files(tmp_path / "caches")) == 1


def test_the_size_of_the_folder_is_kept_with_every_change(tiers, tmp_path):
    key = fake_model(tmp_path / "model")
    size = stored(tiers, key, folder=tmp_path / "probe").total_bytes()
    tier = tiers(max_bytes=int(size * 2.5))
    for n, start in ((300, 0), (300, 1), (200, 2), (300, 2), (300, 3)):
        tier.store(key, prompt(n, start), random_cache(n, seed=start))
        tier.flush()
        on_disk = sum(p.stat().st_size for p in cache_files(tmp_path / "caches"))
        assert tier.total_bytes() == on_disk <= size * 2.5


def test_an_eviction_at_start_is_one_statement_on_the_writers_thread(
    tiers, tmp_path, statements
):
    key = fake_model(tmp_path / "model")
    size = filled(tiers, key, 5)
    statements.clear()
    opened = threading.current_thread().name
    smaller = tiers(max_bytes=int(size * 1.5))
    smaller.flush()
    # Distinct: a statement is traced again as each of its triggers starts.
    deletes = {
        (sql, thread)
        for sql, thread in statements
        if sql.upper().startswith("DELETE FROM ENTRIES")
    }
    [(_, thread)] = deletes
    assert thread != opened
    assert len(cache_files(tmp_path / "caches")) == 1 and consistent(
        tmp_path / "caches"
    )
    assert smaller.restore(key, prompt(300, 4) + [5], 0) is not None


def to_previous_schema(path):
    """The index as the tier before schema 2 made it: no totals, no triggers,
    no index of blocks by row, order of use alone."""
    with sqlite3.connect(path, isolation_level=None) as db:
        for statement in (
            "DROP TRIGGER entries_added",
            "DROP TRIGGER entries_removed",
            "DROP TRIGGER entries_resized",
            "DROP TABLE totals",
            "DROP INDEX blocks_by_entry",
            "DROP INDEX entries_by_use",
            "CREATE INDEX entries_by_use ON entries (last_used)",
            "DROP INDEX entries_by_model",
            "CREATE INDEX entries_by_model ON entries (model, cache_digest)",
            "DELETE FROM meta WHERE key = 'schema'",
        ):
            db.execute(statement)
    db.close()


def test_an_index_of_the_previous_schema_is_migrated_not_rebuilt(
    tiers, tmp_path, caplog
):
    key = fake_model(tmp_path / "model")
    size = filled(tiers, key, 3)
    to_previous_schema(caches(tmp_path / "caches") / INDEX)
    with caplog.at_level(logging.INFO):
        tier = tiers(max_bytes=int(size * 2.5))
        tier.flush()
    assert warnings_of(caplog) == []
    assert any("brought to schema 2" in r.getMessage() for r in caplog.records)
    assert not list(caches(tmp_path / "caches").glob(f"{INDEX}.aside-*"))
    assert tier.total_bytes() == 2 * size and len(rows(tmp_path / "caches")) == 2
    assert tier.restore(key, prompt(300, 2) + [5], 0) is not None
    with sqlite3.connect(caches(tmp_path / "caches") / INDEX) as db:
        [(blocks,)] = db.execute("SELECT COUNT(*) FROM blocks").fetchall()
    db.close()
    assert blocks == 2 * (300 // 64)  # the evicted row's blocks went with it


def damage_the_rows_page(path):
    """Random bytes over the page that holds the index's rows (not its other
    b-trees), as a bad sector would leave: no start reads it."""
    with sqlite3.connect(path) as db:
        [(root,)] = db.execute(
            "SELECT rootpage FROM sqlite_master WHERE name = 'entries'"
        ).fetchall()
        [(size,)] = db.execute("PRAGMA page_size").fetchall()
    db.close()
    with open(path, "r+b") as f:
        f.seek((root - 1) * size)
        f.write(os.urandom(size))


def test_a_damage_found_while_serving_turns_the_tier_off_and_the_next_start_rebuilds(
    tiers, tmp_path, caplog
):
    key = fake_model(tmp_path / "model")
    stored(tiers, key).close()
    damage_the_rows_page(caches(tmp_path / "caches") / INDEX)
    with caplog.at_level(logging.WARNING):
        tier = tiers()
        tier.store(key, prompt(300, 1), random_cache(300, seed=1))
        tier.flush()
        assert tier.off and "the next start builds it again" in tier.off
        tier.close()
        tier = tiers()
    assert any("moved aside" in w and "built again" in w for w in warnings_of(caplog))
    assert tier.restore(key, prompt(300, 0) + [5], 0) is not None


# --- what lies beside the index ------------------------------------------------


def damage_and_start(tiers, folder):
    (caches(folder) / INDEX).write_bytes(os.urandom(8192))
    return tiers()


def asides(folder):
    return sorted(p.name for p in caches(folder).glob(f"{INDEX}.aside-*"))


def test_one_index_moved_aside_is_kept_and_counts_toward_the_bound(tiers, tmp_path):
    key = fake_model(tmp_path / "model")
    folder = tmp_path / "caches"
    stored(tiers, key).close()
    file_bytes = sum(p.stat().st_size for p in cache_files(folder))
    for _ in range(3):
        damage_and_start(tiers, folder).close()
    assert len(asides(folder)) == 1
    tier = tiers()
    assert tier.total_bytes() == file_bytes + 8192  # the random "index" aside
    assert tier.restore(key, prompt(300, 0) + [5], 0) is not None


def test_cache_dir_stats_shows_the_index_moved_aside_and_clear_deletes_it(
    tiers, tmp_path, capsys
):
    key = fake_model(tmp_path / "model")
    folder = tmp_path / "caches"
    stored(tiers, key).close()
    damage_and_start(tiers, folder).close()
    [aside] = asides(folder)
    capsys.readouterr()
    assert mlx_lm_mla_main(["cache-dir", "stats", str(folder)]) == 0
    out = capsys.readouterr().out
    assert f"index moved aside: {aside}, 8.0 KiB" in out
    assert "not the tier's" not in out
    assert mlx_lm_mla_main(["cache-dir", "clear", str(folder)]) == 0
    assert asides(folder) == [] and cache_files(folder) == []
    assert "1 index moved aside" in capsys.readouterr().out


def test_cache_dir_clear_on_a_read_only_file_system_is_one_error_line(
    tiers, tmp_path, capsys, monkeypatch
):
    key = fake_model(tmp_path / "model")
    folder = tmp_path / "caches"
    stored(tiers, key).close()
    (caches(folder) / INDEX).write_bytes(os.urandom(8192))  # to be moved aside
    kept = cache_files(folder)

    def read_only(source, target):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), source, None, target)

    monkeypatch.setattr(os, "rename", read_only)
    capsys.readouterr()
    assert mlx_lm_mla_main(["cache-dir", "clear", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"mlx-lm-mla cache-dir: error: cannot clear {folder}: "
        f"{os.strerror(errno.EROFS)}\n"
    )
    assert cache_files(folder) == kept


def directory(path):
    path.mkdir()
    (path / "x").write_text("?")


STRAY_JOURNALS = {
    "a directory": directory,
    "a link to nowhere": lambda path: path.symlink_to(path.parent / "nowhere"),
    "a link to a file": lambda path: path.symlink_to(path.parent.parent / "elsewhere"),
    "a file of junk": lambda path: path.write_bytes(os.urandom(4096)),
    "an empty file": lambda path: path.write_bytes(b""),
}


@pytest.mark.parametrize("stray", STRAY_JOURNALS)
def test_a_stray_journal_never_makes_a_healthy_index_be_rebuilt(
    stray, tiers, tmp_path, caplog
):
    key = fake_model(tmp_path / "model")
    folder = tmp_path / "caches"
    (tmp_path / "elsewhere").write_text("not the tier's")
    stored(tiers, key).close()
    index = caches(folder) / INDEX
    before = index.stat().st_ino
    STRAY_JOURNALS[stray](caches(folder) / f"{INDEX}-journal")
    with caplog.at_level(logging.WARNING):
        tier = tiers()
        assert tier.restore(key, prompt(300, 0) + [5], 0) is not None
        tier.store(key, prompt(300, 1), random_cache(300, seed=1))
        tier.flush()
    assert index.stat().st_ino == before and len(rows(folder)) == 2
    assert not any("built again" in w for w in warnings_of(caplog))
    assert [a for a in asides(folder) if not a.endswith("-journal")] == []
    if stray in ("a directory", "a link to nowhere", "a link to a file"):
        [warning] = warnings_of(caplog)
        assert f"{INDEX}-journal was not a journal of the index" in warning
        assert "the index is kept" in warning
    assert (tmp_path / "elsewhere").read_text() == "not the tier's"


# --- a full disk -----------------------------------------------------------------


def test_a_full_disk_is_logged_as_full_with_what_was_not_written(
    tiers, tmp_path, monkeypatch, caplog
):
    key = fake_model(tmp_path / "model")
    stored(tiers, key).close()
    real = sqlite3.connect

    def connect(*args, **kwargs):  # SQLite's own "database or disk is full"
        db = real(*args, **kwargs)
        pages = db.execute("PRAGMA page_count").fetchone()[0]
        db.execute(f"PRAGMA max_page_count = {pages}")
        return db

    monkeypatch.setattr(sqlite3, "connect", connect)
    with caplog.at_level(logging.WARNING):
        tier = tiers()
        tier.store(key, prompt(3000, 1), random_cache(3000, seed=1))
        tier.flush()
    [warning] = warnings_of(caplog)
    assert "is full: a prompt cache of 3000 tokens" in warning
    assert "was not written" in warning and "rollback" not in warning
    assert len(rows(tmp_path / "caches")) == 1 and consistent(tmp_path / "caches")


# --- a folder that cannot be written ---------------------------------------------


@contextlib.contextmanager
def read_only(path):
    """``path`` made a folder no file can be added to or removed from: its mode,
    and for root (whom modes do not stop) the immutable attribute."""
    mode = path.stat().st_mode
    path.chmod(0o500)
    immutable = os.geteuid() == 0
    if immutable:
        subprocess.run(["chattr", "+i", str(path)], check=True)
    try:
        assert not os.access(path, os.W_OK)
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(path)], check=True)
        path.chmod(mode)


def contents(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_a_folder_that_cannot_be_written_is_served_read_only(model_path, tmp_path):
    folder = tmp_path / "caches"
    first = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is a trie?"},
    ]
    with Server(model_path, "--prompt-cache-dir", folder) as server:
        reply, _ = answer(server.port, first)
    turn = first + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And a heap?"},
    ]
    before = contents(caches(folder))
    log = tmp_path / "log"
    with read_only(caches(folder)):
        with Server(model_path, "--prompt-cache-dir", folder, log=log) as server:
            _, usage = answer(server.port, turn)
            answer(server.port, turn + [{"role": "user", "content": "More."}])
        assert server.proc.returncode == -signal.SIGTERM
        assert contents(caches(folder)) == before  # nothing written or deleted
    assert cached_tokens(usage) >= len(SYSTEM) + len(reply)  # restored from disk
    text = log.read_text()
    assert text.count("cannot be written") == 1, text
    assert "its prompt caches are restored, none is written" in text


def test_a_folder_that_cannot_be_made_starts_the_server_without_the_tier(
    model_path, tmp_path
):
    parent = tmp_path / "caches"
    parent.mkdir()
    log = tmp_path / "log"
    with read_only(parent):
        with Server(model_path, "--prompt-cache-dir", parent, log=log) as server:
            answer(server.port, [{"role": "user", "content": "What is a trie?"}])
        assert os.listdir(parent) == []
    text = log.read_text()
    assert text.count("prompt caches on disk are off") == 1, text
    assert "cannot make" in text


def test_a_folder_of_the_tier_that_cannot_be_marked_starts_the_server_without_it(
    model_path, tmp_path
):
    folder = tmp_path / "caches"
    caches(folder).mkdir(parents=True)  # as a start cut short before its marker
    log = tmp_path / "log"
    with read_only(caches(folder)):
        with Server(model_path, "--prompt-cache-dir", folder, log=log) as server:
            answer(server.port, [{"role": "user", "content": "What is a trie?"}])
        assert os.listdir(caches(folder)) == []
    text = log.read_text()
    assert text.count("prompt caches on disk are off") == 1, text
    assert f"cannot mark {caches(folder)}: " in text


_CAPABILITIES = 0x20080522  # _LINUX_CAPABILITY_VERSION_3
_OVERRIDES = (1 << 1) | (1 << 2)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH


def where_modes_hold(run):
    """``run()``, on a thread modes stop: for root (whom they do not), one that
    has dropped the capabilities overriding them (each thread has its own)."""
    if os.geteuid() != 0:
        return run()
    out = {}

    def thread():
        try:  # a failure here too is the caller's, raised below
            libc = ctypes.CDLL(None, use_errno=True)
            header = (ctypes.c_uint32 * 2)(_CAPABILITIES, 0)  # 0: this thread
            data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable; twice
            assert libc.capget(header, data) == 0, os.strerror(ctypes.get_errno())
            data[0] &= ~_OVERRIDES
            assert libc.capset(header, data) == 0, os.strerror(ctypes.get_errno())
            out["value"] = run()
        except BaseException as e:
            out["error"] = e

    worker = threading.Thread(target=thread)
    worker.start()
    worker.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.mark.parametrize("unreadable", ["folder", "marker"])
def test_a_folder_of_the_tier_that_cannot_be_read_starts_the_server_without_it(
    tiers, tmp_path, caplog, unreadable
):
    folder = tmp_path / "caches"
    tiers(folder=folder).close()  # made and marked by a tier, as another user's
    path = caches(folder) if unreadable == "folder" else caches(folder) / MARKER
    args = argparse.Namespace(
        prompt_cache_dir=str(folder),
        prompt_cache_dir_bytes=None,
        prompt_cache_dir_min_tokens=None,
    )

    def start():  # what the server runs: its flags checked, then the tier opened
        hooks.check_flags(argparse.ArgumentParser(), args)
        return hooks.open_tier(args)

    mode, marker = path.stat().st_mode, (caches(folder) / MARKER).read_bytes()
    caplog.clear()
    path.chmod(0)
    try:
        assert where_modes_hold(start) is None
    finally:
        path.chmod(mode)
    [line] = warnings_of(caplog)
    assert "prompt caches on disk are off" in line, line
    assert f"cannot read {caches(folder) / MARKER}: Permission denied" in line, line
    assert (caches(folder) / MARKER).read_bytes() == marker


def start_server_tier(folder):
    """What the server runs: its flags checked, then the tier opened."""
    args = argparse.Namespace(
        prompt_cache_dir=str(folder),
        prompt_cache_dir_bytes=None,
        prompt_cache_dir_min_tokens=None,
    )
    hooks.check_flags(argparse.ArgumentParser(), args)
    return hooks.open_tier(args)


@pytest.mark.parametrize("path", ["folder", MARKER, INDEX])
def test_a_folder_others_can_write_starts_the_server_without_the_tier(
    tiers, tmp_path, caplog, path
):
    folder = tmp_path / "caches"
    tiers(folder=folder).close()
    target = caches(folder) if path == "folder" else caches(folder) / path
    target.chmod(target.stat().st_mode | 0o022)
    before = contents(caches(folder))
    caplog.clear()
    assert start_server_tier(folder) is None
    [line] = warnings_of(caplog)
    assert "prompt caches on disk are off" in line, line
    assert f"{target} can be written by its group or other users" in line, line
    assert contents(caches(folder)) == before


def test_a_folder_of_another_user_starts_the_server_without_the_tier(
    tiers, tmp_path, caplog, monkeypatch
):
    folder = tmp_path / "caches"
    tiers(folder=folder).close()  # its owner: this user, not the one below
    before = contents(caches(folder))
    caplog.clear()
    with monkeypatch.context() as m:
        m.setattr(os, "geteuid", lambda: os.stat(caches(folder)).st_uid + 1)
        assert start_server_tier(folder) is None
    [line] = warnings_of(caplog)
    owner = os.stat(caches(folder)).st_uid
    assert f"{caches(folder)} belongs to user {owner}, not this" in line, line
    assert contents(caches(folder)) == before


# --- caches of an older mlx-lm-mla -------------------------------------------------

# The first layout's index (mlx-lm-mla-disk-1: DIR/index.sqlite, no folder of
# the tier's own), as that version made it.
FIRST_SCHEMA = """
CREATE TABLE entries (
    name TEXT PRIMARY KEY, model TEXT NOT NULL, model_digest TEXT NOT NULL,
    cache_digest TEXT NOT NULL, n_tokens INTEGER NOT NULL, tokens BLOB NOT NULL,
    nbytes INTEGER NOT NULL, trimmable INTEGER NOT NULL, last_used REAL NOT NULL
);
CREATE INDEX entries_by_key ON entries (model_digest, cache_digest);
CREATE INDEX entries_by_use ON entries (last_used);
"""


def first_layout(directory):
    """``directory`` as the first layout left it; its files, and the user's."""
    directory.mkdir(parents=True, exist_ok=True)
    name = "ab" * 20 + ".safetensors"
    with sqlite3.connect(directory / INDEX) as db:
        db.executescript(FIRST_SCHEMA)
        db.execute(
            "INSERT INTO entries VALUES (?, 'm', 'd', 'c', 300, x'00', 4096, 1, 0)",
            (name,),
        )
    db.close()
    ours = [
        directory / INDEX,
        directory / name,
        directory / f".tmp-7-{'c' * 32}.safetensors",
    ]
    for path in ours[1:]:
        path.write_bytes(os.urandom(4096))
    theirs = [directory / "notes.txt", directory / ("cd" * 20 + ".safetensors")]
    for path in theirs:
        path.write_text("mine")
    return ours, theirs


def test_caches_of_the_first_layout_are_named_at_start_and_cleared(
    model_path, tmp_path, capsys
):
    folder = tmp_path / "caches"
    ours, theirs = first_layout(folder)
    log = tmp_path / "log"
    with Server(model_path, "--prompt-cache-dir", folder, log=log) as server:
        answer(server.port, [{"role": "user", "content": "What is a trie?"}])
    [line] = [x for x in log.read_text().splitlines() if "older mlx-lm-mla" in x]
    assert "1 cache files" in line and f"mlx-lm-mla cache-dir clear {folder}" in line
    assert all(p.exists() for p in ours)  # named, never deleted by a server
    capsys.readouterr()
    assert mlx_lm_mla_main(["cache-dir", "stats", str(folder)]) == 0
    assert "prompt caches of an older mlx-lm-mla (1 cache files" in (
        capsys.readouterr().out
    )
    assert mlx_lm_mla_main(["cache-dir", "clear", str(folder)]) == 0
    assert not any(p.exists() for p in ours)
    assert [p.read_text() for p in theirs] == ["mine"] * 2
    assert (caches(folder) / INDEX).is_file()  # the tier's own folder stays


def test_a_tier_on_a_folder_named_with_uri_characters_creates_nothing_outside_it(
    tiers, tmp_path, caplog
):
    folder = tmp_path / "caches?v=2#x"
    ours, _ = first_layout(folder)
    before = sorted(os.listdir(tmp_path))
    with caplog.at_level(logging.INFO, logger="mlx_lm_mla.disk.older"):
        tiers(folder=folder).flush()
    assert sorted(os.listdir(tmp_path)) == before  # no "caches" beside it
    assert "1 cache files" in caplog.text  # its own index was the one read
    assert all(p.exists() for p in ours)


def test_another_programs_index_in_wal_mode_gets_no_file_beside_it(
    tiers, tmp_path, capsys
):
    folder = tmp_path / "caches"
    folder.mkdir()
    db = sqlite3.connect(folder / INDEX)  # closed cleanly: no -wal or -shm left
    db.execute("PRAGMA journal_mode = WAL")
    db.execute("CREATE TABLE notes (x)")
    db.commit()
    db.close()
    before = (folder / INDEX).read_bytes()
    tiers(folder=folder).close()
    assert mlx_lm_mla_main(["cache-dir", "stats", str(folder)]) == 0
    assert "older mlx-lm-mla" not in capsys.readouterr().out
    assert sorted(os.listdir(folder)) == sorted([INDEX, caches(folder).name])
    assert (folder / INDEX).read_bytes() == before


def test_a_folder_of_an_older_format_starts_the_server_and_clear_empties_it(
    model_path, tmp_path
):
    from mlx_lm_mla.disk.fingerprint import FORMAT
    from mlx_lm_mla.disk.folder import MARKER

    folder = tmp_path / "caches"
    with Server(model_path, "--prompt-cache-dir", folder):
        pass
    version = int(FORMAT.rsplit("-", 1)[1])
    (caches(folder) / MARKER).write_text(
        json.dumps({"format": f"mlx-lm-mla-disk-{version - 1}"})
    )
    ours = [caches(folder) / ("ef" * 16 + ".safetensors"), caches(folder) / INDEX]
    ours[0].write_bytes(os.urandom(4096))
    (caches(folder) / "notes.txt").write_text("mine")
    log = tmp_path / "log"
    with Server(model_path, "--prompt-cache-dir", folder, log=log) as server:
        answer(server.port, [{"role": "user", "content": "What is a trie?"}])
    [line] = [x for x in log.read_text().splitlines() if "older mlx-lm-mla" in x]
    assert f"mlx-lm-mla cache-dir clear {folder}" in line
    assert all(p.exists() for p in ours)
    assert mlx_lm_mla_main(["cache-dir", "clear", str(folder)]) == 0
    assert not any(p.exists() for p in ours)
    assert (caches(folder) / "notes.txt").read_text() == "mine"
    assert json.loads((caches(folder) / MARKER).read_text())["format"] == FORMAT
    with Server(model_path, "--prompt-cache-dir", folder) as server:
        answer(
            server.port,
            [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "What is a trie?"},
            ],
        )
    assert rows(folder)  # the tier is back in its folder
