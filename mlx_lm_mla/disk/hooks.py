"""The server's side of the disk tier: its two flags, the tier's life with
the server's, and the server's prompt cache (``LRUPromptCache``, the first
tier) joined to it."""

import logging
import os
import signal
import sys
import threading

from ..guards.reuse import NoStore, cache_problem

logger = logging.getLogger(__name__)

DIR, BYTES = "--prompt-cache-dir", "--prompt-cache-dir-bytes"
DEFAULT_BYTES = 10 << 30

HELP = f"""
mlx-lm-mla options (prompt caches on disk):
  {DIR} DIR
                        Also keep the server's prompt caches in DIR, written
                        in the background, restored after a restart (created
                        with mode 0700). Off by default.
  {BYTES} N
                        Bound on the size of DIR's cache files; the least
                        recently used are deleted past it. Suffixes K, M, G, T
                        (powers of 1024). Default: 10G.
"""

ACTIVE = []  # the running server's DiskTier
_flags = {}  # folder and max_bytes from the command line


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = str(text).strip().upper().removesuffix("B").removesuffix("I")
    scale = units.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in units else text
    try:
        value = int(float(number) * scale)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"{BYTES}: expected a positive size such as 4G or 500000000, got {text!r}")
    return value


def take_flags(argv):
    """``argv`` without the package's flags, and their values (folder or
    None, bytes). Raises ValueError naming a bad one."""
    rest, found = [], {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        flag, eq, value = arg.partition("=")
        if flag in (DIR, BYTES):
            if not eq:
                if i + 1 >= len(argv):
                    raise ValueError(f"{flag}: expected a value")
                value, i = argv[i + 1], i + 1
            found[flag] = value
        else:
            rest.append(arg)
        i += 1
    if BYTES in found and DIR not in found:
        raise ValueError(f"{BYTES} needs {DIR}")
    if DIR in found and not found[DIR].strip():
        raise ValueError(f"{DIR}: expected a directory, got an empty value")
    size = parse_size(found[BYTES]) if BYTES in found else DEFAULT_BYTES
    return rest, found.get(DIR), size


def with_flags(main):
    """``mlx_lm.server.main`` that takes the disk tier's flags out of the
    command line before its own parser reads it, and lists them in --help."""

    def main_(*args, **kwargs):
        from .tier import open_folder

        program = os.path.basename(sys.argv[0]) or "mlx_lm.server"
        try:
            rest, folder, size = take_flags(sys.argv[1:])
            if folder is not None and not {"-h", "--help"} & set(rest):
                folder = open_folder(folder)
        except (ValueError, OSError) as e:
            print(f"{program}: error: {e}", file=sys.stderr)
            raise SystemExit(2)
        sys.argv = [sys.argv[0], *rest]
        _flags.clear()
        if folder is not None:
            _flags.update(folder=folder, max_bytes=size)
        try:
            return main(*args, **kwargs)
        except SystemExit:
            if {"-h", "--help"} & set(rest):
                print(HELP)
            raise

    main_.mlx_lm_mla_original = main
    return main_


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # the server stops as on Ctrl-C, the tier's writes finish


def loaded_paths(key, cli_args):
    """The paths a server's model key loads. mlx-lm 0.31's server keys its
    command line's model as "default_model" (with its adapter and draft
    model); 0.32's keys hold the paths themselves."""
    if not (isinstance(key, (tuple, list)) and len(key) == 3 and key[0] == "default_model"):
        return key
    draft = getattr(cli_args, "draft_model", None) if key[2] == "default_model" else key[2]
    return (cli_args.model, key[1] or getattr(cli_args, "adapter_path", None), draft)


def with_tier(run):
    """``mlx_lm.server.run`` that opens the disk tier for the server's
    lifetime when ``--prompt-cache-dir`` is given, and on SIGTERM stops as
    on Ctrl-C so that queued writes finish."""

    def run_(host, port, model_provider, *args, **kwargs):
        from .fingerprint import cache_settings
        from .tier import DiskTier

        if not _flags:
            return run(host, port, model_provider, *args, **kwargs)
        if getattr(model_provider, "is_distributed", False):
            logger.warning("mlx-lm-mla: %s is not supported for a distributed server; prompt caches stay in RAM", DIR)
            return run(host, port, model_provider, *args, **kwargs)
        tier = DiskTier(_flags["folder"], _flags["max_bytes"], cache_settings(model_provider.cli_args),
                        paths=lambda key: loaded_paths(key, model_provider.cli_args))
        logger.info("mlx-lm-mla: prompt caches on disk in %s (up to %d bytes)", tier.folder, tier.max_bytes)
        ACTIVE.append(tier)
        main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.getsignal(signal.SIGTERM) if main_thread else None
        if previous == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _interrupt)
        try:
            return run(host, port, model_provider, *args, **kwargs)
        finally:
            ACTIVE.remove(tier)
            tier.close()
            if previous == signal.SIG_DFL:
                signal.signal(signal.SIGTERM, previous)

    run_.mlx_lm_mla_original = run
    return run_


def fetch_from_disk(original):
    """``LRUPromptCache.fetch_nearest_cache`` that restores a cache from disk
    where it covers more of the prompt than RAM's."""

    def fetch_nearest_cache(self, model, tokens):
        cache, rest = original(self, model, tokens)
        if not ACTIVE or isinstance(tokens, NoStore) or not tokens:
            return cache, rest
        have = len(tokens) - len(rest) if cache is not None else 0
        try:
            found = ACTIVE[0].restore(model, tokens, have)
        except Exception as e:  # the disk never fails a request
            logger.warning("mlx-lm-mla: could not read the prompt caches on disk: %r", e)
            found = None
        return found if found is not None else (cache, rest)

    fetch_nearest_cache.mlx_lm_mla_original = original
    return fetch_nearest_cache


def insert_to_disk(original):
    """``LRUPromptCache.insert_cache`` that also queues the cache for disk."""

    def insert_cache(self, model, tokens, prompt_cache, *args, **kwargs):
        result = original(self, model, tokens, prompt_cache, *args, **kwargs)
        if ACTIVE and not isinstance(tokens, NoStore) and cache_problem(prompt_cache, len(tokens)) is None:
            try:
                ACTIVE[0].store(model, tokens, prompt_cache)
            except Exception as e:
                logger.warning("mlx-lm-mla: could not queue a prompt cache for disk: %r", e)
        return result

    insert_cache.mlx_lm_mla_original = original
    return insert_cache
