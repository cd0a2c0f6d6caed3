"""A process that writes prompt caches into a disk tier directory, for the
crash and two-process tests: ``python disk_child.py FOLDER MODEL START COUNT
MAX_BYTES [CRASH [PID]]``. CRASH: ``fsync:N`` kills the process when its
N-th file is written but not yet renamed into place, ``replace:N`` once it
is renamed but its index row not committed. PID: the process id it reports
(``os.getpid``), as a process of a reused PID would (a container's PID 1)."""

import argparse
import os
import signal
import sys

import mlx.core as mx


def prompt(n, start):
    """Token ids of a prompt; prompts of other starts share no prefix."""
    return [start] + [3 + (start * 7 + i) % 90 for i in range(n - 1)]


def random_cache(n, layers=2, seed=0):
    from mlx_lm.models.cache import KVCache

    mx.random.seed(seed)
    out = []
    for _ in range(layers):
        c = KVCache()
        c.update_and_fetch(
            mx.random.normal((1, 2, n, 16)), mx.random.normal((1, 2, n, 16))
        )
        out.append(c)
    return out


def settings():
    from mlx_lm_mla.disk.fingerprint import cache_settings

    return cache_settings(argparse.Namespace())


def _crash_at(name, n):
    real, calls = getattr(os, name), []

    def crashing(*args):
        calls.append(1)
        if name == "replace":
            real(*args)
        if len(calls) == n:
            signal.raise_signal(signal.SIGKILL)  # this process, whatever getpid says
        if name != "replace":
            real(*args)

    setattr(os, name, crashing)


def main(folder, model, start, count, max_bytes, crash=None, pid=None):
    import mlx_lm_mla
    from mlx_lm_mla.disk.tier import DiskTier

    if pid:
        os.getpid = lambda: int(pid)
    mlx_lm_mla.install()
    tier = DiskTier(folder, int(max_bytes), settings(), min_tokens=64)
    if crash and crash != "-":
        point, _, n = crash.partition(":")
        _crash_at(point, int(n))
    for k in range(int(start), int(start) + int(count)):
        tier.store((model, None, None), prompt(300, k), random_cache(300, seed=k))
        tier.flush()
    tier.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
