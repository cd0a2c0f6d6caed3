"""The server's side of the disk tier: its flags on mlx-lm's own parser, its life
with the server's, and ``LRUPromptCache`` (the first tier) joined to it."""

import argparse
import logging
import signal
import sqlite3
import threading
import types
import weakref
from fractions import Fraction

from ..guards import state as served
from ..guards.reuse import NoStore, cache_problem, stored_key
from .folder import SUBFOLDER, NotOurs, Unusable, open_folder
from .index import BLOCK
from .tier import DEFAULT_MIN_TOKENS

logger = logging.getLogger(__name__)

DIR, BYTES, MIN_TOKENS = (
    "--prompt-cache-dir",
    "--prompt-cache-dir-bytes",
    "--prompt-cache-dir-min-tokens",
)
DEFAULT_BYTES = 10 << 30
_LARGEST = (1 << 63) - 1  # SQLite's integers


def parse_size(text):
    """Bytes from ``500000000``, ``4G``, ``1.5GiB``... (powers of 1024)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    raw = str(text).strip().upper().removesuffix("B").removesuffix("I")
    scale = units.get(raw[-1:], 1)
    number = raw[:-1] if raw[-1:] in units else raw
    whole, _, part = number.partition(".")
    digits = whole + part
    value = (
        int(Fraction(number) * scale) if digits.isascii() and digits.isdigit() else 0
    )
    if not 0 < value <= _LARGEST:
        raise argparse.ArgumentTypeError(
            f"expected a positive size such as 4G or 500000000, at most "
            f"{_LARGEST}, got {text!r}"
        )
    return value


def parse_min_tokens(text):
    value = (
        int(text) if str(text).strip().isascii() and str(text).strip().isdigit() else 0
    )
    if value < BLOCK:
        raise argparse.ArgumentTypeError(
            f"expected a whole number of tokens, at least {BLOCK}, got {text!r}"
        )
    return value


def parse_folder(text):
    if not str(text).strip():
        raise argparse.ArgumentTypeError("expected a directory, got an empty value")
    return text


def add_flags(parser):
    group = parser.add_argument_group("prompt caches on disk (mlx-lm-mla)")
    group.add_argument(
        DIR,
        metavar="DIR",
        type=parse_folder,
        default=None,
        help=f"Also keep the server's prompt caches on disk, in DIR/{SUBFOLDER} (made "
        "with mode 0700 and a marker file; nothing else in DIR is touched), written in "
        "the background and restored after a restart. Off by default.",
    )
    group.add_argument(
        BYTES,
        metavar="N",
        type=parse_size,
        default=None,
        help="Bound on the size of the tier's cache files, temporary files included; "
        "the least recently used are deleted past it, at start too. Suffixes K, M, "
        "G, T (powers of 1024). Default: 10G.",
    )
    group.add_argument(
        MIN_TOKENS,
        metavar="N",
        type=parse_min_tokens,
        default=None,
        help="Read a prompt cache from disk only where it covers at least N more "
        f"tokens of the prompt than RAM's, and keep on disk only caches of N tokens "
        f"or more (at least {BLOCK}). Default: {DEFAULT_MIN_TOKENS}.",
    )


def check_flags(parser, args):
    """The flags fit together, and the tier's folder is there (made now) and ours."""
    if args.prompt_cache_dir is None:
        for flag, value in (
            (BYTES, args.prompt_cache_dir_bytes),
            (MIN_TOKENS, args.prompt_cache_dir_min_tokens),
        ):
            if value is not None:
                parser.error(f"argument {flag}: needs {DIR}")
        return
    try:
        open_folder(args.prompt_cache_dir)
    except Unusable:
        pass  # the server starts; opening the tier says why it is off
    except NotOurs as e:
        parser.error(f"argument {DIR}: {e}")


class ServerParser(argparse.ArgumentParser):
    """``mlx_lm.server.main``'s parser, the tier's flags added as its own."""

    def _with_flags(self):
        if not getattr(self, "_mlx_lm_mla_disk", False):
            self._mlx_lm_mla_disk = True
            add_flags(self)

    def parse_known_args(self, args=None, namespace=None):
        self._with_flags()
        return super().parse_known_args(args, namespace)

    def parse_args(self, args=None, namespace=None):
        self._with_flags()
        parsed = super().parse_args(args, namespace)
        check_flags(self, parsed)
        return parsed


def argparse_with(original, parser):
    """A copy of ``mlx_lm.server``'s ``argparse`` whose ``ArgumentParser`` is
    ``parser``: main() builds its parser inline from this module global and
    parses at once, so mlx-lm has no other hook for flags (docs/design.md)."""
    module = types.ModuleType(original.__name__, original.__doc__)
    module.__dict__.update(vars(original))
    module.ArgumentParser = parser
    module.mlx_lm_mla_original = original
    return module


def server_argparse(original):
    """``mlx_lm.server``'s ``argparse``, whose parser takes the tier's flags."""
    return argparse_with(original, ServerParser)


def loaded_paths(key, cli_args):
    """The paths a server's model key loads: 0.31 keys the command line's model as
    "default_model", 0.32 by its paths."""
    if not (
        isinstance(key, (tuple, list)) and len(key) == 3 and key[0] == "default_model"
    ):
        return key
    draft = cli_args.draft_model if key[2] == "default_model" else key[2]
    return (cli_args.model, key[1] or cli_args.adapter_path, draft)


# A server's ModelProvider: the fingerprint of the model it last loaded.
_LOADED = weakref.WeakKeyDictionary()


def fingerprinted_load(original):
    """``ModelProvider.load`` that, where it loads weights for the disk tier,
    fingerprints their files at once: a cache is labelled with the files its
    weights came from, not with what they are by the first request."""

    def load(self, model_path, adapter_path=None, draft_model_path=None):
        before = self.model
        result = original(self, model_path, adapter_path, draft_model_path)
        cli_args = self.cli_args
        if (
            self.model is not before
            and getattr(cli_args, "prompt_cache_dir", None) is not None
            and not self.is_distributed
        ):
            from .fingerprint import Fingerprint

            key = self.model_key
            try:
                _LOADED[self] = Fingerprint(key, loaded_paths(key, cli_args))
            except Exception as e:  # the disk never fails a load
                _LOADED.pop(self, None)
                logger.warning(
                    "mlx-lm-mla: could not fingerprint the files of model %s "
                    "(%r); its prompt caches stay in RAM",
                    key,
                    e,
                )
        return result

    load.mlx_lm_mla_original = original
    return load


def open_tier(cli_args, provider=None):
    """The tier the command line asks for, or None (with a warning) if it cannot
    be opened; with ``provider``, models are known by their fingerprint taken
    when it loaded them."""
    from .fingerprint import cache_settings
    from .tier import DiskTier

    size = getattr(cli_args, "prompt_cache_dir_bytes", None) or DEFAULT_BYTES
    least = getattr(cli_args, "prompt_cache_dir_min_tokens", None) or DEFAULT_MIN_TOKENS
    try:
        tier = DiskTier(
            cli_args.prompt_cache_dir,
            size,
            cache_settings(cli_args),
            least,
            paths=lambda key: loaded_paths(key, cli_args),
            loaded=None if provider is None else lambda: _LOADED.get(provider),
        )
    except (NotOurs, OSError, sqlite3.Error) as e:
        logger.warning(
            "mlx-lm-mla: prompt caches on disk are off, the server keeps "
            "them in RAM: %s",
            e,
        )
        return None
    logger.info(
        "mlx-lm-mla: prompt caches on disk in %s (up to %d bytes)",
        tier.folder,
        tier.max_bytes,
    )
    return tier


class _SigtermStop:
    """SIGTERM's handler while the tier is open, in place of the default action.
    It stops the server as Ctrl-C does (upstream then ends its step, so the
    cache of an answer just given is queued), but gives that at most ``GRACE``
    seconds: upstream's step can be a whole prefill. Then the queued writes are
    committed and the signal goes to the handler it replaced (the process ends
    as without the tier); a second SIGTERM goes there at once."""

    GRACE = 0.2

    def __init__(self, tier):
        self.tier = tier
        self.received = False
        self._ending = threading.Lock()
        self.previous = signal.signal(signal.SIGTERM, self)

    def __call__(self, signum, frame):
        signal.signal(signal.SIGTERM, self.previous)
        self.received = True
        timer = threading.Timer(self.GRACE, self.end)  # upstream's step may be long
        timer.daemon = True
        timer.start()
        raise KeyboardInterrupt

    def end(self):
        """Commits the queued writes, then hands SIGTERM on (from either thread:
        the first to come ends the process)."""
        with self._ending:
            try:
                self.tier.close()
                logger.info(
                    "mlx-lm-mla: %s on SIGTERM",
                    "prompt caches on disk committed; stopping"
                    if self.tier.closed
                    else "stopping before the queued prompt caches were written",
                )
            finally:  # the process ends whatever the close did
                signal.raise_signal(signal.SIGTERM)

    def remove(self):
        """Puts the replaced handler back, where ours is still the one set."""
        if signal.getsignal(signal.SIGTERM) is self:
            signal.signal(signal.SIGTERM, self.previous)


def with_tier(run):
    """``mlx_lm.server.run`` with the disk tier open while it runs. On SIGTERM the
    queued writes are committed, then SIGTERM ends the process as without the tier
    (skipping the interpreter's exit, where MLX's threads can abort it)."""

    def run_(host, port, model_provider, *args, **kwargs):
        # --prompt-cache-dir: ModelProvider.cli_args -> open_tier -> the server's
        # state -> its loop's LRUPromptCache hooks (fetch/insert below).
        cli_args = model_provider.cli_args
        if getattr(cli_args, "prompt_cache_dir", None) is None:
            return run(host, port, model_provider, *args, **kwargs)
        if model_provider.is_distributed:
            logger.warning(
                "mlx-lm-mla: %s is not supported for a distributed server; "
                "prompt caches stay in RAM",
                DIR,
            )
            return run(host, port, model_provider, *args, **kwargs)
        tier = open_tier(cli_args, model_provider)
        if tier is None:
            return run(host, port, model_provider, *args, **kwargs)
        server = served.of(model_provider)
        server.tier = tier
        stop = (
            _SigtermStop(tier)
            if threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
            else None
        )
        try:
            return run(host, port, model_provider, *args, **kwargs)
        except KeyboardInterrupt:
            if not (stop and stop.received):
                raise  # Ctrl-C outside upstream's loop: as upstream
        finally:
            if stop:
                stop.remove()
            server.tier = None
            if stop and stop.received:
                stop.end()
            tier.close()

    run_.mlx_lm_mla_original = run
    return run_


def _tier():
    # The disk tier of the server whose generation thread this is, or None.
    server = served.current()
    return server.tier if server is not None else None


def fetch_from_disk(original):
    """``LRUPromptCache.fetch_nearest_cache``, from disk where it covers more: the
    tier of the server whose generation loop calls it."""

    def fetch_nearest_cache(self, model, tokens):
        cache, rest = original(self, model, tokens)
        tier = _tier()
        if tier is None or isinstance(tokens, NoStore) or not tokens:
            return cache, rest
        have = len(tokens) - len(rest) if cache is not None else 0
        try:
            found = tier.restore(model, tokens, have)
        except Exception as e:  # the disk never fails a request
            logger.warning(
                "mlx-lm-mla: could not read the prompt caches on disk: %r", e
            )
            found = None
        return found if found is not None else (cache, rest)

    fetch_nearest_cache.mlx_lm_mla_original = original
    return fetch_nearest_cache


def insert_to_disk(original):
    """``LRUPromptCache.insert_cache`` that also queues the cache for disk."""

    def insert_cache(self, model, tokens, prompt_cache, *args, **kwargs):
        result = original(self, model, tokens, prompt_cache, *args, **kwargs)
        tier = _tier()
        if tier is None or isinstance(tokens, NoStore):
            return result
        tokens, main = stored_key(model, tokens, prompt_cache)  # as RAM stores it
        if cache_problem(prompt_cache, len(tokens), main) is None:
            try:
                tier.store(model, tokens, prompt_cache)
            except Exception as e:
                logger.warning(
                    "mlx-lm-mla: could not queue a prompt cache for disk: %r", e
                )
        return result

    insert_cache.mlx_lm_mla_original = original
    return insert_cache
