"""The fix inside LM Studio's MLX engine: ``mlx-lm-mla lmstudio
install|status|uninstall``. ``discover`` finds the layers, ``installer`` writes.
"""

import argparse
import sys
from pathlib import Path

from .discover import Refused, find_home, find_layers
from .installer import install_layer, layer_status, payload, uninstall_layer
from .discover import supported_range

__all__ = ["main", "payload", "supported_range"]


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="mlx-lm-mla lmstudio",
        description="Install the fix into LM Studio's MLX engine, show it, "
        "or remove it.",
    )
    parser.add_argument(
        "command",
        choices=["install", "status", "uninstall"],
        help="install the fix in each layer, show each layer's state, or "
        "remove what install wrote",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--home", type=Path, metavar="DIR", help="LM Studio's home folder"
    )
    where.add_argument(
        "--layer",
        type=Path,
        action="append",
        metavar="DIR",
        help="a layer folder (repeatable)",
    )
    parser.add_argument(
        "--all",
        action="store_true",
        help="every layer with mlx_lm, not only the active engine's",
    )
    args = parser.parse_args(argv)
    if args.layer and args.all:
        parser.error("--all finds layers in a home folder; it does not go with --layer")
    try:
        layers = args.layer or find_layers(args.home or find_home(), args.all)
        # One folder given twice (L and $PWD/L) is one layer: written once.
        unique = {}
        for layer in layers:
            unique.setdefault(layer.resolve(), layer)
        layers = list(unique.values())
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
