"""The command line, ``mlx-lm-mla COMMAND`` or ``python -m mlx_lm_mla COMMAND``."""

import importlib
import sys

COMMANDS = {
    "repro": (
        "mlx_lm_mla.repro",
        "replay the reported failure: stock mlx-lm against the fix",
    ),
    "serve": ("mlx_lm_mla.serve", "run mlx_lm.server with the fix (same flags)"),
    "lmstudio": (
        "mlx_lm_mla.lmstudio",
        "install|status|uninstall the fix in LM Studio's MLX engine",
    ),
    "cache-dir": (
        "mlx_lm_mla.disk.command",
        "stats|clear DIR: the prompt caches on disk (--prompt-cache-dir)",
    ),
    "tiny-model": ("mlx_lm_mla.tiny", "write a tiny random MLA model to try it on"),
    "bench": ("mlx_lm_mla.bench", "decode speed on this device, stock against the fix"),
}


def usage():
    lines = [f"usage: mlx-lm-mla {{{','.join(COMMANDS)}}} [options]", "", "commands:"]
    lines += [f"  {name:<16}{about}" for name, (_, about) in COMMANDS.items()]
    lines += ["", "mlx-lm-mla COMMAND --help shows a command's options."]
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if not argv or argv[0] not in COMMANDS:
        problem = f"unknown command {argv[0]!r}" if argv else "no command given"
        print(usage(), file=sys.stderr)
        print(f"mlx-lm-mla: error: {problem}", file=sys.stderr)
        return 2
    name, args = argv[0], argv[1:]
    module = importlib.import_module(COMMANDS[name][0])
    # argparse names a parser that names no prog (serve's: mlx_lm.server's)
    # after sys.argv[0]: every command's usage line says "mlx-lm-mla NAME".
    sys.argv = [f"mlx-lm-mla {name}", *args]
    return module.main(args)


if __name__ == "__main__":
    sys.exit(main())
