"""Writes the fix into one layer of LM Studio's MLX engine, and takes it out.

The layers have no pip and run isolated: ``install_layer`` writes the runtime
modules and ``mlx_lm_mla.pth`` into the layer's site-packages with a standard
dist-info whose RECORD lists every file; ``uninstall_layer`` removes exactly
those. No other file of the layer is touched.
"""

import base64
import csv
import hashlib
import io
import os
from pathlib import Path

from .._version import MLX_LM_RANGE, __version__
from .discover import Refused, _dists, _version_key, check_mlx_lm, site_packages

NAME = "mlx-lm-mla"
PACKAGE = "mlx_lm_mla"
PTH = "mlx_lm_mla.pth"
INSTALLER = "mlx-lm-mla"
RESTART = "restart LM Studio or reload the model"
NOT_SHIPPED = ("testing",)


def _digest(data: bytes) -> str:
    return (
        "sha256="
        + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    )


def _is_pyc_of(path: Path, modules) -> bool:
    # Bytecode the layer's interpreter wrote for a module we installed.
    return (
        path.parent.name == "__pycache__"
        and path.suffix == ".pyc"
        and (path.parent.parent / (path.name.split(".")[0] + ".py")) in modules
    )


class Install:
    """This package's record in one layer's site-packages."""

    def __init__(self, site: Path):
        self.site = site
        found = _dists(site, NAME)
        if len(found) > 1:
            raise Refused(
                f"{len(found)} records of {NAME} in {site}; expected one at most"
            )
        self.dist = found[0] if found else None
        if self.dist is None:
            stray = [p.name for p in (site / PACKAGE, site / PTH) if p.exists()]
            if stray:
                raise Refused(
                    f"{', '.join(stray)} in {site} without a record; not touching them"
                )
            self.files = {}
            return
        if self.dist.files is None:
            raise Refused(f"{NAME} in {site} has no RECORD; not touching it")
        installer = (self.dist.read_text("INSTALLER") or "").strip()
        if installer != INSTALLER:
            raise Refused(
                f"{NAME} in {site} was installed by "
                f"{installer or 'an unknown installer'}, "
                "not by `mlx-lm-mla lmstudio`; remove it with that tool"
            )
        info = f"{PACKAGE}-{self.dist.version}.dist-info"  # as payload() names it
        for f in self.dist.files:
            own_record = f.as_posix() == f"{info}/RECORD"
            if f.hash is None and not own_record:
                raise Refused(
                    f"the record of {NAME} in {site} lists {f} without a hash; "
                    "not touching it"
                )
            if ".." in f.parts or not (
                f.parts[0] in (PACKAGE, info) or f.as_posix() == PTH
            ):
                raise Refused(
                    f"the record of {NAME} in {site} lists {f}, which is not "
                    f"{NAME}'s ({PACKAGE}/, {PTH} or {info}/); not touching it"
                )
        self.files = {site / f: f for f in self.dist.files}

    @property
    def version(self):
        return self.dist.version if self.dist else None

    def mismatches(self, missing=True):
        """Files that differ from the record, or that the record does not list;
        files only missing too, unless ``missing`` is false."""
        problems = []
        for path, f in self.files.items():
            if f.hash is None:
                continue  # RECORD itself
            if not path.is_file():
                if path.exists() or path.is_symlink():
                    problems.append(f"{f} is not a file")
                elif missing:
                    problems.append(f"{f} is missing")
            elif _digest(path.read_bytes()) != f"{f.hash.mode}={f.hash.value}":
                problems.append(f"{f} was changed")
        modules = {p for p in self.files if p.suffix == ".py"}
        for folder in {p.parent for p in self.files if p.parent != self.site}:
            for path in sorted(folder.rglob("*")):
                if (
                    path.is_file()
                    and path not in self.files
                    and not _is_pyc_of(path, modules)
                ):
                    problems.append(
                        f"{path.relative_to(self.site)} is not in the record"
                    )
        return problems

    def check(self):
        # Files only missing are a cut-short install or uninstall: both finish it.
        problems = self.mismatches(missing=False)
        if problems:
            raise Refused(
                f"the files of {NAME} {self.version} in {self.site} do not match its "
                f"record: {'; '.join(problems)}"
            )


def payload():
    """{path in site-packages: bytes} of what install writes, RECORD last."""
    package = Path(__file__).parent.parent
    pth = package.parent / PTH  # beside the package: site-packages, or the checkout
    if not pth.is_file():
        raise Refused(f"cannot find {PTH} beside {package}; reinstall {NAME}")
    modules = sorted(
        p
        for p in package.rglob("*.py")
        if p.relative_to(package).parts[0] not in NOT_SHIPPED
    )
    files = {
        f"{PACKAGE}/{p.relative_to(package).as_posix()}": p.read_bytes()
        for p in modules
    }
    files[PTH] = pth.read_bytes()
    info = f"{PACKAGE}-{__version__}.dist-info"
    files[f"{info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {__version__}\n"
        f"Summary: MLA-aware KV caches for mlx-lm\n"
        f"Requires-Dist: mlx-lm{MLX_LM_RANGE}\n"
    ).encode()
    files[f"{info}/INSTALLER"] = f"{INSTALLER}\n".encode()
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for name, data in files.items():
        writer.writerow([name, _digest(data), len(data)])
    writer.writerow([f"{info}/RECORD", "", ""])
    files[f"{info}/RECORD"] = record.getvalue().encode()
    return files


def _parts(paths, site: Path):
    """(the .pth, the rest, RECORD) of paths: install writes the activation last,
    uninstall removes it first, so a cut-short run never leaves the .pth with half
    a package; RECORD, which lists the rest, is the last file removed."""
    pth = [p for p in paths if p == site / PTH]
    record = [p for p in paths if p not in pth and p.name == "RECORD"]
    return pth, [p for p in paths if p not in pth and p not in record], record


def _writable(paths):
    for path in paths:
        if path.exists() and not os.access(
            path, os.W_OK | (os.X_OK if path.is_dir() else 0)
        ):
            raise Refused(f"cannot write to {path}")


def _remove(path: Path):
    path.unlink(missing_ok=True)  # a cut-short uninstall left it out
    if path.suffix == ".py":
        for pyc in path.parent.glob(f"__pycache__/{path.stem}.*.pyc"):
            pyc.unlink()


def _prune(site: Path, folders):
    # Deepest first; only folders left empty, and only the package's own: never
    # site-packages nor its __pycache__, which the layer had.
    candidates = {f for p in folders if p != site for f in (p / "__pycache__", p)}
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
        p.is_file() and p.read_bytes() == data for p, data in new_paths.items()
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
        verb = (
            "upgraded"
            if new_key > old_key
            else "downgraded"
            if new_key < old_key
            else "rewrote"
        )
        done = f"{verb} {NAME} {old.version} to {__version__}"

    def write():
        saved = {p: p.read_bytes() for p in old.files if p.is_file()}
        created = []
        try:
            pth, rest, record = _parts(new_paths, site)
            for path in [*rest, *record, *pth]:
                data = new_paths[path]
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
        except BaseException as e:  # an interrupt too: never two records left
            for path in created:
                path.unlink(missing_ok=True)
            for path, data in saved.items():
                path.parent.mkdir(exist_ok=True)
                path.write_bytes(data)
            _prune(site, folders)
            if not isinstance(e, OSError):
                raise
            raise Refused(
                f"writing into {site} failed ({e}); the layer is as it was"
            ) from e

    message = f"{layer}: mlx-lm {found}; {done} ({len(new)} files); {RESTART}"
    return message, write


def uninstall_layer(layer: Path):
    site = site_packages(layer)
    if site is None:
        raise Refused(f"no lib/python3.*/site-packages in {layer}")
    old = Install(site)
    if old.dist is None:
        return f"{layer}: {NAME} is not installed, nothing to remove", None
    old.check()
    folders = {p.parent for p in old.files}
    _writable([site, *folders, *old.files])

    def write():
        pth, rest, record = _parts(old.files, site)
        for path in [*pth, *rest, *record]:
            _remove(path)
        _prune(site, folders)

    return (
        f"{layer}: removed {NAME} {old.version} ({len(old.files)} files); {RESTART}",
        write,
    )


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
