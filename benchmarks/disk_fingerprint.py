"""What knowing a model by content costs the disk tier: ``model_digest`` (the
safetensors header of every weight file, its first and last MiB and 8 pieces
of 64 KiB between, config and tokenizer whole) of a model folder of a given
size, as a server computes it on the first request of a model.

The weight files are safetensors shards of ``--shard-gib`` each with a real
header of a few hundred tensors. "sparse": the shards are sparse files (only
their headers written), so the figure is the digest's own work (system calls
and hashing) at the model's size, whatever the disk. "real": shards filled
with random bytes, each timed cold (its pages dropped from the page cache
with ``posix_fadvise(DONTNEED)`` after an fsync) and warm (read again), so
the figure includes the disk's seeks. Median of ``--repeat`` runs.

    python benchmarks/disk_fingerprint.py            # ~1 min here (4 GiB written)
    python benchmarks/disk_fingerprint.py --real-gib 0
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _serving_common as sc

NAME = "disk_fingerprint"
TARGET_MS = 500  # a 20 GB model, cold (the issue: cheap at start)


def write_model(folder, total_gib, shard_gib, real):
    """A model folder of ``total_gib`` GiB of safetensors shards."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "glm4_moe_lite"}))
    (folder / "tokenizer.json").write_text(json.dumps({"vocab": list(range(50000))}))
    shards = max(1, round(total_gib / shard_gib))
    size = int(total_gib * (1 << 30)) // shards
    for k in range(shards):
        tensors, offset, n = {}, 0, 400
        for i in range(n):  # a few hundred tensors, as a real shard holds
            end = (size - 65536) * (i + 1) // n
            tensors[f"model.layers.{i}.weight"] = {
                "dtype": "U8",
                "shape": [end - offset],
                "data_offsets": [offset, end],
            }
            offset = end
        header = json.dumps(tensors).encode()
        header += b" " * (-(len(header) + 8) % 8)
        path = folder / f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        with open(path, "wb") as f:
            f.write(len(header).to_bytes(8, "little") + header)
            if real:
                chunk = os.urandom(64 << 20)
                while f.tell() < size:
                    f.write(chunk[: size - f.tell()])
                f.flush()
                os.fsync(f.fileno())
            else:
                f.truncate(size)
    return folder


def drop_cache(folder):
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed_digest(folder, cold):
    from mlx_lm_mla.disk.fingerprint import model_digest

    if cold:
        drop_cache(folder)
    reads = []
    pread = os.pread

    def counted(fd, n, at):
        data = pread(fd, n, at)
        reads.append(len(data))
        return data

    os.pread = counted
    try:
        start = time.perf_counter()
        model_digest((str(folder), None, None))
        seconds = time.perf_counter() - start
    finally:
        os.pread = pread
    return seconds, sum(reads)


def measure(tmp, label, total_gib, shard_gib, real, repeat):
    folder = write_model(Path(tmp) / label, total_gib, shard_gib, real)
    shards = len(list(folder.glob("*.safetensors")))
    runs = {"cold": [], "warm": []}
    read = 0
    for _ in range(repeat):
        for kind in ("cold", "warm") if real else ("warm",):
            seconds, read = timed_digest(folder, kind == "cold")
            runs[kind].append(seconds * 1000)
        print(f"  {label}: {runs}", file=sys.stderr)
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()
    return {
        "files": label,
        "gib": total_gib,
        "shards": shards,
        "read_mib": read / (1 << 20),
        "cold_ms": statistics.median(runs["cold"]) if runs["cold"] else None,
        "warm_ms": statistics.median(runs["warm"]),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=20, help="the sparse model's size")
    p.add_argument("--real-gib", type=float, default=4, help="0: no real files")
    p.add_argument("--shard-gib", type=float, default=4)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dir", default=None, help="where the files go (a real disk)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    started, vers = time.perf_counter(), sc.versions()
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        rows.append(
            measure(tmp, "sparse", args.gib, args.shard_gib, False, args.repeat)
        )
        if args.real_gib:
            rows.append(
                measure(tmp, "real", args.real_gib, args.shard_gib, True, args.repeat)
            )
    sc.table(
        [
            [
                r["files"],
                f"{r['gib']:g}",
                r["shards"],
                f"{r['read_mib']:.1f}",
                "-" if r["cold_ms"] is None else f"{r['cold_ms']:.0f}",
                f"{r['warm_ms']:.0f}",
            ]
            for r in rows
        ],
        ["files", "GiB", "shards", "MiB read", "cold ms", "warm ms"],
    )
    worst = max(max(r["cold_ms"] or 0, r["warm_ms"]) for r in rows)
    print(
        f"\ntarget: the digest of a model at most {TARGET_MS} ms: "
        f"{'MET' if worst <= TARGET_MS else 'MISSED'} ({worst:.0f} ms)"
    )
    path = sc.write_json(args.json, NAME, args, {"rows": rows}, started, vers)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
