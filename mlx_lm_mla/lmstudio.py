"""The fix inside LM Studio's MLX engine: ``mlx-lm-mla lmstudio install|status|uninstall``.

LM Studio runs its MLX engine in runtime layers built with venvstacks, under
its home folder (``~/.lmstudio``, or ``~/.cache/lm-studio``, as recorded in
``~/.lmstudio-home-pointer``):

    <home>/extensions/backends/<engine>-<version>/backend-manifest.json
    <home>/extensions/backends/vendor/_amphibian/app-mlx-generate-...@N/lib/python3.11/site-packages

The manifest's ``vendor_lib_package_names`` names the layers an engine runs;
``<home>/.internal/backend-preferences-v1.json`` names the engine in use. The
layers have no pip and their interpreter runs isolated, so ``pip install``
cannot reach them. ``install`` writes this package's modules and its start-up
hook (``mlx_lm_mla.pth``) into the site-packages of each layer holding
mlx-lm, with a standard ``mlx_lm_mla-<version>.dist-info`` (METADATA,
INSTALLER, RECORD) listing every file written; ``uninstall`` removes exactly
what RECORD lists. No other file of the layer is touched: not
``sitecustomize.py``, not another package.
"""

import argparse
import base64
import csv
import hashlib
import io
import json
import os
import sys
from importlib import metadata
from pathlib import Path

from packaging.version import InvalidVersion, Version

from ._version import __version__

NAME = "mlx-lm-mla"
PACKAGE = "mlx_lm_mla"
PTH = "mlx_lm_mla.pth"
INSTALLER = "mlx-lm-mla"
RESTART = "restart LM Studio or reload the model"


class Refused(Exception):
    """A reason not to act; nothing has been written when it is raised."""


# --- where LM Studio keeps its engine ------------------------------------------


def find_home() -> Path:
    user = Path.home()
    pointer = user / ".lmstudio-home-pointer"
    candidates = []
    if pointer.is_file():
        candidates.append(Path(pointer.read_text(encoding="utf-8").strip()).expanduser())
    candidates += [user / ".lmstudio", user / ".cache" / "lm-studio"]
    for home in candidates:
        if (home / "extensions" / "backends").is_dir():
            return home
    raise Refused(
        f"no LM Studio found: no extensions/backends under ~/.lmstudio-home-pointer, "
        f"~/.lmstudio or ~/.cache/lm-studio (HOME={user}); give --home DIR or --layer DIR"
    )


def site_packages(layer: Path):
    """The layer's ``lib/python3.X/site-packages``, or None."""
    found = sorted(layer.glob("lib/python3*/site-packages"))
    return found[0] if len(found) == 1 and found[0].is_dir() else None


def holds_mlx_lm(layer: Path) -> bool:
    site = site_packages(layer)
    return site is not None and (
        (site / "mlx_lm").is_dir() or _dist(site, "mlx-lm") is not None
    )


def _engines(backends: Path):
    """(name, version, layers with mlx_lm) of each engine with a manifest."""
    for manifest_path in sorted(backends.glob("*/backend-manifest.json")):
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        vendor = backends / "vendor"
        names = manifest.get("vendor_lib_package_names") or []
        layers = [vendor / n for n in names if isinstance(n, str)]
        # A name is data from a package: only folders inside vendor/ are layers.
        layers = [p for p in layers if p.resolve().is_relative_to(vendor.resolve())]
        layers = [p for p in layers if holds_mlx_lm(p)]
        if layers:
            yield str(manifest.get("name", "")), str(manifest.get("version", "")), layers


def _version_key(version: str):
    try:
        return (1, Version(version))
    except InvalidVersion:
        return (0, Version("0"))


def find_layers(home: Path, every: bool):
    """The active MLX engine's layers holding mlx-lm; every such layer with ``every``."""
    backends = home / "extensions" / "backends"
    if every:
        # Layers sit one or two folders below vendor/ (vendor/_amphibian/<layer>).
        layers = [p for depth in ("*", "*/*") for p in sorted(backends.glob(f"vendor/{depth}"))]
        layers = [p for p in layers if holds_mlx_lm(p)]
        if not layers:
            raise Refused(f"no layer with mlx_lm under {backends / 'vendor'}")
        return layers
    engines = list(_engines(backends))
    if not engines:
        raise Refused(
            f"no MLX engine in {backends}: no backend-manifest.json names a layer "
            "with mlx_lm (download LM Studio's MLX engine first)"
        )
    try:
        prefs = json.loads((home / ".internal" / "backend-preferences-v1.json").read_text())
        chosen = {(str(p.get("name")), str(p.get("version"))) for p in prefs if isinstance(p, dict)}
    except (OSError, ValueError, AttributeError, TypeError):
        chosen = set()
    active = [e for e in engines if (e[0], e[1]) in chosen]
    # No recorded choice: the newest MLX engine.
    return (active or sorted(engines, key=lambda e: _version_key(e[1])))[-1][2]


# --- what is in a layer -----------------------------------------------------------


def _dists(site: Path, name: str):
    return list(metadata.distributions(name=name, path=[str(site)]))


def _dist(site: Path, name: str):
    found = _dists(site, name)
    return found[0] if found else None


def supported_range():
    # The tested range is patch.py's; importing it loads mlx-lm (a second or two).
    from .patch import SUPPORTED_MLX_LM

    return SUPPORTED_MLX_LM


def _dotted(release):
    return ".".join(map(str, release))


def check_mlx_lm(site: Path) -> str:
    """The layer's mlx-lm version, from its metadata; Refused outside the range."""
    dist = _dist(site, "mlx-lm")
    if dist is None:
        raise Refused(f"no mlx-lm metadata (mlx_lm-*.dist-info) in {site}")
    try:
        release = (Version(dist.version).release + (0, 0, 0))[:3]
    except InvalidVersion:
        raise Refused(f"mlx-lm in {site} has an unreadable version {dist.version!r}") from None
    low, high = supported_range()
    if not low <= release < high:
        raise Refused(
            f"mlx-lm {dist.version} in {site} is outside the supported range "
            f">={_dotted(low)}, <{_dotted(high)}"
        )
    return dist.version


def _digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _is_pyc_of(path: Path, modules) -> bool:
    # Bytecode the layer's interpreter wrote for a module we installed.
    return (
        path.parent.name == "__pycache__"
        and path.suffix == ".pyc"
        and (path.parent.parent / (path.name.split(".")[0] + ".py")) in modules
    )


class Install:
    """This package's record in one layer's site-packages, read with importlib.metadata."""

    def __init__(self, site: Path):
        self.site = site
        found = _dists(site, NAME)
        if len(found) > 1:
            raise Refused(f"{len(found)} records of {NAME} in {site}; expected one at most")
        self.dist = found[0] if found else None
        if self.dist is None:
            stray = [p.name for p in (site / PACKAGE, site / PTH) if p.exists()]
            if stray:
                raise Refused(f"{', '.join(stray)} in {site} without a record; not touching them")
            self.files = {}
            return
        if self.dist.files is None:
            raise Refused(f"{NAME} in {site} has no RECORD; not touching it")
        installer = (self.dist.read_text("INSTALLER") or "").strip()
        if installer != INSTALLER:
            raise Refused(
                f"{NAME} in {site} was installed by {installer or 'an unknown installer'}, "
                "not by `mlx-lm-mla lmstudio`; remove it with that tool"
            )
        self.files = {site / f: f for f in self.dist.files}

    @property
    def version(self):
        return self.dist.version if self.dist else None

    def mismatches(self):
        """Files that differ from the record, or that the record does not list."""
        problems = []
        for path, f in self.files.items():
            if f.hash is None:
                continue  # RECORD itself
            if not path.is_file():
                problems.append(f"{f} is missing")
            elif _digest(path.read_bytes()) != f"{f.hash.mode}={f.hash.value}":
                problems.append(f"{f} was changed")
        modules = {p for p in self.files if p.suffix == ".py"}
        for folder in {p.parent for p in self.files if p.parent != self.site}:
            for path in sorted(folder.rglob("*")):
                if path.is_file() and path not in self.files and not _is_pyc_of(path, modules):
                    problems.append(f"{path.relative_to(self.site)} is not in the record")
        return problems

    def check(self):
        problems = self.mismatches()
        if problems:
            raise Refused(
                f"the files of {NAME} {self.version} in {self.site} do not match its "
                f"record: {'; '.join(problems)}"
            )


def payload():
    """{path in site-packages: bytes} of what install writes, RECORD last."""
    package = Path(__file__).parent
    pth = package.parent / PTH  # beside the package: site-packages, or the checkout
    if not pth.is_file():
        raise Refused(f"cannot find {PTH} beside {package}; reinstall {NAME}")
    files = {f"{PACKAGE}/{p.name}": p.read_bytes() for p in sorted(package.glob("*.py"))}
    files[PTH] = pth.read_bytes()
    info = f"{PACKAGE}-{__version__}.dist-info"
    low, high = supported_range()
    files[f"{info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {__version__}\n"
        f"Summary: MLA-aware KV caches for mlx-lm\n"
        f"Requires-Dist: mlx-lm>={_dotted(low)},<{_dotted(high)}\n"
    ).encode()
    files[f"{info}/INSTALLER"] = f"{INSTALLER}\n".encode()
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for name, data in files.items():
        writer.writerow([name, _digest(data), len(data)])
    writer.writerow([f"{info}/RECORD", "", ""])
    files[f"{info}/RECORD"] = record.getvalue().encode()
    return files


def _writable(paths):
    for path in paths:
        if path.exists() and not os.access(path, os.W_OK | (os.X_OK if path.is_dir() else 0)):
            raise Refused(f"cannot write to {path}")


def _remove(path: Path):
    path.unlink()
    if path.suffix == ".py":
        for pyc in path.parent.glob(f"__pycache__/{path.stem}.*.pyc"):
            pyc.unlink()


def _prune(site: Path, folders):
    # Deepest first; only folders left empty, never site-packages itself.
    candidates = {f for p in folders for f in (p / "__pycache__", p)}
    for folder in sorted(candidates, key=lambda p: -len(p.parts)):
        if folder != site and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


# --- the three commands, one layer each --------------------------------------------


def install_layer(layer: Path):
    """Returns (message, write): write() makes the change; nothing is written before."""
    site = site_packages(layer)
    if site is None:
        raise Refused(f"no lib/python3.*/site-packages in {layer}")
    found = check_mlx_lm(site)
    old = Install(site)
    old.check()
    new = payload()
    new_paths = {site / name: data for name, data in new.items()}
    unchanged = set(old.files) == set(new_paths) and all(
        p.read_bytes() == data for p, data in new_paths.items()
    )
    if unchanged:
        same = f"{NAME} {__version__} already installed, nothing changed"
        return f"{layer}: mlx-lm {found}; {same}", None
    folders = {p.parent for p in [*new_paths, *old.files]}
    _writable([site, *folders, *old.files, *(p for p in new_paths if p.exists())])
    if old.version is None:
        done = f"installed {NAME} {__version__}"
    else:
        new_key, old_key = _version_key(__version__), _version_key(old.version)
        verb = "upgraded" if new_key > old_key else "downgraded" if new_key < old_key else "rewrote"
        done = f"{verb} {NAME} {old.version} to {__version__}"

    def write():
        saved = {p: p.read_bytes() for p in old.files if p.is_file()}
        created = []
        try:
            for path, data in new_paths.items():
                path.parent.mkdir(exist_ok=True)
                if not path.exists():
                    created.append(path)
                tmp = path.with_name(path.name + ".tmp")
                try:
                    tmp.write_bytes(data)
                    os.replace(tmp, path)  # a reader never sees half a file
                finally:
                    tmp.unlink(missing_ok=True)
                if path.suffix == ".py":  # stale bytecode of an older version
                    for pyc in path.parent.glob(f"__pycache__/{path.stem}.*.pyc"):
                        pyc.unlink()
            for path in set(old.files) - set(new_paths):
                _remove(path)
            _prune(site, folders)
        except OSError as e:
            for path in created:
                path.unlink(missing_ok=True)
            for path, data in saved.items():
                path.parent.mkdir(exist_ok=True)
                path.write_bytes(data)
            _prune(site, folders)
            raise Refused(f"writing into {site} failed ({e}); the layer is as it was")

    message = f"{layer}: mlx-lm {found}; {done} ({len(new)} files); {RESTART}"
    return message, write


def uninstall_layer(layer: Path):
    site = site_packages(layer)
    if site is None:
        raise Refused(f"no lib/python3.*/site-packages in {layer}")
    old = Install(site)
    if old.version is None:
        return f"{layer}: {NAME} is not installed, nothing to remove", None
    old.check()
    folders = {p.parent for p in old.files}
    _writable([site, *folders, *old.files])

    def write():
        for path in old.files:
            _remove(path)
        _prune(site, folders)

    return f"{layer}: removed {NAME} {old.version} ({len(old.files)} files); {RESTART}", write


def layer_status(layer: Path) -> str:
    site = site_packages(layer)
    if site is None:
        return f"{layer}: no lib/python3.*/site-packages"
    try:
        found = f"mlx-lm {check_mlx_lm(site)} supported"
    except Refused as e:
        found = f"not supported: {e}"
    try:
        mine = Install(site)
        problems = mine.mismatches()
        if mine.version is None:
            state = f"{NAME} not installed"
        elif problems:
            state = f"{NAME} {mine.version} installed, but {'; '.join(problems)}"
        else:
            state = f"{NAME} {mine.version} installed"
    except Refused as e:
        state = str(e)
    return f"{layer}: {state}; {found}"


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="mlx-lm-mla lmstudio",
        description="Install the fix into LM Studio's MLX engine, show it, or remove it.",
    )
    parser.add_argument("command", choices=["install", "status", "uninstall"])
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--home", type=Path, metavar="DIR", help="LM Studio's home folder")
    where.add_argument(
        "--layer", type=Path, action="append", metavar="DIR", help="a layer folder (repeatable)"
    )
    parser.add_argument(
        "--all", action="store_true", help="every layer with mlx_lm, not only the active engine's"
    )
    args = parser.parse_args(argv)
    if args.layer and args.all:
        parser.error("--all finds layers in a home folder; it does not go with --layer")
    try:
        layers = args.layer or find_layers(args.home or find_home(), args.all)
        if args.command == "status":
            for layer in layers:
                print(layer_status(layer))
            return 0
        act = install_layer if args.command == "install" else uninstall_layer
        plans, refusals = [], []
        for layer in layers:  # every layer is checked before any is written
            try:
                plans.append(act(layer))
            except Refused as e:
                refusals.append(str(e))
        if refusals:
            raise Refused("; ".join(refusals) + "; nothing written")
        for message, write in plans:
            if write is not None:
                write()
            print(message)
        return 0
    except Refused as e:
        print(f"mlx-lm-mla lmstudio {args.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
