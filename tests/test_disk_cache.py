"""Prompt caches on disk (``--prompt-cache-dir``): restored by a new server
process, refused when they are not what they claim; the tier keeps to a
folder of its own, under its bound, starts whatever it finds there, finds
a prefix without reading every row, stops cleanly on SIGTERM."""

import argparse
import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_lm_mla.__main__ import main as mlx_lm_mla_main
from mlx_lm_mla.disk import hooks
from mlx_lm_mla.disk.folder import INDEX, MARKER, SUBFOLDER, is_cache_name, temp_owner
from conftest import swap_layers_in_header
from serving import (
    SYSTEM,
    Server,
    cached_tokens,
    post_json,
    save_served_model,
    server_supports,
)

HERE = Path(__file__).parent
KV_BITS = [None, 4] if server_supports("--kv-bits") else [None]
STOPS = 20  # SIGTERM stops in a row; 12 of 68 aborted before


def body(messages, max_tokens=12):
    return {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logit_bias": {"1": -100},
    }  # no early end-of-text: a full answer


def answer(port, messages, max_tokens=12):
    status, reply = post_json(port, "/v1/chat/completions", body(messages, max_tokens))
    assert status == 200, reply
    return reply["choices"][0]["message"]["content"], reply["usage"]


def caches(directory):
    """The tier's own folder in the directory given to --prompt-cache-dir."""
    return Path(directory) / SUBFOLDER


def rows(directory):
    db = sqlite3.connect(
        f"file:{caches(directory) / INDEX}?mode=ro", uri=True
    )  # never makes one
    try:
        return db.execute("SELECT name, n_tokens FROM entries").fetchall()
    finally:
        db.close()


def cache_files(directory):
    return sorted(p for p in caches(directory).iterdir() if is_cache_name(p.name))


def temp_files(directory):
    return sorted(p for p in caches(directory).iterdir() if temp_owner(p.name))


def tier_bytes(directory):
    return sum(p.stat().st_size for p in cache_files(directory) + temp_files(directory))


def consistent(directory):
    """Every index row has its file and every cache file its row; no
    temporary file."""
    return not temp_files(directory) and {p.name for p in cache_files(directory)} == {
        n for n, _ in rows(directory)
    }


def flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# --- servers -----------------------------------------------------------------


@pytest.mark.parametrize("bits", KV_BITS, ids=lambda b: f"kv_bits={b}")
def test_a_new_server_restores_the_conversation_from_disk_and_answers_as_a_fresh_one(
    bits, model_path, tmp_path
):
    folder = tmp_path / "caches"
    flags = ["--kv-bits", bits, "--quantized-kv-start", 0] if bits else []
    first = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is a trie?"},
    ]
    with Server(model_path, "--prompt-cache-dir", folder, *flags) as server:
        reply, usage = answer(server.port, first)
    # Stopped with SIGTERM: the queued writes finished before the process ended.
    stored = rows(folder)
    assert stored and max(n for _, n in stored) >= usage["prompt_tokens"]
    turn = first + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And a heap?"},
    ]
    with Server(model_path, "--prompt-cache-dir", folder, *flags) as server:
        restored, usage = answer(server.port, turn)
    # A fresh server without the directory, served the same conversation: its
    # second turn reuses the first from RAM, as the restored server reused it
    # from disk, so the two answers are computed alike and must be equal.
    with Server(model_path, *flags) as fresh:
        assert answer(fresh.port, first)[0] == reply
        expected, fresh_usage = answer(fresh.port, turn)
    assert cached_tokens(usage) >= len(SYSTEM) + len(reply)  # one token per character
    assert cached_tokens(usage) == cached_tokens(fresh_usage)
    assert restored == expected
    assert os.stat(caches(folder)).st_mode & 0o777 == 0o700
    assert {os.stat(p).st_mode & 0o777 for p in caches(folder).iterdir()} == {0o600}
    # A changed byte in every file: refused, and the prompt prefilled.
    for path in cache_files(folder):
        flip_last_byte(path)
    with Server(
        model_path, "--prompt-cache-dir", folder, *flags, log=tmp_path / "log"
    ) as server:
        prefilled, usage = answer(server.port, turn)
    with Server(model_path, *flags) as fresh:
        assert answer(fresh.port, turn) == (
            prefilled,
            usage,
        )  # prefilled as on a fresh server
    assert cached_tokens(usage) == 0
    assert "checksum does not match" in (tmp_path / "log").read_text()


def test_a_server_given_its_models_folder_touches_none_of_it_and_starts_on_a_bad_index(
    tmp_path,
):
    model = save_served_model(tmp_path / "model")
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    first = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is a trie?"},
    ]
    with Server(model, "--prompt-cache-dir", model) as server:
        reply, _ = answer(server.port, first)
    assert {
        p.name: p.read_bytes() for p in model.iterdir() if p.name != SUBFOLDER
    } == before
    assert rows(model) and (caches(model) / MARKER).is_file()
    (caches(model) / INDEX).write_bytes(os.urandom(4096))
    turn = first + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And a heap?"},
    ]
    with Server(model, "--prompt-cache-dir", model, log=tmp_path / "log") as server:
        _, usage = answer(server.port, turn)
    assert cached_tokens(usage) >= len(SYSTEM) + len(
        reply
    )  # from the index built again
    assert "moved aside" in (tmp_path / "log").read_text()
    assert {
        p.name: p.read_bytes() for p in model.iterdir() if p.name != SUBFOLDER
    } == before


def test_sigterm_commits_the_queued_writes_and_ends_the_server_as_without_the_tier(
    model_path, tmp_path
):
    folder = tmp_path / "caches"
    codes, stored = [], []
    for i in range(STOPS):
        user = f"Question {i}: what is a trie?"
        with Server(model_path, "--prompt-cache-dir", folder) as server:
            answer(
                server.port,
                [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": user},
                ],
                2,
            )
        codes.append(server.proc.returncode)
        stored.append(len(rows(folder)))
    assert codes == [-signal.SIGTERM] * STOPS  # never -6 (SIGABRT)
    assert all(after > before for before, after in zip([0] + stored, stored)), (
        stored
    )  # each kept its cache


def test_the_servers_help_lists_the_flags_and_the_folder_it_uses():
    out = subprocess.run(
        [sys.executable, "-m", "mlx_lm.server", "--help"],
        capture_output=True,
        text=True,
    ).stdout
    for flag in (
        "--prompt-cache-dir DIR",
        "--prompt-cache-dir-bytes N",
        "--prompt-cache-dir-min-tokens N",
    ):
        assert flag in out
    assert SUBFOLDER in out.replace("\n", "").replace(" ", "")


# --- the server's command line, parsed in this process ------------------------


@pytest.fixture
def server_main(installed, monkeypatch, tmp_path):
    """``mlx_lm.server.main`` on a command line, in this process, in an
    empty working directory; returns the parsed arguments it hands ``run``."""
    import mlx_lm.server as server

    seen = []
    monkeypatch.setattr(
        server, "ModelProvider", lambda args: argparse.Namespace(cli_args=args)
    )
    monkeypatch.setattr(
        server, "run", lambda host, port, provider: seen.append(provider.cli_args)
    )
    monkeypatch.chdir(tmp_path)

    def main(*argv):
        monkeypatch.setattr(sys, "argv", ["mlx_lm.server", *map(str, argv)])
        server.main()
        return seen[-1]

    return main


def usage_error(main, *argv):
    with pytest.raises(SystemExit) as exit_:
        main(*argv)
    assert exit_.value.code == 2


@pytest.mark.parametrize(
    "size", ["inf", "nan", "1e400", "9" * 400, "-3", "0", "4X", " "]
)
def test_a_bad_size_gets_the_servers_usage_error(size, server_main, capsys):
    usage_error(
        server_main, "--prompt-cache-dir", "d", "--prompt-cache-dir-bytes", size
    )
    err = capsys.readouterr().err
    assert (
        err.startswith("usage: ")
        and "error: argument --prompt-cache-dir-bytes: expected a positive size" in err
    )
    assert not Path("d").exists()


def test_a_flag_after_the_folder_flag_is_not_taken_as_its_value(server_main, capsys):
    usage_error(server_main, "--prompt-cache-dir", "--log-level", "INFO")
    assert (
        "argument --prompt-cache-dir: expected one argument" in capsys.readouterr().err
    )
    assert os.listdir() == []


def test_the_folder_is_made_only_once_the_whole_command_line_parsed(
    server_main, capsys
):
    usage_error(server_main, "--prompt-cache-dir", "d", "--port", "eighty")
    assert "argument --port: invalid int value" in capsys.readouterr().err
    assert os.listdir() == []


def test_a_repeated_flag_keeps_the_last_as_every_flag_of_the_server_does(server_main):
    args = server_main(
        "--prompt-cache-dir",
        "a",
        "--prompt-cache-dir",
        "b",
        "--port",
        "1",
        "--port",
        "2",
        "--prompt-cache-dir-bytes",
        "1G",
        "--prompt-cache-dir-bytes",
        "2g",
        "--prompt-cache-dir-min-tokens",
        "100",
    )
    assert (
        args.prompt_cache_dir,
        args.port,
        args.prompt_cache_dir_bytes,
        args.prompt_cache_dir_min_tokens,
    ) == ("b", 2, 2 << 30, 100)
    assert os.listdir() == ["b"] and (caches("b") / MARKER).is_file()


@pytest.mark.parametrize(
    "argv",
    [["--prompt-cache-dir-bytes", "1G"], ["--prompt-cache-dir-min-tokens", "500"]],
)
def test_the_tiers_other_flags_need_a_folder(argv, server_main, capsys):
    usage_error(server_main, *argv)
    assert "needs --prompt-cache-dir" in capsys.readouterr().err


def test_a_folder_that_is_not_the_tiers_is_refused_and_left_alone(
    server_main, capsys, tmp_path
):
    taken = tmp_path / "d" / SUBFOLDER
    taken.mkdir(parents=True)
    (taken / "notes.txt").write_text("mine")
    usage_error(server_main, "--prompt-cache-dir", "d")
    assert "no marker of the tier" in capsys.readouterr().err
    (tmp_path / "f").write_text("a file")
    usage_error(server_main, "--prompt-cache-dir", "f")
    assert "f is not a directory" in capsys.readouterr().err
    assert (
        os.listdir(taken) == ["notes.txt"] and (tmp_path / "f").read_text() == "a file"
    )


# --- the tier itself, without a server ---------------------------------------

from disk_child import prompt, random_cache  # noqa: E402


def fake_model(folder, seed=0):
    """A model folder as the fingerprint sees it: config, weights, tokenizer."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "glm4_moe_lite"}))
    (folder / "tokenizer.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(os.urandom(64) if seed else bytes(64))
    return (str(folder), None, None)


@pytest.fixture
def child():
    """Starts tests/disk_child.py with the given arguments; every child still
    running when the test ends, however it ends, is killed."""
    started = []

    def start(*args):
        command = [sys.executable, str(HERE / "disk_child.py"), *map(str, args)]
        started.append(subprocess.Popen(command))
        return started[-1]

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def filled(tiers, key, files):
    """Stores ``files`` caches of 300 tokens in a tier, then closes it; returns
    one file's size."""
    tier = tiers()
    for start in range(files):
        tier.store(key, prompt(300, start), random_cache(300, seed=start))
        tier.flush()
    size = tier.total_bytes() // files
    tier.close()
    return size


def stored(tiers, key, n=300, start=0, **kwargs):
    tier = tiers(**kwargs)
    tier.store(key, prompt(n, start), random_cache(n, seed=start))
    tier.flush()
    return tier


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def swap_two_layers_in_header(path):
    path.write_bytes(swap_layers_in_header(path.read_bytes()))


def with_data_only_checksum(path):
    """The file's checksum rewritten in the legacy data-only form (``crc32:``,
    the CRC-32 of what follows the header), padded to the same header length."""
    import re
    import zlib

    raw = path.read_bytes()
    end = 8 + int.from_bytes(raw[:8], "little")
    header = raw[8:end].decode()
    [value] = re.findall(r'"(file-crc32:[0-9a-f]{8})"', header)
    legacy = f'"crc32:{zlib.crc32(raw[end:]):08x}"'
    header = header.replace(f'"{value}"', legacy.ljust(len(value) + 2))
    path.write_bytes(raw[:8] + header.encode() + raw[end:])


def swap_two_layers_with_a_legacy_checksum(path):
    swap_two_layers_in_header(path)
    with_data_only_checksum(path)


DAMAGES = {
    "changed byte": (lambda path, key, tiers: flip_last_byte(path), "checksum"),
    "truncated": (lambda path, key, tiers: truncate(path), "truncated"),
    "two layers swapped in its header": (
        lambda path, key, tiers: swap_two_layers_in_header(path),
        "checksum",
    ),
    "two layers swapped, a data-only checksum written back": (
        lambda path, key, tiers: swap_two_layers_with_a_legacy_checksum(path),
        "checksum is not of the whole file",
    ),
    "another model's file": (
        lambda path, key, tiers: (
            stored(tiers, fake_model(Path(key[0]).parent / "other", seed=1))
            and [p.replace(path) for p in cache_files(path.parent.parent) if p != path]
        ),
        "another model's files",
    ),
    "weights changed": (
        lambda path, key, tiers: fake_model(key[0], seed=2),
        "model's files",
    ),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_file_that_is_not_what_it_claims_is_refused_deleted_and_the_prompt_prefilled(
    damage, tiers, tmp_path, caplog
):
    key = fake_model(tmp_path / "model")
    first = stored(tiers, key)
    assert first.restore(key, prompt(300, 0) + [5], 0) is not None  # whole, it restores
    first.close()
    [path] = cache_files(tmp_path / "caches")
    DAMAGES[damage][0](path, key, tiers)
    with caplog.at_level(logging.WARNING):
        tier = tiers()
        found = tier.restore(key, prompt(300, 0) + [5], 0)
        tier.flush()
    assert found is None
    assert any(
        DAMAGES[damage][1] in w and path.name in w for w in warnings_of(caplog)
    ), warnings_of(caplog)
    assert not path.exists() and path.name not in {
        n for n, _ in rows(tmp_path / "caches")
    }


@pytest.mark.parametrize(
    "changes", [{"kv_bits": 4, "kv_group_size": 64}, {"mlx_lm": "0.0.1"}]
)
def test_a_file_of_other_settings_is_not_read_and_is_kept_for_the_server_that_wrote_it(
    changes, tiers, tmp_path, caplog
):
    key = fake_model(tmp_path / "model")
    stored(tiers, key, changes=changes).close()
    with caplog.at_level(logging.WARNING):
        tier = tiers()
        assert tier.restore(key, prompt(300, 0) + [5], 0) is None
        tier.flush()
    assert warnings_of(caplog) == [] and len(cache_files(tmp_path / "caches")) == 1
    assert tiers(changes=changes).restore(key, prompt(300, 0) + [5], 0) is not None


def test_a_restored_cache_is_the_stored_one_trimmed_to_the_shared_prefix(
    tiers, tmp_path
):
    key = fake_model(tmp_path / "model")
    tier = stored(tiers, key)
    tokens = prompt(300, 0)
    cache, rest = tier.restore(key, tokens[:200] + [1, 2, 3], 0)
    assert rest == [1, 2, 3] and [c.offset for c in cache] == [200, 200]
    original = random_cache(300, seed=0)
    assert all(
        mx.array_equal(c.keys[..., :200, :], o.keys[..., :200, :])
        for c, o in zip(cache, original)
    )
    # RAM holding more of the prompt wins; the whole prompt is never taken.
    assert tier.restore(key, tokens[:200] + [1], 200) is None
    assert tier.restore(key, tokens, 0)[1] == tokens[-1:]


def test_nothing_is_read_or_written_for_fewer_tokens_than_the_minimum(
    tiers, tmp_path, caplog
):
    key = fake_model(tmp_path / "model")
    tier = stored(tiers, key, min_tokens=256)
    [path] = cache_files(tmp_path / "caches")
    flip_last_byte(path)  # a read of it refuses it
    with caplog.at_level(logging.WARNING):
        assert (
            tier.restore(key, prompt(300, 0)[:200] + [1, 2, 3], 0) is None
        )  # 200 in common
        assert (
            tier.restore(key, prompt(300, 0) + [5], 100) is None
        )  # 200 more than RAM's
        tier.store(key, prompt(200, 7), random_cache(200, seed=7))
        tier.flush()
    assert warnings_of(caplog) == [] and cache_files(tmp_path / "caches") == [path]
    with caplog.at_level(logging.WARNING):
        assert (
            tier.restore(key, prompt(300, 0)[:280] + [1], 0) is None
        )  # read: 280 tokens
        tier.flush()
    assert any("checksum" in w for w in warnings_of(caplog)) and not path.exists()


def count_steps(db):
    """A counter of the SQLite instructions ``db`` runs from now on."""
    steps = [0]

    def count():
        steps[0] += 1
        return 0

    db.set_progress_handler(count, 1)
    return steps


def test_a_lookup_runs_no_more_steps_at_2000_rows_than_at_100(tiers, tmp_path):
    from mlx_lm_mla.disk import index as rows_of
    from mlx_lm_mla.disk.cachefile import make_record
    from mlx_lm_mla.disk.tier import file_name

    key = fake_model(tmp_path / "model")
    system = prompt(128, 1)  # every row shares its first two blocks
    work = []
    for n in (100, 2000):
        tier = tiers(folder=tmp_path / f"caches-{n}")
        model, digest = tier._model(key)
        with tier.index.transaction() as db:
            for i in range(n):
                blob = np.asarray(system + prompt(172, 1000 + i), dtype="<i4").tobytes()
                record = make_record(
                    json.loads(model), digest, tier.cache_digest, {}, blob, True
                )
                rows_of.add(
                    db, file_name(digest, tier.cache_digest, blob), record, blob, 1000
                )
        steps = count_steps(tier.index.db)
        for tokens in (
            prompt(300, 50000),
            system + prompt(172, 99),
        ):  # no row; a shared prefix
            assert tier.restore(key, tokens, 0) is None  # the rows have no files
        work.append(steps[0])
        tier.index.db.set_progress_handler(None, 1)
    assert work[1] < 1.5 * work[0], work


def test_the_folder_stays_under_its_bound_by_evicting_the_least_recently_used(
    tiers, tmp_path
):
    key = fake_model(tmp_path / "model")
    size = stored(tiers, key, start=0, folder=tmp_path / "probe").total_bytes()
    tier = tiers(max_bytes=int(size * 2.5))
    for start in (1, 2):
        tier.store(key, prompt(300, start), random_cache(300, seed=start))
        tier.flush()
    assert tier.restore(key, prompt(300, 1) + [5], 0) is not None  # 1 is now used last
    tier.flush()
    tier.store(key, prompt(300, 3), random_cache(300, seed=3))
    tier.flush()
    assert tier.total_bytes() <= size * 2.5
    assert tier.restore(key, prompt(300, 2) + [5], 0) is None  # evicted
    assert tier.restore(key, prompt(300, 1) + [5], 0) is not None
    assert tier.restore(key, prompt(300, 3) + [5], 0) is not None
    assert consistent(tmp_path / "caches")


def test_a_lower_bound_shrinks_the_folder_at_start(tiers, tmp_path, caplog):
    key = fake_model(tmp_path / "model")
    size = filled(tiers, key, 3)
    with caplog.at_level(logging.INFO):
        smaller = tiers(max_bytes=int(size * 1.5))
        smaller.flush()  # the writer's first job, once the server listens
    assert (
        tier_bytes(tmp_path / "caches") <= size * 1.5
        and len(cache_files(tmp_path / "caches")) == 1
    )
    assert (
        smaller.restore(key, prompt(300, 2) + [5], 0) is not None
    )  # the last one stored
    deleted = [
        m
        for m in (r.getMessage() for r in caplog.records)
        if "least recently used" in m
    ]
    assert len(deleted) == 2
    tiers(max_bytes=1).flush()
    assert cache_files(tmp_path / "caches") == []


def test_the_bound_holds_while_a_file_is_being_written(tiers, child, tmp_path):
    key = fake_model(tmp_path / "model")
    folder = tmp_path / "caches"
    size = stored(tiers, key, folder=tmp_path / "probe").total_bytes()
    bound = int(size * 2.5)
    tier = tiers(max_bytes=bound)
    for start in (0, 1):
        tier.store(key, prompt(300, start), random_cache(300, seed=start))
        tier.flush()
    tier.close()
    # Killed when its file is written, before it is renamed into place.
    proc = child(folder, key[0], 2, 1, bound, "fsync:1")
    assert proc.wait(timeout=600) == -signal.SIGKILL
    assert len(temp_files(folder)) == 1 and tier_bytes(folder) <= bound


def pending_rows(directory):
    db = sqlite3.connect(f"file:{caches(directory) / INDEX}?mode=ro", uri=True)
    try:
        return db.execute("SELECT name FROM pending").fetchall()
    finally:
        db.close()


def test_a_writer_killed_while_writing_takes_no_room_from_a_server_that_runs_on(
    tiers, child, tmp_path
):
    key = fake_model(tmp_path / "model")
    folder = tmp_path / "caches"
    size = stored(tiers, key, folder=tmp_path / "probe").total_bytes()
    bound = int(size * 1.5)  # room for one file
    tier = tiers(max_bytes=bound)
    tier.flush()  # its start's sweep is done: only a running server is left
    proc = child(folder, key[0], 0, 1, bound, "fsync:1")  # killed mid-write
    assert proc.wait(timeout=600) == -signal.SIGKILL
    assert len(temp_files(folder)) == 1 and len(pending_rows(folder)) == 1
    tier.store(key, prompt(300, 10), random_cache(300, seed=10))
    tier.flush()
    assert tier.restore(key, prompt(300, 10) + [5], 0) is not None
    assert consistent(folder) and pending_rows(folder) == []


def test_a_snapshot_that_fails_gives_its_place_back_to_the_writes_queued(
    tiers, tmp_path, monkeypatch
):
    from mlx_lm_mla.disk import cachefile

    key = fake_model(tmp_path / "model")
    tier = tiers()

    def out_of_memory(cache):
        raise RuntimeError("[malloc] Unable to allocate")  # as mx.eval can

    with monkeypatch.context() as m:
        m.setattr(cachefile, "snapshot", out_of_memory)
        for start in range(tier._pending + 1):  # more than the queue holds
            with pytest.raises(RuntimeError, match="allocate"):
                tier.store(key, prompt(300, start), random_cache(300, seed=start))
    tier.store(key, prompt(300, 99), random_cache(300, seed=99))
    tier.flush()
    assert len(cache_files(tmp_path / "caches")) == 1


def test_quantized_latents_stay_packed_on_disk(tiers, tmp_path):
    from conftest import latent_kv

    key = fake_model(tmp_path / "model")
    tier = tiers()
    exact = [latent_kv(256, seed=i) for i in range(2)]
    packed = [
        latent_kv(256, seed=i).to_quantized(group_size=64, bits=4) for i in range(2)
    ]
    assert {type(c).__name__ for c in packed} == {"QuantizedLatentCache"}
    tier.store(key, prompt(256, 1), exact)
    tier.store(key, prompt(256, 2), packed)
    tier.flush()
    by_size = sorted(p.stat().st_size for p in cache_files(tmp_path / "caches"))
    assert (
        by_size[0] < 1.1 * sum(c.nbytes for c in packed)
        and by_size[0] < 0.4 * by_size[1]
    )
    cache, _ = tier.restore(key, prompt(256, 2) + [5], 0)
    assert [type(c).__name__ for c in cache] == ["QuantizedLatentCache"] * 2
    assert all(
        mx.array_equal(a.keys[..., :255, :], b.keys[..., :255, :])
        for a, b in zip(cache, packed)
    )
    assert len(rows(tmp_path / "caches")) == 2


@pytest.mark.parametrize("crash", ["fsync:3", "replace:3", "kill"])
def test_a_crash_while_writing_leaves_the_directory_whole(
    crash, tiers, child, tmp_path
):
    key = fake_model(tmp_path / "model")
    folder = tmp_path / "caches"
    if crash == "kill":  # killed from outside, wherever the writes are
        proc = child(folder, key[0], 0, 1000, 1 << 30)
        while proc.poll() is None and len(rows_or_none(folder)) < 3:
            pass
        proc.send_signal(signal.SIGKILL)
    else:
        proc = child(folder, key[0], 0, 5, 1 << 30, crash)
    assert proc.wait(timeout=600) == -signal.SIGKILL
    done = len(rows(folder))
    assert done >= 2
    # Killed between writing and renaming, or renaming and committing: a
    # temporary file, or a file without its row, until the next open.
    assert crash == "kill" or not consistent(folder)
    tier = tiers()
    tier.flush()  # the writer's first job sweeps what the crash left
    assert consistent(folder)
    for start in range(done):
        assert tier.restore(key, prompt(300, start) + [5], 0) is not None
    tier.store(key, prompt(300, 99), random_cache(300, seed=99))
    tier.flush()
    assert tier.restore(key, prompt(300, 99) + [5], 0) is not None


def rows_or_none(folder):
    try:
        return rows(folder)
    except sqlite3.Error:
        return []


def test_a_temporary_file_of_a_dead_process_is_swept_even_where_its_pid_lives_again(
    tiers, child, tmp_path
):
    key = fake_model(tmp_path / "model")
    folder = tmp_path / "caches"
    # A writer killed with its file half done, whose PID this process has now
    # (a container's server is PID 1 in every run).
    proc = child(folder, key[0], 0, 1, 1 << 30, "fsync:1", os.getpid())
    assert proc.wait(timeout=600) == -signal.SIGKILL
    assert len(temp_files(folder)) == 1
    tiers().flush()  # the sweep: the writer's first job
    assert consistent(folder)


def test_two_processes_share_one_directory(tiers, child, tmp_path):
    key = fake_model(tmp_path / "model")
    folder = tmp_path / "caches"
    size = stored(tiers, key, folder=tmp_path / "probe").total_bytes()
    bound = int(size * 6.5)
    procs = [child(folder, key[0], start, 8, bound) for start in (0, 100)]
    assert [p.wait(timeout=600) for p in procs] == [0, 0]
    tier = tiers(max_bytes=bound)
    assert consistent(folder) and 0 < tier.total_bytes() <= bound
    kept = [
        s
        for s in [*range(8), *range(100, 108)]
        if tier.restore(key, prompt(300, s) + [5], 0)
    ]
    assert len(kept) == len(rows(folder)) == 6


# --- what the tier finds in its folder ---------------------------------------


def truncate_index(path):
    path.write_bytes(path.read_bytes()[:2048])


def index_of_another_schema(path):
    path.unlink()
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE entries (name TEXT PRIMARY KEY, tokens BLOB)")


def directory_in_its_place(path):
    path.unlink()
    path.mkdir()
    (path / "x").write_text("?")


def link_to_another_file(path):
    path.unlink()
    path.symlink_to(path.parent.parent.parent / "elsewhere.sqlite")


INDEX_DAMAGES = {
    "random bytes": lambda path: path.write_bytes(os.urandom(8192)),
    "truncated": truncate_index,
    "another schema": index_of_another_schema,
    "a directory": directory_in_its_place,
    "a link to another file": link_to_another_file,
    "empty": lambda path: path.write_bytes(b""),
    "missing": lambda path: path.unlink(),
}


@pytest.mark.parametrize("damage", INDEX_DAMAGES)
def test_an_index_that_cannot_be_used_is_moved_aside_and_built_again_from_the_files(
    damage, tiers, tmp_path, caplog
):
    key = fake_model(tmp_path / "model")
    folder = tmp_path / "caches"
    (tmp_path / "elsewhere.sqlite").write_text("not the tier's")
    tier = tiers()
    for start in (0, 1):
        tier.store(key, prompt(300, start), random_cache(300, seed=start))
        tier.flush()
    tier.close()
    INDEX_DAMAGES[damage](caches(folder) / INDEX)
    with caplog.at_level(logging.WARNING):
        tier = tiers()
    assert tier.restore(key, prompt(300, 0) + [5], 0) and tier.restore(
        key, prompt(300, 1) + [5], 0
    )
    [warning] = warnings_of(caplog)
    if damage in ("empty", "missing"):
        assert "had no index; built one from 2 cache files" in warning
    else:
        assert "moved aside" in warning and "built again from 2 cache files" in warning
        assert len(list(caches(folder).glob(f"{INDEX}.aside-*"))) == 1
    assert (
        consistent(folder)
        and (tmp_path / "elsewhere.sqlite").read_text() == "not the tier's"
    )


def test_a_tier_that_cannot_repair_its_index_is_off_with_one_warning(
    installed, tmp_path, monkeypatch, caplog
):
    args = argparse.Namespace(
        prompt_cache_dir=str(tmp_path / "d"),
        prompt_cache_dir_bytes=None,
        prompt_cache_dir_min_tokens=None,
    )
    hooks.open_tier(args).close()
    (caches(tmp_path / "d") / INDEX).write_bytes(os.urandom(4096))

    def refused(*args):  # a folder made read-only (root writes to any folder)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "rename", refused)
    with caplog.at_level(logging.WARNING):
        assert hooks.open_tier(args) is None
    [warning] = warnings_of(caplog)
    assert "prompt caches on disk are off" in warning and "Permission denied" in warning


def test_a_cache_file_replaced_by_a_directory_is_left_alone_and_every_start_serves(
    tiers, tmp_path, caplog
):
    key = fake_model(tmp_path / "model")
    stored(tiers, key).close()
    [path] = cache_files(tmp_path / "caches")
    path.unlink()
    path.mkdir()
    (path / "keep").write_text("kept")
    for start in (1, 2, 3):
        tier = tiers()
        assert tier.restore(key, prompt(300, 0) + [5], 0) is None
        tier.store(key, prompt(300, start), random_cache(300, seed=start))
        tier.flush()
        assert tier.restore(key, prompt(300, start) + [5], 0) is not None
        tier.close()
    assert (path / "keep").read_text() == "kept"


def test_a_cache_written_again_after_its_file_went_missing_is_restored(tiers, tmp_path):
    key = fake_model(tmp_path / "model")
    tier = stored(tiers, key)
    [path] = cache_files(tmp_path / "caches")
    path.unlink()
    assert tier.restore(key, prompt(300, 0) + [5]) is None  # refused, row removed
    tier.flush()
    tier.store(key, prompt(300, 0), random_cache(300, seed=0))
    tier.flush()
    assert path.is_file()
    assert tier.restore(key, prompt(300, 0) + [5]) is not None


def test_a_restore_needs_no_write_to_the_index(tiers, tmp_path):
    key = fake_model(tmp_path / "model")
    tier = stored(tiers, key)
    # Another process holds the index's write lock (as a full disk or a
    # folder made read-only, no write can be made now).
    writer = sqlite3.connect(caches(tmp_path / "caches") / INDEX, isolation_level=None)
    writer.execute("BEGIN IMMEDIATE")
    try:
        found = tier.restore(key, prompt(300, 0) + [5], 0)
        tier.store(
            key, prompt(300, 0), random_cache(300, seed=0)
        )  # stored already: its use is noted later
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    assert found is not None and found[1] == [5]


def forge_row(directory, name):
    """An index row naming ``name``, the least recently used."""
    with sqlite3.connect(caches(directory) / INDEX) as db:
        db.execute(
            "INSERT INTO entries (name, model, model_digest, cache_digest, settings, "
            "n_tokens, tokens, last_block, nbytes, trimmable, last_used) "
            "SELECT ?, model, model_digest, cache_digest, settings, n_tokens, tokens, "
            "NULL, nbytes, trimmable, 0 FROM entries LIMIT 1",
            (name,),
        )


def test_names_in_the_index_are_never_taken_as_paths(tiers, tmp_path, caplog):
    key = fake_model(tmp_path / "model")
    folder = tmp_path / "caches"
    victim = tmp_path / "victim.safetensors"
    victim.write_text("not the tier's")
    names = ["../../victim.safetensors", str(victim), "x/../../../victim.safetensors"]
    size = stored(tiers, key, folder=tmp_path / "probe").total_bytes()
    tier = stored(tiers, key, max_bytes=int(size * 1.5))
    for name in names:  # evicted first
        forge_row(folder, name)
    tier.store(key, prompt(300, 1), random_cache(300, seed=1))
    tier.flush()
    tier.close()
    for name in names:  # swept at start
        forge_row(folder, name)
    tiers().close()
    for name in names:  # cleared
        forge_row(folder, name)
    assert mlx_lm_mla_main(["cache-dir", "clear", str(folder)]) == 0
    assert victim.read_text() == "not the tier's"
    assert sum("nothing deleted" in w for w in warnings_of(caplog)) == 3 * len(names)


def test_every_file_the_tier_deletes_is_logged_with_its_reason(
    tiers, child, tmp_path, caplog
):
    key = fake_model(tmp_path / "model")
    folder = tmp_path / "caches"
    seen = set()

    def look():
        seen.update(p.name for p in cache_files(folder) + temp_files(folder))

    assert (
        child(folder, key[0], 0, 1, 1 << 30, "fsync:1").wait(timeout=600)
        == -signal.SIGKILL
    )
    look()  # a temporary file of a dead process
    size = stored(tiers, key, folder=tmp_path / "probe").total_bytes()
    with caplog.at_level(logging.INFO):
        tier = tiers(max_bytes=int(size * 2.5))
        for n, start in (
            (300, 1),
            (300, 2),
            (300, 3),
            (200, 4),
            (300, 4),
        ):  # evicted; a prefix replaced
            tier.store(key, prompt(n, start), random_cache(n, seed=start))
            tier.flush()
            look()
        flip_last_byte(cache_files(folder)[0])
        for start in (3, 4):  # one of them refused
            tier.restore(key, prompt(300, start) + [5], 0)
        tier.flush()
    gone = seen - {p.name for p in cache_files(folder)}
    assert len(gone) >= 4
    logged = [r.getMessage() for r in caplog.records if "deleted" in r.getMessage()]
    for name in gone:
        assert any(f"{name}: " in m for m in logged), (name, logged)


# --- mlx-lm-mla cache-dir ------------------------------------------------------


def test_cache_dir_stats_says_what_is_stored_for_which_model_and_how_big(
    tiers, tmp_path, capsys
):
    key = fake_model(tmp_path / "model")
    folder = tmp_path / "caches"
    tier = tiers()
    for n, start in ((300, 0), (400, 1)):
        tier.store(key, prompt(n, start), random_cache(n, seed=start))
    tier.flush()
    nbytes = tier.total_bytes()
    tier.close()
    (caches(folder) / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert mlx_lm_mla_main(["cache-dir", "stats", str(folder)]) == 0
    out = capsys.readouterr().out
    assert f"{caches(folder)}: 2 cache files, {nbytes / 1024:,.1f} KiB" in out
    assert (
        f"model {key[0]} (exact" in out and "2 files" in out and "300-400 tokens" in out
    )
    assert "not the tier's, left alone: notes.txt" in out


def test_cache_dir_clear_deletes_the_tiers_files_and_nothing_else(
    tiers, tmp_path, capsys
):
    key = fake_model(tmp_path / "model")
    folder = tmp_path / "caches"
    stored(tiers, key).close()
    theirs = [
        folder / "model.safetensors",
        caches(folder) / "notes.txt",
        caches(folder) / "0123.safetensors",
    ]
    for path in theirs:
        path.write_text("mine")
    assert mlx_lm_mla_main(["cache-dir", "clear", str(folder)]) == 0
    assert cache_files(folder) == [] and rows(folder) == []
    assert [p.read_text() for p in theirs] == ["mine"] * 3
    assert tiers().restore(key, prompt(300, 0) + [5], 0) is None
    assert mlx_lm_mla_main(["cache-dir", "clear", str(tmp_path / "nothing")]) == 2
    assert not (tmp_path / "nothing").exists()


@pytest.mark.parametrize(
    "model_type,kv_bits",
    [("glm4_moe_lite", 4), ("deepseek_v32", None), ("qwen2", None)],
)
def test_a_restored_cache_continues_as_the_one_stored(
    model_type, kv_bits, tiers, tmp_path
):
    """A latent packed at 4 bits, a CacheList (DeepSeek-V3.2's indexer keys
    beside the latent), and a model without MLA."""
    from mlx_lm.generate import maybe_quantize_kv_cache
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lm_mla import tiny

    path = tiny.save_model(tmp_path / model_type, model_type)
    model, _ = tiny.load(path)
    key = (str(path), None, None)
    tokens = prompt(80, 4)
    cache = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=cache)
    if kv_bits:
        maybe_quantize_kv_cache(
            cache, quantized_kv_start=0, kv_group_size=64, kv_bits=kv_bits
        )
    tier = tiers()
    tier.store(key, tokens, cache)
    tier.flush()
    restored, rest = tier.restore(key, tokens + [7, 8], 0)
    assert [type(c).__name__ for c in restored] == [type(c).__name__ for c in cache]
    assert mx.array_equal(
        model(mx.array(rest)[None], cache=restored),
        model(mx.array(rest)[None], cache=cache),
    )
