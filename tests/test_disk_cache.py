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
    with Server(model_path, *flags) as fresh:
        expected, fresh_usage = answer(fresh.port, turn)
    assert cached_tokens(fresh_usage) == 0
    assert cached_tokens(usage) >= len(SYSTEM) + len(reply)  # one token per character
    assert restored == expected
    assert os.stat(folder).st_mode & 0o777 == 0o700
    assert {os.stat(p).st_mode & 0o777 for p in folder.iterdir()} == {0o600}
