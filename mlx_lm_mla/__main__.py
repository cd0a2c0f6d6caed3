"""Command line: ``mlx-lm-mla repro`` replays the reported failure;
``mlx-lm-mla serve [mlx_lm.server flags]`` runs the server with the fix;
``mlx-lm-mla upstream-patch DIR`` writes the upstream form of the fix into
an mlx-lm source tree; ``mlx-lm-mla lmstudio install|status|uninstall``
puts the fix into LM Studio's MLX engine. Also ``python -m mlx_lm_mla ...``."""

import sys


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    commands = {
        "repro": "mlx_lm_mla.repro",
        "serve": "mlx_lm_mla.server",
        "upstream-patch": "mlx_lm_mla.upstream",
        "lmstudio": "mlx_lm_mla.lmstudio",
    }
    if not argv or argv[0] not in commands:
        print(f"usage: mlx-lm-mla {{{','.join(commands)}}} [options]", file=sys.stderr)
        return 2
    module = __import__(commands[argv[0]], fromlist=["main"])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
