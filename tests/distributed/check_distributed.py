"""Across machines: MLA caches under ``mlx.launch``, pipeline and tensor parallel.

Two ranks on this machine (``mlx.launch -n 2 --backend ring`` over
loopback), each a separate process that gets the fix only through the
package's start-up hook, as on a real cluster. ``ranks.py`` runs
the scenarios on each rank and writes what it saw to ``rank<r>.json``;
``serve.py`` runs ``mlx_lm.server`` there. A launch is waited on while its
ranks make progress (output or CPU time; ``serving.wait_for``) and killed
with its ranks afterwards.

The tests that need the fix fail without it: ``MLX_LM_MLA_DISABLE=1`` in the
environment of pytest reaches every rank. The ``without_the_package`` tests
switch it off themselves and expect stock mlx-lm's ``swapaxes`` error.

Which parallelism a model gets is what its installed mlx-lm class offers
(``model.model.pipeline``, ``model.shard``), as ``sharded_load`` decides. The
``CacheList`` model is DeepSeek-V3.2: it has both. Its latent quantizes in
place like the others (its indexer's keys stay exact), and its
``make_cache`` ignores ``max_kv_size``, so it has no rolling-window tests.

    python -m pytest -q tests/distributed -o python_files=check_*.py

Not in the README's test command (it would add a minute or more to every CI
leg); ``.ci/run`` runs it at the high end of the range.
"""

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from mlx_lm_mla import tiny

from conftest import SWAPAXES, leaves
from serving import (
    RequestFailed,
    Server,
    cached_tokens,
    four_clients,
    questions,
    save_served_model,
    server_supports,
    wait_for,
    wait_until_up,
)

HERE = Path(__file__).parent
RANKS = 2

# Rope width 64, so stock KV quantization (group 64) gets to the model code.
WIDE = {"kv_lora_rank": 128, "qk_rope_head_dim": 64}
CONFIGS = {"glm4_moe_lite": WIDE, "deepseek_v3": WIDE, "deepseek_v32": {}}


def _capabilities(model_type):
    model, _ = tiny.build_model(model_type, **CONFIGS[model_type])
    modes = []
    if hasattr(model, "model") and hasattr(model.model, "pipeline"):
        modes.append("pipeline")
    if hasattr(model, "shard"):
        modes.append("tensor")
    window = any(
        isinstance(c, RotatingKVCache) for c in leaves(make_prompt_cache(model, WINDOW))
    )
    return modes, window


def _module(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ranks = _module(HERE / "ranks.py")  # its scenarios' settings
WINDOW = ranks.WINDOW
PREFIX = len(ranks.PREFIX)  # tokens each later request shares with the first

CAPABILITIES = {t: _capabilities(t) for t in CONFIGS}
MODES = [
    m
    for m in ("pipeline", "tensor")
    if any(m in modes for modes, _ in CAPABILITIES.values())
]
# plain latent KVCaches, also tested at 8 bits
QUANTIZABLE = ["glm4_moe_lite", "deepseek_v3"]
WINDOWED = [t for t in CONFIGS if CAPABILITIES[t][1]]


def cases(model_types, mode=None):
    return [
        pytest.param(m, t, id=f"{m}-{t}")
        for t in model_types
        for m in CAPABILITIES[t][0]
        if mode in (None, m)
    ]


def scenarios(model_type):
    names = (
        ["reuse_kv4", "reuse_kv8", "batch"]
        if model_type in QUANTIZABLE
        else ["reuse_kv4", "batch"]
    )
    return names + (["window_kv4"] if model_type in WINDOWED else [])


# --- launching ---------------------------------------------------------------


def launcher():
    local = Path(sys.executable).parent / "mlx.launch"
    return str(local) if local.exists() else "mlx.launch"


def ring_port():
    """A port p with p + 1 also free: the ring backend listens on one per rank."""
    while True:
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port + RANKS > 65535:
                continue
            try:
                with socket.socket() as b:
                    b.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


def launch(script, *args, disabled=False, log):
    """``mlx.launch -n 2 --backend ring`` running script on this machine, in a
    process group of its own so that stop() ends every rank. The ranks get
    this process's environment; disabled adds ``MLX_LM_MLA_DISABLE=1``. The
    launcher's host and pid files go beside the log, in the test's folder."""
    env = dict(os.environ, **({"MLX_LM_MLA_DISABLE": "1"} if disabled else {}))
    env["TMPDIR"] = str(Path(log.name).resolve().parent)
    cmd = [launcher(), "-n", str(RANKS), "--backend", "ring", "-p", str(ring_port())]
    cmd += ["--python", sys.executable, "--", str(script), *map(str, args)]
    # stdin: a pipe never written, so the launcher's select on it waits
    return subprocess.Popen(
        cmd,
        env=env,
        stdin=subprocess.PIPE,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def stop(proc):
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:  # ranks the launcher left behind
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Run:
    """One launch of ranks.py: every rank's report."""

    def __init__(self, out, mode, models, disabled=False):
        self.stalled = None
        out.mkdir(parents=True, exist_ok=True)
        self.log_path = out / "launch.log"
        with open(self.log_path, "w+") as log:
            proc = launch(
                HERE / "ranks.py", out, mode, *models, disabled=disabled, log=log
            )
            try:
                wait_for(proc, log, lambda: proc.poll() is not None, what="launch")
            except TimeoutError as e:
                self.stalled = str(e).split("; its output")[0]
            finally:
                stop(proc)
        self.reports = []
        for r in range(RANKS):
            path = out / f"rank{r}.json"
            self.reports.append(json.loads(path.read_text()) if path.exists() else {})
        self.references = {}
        for report in self.reports:
            self.references.update(report.get("references", {}))

    def log(self):
        return (self.stalled or "") + "\n" + self.log_path.read_text()[-3000:]

    def results(self, model_type, scenario):
        """(rank's result, one-process result) for every rank; each must be there."""
        key = f"{model_type}/{scenario}"
        pairs = [
            (report.get("results", {}).get(key), self.references.get(key))
            for report in self.reports
        ]
        assert all(got is not None and ref is not None for got, ref in pairs), (
            self.log()
        )
        for got, ref in pairs:
            assert "error" not in got, got.get("traceback")
            assert "error" not in ref, ref.get("traceback")
        return pairs


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("distributed-models")
    return {t: tiny.save_model(root / t, t, **CONFIGS[t]) for t in CONFIGS}


@pytest.fixture(scope="module")
def runs(model_dirs, tmp_path_factory):
    """The fixed run of every scenario, one launch per mode, made on first use."""
    made = {}

    def get(mode):
        if mode not in made:
            specs = [
                f"{model_dirs[t]}={','.join(scenarios(t))}"
                for t in CONFIGS
                if mode in CAPABILITIES[t][0]
            ]
            made[mode] = Run(tmp_path_factory.mktemp(f"run-{mode}"), mode, specs)
        return made[mode]

    return get


# --- the fixed run -----------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_every_rank_runs_with_the_fix_to_the_end(mode, runs):
    run = runs(mode)
    assert [r.get("rank") for r in run.reports] == list(range(RANKS)), run.log()
    assert all(r["size"] == RANKS and r["mode"] == mode for r in run.reports)
    assert all(r["fix_installed"] for r in run.reports)
    assert all(r["done"] for r in run.reports), run.log()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("mode, model_type", cases(QUANTIZABLE))
def test_kv_bits_with_prompt_cache_reuse_give_the_tokens_of_one_process(
    mode, model_type, bits, runs
):
    for got, ref in runs(mode).results(model_type, f"reuse_kv{bits}"):
        assert got["tokens"] == ref["tokens"]
        assert got["reused"] == [0, PREFIX, PREFIX]  # the later requests hit the cache
        assert all(len(t) == ranks.MAX_TOKENS for t in got["tokens"])


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("mode, model_type", cases(QUANTIZABLE))
def test_every_rank_quantizes_its_latent_in_place(mode, model_type, bits, runs):
    for got, ref in runs(mode).results(model_type, f"reuse_kv{bits}"):
        assert got["classes"] == ref["classes"] == ["QuantizedLatentCache"]


@pytest.mark.parametrize("mode, model_type", cases(["deepseek_v32"]))
def test_a_cache_list_model_quantizes_and_reuses_its_prompt_cache_like_one_process(
    mode, model_type, runs
):
    for got, ref in runs(mode).results(model_type, "reuse_kv4"):
        assert got["tokens"] == ref["tokens"]
        assert got["reused"] == [0, PREFIX, PREFIX]
        # the latent quantized in place on every rank, the indexer's keys exact
        assert got["classes"] == ref["classes"] == ["KVCache", "QuantizedLatentCache"]


@pytest.mark.parametrize("mode, model_type", cases(CONFIGS, "pipeline"))
def test_under_pipeline_each_rank_holds_only_its_own_layers(mode, model_type, runs):
    run = runs(mode)
    pairs = run.results(model_type, "reuse_kv4")
    total = run.reports[0]["total_layers"][model_type]
    layers = [got["layers"] for got, _ in pairs]
    assert sum(layers) == total and all(0 < n < total for n in layers)
    # together the ranks hold exactly what one process holds
    assert sum(got["bytes"] for got, _ in pairs) == pairs[0][1]["bytes"]


@pytest.mark.parametrize("mode, model_type", cases(CONFIGS, "tensor"))
def test_under_tensor_parallel_every_rank_holds_the_whole_latent(
    mode, model_type, runs
):
    # one latent head cannot be split over ranks: each holds it for every layer
    run = runs(mode)
    for got, ref in run.results(model_type, "reuse_kv4"):
        assert (
            got["layers"] == ref["layers"] == run.reports[0]["total_layers"][model_type]
        )
        assert got["bytes"] == ref["bytes"]


@pytest.mark.parametrize("mode, model_type", cases(CONFIGS))
def test_a_batch_whose_rows_finish_at_different_steps_matches_each_row_alone(
    mode, model_type, runs
):
    for got, ref in runs(mode).results(model_type, "batch"):
        assert got["tokens"] == ref["tokens"]
        assert len(set(got["finished_at"])) == len(got["finished_at"])


@pytest.mark.parametrize("mode, model_type", cases(WINDOWED))
def test_a_rolling_window_quantizes_stays_its_size_and_matches_one_process(
    mode, model_type, runs
):
    for got, ref in runs(mode).results(model_type, "window_kv4"):
        assert got["tokens"] == ref["tokens"]
        assert got["positions"] == [WINDOW]
        assert got["classes"] == ["QuantizedRotatingLatentCache"]


# --- stock mlx-lm ------------------------------------------------------------


@pytest.mark.parametrize("mode, model_type", cases(["glm4_moe_lite"]))
def test_without_the_package_kv_bits_with_reuse_fail_on_every_rank(
    mode, model_type, model_dirs, tmp_path
):
    run = Run(
        tmp_path / "stock", mode, [f"{model_dirs[model_type]}=reuse_kv4"], disabled=True
    )
    assert len(run.reports) == RANKS and not any(
        r.get("fix_installed", True) for r in run.reports
    ), run.log()
    errors = [
        r["results"][f"{model_type}/reuse_kv4"].get("error", "") for r in run.reports
    ]
    assert all(SWAPAXES in e for e in errors), errors


# --- mlx_lm.server --pipeline ------------------------------------------------

# mlx-lm 0.31.2's server has no --kv-bits: there it serves exact caches.
SERVER_BITS = [4] if server_supports("--kv-bits") else [None]
START = 64  # --quantized-kv-start: every request crosses it


class LaunchedServer(Server):
    """``mlx_lm.server`` started by ``mlx.launch`` through distributed/serve.py;
    rank 0 answers on 127.0.0.1."""

    def __init__(self, model_path, *flags, log, disabled=False):
        self.port = free_port_for_http()
        self.log = open(log, "w+")
        args = [
            "--model",
            model_path,
            "--host",
            "127.0.0.1",
            "--port",
            self.port,
            *flags,
        ]
        self.proc = launch(HERE / "serve.py", *args, disabled=disabled, log=self.log)
        try:
            wait_until_up(self.proc, self.port, self.log, own=True)
        except BaseException:
            self.close()
            raise

    def close(self):
        stop(self.proc)
        self.log.close()


def free_port_for_http():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("bits", SERVER_BITS, ids=lambda b: f"kv{b}" if b else "exact")
def test_a_pipeline_server_serves_four_concurrent_clients_with_prompt_cache_hits(
    bits, tmp_path
):
    model_path = save_served_model(tmp_path / "glm")
    flags = ["--pipeline", "--decode-concurrency", 4]
    if bits:
        flags += ["--kv-bits", bits, "--quantized-kv-start", START]
    log = tmp_path / "server.log"
    with LaunchedServer(model_path, *flags, log=log) as server:
        served, errors = four_clients(server, per_client=3, max_tokens=24)
    assert errors == [], log.read_text()[-3000:]
    assert len(served) == 12 and all(text for text, _ in served)
    # the shared system prompt comes from the prompt cache for most requests
    assert sum(cached_tokens(usage) > 0 for _, usage in served) >= 8


if SERVER_BITS != [None]:  # defined only where the server has --kv-bits, not skipped

    def test_without_the_package_a_pipeline_server_fails_every_kv_bits_request(
        tmp_path,
    ):
        model_path = save_served_model(tmp_path / "glm")
        flags = ["--pipeline", "--kv-bits", 4, "--quantized-kv-start", START]
        log = tmp_path / "server.log"
        failures = 0
        with LaunchedServer(model_path, *flags, log=log, disabled=True) as server:
            for q in questions(3):
                try:
                    server.chat(q, max_tokens=24, timeout=60)
                except RequestFailed:
                    failures += 1
        assert failures == 3
        assert SWAPAXES in log.read_text()
