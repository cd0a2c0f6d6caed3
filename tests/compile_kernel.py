"""Compiles each variant of the CUDA decode kernel and of the kernel that
combines its blocks with nvcc, as MLX's CUDA backend would build them, for
Ampere and Hopper; fails on any error, a spilled register, or a decode variant
whose PTX stages no rows by 16-byte ``cp.async`` copies. Prints each variant's
registers, spills, shared memory and copies. `.ci/run` runs it where nvcc is
installed (no GPU needed):

    python tests/compile_kernel.py
"""

import re
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
from cuda_emulator import Emulator

from mlx_lm_mla import decode_cuda
from mlx_lm_mla.cache import quantize_latent

ARCHS = ("sm_80", "sm_90")


def variants():
    """(name, launch) for each kind of step: exact latents of each dtype,
    quantized ones of each width, masks of each kind, few heads and many; and
    tile and ring sizes other than the default, as kernel_tiles.py runs."""
    from mlx_lm.models.cache import KVCache

    def exact(dtype, heads=20, mask=None, **sizes):
        q = mx.zeros((1, heads, 1, 512), dtype)
        x = mx.zeros((1, 1, 40, 512), dtype)
        return decode_cuda.prepare(q, x, 0.1, mask, sms=132, **sizes)

    def packed(bits, dtype=mx.bfloat16, **sizes):
        cache = KVCache()
        cache.update_and_fetch(
            mx.zeros((1, 1, 40, 512), dtype), mx.zeros((1, 1, 40, 64), dtype)
        )
        cache = quantize_latent(cache, 64, bits)
        x, _ = cache.update_and_fetch(
            mx.zeros((1, 1, 1, 512), dtype), mx.zeros((1, 1, 1, 64), dtype)
        )
        q = mx.zeros((1, 128, 1, 512), dtype)
        mask = mx.zeros((1, 128, 1, 41), dtype)
        packed = cache.latent_bytes(x)
        return decode_cuda.prepare(q, x, 0.1, mask, packed, sms=132, **sizes)

    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        yield f"exact {dtype}", exact(dtype)
    yield "exact, additive mask", exact(mx.bfloat16, mask=mx.zeros((1, 20, 1, 40)))
    yield "exact, boolean mask", exact(mx.bfloat16, mask=mx.zeros((1, 1, 1, 40)) > 0)
    for bits in (8, 4, 2):
        yield f"{bits}-bit, 128 heads", packed(bits)
    yield "4-bit, float16 scales", packed(4, mx.float16)
    yield "4-bit, tile 8, ring 2", packed(4, tile=8, stages=2)
    yield "exact bfloat16, tile 32, ring 3", exact(mx.bfloat16, tile=32, stages=3)
    o, ml = mx.zeros((1, 20, 3, 512)), mx.zeros((1, 20, 3, 2))
    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        yield f"combine to {dtype}", decode_cuda.prepare_combine(o, ml, dtype)


def sixteen_byte_moves(source, arch):
    """16-byte global loads (``ld.global.v4`` of 32-bit words) and 16-byte
    ``cp.async`` copies from global to shared memory in the PTX."""
    ptx = subprocess.run(
        ["nvcc", f"-arch={arch}", "-ptx", "-o", "-", str(source)],
        capture_output=True,
        text=True,
    ).stdout
    loads = len(re.findall(r"ld\.global(?:\.nc)?\.v4\.[ub]32", ptx))
    copies = len(re.findall(r"cp\.async\.cg\.shared\.global[^;]*, 16;", ptx))
    return loads, copies


def main():
    with tempfile.TemporaryDirectory(prefix="mla-kernel-") as folder:
        return compile_all(Path(folder))


def compile_all(folder):
    decode = Emulator(
        decode_cuda.INPUTS,
        decode_cuda.OUTPUTS,
        decode_cuda.SOURCE,
        decode_cuda.HEADER,
        folder=folder,
    )
    combine = Emulator(
        decode_cuda.COMBINE_INPUTS,
        decode_cuda.COMBINE_OUTPUTS,
        decode_cuda.COMBINE,
        folder=folder,
    )
    failed = 0
    for i, (name, launch) in enumerate(variants()):
        kernel = combine if name.startswith("combine") else decode
        source = kernel.cuda_source(
            [a.dtype for a in launch["inputs"]],
            launch["output_dtypes"],
            launch["template"],
        )
        path = folder / f"variant{i}.cu"
        path.write_text(source)
        for arch in ARCHS:
            out = subprocess.run(
                ["nvcc", f"-arch={arch}", "-cubin", "-Xptxas", "-v"]
                + ["-o", str(path.with_suffix(f".{arch}.cubin")), str(path)],
                capture_output=True,
                text=True,
            )
            registers = re.findall(r"Used (\d+) registers", out.stderr)
            spills = re.findall(r"(\d+) bytes spill stores", out.stderr)
            ok = out.returncode == 0 and spills and all(s == "0" for s in spills)
            loads, copies = sixteen_byte_moves(path, arch) if ok else (0, 0)
            # Every decode variant stages aligned rows by 16-byte async copies.
            ok = ok and (copies > 0 or name.startswith("combine"))
            print(
                f"{'ok' if ok else 'FAILED':6} {arch} {name}: "
                f"{registers[0] if registers else '?'} registers, "
                f"{max(map(int, spills)) if spills else '?'} bytes spilled, "
                f"{launch.get('shared_memory', 0)} bytes shared, "
                f"{copies} cp.async, {loads} 16-byte loads"
            )
            if not ok:
                print(out.stderr[-3000:])
                failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
