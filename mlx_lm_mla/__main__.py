"""Command line: ``python -m mlx_lm_mla repro`` (also ``mlx-lm-mla repro``)."""

import sys


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    commands = {"repro": "mlx_lm_mla.repro"}
    if not argv or argv[0] not in commands:
        print(f"usage: mlx-lm-mla {{{','.join(commands)}}} [options]", file=sys.stderr)
        return 2
    module = __import__(commands[argv[0]], fromlist=["main"])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
