"""mlx-lm's server, same flags, with the fix on even where the start-up hook is off."""

import sys


def main(argv=None):
    from .patches import install

    install()
    import mlx_lm.server

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    return mlx_lm.server.main()


if __name__ == "__main__":
    main()
