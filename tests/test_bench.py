"""``mlx-lm-mla bench``: decode side by side on this device, a row per variant
on stdout, progress on stderr, every repetition in its JSON, a plot where
matplotlib is installed and a clear refusal where it is not."""

import json
import os
import statistics
import subprocess
import sys
import types
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest

import mlx_lm_mla
from mlx_lm_mla import bench, mla, tiny

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--contexts", "256", "--batch", "1", "--repeats", "1"]
SMALL += ["--steps", "1", "--warmup", "1"]


def command(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "mlx_lm_mla", "bench", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env=env,
    )


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    out = command(*SMALL, "--json", path)
    assert out.returncode == 0, out.stderr
    return out, json.loads(path.read_text())


def printed_rows(stdout):
    """The decode table's header and its rows, as cells."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("context"))
    header = lines[start].split("  ")
    rows = []
    for line in lines[start + 2 :]:
        if not line.strip():
            break
        rows.append([c.strip() for c in line.split("  ") if c.strip()])
    return [c.strip() for c in header if c.strip()], rows


def labels():
    return [bench.label(v) for v in bench.offered_variants()]


def test_the_table_has_a_row_per_variant_and_the_promised_columns(ran):
    header, rows = printed_rows(ran[0].stdout)
    assert header == [
        "context",
        "batch",
        "variant",
        "tokens/s",
        "x stock",
        "cache GB/s",
        "transient MiB/layer",
    ]
    assert [r[2] for r in rows] == labels()
    assert all(r[:2] == ["256", "1"] and len(r) == len(header) for r in rows)
    assert rows[0][2:5:2] == ["stock bf16", "1.00"]
    assert all(float(r[3]) > 0 and float(r[5]) > 0 for r in rows)


def test_the_table_prints_the_jsons_medians(ran):
    _, rows = printed_rows(ran[0].stdout)
    data = ran[1]
    assert [f"{r['tokens_per_s']:.2f}" for r in data["decode_rows"]] == [
        r[3] for r in rows
    ]
    for row in data["decode_rows"]:
        mine = [
            r["tokens_per_s"]
            for r in data["repetitions"]
            if r["variant"] == row["variant"]
        ]
        assert row["tokens_per_s"] == statistics.median(mine)


def test_the_json_names_the_device_and_the_versions(ran):
    data = ran[1]
    assert data["device"]["mlx_device"] == str(mx.default_device())
    assert data["device"]["backend"] in ("cpu", "metal", "cuda")
    assert data["device"]["name"]
    # The memory's peak is the CUDA driver's to tell: none on this CPU.
    assert (
        data["device"]["peak_gb_per_s"] is None or data["device"]["backend"] == "cuda"
    )
    versions = data["versions"]
    assert (versions["mlx"], versions["mlx_lm"], versions["mlx_lm_mla"]) == (
        mx.__version__,
        mlx_lm.__version__,
        mlx_lm_mla.__version__,
    )
    assert data["command"].startswith("mlx-lm-mla bench --contexts 256")


def test_the_json_holds_every_repetition_of_every_variant(ran):
    data = ran[1]
    reps = data["repetitions"]
    assert sorted(r["variant"] for r in reps) == sorted(bench.offered_variants())
    for r in reps:
        assert (r["kind"], r["context"], r["batch"], r["rep"]) == ("decode", 256, 1, 0)
        assert r["tokens_per_s"] > 0 and r["cache_bytes"] > 0
    # The quantized latent is what a step reads: fewer bytes than bf16's.
    read = {r["variant"]: r["cache_bytes"] for r in reps}
    assert read["ours4"] < read["ours8"] < read["ours"] == read["stock"]


def test_the_device_is_the_default_one_as_it_is_now(monkeypatch):
    asked = []
    info = {"device_name": "Some GPU", "memory_size": 8}
    monkeypatch.setattr(mx, "device_info", lambda *d: asked.append(d) or info)
    assert bench.device()["name"].startswith("Some GPU")
    assert asked == [(mx.default_device(),)]


def attention_repetitions(ms):
    """One repetition of stock and ours each at 1K, batch 1: 200 MB of cache."""
    return [
        dict(kind="attention", context=1024, batch=1, variant=v, ms=t, cache_bytes=2e8)
        for v, t in ms.items()
    ]


def test_attention_rows_give_a_share_of_the_gpus_peak_bandwidth():
    reps = attention_repetitions({"stock": 1.0, "ours": 0.1})
    rows = bench.attention_rows(reps, ["stock", "ours"], peak_gb_per_s=3350.0)
    # 200 MB in 0.1 ms: 2,000 GB/s, 59.7 % of 3,350.
    assert [r["gb_per_s"] for r in rows] == pytest.approx([200.0, 2000.0])
    assert [r["peak_percent"] for r in rows] == pytest.approx([5.97, 59.7], rel=1e-3)


def test_without_a_known_peak_the_attention_rows_have_no_share():
    reps = attention_repetitions({"stock": 1.0, "ours": 0.1})
    rows = bench.attention_rows(reps, ["stock", "ours"])
    assert [r["peak_percent"] for r in rows] == [None, None]


def report_of(peak, capsys):
    reps = attention_repetitions({"stock": 1.0, "ours": 0.1})
    bench.report(
        dict(
            args=dict(repeats=1, steps=1, warmup=1),
            model=dict(model="tiny"),
            device=dict(name="GPU (cuda)", peak_gb_per_s=peak),
            decode_rows=[],
            attention_rows=bench.attention_rows(reps, ["stock", "ours"], peak),
        )
    )
    return capsys.readouterr().out


def test_the_attention_table_shows_the_share_of_peak_where_the_gpu_tells_it(capsys):
    out = report_of(3350.0, capsys)
    assert "of the GPU memory's 3,350 GB/s" in out
    assert "% of peak" in out and "59.7" in out


def test_the_attention_table_has_no_share_column_where_no_peak_is_known(capsys):
    assert "% of peak" not in report_of(None, capsys)


def test_progress_goes_to_stderr_and_only_the_tables_to_stdout(ran):
    out = ran[0]
    assert "bench" in out.stderr and "256" in out.stderr
    assert "it/s" not in out.stdout and "\r" not in out.stdout


def test_plot_without_matplotlib_is_refused_before_any_run(tmp_path):
    blocked = tmp_path / "blocked" / "matplotlib"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    env = dict(os.environ, PYTHONPATH=str(blocked.parent))
    out = command(*SMALL, "--json", tmp_path / "b.json", "--plot", "b.png", env=env)
    assert out.returncode == 2
    assert "--plot needs matplotlib" in out.stderr
    assert "mlx-lm-mla[plot]" in out.stderr
    assert not (tmp_path / "b.json").exists() and out.stdout == ""


def test_plot_draws_a_line_per_variant_against_context(ran, monkeypatch, tmp_path):
    drawn, saved = [], []

    class Axes:
        def plot(self, x, y, marker=None, label=None):
            drawn.append((label, list(x), list(y)))

        def __getattr__(self, name):  # titles, labels, scale, legend
            return lambda *a, **k: None

    class Figure:
        def tight_layout(self):
            pass

        def savefig(self, path, dpi=None):
            saved.append(path)

    pyplot = types.SimpleNamespace(
        subplots=lambda rows, cols, **k: (Figure(), [[Axes() for _ in range(cols)]]),
        close=lambda figure: None,
    )
    matplotlib = types.SimpleNamespace(use=lambda backend: None, pyplot=pyplot)
    monkeypatch.setitem(sys.modules, "matplotlib", matplotlib)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", pyplot)
    rows = ran[1]["decode_rows"]
    bench.plot(rows, tmp_path / "p.png")
    assert saved == [tmp_path / "p.png"]
    assert [label for label, _, _ in drawn] == labels()
    assert all(x == [256] for _, x, _ in drawn)
    assert [y[0] for _, _, y in drawn] == [r["tokens_per_s"] for r in rows]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--contexts", "1k"], "--contexts: '1k' is not a comma-separated list"),
        (["--batch", "0"], "--batch: '0': give positive integers"),
        (["--variants", "ours5"], "unknown variant(s) ours5"),
        (["--model", "no/such/folder"], "not a local mlx-lm model folder"),
    ],
)
def test_bad_arguments_are_refused_by_name(args, message):
    out = command(*args)
    assert out.returncode == 2
    assert message in out.stderr


def test_the_settings_a_run_measured_under_are_in_its_command(monkeypatch):
    monkeypatch.setenv("MLX_LM_MLA_DECODE", "fold")
    monkeypatch.delenv("MLX_LM_MLA_CUDA_KERNEL", raising=False)
    assert bench.settings() == {"MLX_LM_MLA_DECODE": "fold"}
    assert bench.command_line(["--contexts", "16"]) == (
        "MLX_LM_MLA_DECODE=fold mlx-lm-mla bench --contexts 16"
    )


def test_a_run_without_settings_records_the_plain_command(ran):
    assert ran[1]["settings"] == {} and ran[1]["command"].startswith("mlx-lm-mla")


def test_a_json_path_that_is_a_folder_is_refused_before_any_run(tmp_path):
    out = command(*SMALL, "--json", tmp_path)
    assert out.returncode == 2
    assert f"--json {tmp_path}: is a folder" in out.stderr and out.stdout == ""


def test_trying_a_new_output_path_leaves_no_file_behind(tmp_path):
    assert bench.unwritable(tmp_path / "new.json") is None
    assert not (tmp_path / "new.json").exists()
    kept = tmp_path / "kept.json"
    kept.write_text("earlier run")
    assert bench.unwritable(kept) is None and kept.read_text() == "earlier run"


def test_a_plot_name_matplotlib_cannot_write_is_refused_before_any_run(tmp_path):
    stand_in = tmp_path / "stand_in" / "matplotlib"
    stand_in.mkdir(parents=True)
    (stand_in / "__init__.py").write_text("")
    (stand_in / "figure.py").write_text(
        "class Figure:\n"
        "    class canvas:\n"
        "        get_supported_filetypes = staticmethod(\n"
        "            lambda: {'png': 'Portable Network Graphics', 'pdf': 'PDF'})\n"
    )
    env = dict(os.environ, PYTHONPATH=str(stand_in.parent))
    for name in ("speed.xyz", "speed"):
        out = command(*SMALL, "--plot", tmp_path / name, env=env)
        assert out.returncode == 2, out.stderr
        assert "one of matplotlib's formats (.pdf, .png)" in out.stderr
        assert out.stdout == ""


def test_a_model_folder_mlx_lm_cannot_load_is_refused_by_name(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "glm4_moe_lite"')
    out = command(*SMALL, "--model", tmp_path)
    assert out.returncode == 1
    assert f"--model {tmp_path}: mlx_lm.load cannot load it" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("context", [1, 4, bench.PROMPT, bench.PROMPT + 3])
def test_a_context_holds_that_many_positions_even_below_the_prompt(context):
    model, _ = tiny.build_model("glm4_moe_lite")
    cache = bench.filled_cache(model, context, 1, None)
    assert {c.offset for c in cache} == {context}


def test_rows_name_the_dtype_the_models_cache_holds():
    model, _ = tiny.build_model("glm4_moe_lite", dtype=mx.float32)
    dtype = bench.short_name(bench.model_dtype(model))
    reps = [
        dict(kind="decode", context=8, batch=1, variant=v, tokens_per_s=1.0)
        | dict(step_s=1.0, transient_bytes=0, cache_bytes=1)
        for v in ("stock", "ours", "ours4")
    ]
    rows = bench.decode_rows(reps, ["stock", "ours", "ours4"], 1, dtype)
    assert [r["label"] for r in rows] == ["stock fp32", "fp32", "4-bit"]


@pytest.mark.parametrize("model_type", sorted(mla.installed_model_types()))
def test_the_head_count_of_every_mla_attention_is_read(model_type):
    model, config = tiny.build_model(model_type)
    _, attention, _ = bench.mla_layer(model)
    text = config.get("text_config", config)
    assert bench.head_count(attention) == text["num_attention_heads"]


def test_a_value_given_twice_is_measured_once():
    args = bench.parser().parse_args(
        ["--contexts", "256,1024,256", "--batch", "1,1", "--variants", "ours,ours"]
    )
    assert (args.contexts, args.batch, args.variants) == ([256, 1024], [1], ["ours"])
