"""The README and docs/ say what the code does: the model table is the
command's output, the README stays short, and every module named exists."""

import importlib
import re
import subprocess
import sys
from pathlib import Path

import mlx_lm
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))

BEGIN = re.compile(
    r"^<!-- model-table: python -m mlx_lm_mla\.testing\.model_table \(mlx-lm ([^)]+)\) -->$",
    re.M,
)
END = "<!-- /model-table -->"


def run(*args, timeout=300):
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def readme_table():
    """(the mlx-lm version its marker names, the text from marker to end marker)."""
    text = README.read_text(encoding="utf-8")
    begin = BEGIN.search(text)
    assert begin, "README.md has no model-table marker"
    end = text.index(END, begin.start()) + len(END)
    return begin.group(1), text[begin.start() : end]


@pytest.fixture(scope="module")
def command_table():
    out = run("-m", "mlx_lm_mla.testing.model_table")
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_model_table_is_the_commands_output(command_table):
    version, table = readme_table()
    if version == mlx_lm.__version__:
        assert table == command_table
    else:
        # Another mlx-lm (CI's other legs) may have fewer MLA models: each
        # row it has must read as in the README, and nothing else may differ.
        assert BEGIN.search(command_table).group(1) == mlx_lm.__version__
        readme_lines = set(table.splitlines())
        printed = [line for line in command_table.splitlines() if not BEGIN.match(line)]
        assert [line for line in printed if line not in readme_lines] == []


def test_the_model_table_has_a_row_per_mla_model(command_table):
    from mlx_lm_mla import mla

    rows = [line for line in command_table.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == sorted(mla.installed_model_types())


def test_the_readme_is_short_and_starts_with_the_quick_start():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) < 250
    headings = [line for line in lines if line.startswith("## ")]
    assert headings[0] == "## Quick start"


def _exists(dotted):
    """Whether ``mlx_lm_mla.a.b`` is a module of the package, or an
    attribute of the deepest module it names."""
    parts = dotted.split(".")
    module, i = "mlx_lm_mla", 1
    while i < len(parts):
        path = ROOT.joinpath(*parts[: i + 1])
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            module, i = f"{module}.{parts[i]}", i + 1
        else:
            break
    owner = importlib.import_module(module)
    for name in parts[i:]:
        if not hasattr(owner, name):
            return False
        owner = getattr(owner, name)
    return True


def named_but_missing(text):
    missing = []
    # Paths: mlx_lm_mla/... and benchmarks/..., files and folders (not
    # tests/: mlx-lm's own tests are named too).
    for path in re.findall(r"(?<![\w/.])((?:mlx_lm_mla|benchmarks)/[\w/.-]*)", text):
        path = path.rstrip(".")
        if path.startswith("benchmarks/results/"):
            continue  # where a quoted command wrote its run (git-ignored)
        if not (ROOT / path).exists():
            missing.append(path)
    # Dotted names: mlx_lm_mla.x.y (the start-up hook mlx_lm_mla.pth is a file).
    for dotted in re.findall(r"(?<![\w.])(mlx_lm_mla(?:\.[A-Za-z_]\w*)+)", text):
        if dotted == "mlx_lm_mla.pth":
            if not (ROOT / dotted).is_file():
                missing.append(dotted)
        elif not _exists(dotted):
            missing.append(dotted)
    # from mlx_lm_mla[.x] import a, b
    for module, names in re.findall(r"from (mlx_lm_mla[\w.]*) import ([\w, ]+)", text):
        for name in (n.strip() for n in names.split(",")):
            if not _exists(f"{module}.{name}"):
                missing.append(f"{module}.{name}")
    return missing


@pytest.mark.parametrize(
    "doc", [README, *DOCS], ids=lambda p: p.relative_to(ROOT).as_posix()
)
def test_the_docs_name_only_modules_that_exist(doc):
    assert named_but_missing(doc.read_text(encoding="utf-8")) == []


def test_a_quoted_runs_output_is_not_taken_for_a_missing_file():
    text = "`bench --json benchmarks/results/run.json`, `benchmarks/gone.py`"
    assert named_but_missing(text) == ["benchmarks/gone.py"]


def test_the_module_check_catches_an_old_name():
    assert named_but_missing(
        "see `mlx_lm_mla/patch.py` and `mlx_lm_mla.testing.tiny`"
    ) == [
        "mlx_lm_mla/patch.py",
        "mlx_lm_mla.testing.tiny",
    ]


def test_mlx_lm_mla_help_lists_the_commands():
    out = run("-m", "mlx_lm_mla", "--help", timeout=60)
    assert out.returncode == 0, out.stderr
    for command in ("repro", "serve", "lmstudio", "tiny-model"):
        assert re.search(rf"^\s+{re.escape(command)}\s", out.stdout, re.M), command


def readme_repro():
    text = README.read_text(encoding="utf-8")
    block = text.split("What `repro` prints", 1)[1].split("```\n", 2)[1]
    return block.rstrip("\n").splitlines()


def test_the_readmes_repro_output_is_what_repro_prints():
    out = run("-m", "mlx_lm_mla", "repro")
    assert out.returncode == 0, out.stderr
    printed, quoted = out.stdout.splitlines(), readme_repro()
    version = re.search(r"stock mlx-lm (\S+)", quoted[0]).group(1)
    if version == mlx_lm.__version__:
        start = printed.index(quoted[0])
        assert printed[start : start + len(quoted)] == quoted
    else:  # another mlx-lm (CI's other legs): the same rows, as labelled
        labels = [line[:24] for line in quoted]
        assert all(any(p.startswith(label) for p in printed) for label in labels)


def section(heading):
    """The README's text under ``## heading``, to the next heading."""
    text = README.read_text(encoding="utf-8")
    return text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]


def blocks_and_paragraphs(text):
    """(the paragraph before it, its lines) of each code block in ``text``."""
    parts = text.split("```\n")
    return [
        (parts[i - 1].strip().split("\n\n")[-1], parts[i].splitlines())
        for i in range(1, len(parts), 2)
    ]


def second_terminal(block):
    """The try-it lines typed in the second terminal: after the line that says
    so, or, where the text says so, after the server's."""
    said = [i for i, line in enumerate(block) if "another terminal" in line]
    if not said:
        said = [i for i, line in enumerate(block) if line.startswith("mlx_lm.server")]
    return block[said[0] + 1 :]


def unset_in_second_terminal(block):
    """The variables the second terminal's lines read but do not set."""
    lines = second_terminal(block)
    used = set(re.findall(r"\$(\w+)", "\n".join(lines)))
    return used - {name for line in lines for name in re.findall(r"^(\w+)=", line)}


def test_the_try_it_sets_in_the_second_terminal_what_it_uses_there():
    # A url= typed in the server's terminal leaves curl "no URL specified".
    text = section("Try it in a minute")
    (_, block), *_ = blocks_and_paragraphs(text)
    assert "another terminal" in text and "$url" in "".join(block)
    assert unset_in_second_terminal(block) == set()


def test_the_try_it_check_catches_a_variable_set_in_the_servers_terminal():
    block = ["mlx_lm.server --port 8080", "url=x     # then, in another terminal:"]
    assert unset_in_second_terminal(block + ["curl $url"]) == {"url"}


def test_no_time_said_for_a_command_covers_an_install_unsaid():
    for heading in ("Quick start", "Try it in a minute", "Set up"):
        for paragraph, block in blocks_and_paragraphs(section(heading)):
            installs = any("pip install" in line for line in block)
            timed = re.search(r"minute|\d s\b", heading + " " + paragraph)
            assert not (installs and timed) or "install" in paragraph, paragraph


def test_the_quick_start_installs_into_a_virtual_environment():
    (_, block), *_ = blocks_and_paragraphs(section("Quick start"))
    venv = next(i for i, line in enumerate(block) if "-m venv" in line)
    install = next(i for i, line in enumerate(block) if "pip install" in line)
    assert venv <= install and "bin/activate" in block[venv]


def test_the_test_time_claim_is_marked_for_restating():
    text = README.read_text(encoding="utf-8")
    assert re.search(r"^<!-- test-time -->\nThe tests, .*\stake\s", text, re.M | re.S)


def design_examples():
    """design.md's Python examples: (source, the output its last comment
    lines quote, each without the note after two spaces)."""
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    found = []
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        lines = block.rstrip("\n").splitlines()
        quoted = []
        while lines and lines[-1].startswith("# "):
            quoted.insert(0, re.split(r"\s{2,}", lines.pop()[2:])[0])
        found.append(("\n".join(lines), quoted))
    return found


@pytest.mark.parametrize("source,quoted", design_examples())
def test_the_design_docs_examples_print_what_they_say(source, quoted):
    out = subprocess.run(
        [sys.executable, "-c", source],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert quoted and out.stdout.splitlines() == quoted


def test_the_supported_range_said_is_the_one_the_package_declares():
    from packaging.specifiers import SpecifierSet

    from mlx_lm_mla._version import MLX_LM_RANGE

    text = " ".join(README.read_text(encoding="utf-8").split())
    low = min(s.version for s in SpecifierSet(MLX_LM_RANGE) if s.operator == ">=")
    assert f'pip install "mlx-lm{MLX_LM_RANGE}"' in text
    assert f"mlx-lm {low} (mlx" in text  # the range's low end, named in prose
    pins = (ROOT / ".ci" / "low.txt").read_text(encoding="utf-8").split()
    assert f"mlx-lm=={low}" in pins  # CI's low leg tests that end


def test_the_readme_names_the_models_that_cache_per_head_keys_as_the_kit_knows_them():
    from mlx_lm_mla import tiny

    names = [f"`{t}`" for t in tiny._FULL_KV_CONFIGS]
    said = f"{', '.join(names[:-1])} and {names[-1]} cache per-head keys"
    assert said in " ".join(README.read_text(encoding="utf-8").split())


def test_every_model_file_with_a_latent_rank_is_known_as_mla_or_as_per_head():
    # A new mlx-lm model with MLA-style projections is named here until it is
    # listed as MLA (its source read by mla.py) or as caching per-head keys.
    from mlx_lm_mla import tiny

    models = Path(importlib.import_module("mlx_lm.models").__file__).parent
    ranked = {
        p.stem for p in models.glob("*.py") if "kv_lora_rank" in p.read_text("utf-8")
    }
    known = set(tiny.MLA_MODEL_TYPES) | set(tiny._FULL_KV_CONFIGS)
    assert sorted(ranked - known) == []
