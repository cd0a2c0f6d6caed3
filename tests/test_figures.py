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
