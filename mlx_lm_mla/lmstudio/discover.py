"""Where LM Studio keeps its MLX engine, and what is in a layer of it.

LM Studio runs its MLX engine in venvstacks layers under its home folder:

    <home>/extensions/backends/<engine>-<version>/backend-manifest.json
    <home>/extensions/backends/vendor/_amphibian/<layer>/lib/python3.11/site-packages

The manifest's ``vendor_lib_package_names`` names an engine's layers;
``<home>/.internal/backend-preferences-v1.json`` names the engine in use.
"""

import json
from importlib import metadata
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from .._version import MLX_LM_RANGE


class Refused(Exception):
    """A reason not to act; nothing has been written when it is raised."""


# --- where LM Studio keeps its engine ------------------------------------------


def find_home() -> Path:
    user = Path.home()
    pointer = user / ".lmstudio-home-pointer"
    candidates = []
    if pointer.is_file():
        try:
            text = pointer.read_text(encoding="utf-8").strip()
        except UnicodeDecodeError:
            raise Refused(
                f"{pointer} is not UTF-8 text; give --home DIR or --layer DIR"
            ) from None
        if "\0" in text:
            raise Refused(f"{pointer} holds a NUL byte; give --home DIR or --layer DIR")
        candidates.append(Path(text).expanduser())
    candidates += [user / ".lmstudio", user / ".cache" / "lm-studio"]
    for home in candidates:
        if (home / "extensions" / "backends").is_dir():
            return home
    raise Refused(
        f"no LM Studio found: no extensions/backends under ~/.lmstudio-home-pointer, "
        f"~/.lmstudio or ~/.cache/lm-studio (HOME={user}); "
        "give --home DIR or --layer DIR"
    )


def site_packages(layer: Path):
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
        if not isinstance(manifest, dict):
            continue  # not a layout we know, as an unreadable one
        vendor = backends / "vendor"
        names = manifest.get("vendor_lib_package_names")
        names = names if isinstance(names, list) else []  # a layout we do not know
        layers = [vendor / n for n in names if isinstance(n, str)]
        # A name is data from a package: only folders inside vendor/ are layers.
        layers = [p for p in layers if p.resolve().is_relative_to(vendor.resolve())]
        layers = [p for p in layers if holds_mlx_lm(p)]
        if layers:
            yield (
                str(manifest.get("name", "")),
                str(manifest.get("version", "")),
                layers,
            )


def _version_key(version: str):
    try:
        return (1, Version(version))
    except InvalidVersion:
        return (0, Version("0"))


def find_layers(home: Path, every: bool):
    """The active MLX engine's layers holding mlx-lm (every such layer: ``every``)."""
    backends = home / "extensions" / "backends"
    if every:
        # Layers sit one or two folders below vendor/ (vendor/_amphibian/<layer>).
        layers = [
            p
            for depth in ("*", "*/*")
            for p in sorted(backends.glob(f"vendor/{depth}"))
        ]
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
        prefs = json.loads(
            (home / ".internal" / "backend-preferences-v1.json").read_text()
        )
        chosen = {
            (str(p.get("name")), str(p.get("version")))
            for p in prefs
            if isinstance(p, dict)
        }
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
    """(low, high) releases of the tested mlx-lm range, ``>=low,<high``."""
    ends = {s.operator: Version(s.version).release for s in SpecifierSet(MLX_LM_RANGE)}
    return ends[">="], ends["<"]


def _dotted(release):
    return ".".join(map(str, release))


def check_mlx_lm(site: Path) -> str:
    """The layer's mlx-lm version, from its metadata; Refused outside the range."""
    dist = _dist(site, "mlx-lm")
    if dist is None:
        raise Refused(f"no mlx-lm metadata (mlx_lm-*.dist-info) in {site}")
    try:
        version = Version(dist.version)
    except InvalidVersion:
        raise Refused(
            f"mlx-lm in {site} has an unreadable version {dist.version!r}"
        ) from None
    low, high = supported_range()
    if not SpecifierSet(MLX_LM_RANGE).contains(version, prereleases=True):
        raise Refused(
            f"mlx-lm {dist.version} in {site} is outside the supported range "
            f">={_dotted(low)}, <{_dotted(high)}"
        )
    return dist.version
