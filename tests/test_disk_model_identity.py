"""The disk tier knows a model by its files' contents, not their times: weights
replaced under the same name, size and modification time are another model,
whose stored caches are not served; a model whose files are only touched keeps
its caches; a large weight file is read in part."""

import json
import logging
import os

import mlx.core as mx
import pytest

from mlx_lm_mla import tiny
from mlx_lm_mla.disk import fingerprint
from mlx_lm_mla.disk.folder import SUBFOLDER, is_cache_name
from mlx_lm_mla.disk.tier import DiskTier
from disk_child import prompt, random_cache, settings

PROMPT = prompt(300, 0)


def open_tier(tmp_path):
    return DiskTier(tmp_path / "caches", 1 << 30, settings(), min_tokens=64)


def store(tmp_path, key):
    """Stores one cache for ``key`` and checks it restores; the tier is closed."""
    tier = open_tier(tmp_path)
    try:
        tier.store(key, PROMPT, random_cache(len(PROMPT)))
        tier.flush()
        assert tier.restore(key, PROMPT + [5]) is not None
    finally:
        tier.close()


def restores(tmp_path, key):
    tier = open_tier(tmp_path)
    try:
        found = tier.restore(key, PROMPT + [5])
        tier.flush()
        return found is not None
    finally:
        tier.close()


def cache_files(tmp_path):
    folder = tmp_path / "caches" / SUBFOLDER
    return [p for p in folder.iterdir() if is_cache_name(p.name)]


def replace_keeping_times(path, data):
    """Writes ``data`` (of the file's size) over ``path``, its times put back."""
    before = os.stat(path)
    assert len(data) == before.st_size
    path.write_bytes(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def large_model(folder, size_mib=8):
    """A model folder whose weight file is larger than the bytes sampled from
    it: two tensors of the same shape, then one that fills the rest."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "glm4_moe_lite"}))
    (folder / "tokenizer.json").write_text("{}")
    mx.random.seed(0)
    weights = {
        "a.weight": mx.random.normal((64, 64)),
        "b.weight": mx.random.normal((64, 64)),
        "c.weight": mx.random.normal((size_mib << 18,)),
    }
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    return (str(folder), None, None)


def swap_names_in_header(raw):
    """The file with tensors a and b's names swapped in its header: the same
    size and data, another model."""
    end = 8 + int.from_bytes(raw[:8], "little")
    header = raw[8:end].replace(b'"a.weight"', b'"x.weight"')
    header = header.replace(b'"b.weight"', b'"a.weight"')
    header = header.replace(b'"x.weight"', b'"b.weight"')
    assert header != raw[8:end]
    return raw[:8] + header + raw[end:]


def flip_byte(at):
    def flip(raw):
        data = bytearray(raw)
        data[at(len(raw))] ^= 1
        return bytes(data)

    return flip


def test_weights_replaced_with_their_size_and_times_kept_are_another_models(
    installed, tmp_path, caplog
):
    key = (str(tiny.save_demo_model(tmp_path / "model", seed=0)), None, None)
    other = tiny.save_demo_model(tmp_path / "other", seed=1)
    store(tmp_path, key)
    weights = tmp_path / "model" / "model.safetensors"
    replace_keeping_times(weights, (other / "model.safetensors").read_bytes())
    with caplog.at_level(logging.WARNING):
        assert not restores(tmp_path, key)
    assert cache_files(tmp_path) == []  # deleted as another model's
    assert any("were others" in r.getMessage() for r in caplog.records)


CHANGES = {
    "two tensors' names swapped in the header": swap_names_in_header,
    "a byte of the first MiB": flip_byte(lambda n: 4096),
    "a byte of the last MiB": flip_byte(lambda n: n - 1),
    "a byte in the middle": flip_byte(lambda n: fingerprint._pieces(n)[4][0] + 7),
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_large_weight_file_changed_in_its_sampled_bytes_is_another_model(
    change, installed, tmp_path
):
    key = large_model(tmp_path / "model")
    store(tmp_path, key)
    weights = tmp_path / "model" / "model.safetensors"
    replace_keeping_times(weights, CHANGES[change](weights.read_bytes()))
    assert not restores(tmp_path, key)


def test_a_model_whose_files_are_only_touched_keeps_its_caches(installed, tmp_path):
    key = large_model(tmp_path / "model")
    store(tmp_path, key)
    for path in (tmp_path / "model").iterdir():
        os.utime(path, ns=(0, os.stat(path).st_mtime_ns + 10**9))
    assert restores(tmp_path, key)


def test_a_cache_stored_under_an_older_form_of_the_fingerprint_is_not_served(
    installed, tmp_path, monkeypatch
):
    key = large_model(tmp_path / "model")
    with monkeypatch.context() as m:
        m.setattr(fingerprint, "MODEL_FORM", "model-1")
        store(tmp_path, key)
    assert not restores(tmp_path, key)
    assert cache_files(tmp_path) == []


def test_a_large_weight_file_is_read_in_part(tmp_path, monkeypatch):
    """A 4 GiB weight file (sparse): its header and about 2.5 MiB are read."""
    folder = tmp_path / "model"
    folder.mkdir()
    size = 4 << 30
    header = json.dumps(
        {"w": {"dtype": "U8", "shape": [size - 64], "data_offsets": [0, size - 64]}}
    ).encode()
    header += b" " * (56 - len(header))  # the data starts at byte 64
    with open(folder / "model.safetensors", "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.truncate(size)
    read = []
    pread = os.pread
    monkeypatch.setattr(
        os, "pread", lambda fd, n, at: read.append(n) or pread(fd, n, at)
    )
    assert fingerprint.model_digest((str(folder), None, None)) is not None
    assert 2 << 20 < sum(read) < 3 << 20


# --- a server's model is known by its files as it loaded them ------------------


def server_args(monkeypatch, tmp_path, model):
    """The arguments ``mlx_lm.server.main`` parses for a server of ``model``
    with the tier in ``tmp_path / "caches"``."""
    import sys

    import mlx_lm.server as server

    seen = []
    with monkeypatch.context() as m:
        m.setattr(server, "ModelProvider", lambda args: seen.append(args))
        m.setattr(server, "run", lambda *args: None)
        folder = str(tmp_path / "caches")
        argv = ["--model", str(model), "--prompt-cache-dir", folder]
        m.setattr(sys, "argv", ["mlx_lm.server", *argv])
        server.main()
    return seen[0]


def started(cli_args):
    """A server's provider with its default model loaded (mlx-lm 0.31 loads it
    when made, 0.32 at its loop's start), and its tier."""
    import mlx_lm.server as server

    from mlx_lm_mla.disk import hooks

    provider = server.ModelProvider(cli_args)
    getattr(provider, "load_default", lambda: None)()
    return provider, hooks.open_tier(cli_args, provider)


def copy_over(source, folder):
    for path in source.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())


def test_files_changed_between_the_load_and_the_first_request_do_not_label_its_caches(
    installed, tmp_path, monkeypatch
):
    model = tiny.save_demo_model(tmp_path / "model", seed=0)
    cli_args = server_args(monkeypatch, tmp_path, model)
    provider, tier = started(cli_args)
    copy_over(tiny.save_demo_model(tmp_path / "v2", seed=1), model)
    try:  # the first request: a cache of the weights loaded before the change
        tier.store(provider.model_key, PROMPT, random_cache(len(PROMPT)))
        tier.flush()
        assert tier.restore(provider.model_key, PROMPT + [5]) is not None
    finally:
        tier.close()
    provider, tier = started(cli_args)  # a restart loads the files now there
    try:
        assert tier.restore(provider.model_key, PROMPT + [5]) is None
    finally:
        tier.close()


def test_a_model_loaded_again_is_fingerprinted_again_and_its_older_caches_go(
    installed, tmp_path, monkeypatch
):
    model = tiny.save_demo_model(tmp_path / "model", seed=0)
    other = tiny.save_demo_model(tmp_path / "other", seed=1)
    provider, tier = started(server_args(monkeypatch, tmp_path, model))
    try:
        key = provider.model_key
        tier.store(key, PROMPT, random_cache(len(PROMPT)))
        tier.flush()
        copy_over(other, model)
        provider.load(str(other))  # another model, then the default again
        provider.load(*key)
        assert provider.model_key == key
        assert tier.restore(key, PROMPT + [5]) is None
        tier.flush()
        assert cache_files(tmp_path) == []  # written for the files before
    finally:
        tier.close()


def test_files_that_cannot_be_fingerprinted_keep_the_caches_in_ram_and_load_on(
    installed, tmp_path, monkeypatch, caplog
):
    from mlx_lm_mla.disk import fingerprint

    def unreadable(*args):
        raise PermissionError(13, "Permission denied", "notes.bin")

    model = tiny.save_demo_model(tmp_path / "model", seed=0)
    cli_args = server_args(monkeypatch, tmp_path, model)
    monkeypatch.setattr(fingerprint, "model_digest", unreadable)
    provider, tier = started(cli_args)  # the load itself goes on
    try:
        assert provider.model is not None
        tier.store(provider.model_key, PROMPT, random_cache(len(PROMPT)))
        tier.flush()
        assert cache_files(tmp_path) == []
    finally:
        tier.close()
    assert "could not fingerprint the files of model" in caplog.text


# --- a model path is its folder, wherever the server runs ----------------------


def test_servers_given_one_relative_path_in_other_folders_keep_each_others_caches(
    installed, tmp_path, monkeypatch, caplog
):
    for project, seed in (("a", 0), ("b", 1)):
        tiny.save_demo_model(tmp_path / project / "model", seed=seed)
    key = ("model", None, None)  # `--model model` in each project's folder
    monkeypatch.chdir(tmp_path / "a")
    a = open_tier(tmp_path)
    monkeypatch.chdir(tmp_path / "b")
    b = open_tier(tmp_path)
    try:
        monkeypatch.chdir(tmp_path / "a")
        a.store(key, PROMPT, random_cache(len(PROMPT)))
        a.flush()
        monkeypatch.chdir(tmp_path / "b")
        with caplog.at_level(logging.WARNING):
            assert b.restore(key, prompt(300, 1) + [5]) is None  # its first request
            b.flush()
        assert len(cache_files(tmp_path)) == 1
        assert not any("were others" in r.getMessage() for r in caplog.records)
        monkeypatch.chdir(tmp_path / "a")
        assert a.restore(key, PROMPT + [5]) is not None
    finally:
        a.close()
        b.close()


def test_rows_that_name_a_model_by_its_absolute_path_as_given_go_when_it_changes(
    installed, tmp_path, monkeypatch
):
    model = tiny.save_demo_model(tmp_path / "model", seed=0)
    (tmp_path / "link").symlink_to(model)
    key = (str(tmp_path / "link"), None, None)
    with monkeypatch.context() as m:  # as the index kept paths before
        m.setattr(fingerprint, "model_form", lambda paths: json.dumps(list(paths)))
        store(tmp_path, key)
    assert json.loads(only_row_model(tmp_path)) == list(key)
    copy_over(tiny.save_demo_model(tmp_path / "v2", seed=1), model)
    assert not restores(tmp_path, key)
    assert cache_files(tmp_path) == []


def only_row_model(tmp_path):
    import sqlite3

    db = sqlite3.connect(tmp_path / "caches" / SUBFOLDER / "index.sqlite")
    try:
        [(model,)] = db.execute("SELECT model FROM entries").fetchall()
    finally:
        db.close()
    return model
