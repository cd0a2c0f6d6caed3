"""``mlx-lm-mla lmstudio``, on an LM Studio home laid out the way its MLX
engine is: venvstacks layers under ``extensions/backends/vendor/_amphibian``.

The layout, built once for the module:

- a base runtime layer (``cpython3.X-mac-arm64@10``): ``bin/python3``, a link
  to this machine's interpreter, and an empty site-packages;
- a framework layer holding the rest of mlx-lm's dependencies (links to this
  test environment's packages, never mlx, mlx-lm, pip or this package);
- the app layer (``app-mlx-generate-mac14-arm64@34``): a layered venv
  (``pyvenv.cfg`` pointing at the runtime) whose site-packages holds copies of
  this environment's mlx and mlx-lm with their dist-info (at CI's middle leg,
  LM Studio's pins: mlx 0.32.0, mlx-lm 0.31.3) and the ``sitecustomize.py``
  that links the lower layers, as venvstacks generates it; no pip;
- engine 1.8.5's ``backend-manifest.json`` naming those layers, selected in
  ``.internal/backend-preferences-v1.json``; engine 1.8.6, downloaded but not
  selected, naming a newer app layer (@35, mlx-lm metadata only); and a
  llama.cpp engine with no Python layer.

The app layer's interpreter runs isolated (``python -I``), as LM Studio's does.
"""

import compileall
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest

from mlx_lm_mla import __version__, lmstudio
from mlx_lm_mla.lmstudio import installer
from mlx_lm_mla import tiny

from conftest import SWAPAXES

TESTS = Path(__file__).resolve().parent
README = TESTS.parent / "README.md"
PY = f"python{sys.version_info.major}.{sys.version_info.minor}"
ENGINE = "mlx-llm-mac-arm64-apple-metal-advsimd"
RUNTIME = (
    f"_amphibian/cpython{sys.version_info.major}.{sys.version_info.minor}-mac-arm64@10"
)
FRAMEWORK = "_amphibian/framework-mlx-deps-mac-arm64@10"
APP = "_amphibian/app-mlx-generate-mac14-arm64@34"
NEXT_APP = "_amphibian/app-mlx-generate-mac14-arm64@35"
COPIED = (
    "mlx",
    "mlx-cpu",
    "mlx-metal",
    "mlx-lm",
)  # into the app layer, as installed here
NOT_LINKED = (*COPIED, "mlx-lm-mla", "pip", "setuptools")


def site(layer: Path) -> Path:
    return layer / "lib" / PY / "site-packages"


def dist_tops(name):
    """Top-level names in site-packages that belong to an installed distribution."""
    try:
        files = metadata.distribution(name).files or []
    except metadata.PackageNotFoundError:
        return set()
    return {f.parts[0] for f in files if f.parts[0] != ".."}


def copy_dist(name, into: Path):
    dist = metadata.distribution(name)
    for f in dist.files:
        source = Path(dist.locate_file(f))
        if f.parts[0] != ".." and source.is_file():
            (into / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / f)


def runtime_layer(layer: Path):
    (layer / "bin").mkdir(parents=True)
    os.symlink(os.path.realpath(sys._base_executable), layer / "bin" / PY)
    os.symlink(PY, layer / "bin" / "python3")
    site(layer).mkdir(parents=True)


def framework_layer(layer: Path):
    here = Path(sysconfig.get_paths()["purelib"])
    skip = set().union(*(dist_tops(n) for n in NOT_LINKED))
    site(layer).mkdir(parents=True)
    for entry in here.iterdir():
        name = entry.name
        if name in skip or name.endswith(".pth") or name.startswith("__"):
            continue  # start-up hooks (.pth) stay out: only the app layer's own run
        os.symlink(entry, site(layer) / name)


def app_layer(layer: Path, runtime: Path, framework: Path):
    """A layered venv on the runtime, as venvstacks deploys an application layer."""
    python = runtime / "bin" / "python3"
    (layer / "bin").mkdir(parents=True)
    os.symlink(os.path.relpath(python, layer / "bin"), layer / "bin" / "python")
    version = ".".join(map(str, sys.version_info[:3]))
    (layer / "pyvenv.cfg").write_text(
        f"home = {python.parent}\ninclude-system-site-packages = false\n"
        f"version = {version}\nexecutable = {python}\n"
    )
    site(layer).mkdir(parents=True)
    for name in COPIED:
        if dist_tops(name):
            copy_dist(name, site(layer))
    (site(layer) / "sitecustomize.py").write_text(
        '"""Layered environment set-up, generated at deployment: the lower layers."""\n\n'
        "from site import addsitedir\n"
        f"addsitedir({str(site(framework))!r})\n"
        f"addsitedir({str(site(runtime))!r})\n"
    )
    compileall.compile_dir(layer / "lib", quiet=1)  # as venvstacks does at deployment


def metadata_only_layer(layer: Path, mlx_lm_version: str):
    """A layer whose site-packages holds mlx-lm's package folder and dist-info only."""
    (site(layer) / "mlx_lm").mkdir(parents=True)
    (site(layer) / "mlx_lm" / "__init__.py").write_text(
        f'__version__ = "{mlx_lm_version}"\n'
    )
    info = site(layer) / f"mlx_lm-{mlx_lm_version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: mlx-lm\nVersion: {mlx_lm_version}\n"
    )
    (info / "RECORD").write_text("")
    return layer


def write_json(path: Path, value):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2))


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    root = tmp_path_factory.mktemp("lmstudio")
    user = root / "user"  # HOME
    home = user / ".lmstudio"
    backends = home / "extensions" / "backends"
    vendor = backends / "vendor"
    runtime_layer(vendor / RUNTIME)
    framework_layer(vendor / FRAMEWORK)
    app_layer(vendor / APP, vendor / RUNTIME, vendor / FRAMEWORK)
    metadata_only_layer(vendor / NEXT_APP, metadata.version("mlx-lm"))
    write_json(
        backends / f"{ENGINE}-1.8.5" / "backend-manifest.json",
        {
            "name": ENGINE,
            "version": "1.8.5",
            "engine": "mlx",
            "extension_type": "engine",
            "vendor_lib_package_names": [APP, FRAMEWORK, RUNTIME],
        },
    )
    write_json(
        backends / f"{ENGINE}-1.8.6" / "backend-manifest.json",
        {
            "name": ENGINE,
            "version": "1.8.6",
            "engine": "mlx",
            "extension_type": "engine",
            "vendor_lib_package_names": [NEXT_APP, RUNTIME],
        },
    )
    llama = "llama.cpp-mac-arm64-apple-metal-advsimd"
    write_json(
        backends / f"{llama}-1.50.0" / "backend-manifest.json",
        {
            "name": llama,
            "version": "1.50.0",
            "engine": "llama.cpp",
            "vendor_lib_package_names": [],
        },
    )
    write_json(
        home / ".internal" / "backend-preferences-v1.json",
        [
            {"model_format": "gguf", "name": llama, "version": "1.50.0"},
            {"model_format": "safetensors", "name": ENGINE, "version": "1.8.5"},
        ],
    )
    model = tiny.save_model(
        root / "model", "glm4_moe_lite", kv_lora_rank=128, qk_rope_head_dim=64
    )
    return SimpleNamespace(
        root=root,
        user=user,
        home=home,
        app=vendor / APP,
        next_app=vendor / NEXT_APP,
        python=vendor / APP / "bin" / "python",
        model=model,
    )


@pytest.fixture
def cli(layout, monkeypatch, capsys):
    """``mlx-lm-mla lmstudio ARGS`` in this process, with HOME at the layout's user."""

    def run(*args, user=layout.user):
        monkeypatch.setenv("HOME", str(user))
        capsys.readouterr()
        code = lmstudio.main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def tree(folder: Path):
    """Every path under folder with its bytes' digest (or link target)."""
    found = {}
    for top, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(top) / name
            key = str(path.relative_to(folder))
            if path.is_symlink():
                found[key] = "-> " + os.readlink(path)
            elif path.is_file():
                found[key] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                found[key] = "folder"
    return found


def in_layer(layout, *args, timeout=300):
    """The app layer's interpreter, isolated, as LM Studio runs it."""
    out = subprocess.run(
        [str(layout.python), "-I", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd="/",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def engine(layout):
    out = in_layer(layout, str(TESTS / "engine_sequence.py"), str(layout.model))
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.fixture
def installed(layout, cli):
    before = tree(layout.app)
    code, out, err = cli("install")
    assert code == 0, err
    yield out
    code, _, err = cli("uninstall")
    assert code == 0, err
    assert tree(layout.app) == before


@contextmanager
def unwritable(folder: Path):
    """folder really refuses new entries: immutable for root, read-only for others."""
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(folder)], check=True)
        undo = ["chattr", "-i", str(folder)]
    else:
        mode = folder.stat().st_mode
        folder.chmod(0o555)
        undo = None
    try:
        yield
    finally:
        if undo:
            subprocess.run(undo, check=True)
        else:
            folder.chmod(mode)


# --- the layout is LM Studio's ------------------------------------------------------


def test_the_layer_has_the_pinned_mlx_and_mlx_lm_and_no_pip(layout):
    out = in_layer(
        layout,
        "-c",
        "import importlib.metadata as m, importlib.util as u; "
        "print(m.version('mlx'), m.version('mlx-lm'), u.find_spec('mlx_lm').origin, "
        "u.find_spec('pip') is None, u.find_spec('mlx_lm_mla') is None)",
    )
    mlx, mlx_lm, origin, *missing = out.stdout.split()
    assert [mlx, mlx_lm] == [metadata.version("mlx"), metadata.version("mlx-lm")]
    assert Path(origin).is_relative_to(site(layout.app)) and missing == ["True", "True"]


def test_the_bare_layer_fails_as_reported(layout):
    result, _ = engine(layout)
    assert result["patched"] == 0 and result["cache"] == "QuantizedKVCache"  # stock's
    assert result["errors"] == 6 and SWAPAXES in result["first_error"]


# --- install, status, uninstall ------------------------------------------------------


def test_install_writes_into_the_active_engines_layer_and_says_so(layout, installed):
    assert str(layout.app) in installed and str(layout.next_app) not in installed
    assert f"mlx-lm {metadata.version('mlx-lm')}" in installed
    assert "restart LM Studio or reload the model" in installed


def test_installed_fix_is_active_in_the_isolated_interpreter(layout, installed):
    result, log = engine(layout)
    assert result["patched"] > 0 and result["cache"] == "QuantizedLatentCache"
    assert result["errors"] == 0 and result["served"] == 6
    assert f"INFO mlx_lm_mla: mlx-lm-mla {__version__} active" in log


def test_the_install_is_a_distribution_importlib_metadata_sees(layout, installed):
    out = in_layer(
        layout,
        "-c",
        "import importlib.metadata as m, importlib.util as u; d = m.distribution('mlx-lm-mla'); "
        "print(d.version, d.read_text('INSTALLER').strip(), len(d.files), "
        "u.find_spec('mlx_lm_mla').origin)",
    )
    version, installer, files, origin = out.stdout.split()
    assert (version, installer) == (__version__, "mlx-lm-mla")
    assert Path(origin) == site(layout.app) / "mlx_lm_mla" / "__init__.py"
    assert int(files) == len(lmstudio.payload())
    assert "mlx_lm_mla" not in (site(layout.app) / "sitecustomize.py").read_text()


def test_install_writes_the_runtime_and_no_test_kit(layout, installed):
    package = site(layout.app) / "mlx_lm_mla"
    assert (package / "patches" / "__init__.py").is_file() and (
        package / "guards" / "reuse.py"
    ).is_file()
    assert not (package / "testing").exists()


def test_repro_runs_in_the_layer_on_its_interpreter_alone(layout, installed):
    out = in_layer(layout, "-m", "mlx_lm_mla", "repro", "--json", "--requests", "4")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    stock, fixed = result["stock"], result["fixed"]
    assert stock["mlx_lm"] == fixed["mlx_lm"] == metadata.version("mlx-lm")
    assert stock["errors"] == 3 and SWAPAXES in stock["first_error"]
    assert fixed["served"] == 4 and fixed["cache_class"] == "QuantizedLatentCache"


def test_install_again_changes_nothing(layout, installed, cli):
    before = tree(layout.app)
    code, out, _ = cli("install")
    assert code == 0 and "already installed, nothing changed" in out
    assert tree(layout.app) == before


def test_uninstall_leaves_the_layer_byte_for_byte_as_before(layout, cli):
    before = tree(layout.app)
    assert cli("install")[0] == 0
    in_layer(layout, "-c", "import mlx_lm_mla.lmstudio")  # the layer writes bytecode
    assert any("mlx_lm_mla/__pycache__" in p for p in tree(layout.app))
    code, out, _ = cli("uninstall")
    assert code == 0 and f"removed mlx-lm-mla {__version__}" in out
    assert tree(layout.app) == before


def test_install_upgrades_an_older_install_in_place(layout, cli, monkeypatch):
    before = tree(layout.app)
    monkeypatch.setattr(installer, "__version__", "0.0.9")
    assert cli("install")[0] == 0
    monkeypatch.undo()
    try:
        code, out, _ = cli("install")
        assert code == 0 and f"upgraded mlx-lm-mla 0.0.9 to {__version__}" in out
        assert not (site(layout.app) / "mlx_lm_mla-0.0.9.dist-info").exists()
        versions = [
            d.version
            for d in metadata.distributions(path=[str(site(layout.app))])
            if d.metadata["Name"] == "mlx-lm-mla"
        ]
        assert versions == [__version__]
    finally:
        assert cli("uninstall")[0] == 0
    assert tree(layout.app) == before


def test_status_names_the_layer_its_mlx_lm_and_the_install(layout, cli):
    code, out, _ = cli("status")
    assert code == 0 and out.count("\n") == 1
    found = f"mlx-lm {metadata.version('mlx-lm')} supported"
    assert f"{layout.app}: mlx-lm-mla not installed; {found}" in out
    try:
        cli("install")
        assert f"mlx-lm-mla {__version__} installed;" in cli("status")[1]
    finally:
        cli("uninstall")


def test_an_update_to_a_new_layer_shows_as_not_installed(layout, installed, cli):
    prefs = layout.home / ".internal" / "backend-preferences-v1.json"
    saved = prefs.read_text()
    prefs.write_text(saved.replace('"1.8.5"', '"1.8.6"'))  # LM Studio switched engines
    try:
        code, out, _ = cli("status")
    finally:
        prefs.write_text(saved)
    assert code == 0 and f"{layout.next_app}: mlx-lm-mla not installed" in out
    assert str(layout.app) not in out


def test_all_reaches_every_layer_with_mlx_lm(layout, cli):
    before = tree(layout.next_app)
    try:
        assert cli("install", "--all")[0] == 0
        out = cli("status", "--all")[1]
        assert out.count(f"mlx-lm-mla {__version__} installed") == 2
    finally:
        assert cli("uninstall", "--all")[0] == 0
    assert "not installed" in cli("status")[1] and tree(layout.next_app) == before


def test_home_and_layer_options_work_on_that_folder(layout, cli, tmp_path):
    elsewhere = tmp_path / "user"  # no LM Studio there
    elsewhere.mkdir()
    assert (
        str(layout.app) in cli("status", "--home", str(layout.home), user=elsewhere)[1]
    )
    code, out, _ = cli("status", "--layer", str(layout.next_app), user=elsewhere)
    assert code == 0 and out.startswith(f"{layout.next_app}: mlx-lm-mla not installed")


def test_the_home_pointer_is_followed(layout, cli, tmp_path):
    (tmp_path / ".lmstudio-home-pointer").write_text(f"{layout.home}\n")
    code, out, _ = cli("status", user=tmp_path)
    assert code == 0 and str(layout.app) in out


def small_layer(tmp_path):
    """A layer of mlx-lm's metadata and package folder only, and the empty
    ``site-packages/__pycache__`` a layer may have."""
    layer = metadata_only_layer(tmp_path / "app@1", metadata.version("mlx-lm"))
    (site(layer) / "__pycache__").mkdir()
    return layer


def record_of(layer: Path) -> Path:
    return site(layer) / f"mlx_lm_mla-{__version__}.dist-info" / "RECORD"


def test_install_and_uninstall_leave_every_file_and_folder_as_before(cli, tmp_path):
    layer = small_layer(tmp_path)
    before = tree(layer)
    assert cli("install", "--layer", str(layer))[0] == 0
    assert cli("uninstall", "--layer", str(layer))[0] == 0
    assert tree(layer) == before  # folders too: the empty __pycache__ stays


def test_an_uninstall_cut_short_removed_the_activation_and_can_be_finished(
    cli, tmp_path, monkeypatch
):
    layer = small_layer(tmp_path)
    before = tree(layer)
    assert cli("install", "--layer", str(layer))[0] == 0
    remove, calls = installer._remove, []

    def interrupted(path):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt
        remove(path)

    monkeypatch.setattr(installer, "_remove", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cli("uninstall", "--layer", str(layer))
    monkeypatch.undo()
    assert not (site(layer) / "mlx_lm_mla.pth").exists()  # the fix is off
    code, out, err = cli("uninstall", "--layer", str(layer))
    assert code == 0 and f"removed mlx-lm-mla {__version__}" in out, err
    assert tree(layer) == before


def test_an_install_over_a_record_with_missing_files_repairs_it(cli, tmp_path):
    layer = small_layer(tmp_path)
    before = tree(layer)
    assert cli("install", "--layer", str(layer))[0] == 0
    installed = tree(layer)
    (site(layer) / "mlx_lm_mla" / "cache.py").unlink()
    (site(layer) / "mlx_lm_mla.pth").unlink()
    assert "mlx_lm_mla/cache.py is missing" in cli("status", "--layer", str(layer))[1]
    code, _, err = cli("install", "--layer", str(layer))
    assert code == 0, err
    assert tree(layer) == installed
    assert cli("uninstall", "--layer", str(layer))[0] == 0
    assert tree(layer) == before


def test_an_upgrade_interrupted_midway_leaves_the_older_install_alone(
    cli, tmp_path, monkeypatch
):
    layer = small_layer(tmp_path)
    monkeypatch.setattr(installer, "__version__", "0.0.9")
    assert cli("install", "--layer", str(layer))[0] == 0
    monkeypatch.undo()
    older = tree(layer)

    def interrupted(path):  # the new record is written, the old one not yet gone
        raise KeyboardInterrupt

    monkeypatch.setattr(installer, "_remove", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cli("install", "--layer", str(layer))
    monkeypatch.undo()
    assert tree(layer) == older
    assert "mlx-lm-mla 0.0.9 installed" in cli("status", "--layer", str(layer))[1]


def test_the_same_layer_given_twice_is_written_once(cli, tmp_path, monkeypatch):
    layer = small_layer(tmp_path)
    before = tree(layer)
    monkeypatch.chdir(tmp_path)
    for command, done in (("install", "installed"), ("uninstall", "removed")):
        code, out, err = cli(command, "--layer", "app@1", "--layer", str(layer))
        assert code == 0 and out.count(f"{done} mlx-lm-mla") == 1, err
    assert tree(layer) == before


def test_a_manifest_in_a_layout_not_known_is_skipped(cli, tmp_path):
    backends = tmp_path / ".lmstudio" / "extensions" / "backends"
    layer = metadata_only_layer(backends / "vendor" / APP, metadata.version("mlx-lm"))
    write_json(backends / "odd-1.0" / "backend-manifest.json", [APP])
    write_json(backends / "odder-1.0" / "backend-manifest.json", APP)
    for i, names in enumerate([7, APP]):  # its layers' names, not a list of them
        manifest = {"name": f"odd{i}", "vendor_lib_package_names": names}
        write_json(backends / f"oddest{i}-1.0" / "backend-manifest.json", manifest)
    write_json(
        backends / f"{ENGINE}-1.8.5" / "backend-manifest.json",
        {"name": ENGINE, "version": "1.8.5", "vendor_lib_package_names": [APP]},
    )
    code, out, err = cli("status", user=tmp_path)
    assert code == 0 and out.startswith(f"{layer}: mlx-lm-mla not installed"), err


# --- refusals: a clear message, nothing written ------------------------------------------


def run_cli(*args, user):
    """The installed command, in a new process."""
    return subprocess.run(
        [sys.executable, "-m", "mlx_lm_mla", "lmstudio", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HOME": str(user)},
        cwd="/",
    )


def test_status_without_lm_studio_says_so_in_one_line(tmp_path):
    out = run_cli("status", user=tmp_path)
    assert out.returncode != 0 and out.stdout == ""
    assert len(out.stderr.splitlines()) == 1 and "no LM Studio found" in out.stderr


def test_install_without_lm_studio_is_refused(cli, tmp_path):
    code, out, err = cli("install", user=tmp_path)
    assert code == 1 and out == "" and "no LM Studio found" in err
    assert list(tmp_path.iterdir()) == []


def test_a_home_without_an_mlx_layer_is_refused(cli, tmp_path):
    llama = tmp_path / ".lmstudio" / "extensions" / "backends" / "llama.cpp-1.50.0"
    write_json(
        llama / "backend-manifest.json", {"name": "llama.cpp", "engine": "llama.cpp"}
    )
    before = tree(tmp_path)
    code, _, err = cli("install", user=tmp_path)
    assert code == 1 and "no MLX engine" in err and "mlx_lm" in err
    assert tree(tmp_path) == before


def test_an_unsupported_mlx_lm_is_refused(cli, tmp_path):
    layer = metadata_only_layer(tmp_path / "old@1", "0.30.0")
    before = tree(layer)
    code, _, err = cli("install", "--layer", str(layer))
    low, high = lmstudio.supported_range()
    assert code == 1 and "mlx-lm 0.30.0" in err and "outside the supported range" in err
    dotted = [".".join(map(str, end)) for end in (low, high)]
    assert f">={dotted[0]}, <{dotted[1]}" in err and "nothing written" in err
    assert tree(layer) == before


def test_an_unwritable_layer_is_refused(layout, cli):
    before = tree(layout.app)
    with unwritable(site(layout.app)):
        with pytest.raises(OSError):
            (site(layout.app) / "probe").write_bytes(b"")
        code, _, err = cli("install")
    assert (
        code == 1
        and f"cannot write to {site(layout.app)}" in err
        and "nothing written" in err
    )
    assert tree(layout.app) == before


def test_a_write_that_fails_midway_leaves_the_layer_as_it_was(layout, cli, monkeypatch):
    before = tree(layout.app)
    replace, calls = os.replace, []

    def full_disk(source, target):
        calls.append(target)
        if len(calls) == 5:
            raise OSError(28, "No space left on device")
        replace(source, target)

    monkeypatch.setattr(installer.os, "replace", full_disk)
    code, out, err = cli("install")
    assert (
        code == 1
        and out == ""
        and "No space left on device" in err
        and "as it was" in err
    )
    assert tree(layout.app) == before


def test_files_that_do_not_match_the_record_are_refused(layout, installed, cli):
    module = site(layout.app) / "mlx_lm_mla" / "cache.py"
    original = module.read_bytes()
    module.write_bytes(original + b"# edited\n")
    try:
        changed = tree(layout.app)
        for command in ("uninstall", "install"):
            code, _, err = cli(command)
            assert code == 1 and "nothing written" in err
            assert "mlx_lm_mla/cache.py was changed" in err
            assert tree(layout.app) == changed
        assert "mlx_lm_mla/cache.py was changed" in cli("status")[1]
    finally:
        module.write_bytes(original)


def test_mlx_lm_mla_files_without_a_record_are_not_touched(cli, tmp_path):
    layer = metadata_only_layer(tmp_path / "app@1", metadata.version("mlx-lm"))
    (site(layer) / "mlx_lm_mla").mkdir()
    (site(layer) / "mlx_lm_mla" / "__init__.py").write_text("# someone else's\n")
    before = tree(layer)
    for command in ("install", "uninstall"):
        code, _, err = cli(command, "--layer", str(layer))
        assert code == 1 and "without a record" in err
    assert tree(layer) == before


def test_a_home_pointer_that_is_not_utf8_is_refused_naming_it(cli, tmp_path):
    (tmp_path / ".lmstudio-home-pointer").write_bytes(b"/Users/\xff\xfe/lm\n")
    code, out, err = cli("status", user=tmp_path)
    assert code == 1 and out == ""
    assert f"{tmp_path / '.lmstudio-home-pointer'} is not UTF-8 text" in err


def test_a_home_pointer_holding_a_nul_is_refused_naming_it(cli, tmp_path):
    (tmp_path / ".lmstudio-home-pointer").write_bytes(b"/Users/a\0b\n")
    code, out, err = cli("status", user=tmp_path)
    assert code == 1 and out == ""
    assert f"{tmp_path / '.lmstudio-home-pointer'} holds a NUL byte" in err


def refused_with_row(cli, layer, row, said):
    """``row`` added to the record of an install in ``layer``: uninstall and
    install both refuse, saying ``said``, and the layer is left as it was."""
    with record_of(layer).open("a") as record:
        record.write(row + "\n")
    before = tree(layer)
    for command in ("uninstall", "install"):
        code, _, err = cli(command, "--layer", str(layer))
        assert code == 1 and "nothing written" in err
        assert said in err
    assert tree(layer) == before


def installed_layer(cli, tmp_path):
    layer = small_layer(tmp_path)
    assert cli("install", "--layer", str(layer))[0] == 0
    return layer


def test_a_record_row_without_a_hash_is_refused_and_nothing_deleted(cli, tmp_path):
    layer = installed_layer(cli, tmp_path)
    said = "lists mlx_lm/__init__.py without a hash"
    refused_with_row(cli, layer, "mlx_lm/__init__.py,,", said)  # the layer's own


def test_a_record_row_outside_the_package_is_refused_and_nothing_deleted(cli, tmp_path):
    layer = installed_layer(cli, tmp_path)
    theirs = (site(layer) / "mlx_lm" / "__init__.py").read_bytes()
    row = f"mlx_lm/__init__.py,{installer._digest(theirs)},{len(theirs)}"
    said = "lists mlx_lm/__init__.py, which is not mlx-lm-mla's"
    refused_with_row(cli, layer, row, said)


def test_a_record_row_naming_a_folder_is_refused_and_nothing_deleted(cli, tmp_path):
    layer = installed_layer(cli, tmp_path)
    row = f"mlx_lm_mla/lmstudio,{installer._digest(b'')},0"
    refused_with_row(cli, layer, row, "mlx_lm_mla/lmstudio is not a file")


# --- the README ---------------------------------------------------------------------------


def test_the_readme_commands_run_as_written(layout):
    section = README.read_text().split("## LM Studio", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```\n(.*?)```", section, re.S).group(1)
    commands = [line for line in block.splitlines() if line.startswith("mlx-lm-mla ")]
    assert [c.split()[2] for c in commands] == ["install", "status", "uninstall"]
    before = tree(layout.app)
    scripts = sysconfig.get_paths()["scripts"]
    env = {
        **os.environ,
        "HOME": str(layout.user),
        "PATH": f"{scripts}:{os.environ['PATH']}",
    }
    for command in commands:
        out = subprocess.run(
            ["bash", "-c", command],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert out.returncode == 0, (command, out.stderr)
        assert str(layout.app) in out.stdout
    assert tree(layout.app) == before
