"""Prompt caches on disk (``--prompt-cache-dir``): restored by a new server
process, refused when they are not what they claim, the directory bounded,
whole after a crash, shared by two processes."""

import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache

import mlx_lm_mla
from mlx_lm_mla.disk.fingerprint import cache_settings
from mlx_lm_mla.disk.hooks import parse_size, take_flags
from mlx_lm_mla.disk.tier import DiskTier
from serving import SYSTEM, Server, cached_tokens, post_json, save_served_model, server_supports

HERE = Path(__file__).parent
KV_BITS = [None, 4] if server_supports("--kv-bits") else [None]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return save_served_model(tmp_path_factory.mktemp("served") / "glm")


def body(messages, max_tokens=12):
    return {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "logit_bias": {"1": -100}}  # no early end-of-text: a full answer


def answer(port, messages):
    status, reply = post_json(port, "/v1/chat/completions", body(messages))
    assert status == 200, reply
    return reply["choices"][0]["message"]["content"], reply["usage"]


def rows(folder):
    with sqlite3.connect(Path(folder) / "index.sqlite") as db:
        return db.execute("SELECT name, n_tokens FROM entries").fetchall()


@pytest.mark.parametrize("bits", KV_BITS, ids=lambda b: f"kv_bits={b}")
def test_a_new_server_restores_the_conversation_from_disk_and_answers_as_a_fresh_one(bits, model_path, tmp_path):
    folder = tmp_path / "caches"
    flags = ["--kv-bits", bits, "--quantized-kv-start", 0] if bits else []
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a trie?"}]
    with Server(model_path, "--prompt-cache-dir", folder, *flags) as server:
        reply, usage = answer(server.port, first)
    # Stopped with SIGTERM: the queued writes finished before the process ended.
    stored = rows(folder)
    assert stored and max(n for _, n in stored) >= usage["prompt_tokens"]
    turn = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And a heap?"}]
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
    assert os.stat(folder).st_mode & 0o777 == 0o700
    assert {os.stat(p).st_mode & 0o777 for p in folder.iterdir()} == {0o600}
    # A changed byte in every file: refused, and the prompt prefilled.
    for path in folder.glob("*.safetensors"):
        flip_last_byte(path)
    with Server(model_path, "--prompt-cache-dir", folder, *flags, log=tmp_path / "log") as server:
        prefilled, usage = answer(server.port, turn)
    with Server(model_path, *flags) as fresh:
        assert answer(fresh.port, turn) == (prefilled, usage)  # prefilled as on a fresh server
    assert cached_tokens(usage) == 0
    assert "checksum does not match" in (tmp_path / "log").read_text()


# --- the tier itself, without a server ---------------------------------------

from disk_child import prompt, random_cache, settings  # noqa: E402


def fake_model(folder, seed=0):
    """A model folder as the fingerprint sees it: config, weights, tokenizer."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "glm4_moe_lite"}))
    (folder / "tokenizer.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(os.urandom(64) if seed else bytes(64))
    return (str(folder), None, None)


def child(*args):
    return subprocess.Popen([sys.executable, str(HERE / "disk_child.py"), *map(str, args)])


def consistent(folder):
    """Every index row has its file and every file its row; no temporary file.
    SQLite's own files (the index, a journal a killed writer left, which SQLite
    ignores once it is not hot) are not the tier's."""
    names = {p.name for p in Path(folder).iterdir() if not p.name.startswith("index.sqlite")}
    return names == {name for name, _ in rows(folder)}


@pytest.fixture
def tiers(installed, tmp_path):
    opened = []

    def tier(max_bytes=1 << 30, changes=None, folder=tmp_path / "caches"):
        t = DiskTier(folder, max_bytes, {**settings(), **(changes or {})})
        opened.append(t)
        return t

    yield tier
    for t in opened:
        t.close()


def stored(tiers, key, n=300, start=0, **kwargs):
    tier = tiers(**kwargs)
    tier.store(key, prompt(n, start), random_cache(n, seed=start))
    tier.flush()
    return tier


def flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGES = {
    "changed byte": (lambda path, key, tiers: flip_last_byte(path), {}, "checksum"),
    "truncated": (lambda path, key, tiers: truncate(path), {}, "truncated"),
    "another model's file": (
        lambda path, key, tiers: stored(tiers, fake_model(Path(key[0]).parent / "other", seed=1))
        and [p.replace(path) for p in path.parent.glob("*.safetensors") if p != path],
        {}, "another model's files"),
    "weights changed": (lambda path, key, tiers: fake_model(key[0], seed=2), {}, "model's files"),
    "other kv bits": (lambda path, key, tiers: None, {"kv_bits": 4, "kv_group_size": 64}, "other cache settings"),
    "other mlx-lm": (lambda path, key, tiers: None, {"mlx_lm": "0.0.1"}, "another mlx"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_file_that_is_not_what_it_claims_is_refused_deleted_and_the_prompt_prefilled(damage, tiers, tmp_path, caplog):
    key = fake_model(tmp_path / "model")
    changes, why = DAMAGES[damage][1:]
    # Written under `changes`, read without: a file of other settings.
    first = stored(tiers, key, changes={k: "written" for k in changes})
    assert first.restore(key, prompt(300, 0) + [5], 0) is not None  # whole, it restores
    first.close()
    [path] = (tmp_path / "caches").glob("*.safetensors")
    DAMAGES[damage][0](path, key, tiers)
    with caplog.at_level(logging.WARNING):
        found = tiers(changes=changes).restore(key, prompt(300, 0) + [5], 0)
    assert found is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(why in w and path.name in w for w in warnings), warnings
    assert not path.exists() and path.name not in {n for n, _ in rows(tmp_path / "caches")}


def test_a_restored_cache_is_the_stored_one_trimmed_to_the_shared_prefix(tiers, tmp_path):
    key = fake_model(tmp_path / "model")
    tier = stored(tiers, key)
    tokens = prompt(300, 0)
    cache, rest = tier.restore(key, tokens[:200] + [1, 2, 3], 0)
    assert rest == [1, 2, 3] and [c.offset for c in cache] == [200, 200]
    original = random_cache(300, seed=0)
    assert all(mx.array_equal(c.keys[..., :200, :], o.keys[..., :200, :]) for c, o in zip(cache, original))
    # RAM holding more of the prompt wins; the whole prompt is never taken.
    assert tier.restore(key, tokens[:200] + [1], 200) is None
    assert tier.restore(key, tokens, 0)[1] == tokens[-1:]


def test_the_directory_stays_under_its_bound_by_evicting_the_least_recently_used(tiers, tmp_path):
    key = fake_model(tmp_path / "model")
    size = stored(tiers, key, start=0, folder=tmp_path / "probe").total_bytes()
    tier = tiers(max_bytes=int(size * 2.5))
    for start in (1, 2):
        tier.store(key, prompt(300, start), random_cache(300, seed=start))
        tier.flush()
    assert tier.restore(key, prompt(300, 1) + [5], 0) is not None  # 1 is now used last
    tier.store(key, prompt(300, 3), random_cache(300, seed=3))
    tier.flush()
    assert tier.total_bytes() <= size * 2.5
    assert tier.restore(key, prompt(300, 2) + [5], 0) is None  # evicted
    assert tier.restore(key, prompt(300, 1) + [5], 0) is not None
    assert tier.restore(key, prompt(300, 3) + [5], 0) is not None
    assert consistent(tmp_path / "caches")


def test_quantized_latents_stay_packed_on_disk(tiers, tmp_path):
    from conftest import latent_kv

    key = fake_model(tmp_path / "model")
    tier = tiers()
    exact = [latent_kv(256, seed=i) for i in range(2)]
    packed = [latent_kv(256, seed=i).to_quantized(group_size=64, bits=4) for i in range(2)]
    assert {type(c).__name__ for c in packed} == {"QuantizedLatentCache"}
    tier.store(key, prompt(256, 1), exact)
    tier.store(key, prompt(256, 2), packed)
    tier.flush()
    sizes = dict(rows(tmp_path / "caches"))
    by_size = sorted(p.stat().st_size for p in (tmp_path / "caches").glob("*.safetensors"))
    assert by_size[0] < 1.1 * sum(c.nbytes for c in packed) and by_size[0] < 0.4 * by_size[1]
    cache, _ = tier.restore(key, prompt(256, 2) + [5], 0)
    assert [type(c).__name__ for c in cache] == ["QuantizedLatentCache"] * 2
    assert all(mx.array_equal(a.keys[..., :255, :], b.keys[..., :255, :]) for a, b in zip(cache, packed))
    assert len(sizes) == 2


@pytest.mark.parametrize("crash", ["fsync:3", "replace:3", "kill"])
def test_a_crash_while_writing_leaves_the_directory_whole(crash, tiers, tmp_path):
    key = fake_model(tmp_path / "model")
    folder = tmp_path / "caches"
    if crash == "kill":  # killed from outside, wherever the writes are
        proc = child(folder, key[0], 0, 1000, 1 << 30)
        while proc.poll() is None and len(rows_or_none(folder)) < 3:
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    else:
        proc = child(folder, key[0], 0, 5, 1 << 30, crash)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    done = len(rows(folder))
    assert done >= 2
    # Killed between writing and renaming, or renaming and committing: a
    # temporary file, or a file without its row, until the next open.
    assert crash == "kill" or not consistent(folder)
    tier = tiers()  # opening it sweeps what the crash left
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


def test_two_processes_share_one_directory(tiers, tmp_path):
    key = fake_model(tmp_path / "model")
    folder = tmp_path / "caches"
    size = stored(tiers, key, folder=tmp_path / "probe").total_bytes()
    bound = int(size * 6.5)
    procs = [child(folder, key[0], start, 8, bound) for start in (0, 100)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    tier = tiers(max_bytes=bound)
    assert consistent(folder) and 0 < tier.total_bytes() <= bound
    kept = [s for s in [*range(8), *range(100, 108)] if tier.restore(key, prompt(300, s) + [5], 0)]
    assert len(kept) == len(rows(folder)) == 6


def test_the_flags_are_taken_out_of_the_command_line():
    rest, folder, size = take_flags(["--model", "m", "--prompt-cache-dir", "d", "--prompt-cache-dir-bytes=2G"])
    assert (rest, folder, size) == (["--model", "m"], "d", 2 << 30)
    assert parse_size("500000") == 500000
    for bad in (["--prompt-cache-dir-bytes", "1G"], ["--prompt-cache-dir"], ["--prompt-cache-dir="],
                ["--prompt-cache-dir", "d", "--prompt-cache-dir-bytes", "-3"]):
        with pytest.raises(ValueError, match="prompt-cache-dir"):
            take_flags(bad)


@pytest.mark.parametrize("model_type,kv_bits", [("glm4_moe_lite", 4), ("deepseek_v32", None), ("qwen2", None)])
def test_a_restored_cache_continues_as_the_one_stored(model_type, kv_bits, tiers, tmp_path):
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
        maybe_quantize_kv_cache(cache, quantized_kv_start=0, kv_group_size=64, kv_bits=kv_bits)
    tier = tiers()
    tier.store(key, tokens, cache)
    tier.flush()
    restored, rest = tier.restore(key, tokens + [7, 8], 0)
    assert [type(c).__name__ for c in restored] == [type(c).__name__ for c in cache]
    assert mx.array_equal(model(mx.array(rest)[None], cache=restored), model(mx.array(rest)[None], cache=cache))


def test_the_servers_help_lists_the_flags():
    assert server_supports("--prompt-cache-dir") and server_supports("--prompt-cache-dir-bytes")
