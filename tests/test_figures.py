"""Every measured table the docs quote is the rendering of a kept benchmark
run (``benchmarks/figures.py``): a figure changes only with its JSON."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import figures  # noqa: E402

QUOTED = [
    (doc, name, table, text)
    for doc in figures.DOCS
    for name, table, text in figures.blocks(doc.read_text(encoding="utf-8"))
]


@pytest.mark.parametrize(
    "doc,name,table,text",
    QUOTED,
    ids=[
        f"{d.relative_to(ROOT).as_posix()}:{n}{'-' + t if t else ''}"
        for d, n, t, _ in QUOTED
    ],
)
def test_a_quoted_table_is_its_kept_runs_rendering(doc, name, table, text):
    assert text == figures.render(name, table)


def test_every_kept_run_is_quoted_somewhere():
    kept = {p.stem for p in figures.FIGURES.glob("*.json")}
    assert kept and kept == {name for _, name, _, _ in QUOTED}


def test_a_figure_changed_by_hand_is_caught():
    doc = f"<!-- figures: mixed_batch_memory -->\n{figures.render('mixed_batch_memory')}<!-- /figures -->"
    ((name, table, text),) = figures.blocks(doc.replace("18.00", "17.00"))
    assert text != figures.render(name, table)


def test_a_figure_quoted_in_a_sentence_changed_by_hand_is_caught():
    figure = figures.render("bytes_per_token", "layer")
    doc = f"That is <!-- figure: bytes_per_token layer -->{figure}<!-- /figure -->."
    ((name, table, text),) = figures.blocks(doc.replace("672", "640"))
    assert (name, table) == ("bytes_per_token", "layer")
    assert "672" in figure and text != figures.render(name, table)


def attention_run(peak, ms):
    row = dict(context=131072, batch=1, label="4-bit", speed=3.0, floor_mb=37.7)
    return dict(
        versions=dict(mlx="0.32.4", mlx_lm="0.32.2", machine="x86_64"),
        command="mlx-lm-mla bench --attention",
        device=dict(peak_gb_per_s=peak),
        attention_rows=[dict(row, ms=ms, gb_per_s=37.7 / ms, peak_percent=1.0)],
    )


def test_a_gpu_runs_attention_table_gives_its_share_of_peak_and_fine_times():
    text = figures.decode_speed(attention_run(3350.0, 0.0225), "attention")
    header, _, row = text.splitlines()[:3]
    assert header.endswith("| % of peak |")
    assert "| 0.0225 |" in row and row.endswith("| 1.0 |")


def test_a_run_without_a_known_peak_has_no_share_column():
    text = figures.decode_speed(attention_run(None, 12.34), "attention")
    assert "% of peak" not in text and "| 12.3 |" in text


def test_keeping_a_run_that_is_not_there_is_refused_by_name(tmp_path, capsys):
    missing = tmp_path / "no_run.json"
    with pytest.raises(SystemExit) as exit:
        figures.main(["keep", "cpu_rule", str(missing)])
    assert exit.value.code == 2
    assert f"no run to keep at {missing}" in capsys.readouterr().err
