"""The package's layout: one concern per module, no import cycle, and a
test kit that the runtime never loads and LM Studio never receives."""

import ast
import subprocess
import sys
from pathlib import Path

import mlx_lm_mla
from mlx_lm_mla.lmstudio import payload

PACKAGE = Path(mlx_lm_mla.__file__).parent
# The test kit, and the demo that builds its tiny model.
NOT_RUNTIME = ("mlx_lm_mla.testing", "mlx_lm_mla.repro")


def module_name(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules():
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name, path):
    """The package's modules ``name`` imports, anywhere in its source."""
    known, found = modules(), set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # from package import submodule: the submodule, not the package's own code
            names = [f"{base}.{a.name}" for a in node.names]
            targets = names + ([base] if any(n not in known for n in names) else [])
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def graph():
    return {name: imports(name, path) for name, path in modules().items()}


def test_no_module_of_the_package_imports_itself_back():
    edges = graph()
    cycles = []

    def visit(name, trail):
        for target in edges[name]:
            if target in trail:
                cycles.append(trail[trail.index(target) :] + [target])
            elif target not in done:
                visit(target, trail + [target])
        done.add(name)

    done = set()
    for name in edges:
        if name not in done:
            visit(name, [name])
    assert cycles == []


def test_no_runtime_module_imports_the_test_kit():
    runtime = {n: e for n, e in graph().items() if not n.startswith(NOT_RUNTIME)}
    offenders = {
        n: sorted(e)
        for n, e in runtime.items()
        if any(t.startswith("mlx_lm_mla.testing") for t in e)
    }
    assert offenders == {}


def test_lmstudio_receives_the_runtime_modules_and_no_test_kit():
    shipped = {name for name in payload() if name.endswith(".py")}
    assert (
        "mlx_lm_mla/patches/__init__.py" in shipped
        and "mlx_lm_mla/guards/reuse.py" in shipped
    )
    assert not [name for name in shipped if name.startswith("mlx_lm_mla/testing/")]


def test_no_class_is_made_with_type_and_no_file_is_searched_with_a_regex():
    fabricated, regex_in_files = [], []
    for name, path in modules().items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "type"
                and len(node.args) == 3
            ):
                fabricated.append(f"{name}:{node.lineno}")
    files = ast.parse((PACKAGE / "patches" / "files.py").read_text())
    for node in ast.walk(files):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", None)]
            regex_in_files += [n for n in names if n in ("re", "struct")]
    assert fabricated == [] and regex_in_files == []


def unit(name):
    # A folder of the package (patches, guards, disk, ...) or a top module.
    parts = name.split(".")
    return ".".join(parts[:2])


def test_folders_import_downward_only():
    # No two folders (or top modules) import each other, directly or round about.
    edges = {}
    for name, targets in graph().items():
        for target in targets:
            if unit(target) != unit(name):
                edges.setdefault(unit(name), set()).add(unit(target))

    def reaches(start):
        seen, todo = set(), [start]
        while todo:
            for target in edges.get(todo.pop(), ()):
                if target not in seen:
                    seen.add(target)
                    todo.append(target)
        return seen

    assert sorted(u for u in edges if u in reaches(u)) == []


def test_no_two_modules_of_different_concerns_share_a_file_name():
    names = {}
    for name, path in modules().items():
        if path.name != "__init__.py":
            names.setdefault(path.name, []).append(name)
    assert {n: m for n, m in names.items() if len(m) > 1} == {}


def ruff(*args):
    """``ruff ARGS .`` over the whole repository, with its ruff.toml."""
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "ruff", *args, "."]
    return subprocess.run(command, cwd=root, capture_output=True, text=True)


def test_the_code_is_as_ruff_formats_it_at_88_columns():
    out = ruff("format", "--check")
    assert out.returncode == 0, out.stdout + out.stderr


def test_ruff_check_finds_nothing_under_the_rules_of_ruff_toml():
    out = ruff("check", "--output-format", "concise")
    assert out.returncode == 0, out.stdout + out.stderr
