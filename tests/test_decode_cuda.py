"""The CUDA decode kernel gives the portable path's attention (its reference):
exact and quantized latents, masks, heads and positions split across blocks;
a decode step through it gives stock's logits, and a kernel that fails or
disagrees is not used. On MLX's CUDA backend the kernel runs as built; on
other machines its source runs on the CPU (tests/cuda_emulator.py)."""

import argparse
import ctypes
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from cuda_emulator import Emulator
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import KVCache

import mlx_lm_mla
from mlx_lm_mla import decode, decode_cuda, tiny
from mlx_lm_mla.cache import quantize_latent

from conftest import step_logits

ON_CUDA = decode_cuda.available()
ROOT = Path(__file__).resolve().parents[1]
TOKENS = [(5 * i + 7) % 190 + 5 for i in range(140)]


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    return Emulator(
        decode_cuda.INPUTS,
        decode_cuda.OUTPUTS,
        decode_cuda.SOURCE,
        decode_cuda.HEADER,
        folder=tmp_path_factory.mktemp("kernels"),
    )


@pytest.fixture(scope="module")
def combine(tmp_path_factory):
    """``decode_cuda.combine``: as built on CUDA, else its source emulated."""
    if ON_CUDA:
        return decode_cuda.combine
    emulated = Emulator(
        decode_cuda.COMBINE_INPUTS,
        decode_cuda.COMBINE_OUTPUTS,
        decode_cuda.COMBINE,
        folder=tmp_path_factory.mktemp("combine"),
        ensure_row_contiguous=True,
    )
    return lambda o, ml, dtype: emulated(**decode_cuda.prepare_combine(o, ml, dtype))[0]


@pytest.fixture
def kernel(emulator, combine, monkeypatch):
    """``decode_cuda.latent_attention``: as built on CUDA, else its source
    emulated, on a GPU of 4 SMs so a tiny step still spans several blocks,
    and kept to the shared memory it asks for."""
    monkeypatch.setattr(decode_cuda, "sm_count", lambda: 4)
    if ON_CUDA:
        return decode_cuda.latent_attention

    def run(queries, latent, scale, mask=None, packed=None, **sizes):
        launch = decode_cuda.prepare(queries, latent, scale, mask, packed, **sizes)
        if launch is None:
            return None
        o, ml = emulator(**launch)
        return combine(o, ml, queries.dtype)

    return run


def queries(B=2, H=20, D=512, dtype=mx.float32, seed=1):
    return mx.random.normal((B, H, 1, D), key=mx.random.key(seed)).astype(dtype)


def latent(B=2, L=150, D=512, dtype=mx.float32, seed=2):
    return mx.random.normal((B, 1, L, D), key=mx.random.key(seed)).astype(dtype)


def packed_cache(bits, B=2, L=150, D=512, group_size=64, dtype=mx.bfloat16):
    """A quantized latent cache of L positions and the latent it last fetched."""
    cache = KVCache()
    rope = mx.zeros((B, 1, L, 64), dtype)
    cache.update_and_fetch(latent(B, L - 1, D, dtype), rope[:, :, 1:])
    cache = quantize_latent(cache, group_size, bits)
    fetched, _ = cache.update_and_fetch(latent(B, 1, D, dtype, seed=3), rope[:, :, :1])
    return cache, fetched


def close(got, expected, dtype):
    tolerance = 1e-5 if dtype == mx.float32 else 2e-2
    return mx.allclose(got, expected, atol=tolerance, rtol=tolerance).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_the_kernel_attends_an_exact_latent_as_the_reference(kernel, dtype):
    q, x = queries(dtype=dtype), latent(dtype=dtype)
    got = kernel(q, x, 0.05)
    assert got.dtype == dtype and got.shape == q.shape
    assert close(got, decode.reference_attention(q, x, 0.05), dtype)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_the_kernel_reads_a_quantized_latent_from_its_bytes(kernel, bits):
    cache, x = packed_cache(bits)
    q = queries(dtype=mx.bfloat16)
    expected = decode.reference_attention(q, x, 0.05, None, cache.latent_reader(x))
    assert close(kernel(q, x, 0.05, None, cache.latent_bytes(x)), expected, x.dtype)


@pytest.mark.skipif(ON_CUDA, reason="counts the emulator's copies")
@pytest.mark.parametrize("bits, row_bytes", [(8, 512), (4, 256), (2, 128)])
def test_aligned_quantized_rows_are_staged_by_async_16_byte_copies(
    kernel, emulator, bits, row_bytes
):
    cache, x = packed_cache(bits)
    q = queries(dtype=mx.bfloat16)
    expected = decode.reference_attention(q, x, 0.05, None, cache.latent_reader(x))
    assert close(kernel(q, x, 0.05, None, cache.latent_bytes(x)), expected, x.dtype)
    # Each row of both sequences once, for the one group of 20 heads: its
    # bytes, and the 32 of its scales and biases (after 128 of RoPE key).
    assert emulator.async_copies == 2 * 150 * (row_bytes // 16 + 32 // 16)
    assert emulator.vector_loads == 0


@pytest.mark.skipif(ON_CUDA, reason="counts the emulator's copies")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_aligned_exact_rows_are_staged_by_async_16_byte_copies(kernel, emulator, dtype):
    q, x = queries(dtype=dtype), latent(dtype=dtype)
    assert close(kernel(q, x, 0.05), decode.reference_attention(q, x, 0.05), dtype)
    assert emulator.async_copies == 2 * 150 * 512 * dtype.size // 16


def test_unaligned_exact_rows_are_read_a_value_at_a_time(kernel, emulator, monkeypatch):
    monkeypatch.setattr(emulator, "unaligned", True)
    q, x = queries(dtype=mx.bfloat16), latent(dtype=mx.bfloat16)
    expected = decode.reference_attention(q, x, 0.05)
    assert close(kernel(q, x, 0.05), expected, mx.bfloat16)
    assert ON_CUDA or emulator.async_copies == 0


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_unaligned_quantized_rows_are_read_a_byte_at_a_time(
    kernel, emulator, monkeypatch, bits
):
    cache, x = packed_cache(bits)
    keys, values, fmt = cache.latent_bytes(x)
    # Rows an odd number of bytes apart, from an odd offset.
    wider = mx.pad(keys, [(0, 0), (0, 0), (0, 0), (1, 0)])[..., 1:]
    monkeypatch.setattr(emulator, "unaligned", True)
    q = queries(dtype=mx.bfloat16)
    expected = decode.reference_attention(q, x, 0.05, None, cache.latent_reader(x))
    assert close(kernel(q, x, 0.05, None, (wider, values, fmt)), expected, x.dtype)
    assert ON_CUDA or emulator.vector_loads == emulator.async_copies == 0


# Small and large tiles, the shortest and longest rings and none, exact and
# packed rows (every pair costs an emulated step: a few of them).
@pytest.mark.parametrize(
    "bits, tile, stages", [(4, 8, 4), (4, 32, 2), (0, 32, 3), (0, 16, 1)]
)
def test_each_tile_and_ring_size_a_sweep_may_measure_attends_as_the_reference(
    kernel, tile, stages, bits
):
    # 300 positions over two blocks a sequence: every ring wraps.
    cache, x = packed_cache(bits or 8, L=300)
    packed = cache.latent_bytes(x) if bits else None
    read = cache.latent_reader(x) if bits else None
    q = queries(dtype=mx.bfloat16)
    mask = 3 * mx.random.normal((2, 20, 1, 300), key=mx.random.key(4))
    expected = decode.reference_attention(q, x, 0.05, mask, read)
    got = kernel(q, x, 0.05, mask, packed, tile=tile, stages=stages)
    assert close(got, expected, mx.bfloat16)
    launch = decode_cuda.prepare(q, x, 0.05, mask, packed, tile=tile, stages=stages)
    assert ("TILE", tile) in launch["template"]
    assert ("STAGES", stages) in launch["template"]


@pytest.fixture
def kernel_tiles(monkeypatch):
    """``benchmarks/kernel_tiles.py``, its kernel a float32 fold that is off
    by one where the tile is ``kernel_tiles.wrong_tile``."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import kernel_tiles

    def fake(q, x, scale, mask=None, packed=None, tile=decode_cuda.TILE, stages=None):
        out = decode.latent_attention(q.astype(mx.float32), x, scale, mask)
        return (out + (tile == kernel_tiles.wrong_tile)).astype(q.dtype)

    monkeypatch.setattr(decode_cuda, "latent_attention", fake)
    monkeypatch.setattr(kernel_tiles, "wrong_tile", None, raising=False)
    monkeypatch.setattr(kernel_tiles, "_AGREES", {})
    return kernel_tiles


SWEEP = argparse.Namespace(tiles=[8, 32], stages=[2], repeats=2, calls=1)


def test_the_tile_sweep_times_each_size_the_gpus_shared_memory_holds(
    kernel_tiles, monkeypatch
):
    # 64 KB a block: 4-bit rows at 32 a tile take 87 KB; 16 (4 in the ring,
    # the default) 53 KB, 8 (2) 22 KB.
    gpu = decode_cuda.GPU(4, 64 * 1024, 1e11)
    monkeypatch.setattr(decode_cuda, "gpu", lambda: gpu)
    rows = kernel_tiles.measure("4-bit", 300, 1, SWEEP, gpu)
    sizes = [(r["path"], r["tile"], r["ring"], r["default"]) for r in rows]
    assert sizes == [
        ("portable", None, None, False),
        ("kernel", 16, 4, True),
        ("kernel", 8, 2, False),
    ]
    for r in rows:
        assert len(r["samples"]) == 2
        # 300 rows of 256 packed bytes, 32 of scales and biases and 20 heads'
        # bf16 scores a step.
        moved = r["gb_per_s"] * 1e9 * r["us"] / 1e6
        assert moved == pytest.approx(300 * (288 + 40))
        assert r["peak_percent"] == pytest.approx(100 * r["gb_per_s"] * 1e9 / 1e11)
    assert rows[1]["x_default"] == 1.0 and rows[1]["shared_kb"] * 1024 <= 64 * 1024


def test_the_tile_sweep_leaves_out_a_size_that_fails_the_kernels_check(
    kernel_tiles, monkeypatch, capsys
):
    kernel_tiles.wrong_tile = 8
    gpu = decode_cuda.GPU(4, 227 * 1024, None)
    monkeypatch.setattr(decode_cuda, "gpu", lambda: gpu)
    rows = kernel_tiles.measure("bf16", 300, 1, SWEEP, gpu)
    assert [(r["tile"], r["ring"]) for r in rows] == [(None, None), (16, 2), (32, 2)]
    assert "tile 8, ring 2 fails the kernel's check" in capsys.readouterr().out
    assert all(r["peak_percent"] is None for r in rows)


@pytest.mark.skipif(ON_CUDA, reason="refuses where there is no CUDA backend")
def test_the_tile_sweep_refuses_to_run_without_mlxs_cuda_backend():
    out = subprocess.run(
        [sys.executable, "benchmarks/kernel_tiles.py"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert out.returncode == 1
    assert "it needs MLX's CUDA backend" in out.stderr


def gpu_checks(tmp_path, parts):
    env = dict(os.environ, PYTHON=sys.executable, PARTS=parts, OUT=str(tmp_path))
    return subprocess.run(
        ["bash", "benchmarks/gpu_checks.sh"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(env, QUICK="1"),
        timeout=300,
    )


@pytest.mark.skipif(ON_CUDA, reason="the sweep refuses where there is no CUDA")
def test_gpu_checks_runs_the_parts_named_and_exits_with_the_worst(tmp_path):
    out = gpu_checks(tmp_path, "sweep")
    assert out.returncode == 1
    assert (tmp_path / "parts.txt").read_text().startswith("part sweep: exit 1 in ")
    assert "it needs MLX's CUDA backend" in out.stdout  # the failed part's errors
    assert not (tmp_path / "tests.txt").exists()


def test_gpu_checks_refuses_a_part_it_does_not_have(tmp_path):
    out = gpu_checks(tmp_path, "sweep,speed")
    assert out.returncode == 2 and "no part 'sweep,speed'" in out.stdout


def test_an_additive_mask_is_added_to_each_heads_scores(kernel):
    q, x = queries(), latent()
    mask = 3 * mx.random.normal((2, 20, 1, 150), key=mx.random.key(4))
    expected = decode.reference_attention(q, x, 0.05, mask)
    assert close(kernel(q, x, 0.05, mask), expected, mx.float32)
    assert not close(kernel(q, x, 0.05), expected, mx.float32)


def test_a_boolean_mask_leaves_the_padding_of_a_row_out(kernel):
    q, x = queries(), latent()
    mask = mx.array([[i >= 40 for i in range(150)], [True] * 150])[:, None, None]
    got = kernel(q, x, 0.05, mask)
    assert close(got, decode.reference_attention(q, x, 0.05, mask), mx.float32)
    alone = decode.reference_attention(q[:1], x[:1, :, 40:], 0.05)
    assert close(got[:1], alone, mx.float32)


def test_heads_beyond_a_blocks_share_go_to_other_blocks(kernel):
    q, x = queries(H=64, D=128), latent(D=128)
    assert decode_cuda.heads_per_block(64) == 32
    assert close(kernel(q, x, 0.1), decode.reference_attention(q, x, 0.1), mx.float32)


@pytest.mark.parametrize("sms, splits", [(1, 1), (3, 3), (5, 5), (64, 10)])
def test_positions_split_across_blocks_combine_as_one_softmax(
    kernel, monkeypatch, sms, splits
):
    # 150 positions (10 tiles): one block of every tile, a few blocks, a block
    # a tile, the last partial.
    monkeypatch.setattr(decode_cuda, "sm_count", lambda: sms)
    q, x = queries(B=1), latent(B=1)
    launch = decode_cuda.prepare(q, x, 0.05)
    assert launch["grid"][0] // launch["threadgroup"][0] == splits
    assert close(kernel(q, x, 0.05), decode.reference_attention(q, x, 0.05), mx.float32)


def blocks(launch):
    grid, block = launch["grid"], launch["threadgroup"]
    return grid[0] // block[0] * grid[1] * grid[2]


@pytest.mark.parametrize("sms", [132, 108, 78])
@pytest.mark.parametrize("B, H", [(1, 20), (8, 20), (1, 128), (3, 64)])
def test_a_long_step_fills_one_wave_of_the_gpus_sms(sms, B, H):
    q, x = queries(B=B, H=H, D=32), latent(B=B, L=16 * 4096, D=32)
    launch = decode_cuda.prepare(q, x, 0.1, sms=sms)
    units = B * math.ceil(H / decode_cuda.heads_per_block(H))
    splits = launch["grid"][0] // launch["threadgroup"][0]
    # At most one block an SM, each as few tiles as one wave of them allows
    # (4096 tiles over 132 blocks: 128 blocks of 32, as long as 132 would be).
    assert blocks(launch) <= sms
    assert math.ceil(4096 / splits) == math.ceil(4096 / (sms // units))


@pytest.mark.parametrize("B, H", [(132, 20), (40, 128), (200, 20)])
def test_sequences_and_head_groups_that_fill_the_sms_take_one_split_each(B, H):
    q, x = queries(B=B, H=H, D=32), latent(B=B, L=1000, D=32)
    launch = decode_cuda.prepare(q, x, 0.1, sms=132)
    assert launch["grid"][0] // launch["threadgroup"][0] == 1
    assert launch["output_shapes"][0] == (B, H, 1, 32)


def test_a_step_is_sized_to_the_sm_count_of_the_gpu(monkeypatch):
    monkeypatch.setattr(decode_cuda, "sm_count", lambda: 132)
    q, x = queries(B=1), latent(B=1, L=16 * 1000)
    assert blocks(decode_cuda.prepare(q, x, 0.1)) == 125  # 1000 tiles, 8 each


def test_without_a_cuda_driver_the_sm_count_is_an_error_naming_it(monkeypatch):
    monkeypatch.setattr(decode_cuda, "DRIVERS", ("libcuda-absent.so.1",))
    monkeypatch.setattr(decode_cuda, "_GPU", [])
    with pytest.raises(RuntimeError, match="CUDA driver .libcuda. cannot be loaded"):
        decode_cuda.prepare(queries(), latent(), 0.1)


# The driver's calls ``decode_cuda.gpu`` makes: GPU 0 is an A100 (108 SMs,
# 163 KB of shared memory a block, 1,215 MHz over 5,120 bits), GPU 1 (at PCI
# address 0000:3b:00.0) an H100 (132, 227 KB, 2,619 MHz). ``clocks``: whether
# the driver tells the memory clock; ``counts``: the SM count.
FAKE_DRIVER = r"""
#include <string.h>
extern "C" {
int inits = 0, gpus = 1, clocks = 1, counts = 1;
int cuInit(unsigned flags) { ++inits; return flags; }
int cuDeviceGetCount(int* n) { *n = gpus; return 0; }
int cuDeviceGet(int* device, int i) { *device = i; return i < gpus ? 0 : 101; }
int cuDeviceGetByPCIBusId(int* device, const char* bus) {
  *device = 1;
  return strcmp(bus, "0000:3b:00.0") ? 101 : 0;
}
int cuDeviceGetAttribute(int* value, int attribute, int device) {
  const int h100 = device == 1;
  switch (attribute) {
    case 16: *value = h100 ? 132 : 108; return counts ? 0 : 1;
    case 97: *value = h100 ? 232448 : 166912; return 0;
    case 36: *value = h100 ? 2619000 : 1215000; return clocks ? 0 : 1;
    case 37: *value = 5120; return 0;
  }
  return 1;
}
}
"""


@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory):
    folder = tmp_path_factory.mktemp("driver")
    (folder / "driver.cpp").write_text(FAKE_DRIVER)
    lib = folder / "libcuda-fake.so"
    subprocess.run(
        ["g++", "-shared", "-fPIC", str(folder / "driver.cpp"), "-o", str(lib)],
        check=True,
    )
    return str(lib), ctypes.CDLL(str(lib))


@pytest.fixture
def driver(fake_driver, monkeypatch):
    """The fake driver as the one ``decode_cuda.gpu`` asks, afresh."""
    path, lib = fake_driver
    monkeypatch.setattr(decode_cuda, "DRIVERS", ("libcuda-absent.so.1", path))
    monkeypatch.setattr(decode_cuda, "_GPU", [])
    ctypes.c_int.in_dll(lib, "inits").value = 0
    ctypes.c_int.in_dll(lib, "gpus").value = 2
    ctypes.c_int.in_dll(lib, "clocks").value = 1
    ctypes.c_int.in_dll(lib, "counts").value = 1
    return lib


def test_the_sm_count_is_the_drivers_for_mlxs_gpu_by_its_pci_address(
    driver, monkeypatch
):
    asked = []  # the devices MLX is asked about
    info = {"pci_bus_id": "0000:3b:00.0"}
    monkeypatch.setattr(mx, "device_info", lambda d: asked.append(d) or info)
    assert decode_cuda.sm_count() == 132
    assert decode_cuda.sm_count() == 132
    assert ctypes.c_int.in_dll(driver, "inits").value == 1  # asked once
    assert asked == [mx.default_device()]


def test_without_a_pci_address_the_one_gpu_is_asked(driver, monkeypatch):
    monkeypatch.setattr(mx, "device_info", lambda d: {})
    ctypes.c_int.in_dll(driver, "gpus").value = 1
    assert decode_cuda.sm_count() == 108


def test_without_a_pci_address_among_several_gpus_the_sm_count_is_an_error(
    driver, monkeypatch
):
    monkeypatch.setattr(mx, "device_info", lambda d: {})
    with pytest.raises(RuntimeError, match="2 GPUs and MLX names none"):
        decode_cuda.sm_count()


def test_the_gpus_shared_memory_and_bandwidth_are_the_drivers(driver, monkeypatch):
    monkeypatch.setattr(mx, "device_info", lambda d: {"pci_bus_id": "0000:3b:00.0"})
    h100 = decode_cuda.gpu()
    assert (h100.sms, h100.shared_memory) == (132, 232448)
    assert h100.bandwidth == pytest.approx(3.352e12, rel=1e-3)  # 3.35 TB/s


def test_a_driver_that_does_not_tell_the_memory_clock_gives_no_bandwidth(
    driver, monkeypatch
):
    monkeypatch.setattr(mx, "device_info", lambda d: {})
    ctypes.c_int.in_dll(driver, "gpus").value = 1
    ctypes.c_int.in_dll(driver, "clocks").value = 0
    assert decode_cuda.gpu() == decode_cuda.GPU(108, 166912, None)


def test_a_driver_that_does_not_tell_the_sm_count_is_an_error_naming_it(
    driver, monkeypatch
):
    monkeypatch.setattr(mx, "device_info", lambda d: {})
    ctypes.c_int.in_dll(driver, "gpus").value = 1
    ctypes.c_int.in_dll(driver, "counts").value = 0
    with pytest.raises(RuntimeError, match="does not tell the GPU's SM count"):
        decode_cuda.gpu()


def test_a_variant_over_the_gpus_shared_memory_is_no_kernel(monkeypatch):
    # A Turing GPU: float32 rows need 67 KB a block, bfloat16 rows 34 KB.
    monkeypatch.setattr(decode_cuda, "gpu", lambda: decode_cuda.GPU(40, 65536, None))
    q, x = queries(B=1), latent(B=1)
    assert decode_cuda.prepare(q, x, 0.1)["shared_memory"] > 65536
    assert decode_cuda.latent_attention(q, x, 0.1) is None
    q, x = q.astype(mx.bfloat16), x.astype(mx.bfloat16)
    assert decode_cuda.prepare(q, x, 0.1)["shared_memory"] <= 65536


def test_a_kernel_over_the_gpus_shared_memory_fails_its_check(monkeypatch, caplog):
    monkeypatch.setattr(decode_cuda, "gpu", lambda: decode_cuda.GPU(4, 65536, None))
    with caplog.at_level(logging.WARNING, logger="mlx_lm_mla.decode"):
        assert not decode.kernel_agrees((20, 512, mx.float32, mx.float32, None))
    assert "it has no variant" in caplog.text


@pytest.mark.skipif(not ON_CUDA, reason="asks the GPU's own driver")
def test_the_gpus_sm_count_is_asked_of_its_driver():
    assert 1 <= decode_cuda.sm_count() <= 1024
    assert decode_cuda.gpu().shared_memory >= 48 * 1024


def test_splits_whose_positions_are_all_masked_weigh_nothing(kernel, monkeypatch):
    # 5 splits of 32 positions: the first two all masked.
    monkeypatch.setattr(decode_cuda, "sm_count", lambda: 5)
    q, x = queries(B=1), latent(B=1)
    mask = mx.array([i >= 64 for i in range(150)])[None, None, None]
    alone = decode.reference_attention(q, x[:, :, 64:], 0.05)
    assert close(kernel(q, x, 0.05, mask), alone, mx.float32)


LOW = mx.finfo(mx.float32).min


def partials(splits, B=2, H=3, D=64):
    """Partial outputs as the kernel writes them: unnormalized outputs, and
    each split's maximum score and sum of weights."""
    k = mx.random.split(mx.random.key(5), 3)
    o = 10 * mx.random.normal((B, H, splits, D), key=k[0])
    top = 4 * mx.random.normal((B, H, splits), key=k[1])
    total = mx.random.uniform(1, 20, (B, H, splits), key=k[2])
    return o, mx.stack([top, total], axis=-1)


def softmax_of(o, ml):
    """The splits joined as one softmax, in float32."""
    weights = mx.exp(ml[..., 0] - ml[..., 0].max(axis=-1, keepdims=True))
    total = (ml[..., 1] * weights).sum(axis=-1, keepdims=True)
    return (o * weights[..., None]).sum(axis=-2, keepdims=True) / total[..., None]


@pytest.mark.parametrize("splits", [1, 2, 7, 33])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_the_combine_joins_the_splits_as_one_softmax_in_the_queries_dtype(
    combine, splits, dtype
):
    o, ml = partials(splits)
    got = combine(o, ml, dtype)
    assert got.dtype == dtype and got.shape == (2, 3, 1, 64)
    assert close(got, softmax_of(o, ml), dtype)


def test_the_combine_weighs_an_all_masked_split_at_nothing(combine):
    o, ml = partials(3)
    masked = mx.array([LOW, 16.0])  # 16 masked positions: weight 1 each
    ml = mx.concatenate([ml[:, :, :1], mx.broadcast_to(masked, (2, 3, 1, 2))], 2)
    o = mx.concatenate([o[:, :, :1], mx.full((2, 3, 1, 64), 1e6)], axis=2)
    assert close(combine(o, ml, mx.float32), o[:, :, :1] / ml[:, :, :1, 1:], mx.float32)


def test_the_combine_weighs_splits_alike_where_every_position_is_masked(combine):
    o, ml = partials(3)
    ml = mx.stack([mx.full((2, 3, 3), LOW), ml[..., 1]], axis=-1)
    expected = o.sum(axis=2, keepdims=True) / ml[..., 1:].sum(axis=2, keepdims=True)
    assert close(combine(o, ml, mx.float32), expected, mx.float32)


@pytest.mark.parametrize("kind", ["bfloat16", "4-bit"])
@pytest.mark.parametrize("positions", [5, 35, 83, 96], ids=lambda n: f"{n}-positions")
def test_a_block_of_any_number_of_tiles_attends_as_the_reference(
    kernel, monkeypatch, kind, positions
):
    # One block takes every tile: 1, 3 (fewer than the ring holds), 6 with a
    # partial last, 6 whole.
    monkeypatch.setattr(decode_cuda, "sm_count", lambda: 1)
    q = queries(B=1, dtype=mx.bfloat16)
    if kind == "4-bit":
        cache, x = packed_cache(4, B=1, L=positions)
        packed, reader = cache.latent_bytes(x), cache.latent_reader(x)
    else:
        x, packed, reader = latent(B=1, L=positions, dtype=mx.bfloat16), None, None
    expected = decode.reference_attention(q, x, 0.05, None, reader)
    assert close(kernel(q, x, 0.05, None, packed), expected, mx.bfloat16)


def step_rows(kind):
    """(queries, latent, its packed bytes, its reader) of a one-sequence
    bfloat16 step over exact rows (no bytes, no reader) or a 4-bit cache."""
    q = queries(B=1, dtype=mx.bfloat16)
    if kind == "4-bit":
        cache, x = packed_cache(4, B=1)
        return q, x, cache.latent_bytes(x), cache.latent_reader(x)
    return q, latent(B=1, dtype=mx.bfloat16), None, None


WAIT = "    mla_wait<STAGES - 1>();\n    __syncthreads();\n"


@pytest.mark.parametrize(
    "mutant",
    [
        "",
        "    __syncthreads();\n    mla_wait<STAGES - 1>();\n",
        "    mla_wait<STAGES>();\n    __syncthreads();\n",
    ],
    ids=["no-wait", "wait-after-the-barrier", "wait-a-tile-short"],
)
@pytest.mark.parametrize("kind", ["bfloat16", "4-bit"])
def test_a_kernel_that_reads_a_tile_before_it_lands_disagrees(
    tmp_path, monkeypatch, combine, mutant, kind
):
    # In the emulator a copy lands only at its thread's wait (shared memory
    # before it is garbage), as a GPU does not promise it earlier.
    assert decode_cuda.SOURCE.count(WAIT) == 1
    emulated = Emulator(
        decode_cuda.INPUTS,
        decode_cuda.OUTPUTS,
        decode_cuda.SOURCE.replace(WAIT, mutant),
        decode_cuda.HEADER,
        folder=tmp_path,
    )
    monkeypatch.setattr(decode_cuda, "sm_count", lambda: 4)
    q, x, packed, reader = step_rows(kind)
    launch = decode_cuda.prepare(q, x, 0.05, None, packed)
    launch.pop("shared_memory")
    o, ml = emulated(**launch)
    got = combine(o, ml, q.dtype)
    expected = decode.reference_attention(q, x, 0.05, None, reader)
    assert not close(got, expected, mx.bfloat16)


@pytest.mark.parametrize("kind", ["bfloat16", "4-bit"])
def test_a_kernel_given_less_shared_memory_than_it_uses_is_an_error(emulator, kind):
    # The emulator's shared memory is larger than a GPU gives: it checks.
    q, x, packed, _ = step_rows(kind)
    launch = decode_cuda.prepare(q, x, 0.05, None, packed, sms=4)
    launch["shared_memory"] -= 4  # the last head's carry
    with pytest.raises(RuntimeError, match="beyond the .* bytes it asked for"):
        emulator(**launch)


# The barrier that ends a tile: only after it may a thread refill the ring slot
# that tile was read from (its copies may land as soon as they are issued).
TILE_END = "    __syncthreads();\n  }\n\n#pragma unroll\n"


def copies_landing_at_issue(source, folder, combine, kind):
    """(kernel's attention, reference) for a step run by ``source`` with each
    copy landing as it is issued, on 4 SMs (several tiles a block)."""
    emulated = Emulator(
        decode_cuda.INPUTS,
        decode_cuda.OUTPUTS,
        source,
        decode_cuda.HEADER,
        folder=folder,
        copies_land_at_issue=True,
    )
    q, x, packed, reader = step_rows(kind)
    launch = decode_cuda.prepare(q, x, 0.05, None, packed, sms=4)
    o, ml = emulated(**launch)
    assert emulated.async_copies > 0
    got = combine(o, ml, q.dtype)
    return got, decode.reference_attention(q, x, 0.05, None, reader)


@pytest.mark.parametrize("kind", ["bfloat16", "4-bit"])
def test_the_kernel_holds_where_copies_land_as_soon_as_issued(tmp_path, combine, kind):
    got, expected = copies_landing_at_issue(decode_cuda.SOURCE, tmp_path, combine, kind)
    assert close(got, expected, mx.bfloat16)


def test_a_kernel_that_refills_a_slot_before_every_thread_read_it_disagrees(
    tmp_path, combine
):
    # Exact rows are read in place from the ring to the tile's last step.
    assert decode_cuda.SOURCE.count(TILE_END) == 1
    mutant = decode_cuda.SOURCE.replace(TILE_END, "  }\n\n#pragma unroll\n")
    got, expected = copies_landing_at_issue(mutant, tmp_path, combine, "bfloat16")
    assert not close(got, expected, mx.bfloat16)


# One 16-byte copy from x + FROM to shared memory + TO, emulated in a child
# process (a trap ends it).
COPY = """
import sys
import mlx.core as mx
from cuda_emulator import Emulator
from mlx_lm_mla import decode_cuda
source = '''
  extern __shared__ float smem[];
  mla_copy16(reinterpret_cast<char*>(smem) + TO,
             reinterpret_cast<const char*>(x) + FROM);
  mla_commit();
  mla_wait<0>();
  o[threadIdx.x] = smem[TO / 4 + threadIdx.x % 4];
'''
copy = Emulator(["x"], ["o"], source, decode_cuda.HEADER, folder=sys.argv[3])
(o,) = copy(
    [mx.arange(8, dtype=mx.float32)],
    [("TO", int(sys.argv[1])), ("FROM", int(sys.argv[2]))],
    (32, 1, 1), (32, 1, 1), [(32,)], [mx.float32],
)
print(o[:4].tolist(), copy.async_copies)
"""


@pytest.mark.parametrize(
    "to, source, traps",
    [(16, 0, False), (8, 0, True), (16, 4, True)],
    ids=["aligned", "destination-off", "source-off"],
)
def test_the_emulator_traps_an_async_copy_out_of_alignment(tmp_path, to, source, traps):
    child = subprocess.run(
        [sys.executable, "-c", COPY, str(to), str(source), str(tmp_path)],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    if traps:
        assert child.returncode != 0
        assert "misaligned 16-byte async copy" in child.stderr
    else:
        assert child.returncode == 0, child.stderr
        assert child.stdout.split() == ["[0.0,", "1.0,", "2.0,", "3.0]", "32"]


@pytest.mark.parametrize(
    "width, bits, dtype", [(48, 0, mx.float32), (512, 3, mx.bfloat16)]
)
def test_steps_the_kernel_has_no_variant_for_are_left_to_the_reference(
    width, bits, dtype
):
    q, x = queries(D=width, dtype=dtype), latent(D=width, dtype=dtype)
    packed = None
    if bits:
        cache, x = packed_cache(bits, D=width, dtype=dtype)
        packed = cache.latent_bytes(x)
    assert decode_cuda.prepare(q, x, 0.1, None, packed) is None


@pytest.fixture
def timed(monkeypatch):
    """Steps choose their path by timing (the CPU's rule off), the timing
    patched: ``seconds[path]`` is each path's time. Returns (seconds, the
    path names timed together at each choice)."""
    monkeypatch.delenv("MLX_LM_MLA_DECODE", raising=False)
    for table in ("_CHOSEN", "_OFF", "_KERNEL_AGREES"):
        monkeypatch.setattr(decode, table, {})
    monkeypatch.setattr(decode, "rule", lambda key: None)
    seconds, runs = {}, []

    def measured(paths):
        runs.append(sorted(paths))
        return {name: seconds[name] for name in paths}

    monkeypatch.setattr(decode, "_seconds", measured)
    return seconds, runs


@pytest.fixture
def kernel_calls(kernel, timed, monkeypatch):
    """Decode steps may take the kernel path, checked and chosen afresh;
    returns its calls: whether each read a cache's bytes."""
    seen = []

    def recording(*args):
        seen.append(args[-1] is not None)
        return kernel(*args)

    monkeypatch.setattr(decode_cuda, "available", lambda: True)
    monkeypatch.setattr(decode_cuda, "latent_attention", recording)
    return seen


@pytest.fixture
def through_the_kernel(kernel_calls, timed):
    """Decode steps take the kernel path (as where it measured fastest)."""
    timed[0].update(kernel=1.0, fold=2.0, stock=3.0)
    return kernel_calls


def decode_logits(model, bits=None, prefill=90):
    return step_logits(model, TOKENS, prefill, bits)


def test_the_kernel_serves_no_step_where_it_measured_slower(
    installed, kernel_calls, timed, monkeypatch
):
    # Steps at 121 to 140 positions: chosen at 121 and again at 128.
    seconds, runs = timed
    seconds.update(kernel=2.0, fold=1.0, stock=3.0)
    model, _ = tiny.build_model("glm4_moe_lite")
    got = decode_logits(model, prefill=120)
    assert runs == [["fold", "kernel", "stock"]] * 2
    assert len(kernel_calls) == 1 + 2  # its check, then each choice's
    assert mx.array_equal(got, portable_logits(model, monkeypatch, prefill=120)).item()


def test_a_kernel_measured_fastest_serves_every_step_of_its_length(
    installed, kernel_calls, timed
):
    seconds, runs = timed
    seconds.update(kernel=1.0, fold=2.0, stock=3.0)
    model, _ = tiny.build_model("glm4_moe_lite")
    decode_logits(model, prefill=120)
    assert len(runs) == 2 and set(decode._CHOSEN.values()) == {"kernel"}
    # Its check, then every step (the first of each length is the choice's).
    assert len(kernel_calls) == 1 + (len(TOKENS) - 120) * len(model.layers)


def test_a_kernel_that_raises_at_a_later_step_is_turned_off_and_stock_serves(
    installed, kernel_calls, timed, monkeypatch, caplog
):
    seconds, _ = timed
    seconds.update(kernel=1.0, fold=2.0, stock=3.0)
    working = decode_cuda.latent_attention

    def breaking(*args):
        if len(kernel_calls) >= 6:
            raise RuntimeError("cuda: launch failed")
        return working(*args)

    monkeypatch.setattr(decode_cuda, "latent_attention", breaking)
    model, _ = tiny.build_model("glm4_moe_lite")
    with caplog.at_level(logging.WARNING, logger="mlx_lm_mla.decode"):
        got = decode_logits(model, prefill=120)
    assert len(kernel_calls) == 6  # never called once it raised
    assert "kernel off" in caplog.text and "launch failed" in caplog.text
    assert "kernel" not in decode._CHOSEN.values()
    mlx_lm_mla.uninstall()
    expected = decode_logits(model, prefill=120)
    mlx_lm_mla.install()
    assert mx.allclose(got, expected, atol=1e-4, rtol=1e-4).item()


def test_a_choice_made_without_the_kernel_does_not_serve_where_it_is_offered(
    kernel_calls, timed, monkeypatch
):
    # As `mlx-lm-mla bench` switches between ours and portable in one process.
    seconds, runs = timed
    seconds.update(kernel=1.0, fold=2.0, stock=3.0)
    monkeypatch.setattr(decode_cuda, "available", lambda: decode_cuda.ENABLED)
    q, x = queries(B=1, dtype=mx.bfloat16), latent(B=1, dtype=mx.bfloat16)
    for enabled in (True, False, True, False):
        monkeypatch.setattr(decode_cuda, "ENABLED", enabled)
        decode.attend(scaled_dot_product_attention, q, x, None, 0.05, None)
    # Each choice timed once, among the paths there; none turned off.
    assert runs == [["fold", "kernel", "stock"], ["fold", "stock"]]
    assert sorted(decode._CHOSEN.values()) == ["fold", "kernel"]
    assert decode._OFF == {next(iter(decode._CHOSEN))[0]: set()}
    assert len(kernel_calls) == 1 + 1 + 1  # its check, its choice, its step


def test_a_forced_kernel_serves_every_step_unchecked_and_untimed(
    installed, kernel_calls, timed, monkeypatch
):
    monkeypatch.setenv("MLX_LM_MLA_DECODE", "kernel")
    model, _ = tiny.build_model("glm4_moe_lite")
    decode_logits(model, prefill=120)
    assert timed[1] == [] and decode._CHOSEN == {} and decode._KERNEL_AGREES == {}
    assert len(kernel_calls) == (len(TOKENS) - 120) * len(model.layers)


def test_a_forced_kernel_without_a_variant_for_the_step_says_so(monkeypatch):
    monkeypatch.setenv("MLX_LM_MLA_DECODE", "kernel")
    monkeypatch.setattr(decode_cuda, "available", lambda: True)
    q, x = queries(D=48), latent(D=48)
    with pytest.raises(NotImplementedError, match="kernel has no variant for"):
        decode.attend(None, q, x, None, 0.1, None)


QUANTIZED = (64, 4, 512, "bfloat16", 64, "bfloat16")


@pytest.mark.parametrize(
    "kind",
    [
        (20, 512, mx.bfloat16, mx.bfloat16, mx.bfloat16),
        (20, 512, mx.bfloat16, mx.bfloat16, None),
        (20, 512, mx.float16, mx.float16, mx.float16),
        (20, 512, mx.float32, mx.float32, mx.bool_),
        (20, 512, mx.bfloat16, QUANTIZED, mx.bfloat16),
        (64, 512, mx.bfloat16, (64, 8, 512, "bfloat16", 64, "bfloat16"), None),
    ],
    ids=["bf16", "bf16-no-mask", "f16", "f32-bool-mask", "4-bit", "8-bit-64-heads"],
)
def test_the_kernel_passes_its_check_on_each_kind_of_step(kernel, monkeypatch, kind):
    monkeypatch.setattr(decode_cuda, "latent_attention", kernel)
    assert decode.kernel_agrees(kind)


def test_a_kernel_that_drops_the_mask_fails_its_check(kernel, monkeypatch):
    monkeypatch.setattr(decode_cuda, "latent_attention", lambda *a: kernel(*a[:3]))
    assert not decode.kernel_agrees((20, 512, mx.bfloat16, QUANTIZED, mx.bfloat16))


def test_the_check_runs_two_sequences_and_several_tiles_a_block(monkeypatch):
    # At the real number of blocks (an H100's 132 SMs): planned, never run.
    monkeypatch.setattr(decode_cuda, "sm_count", lambda: 132)
    seen = []

    def planned(q, x, scale, mask, packed):
        seen.append(decode_cuda.prepare(q, x, scale, mask, packed))
        return None

    monkeypatch.setattr(decode_cuda, "latent_attention", planned)
    for kind in [
        (20, 512, mx.bfloat16, QUANTIZED, mx.bfloat16),
        (64, 512, mx.float32, mx.float32, None),
    ]:
        assert not decode.kernel_agrees(kind)
    for launch in seen:
        q, x = launch["inputs"][:2]
        splits = launch["grid"][0] // launch["threadgroup"][0]
        tiles = math.ceil(x.shape[2] / decode_cuda.TILE)
        assert q.shape[0] == 2 and tiles == decode.CHECK_TILES * splits
        assert 132 - 2 * launch["grid"][1] < blocks(launch) <= 132


SLOT = "    const uint8_t* rows = stage + (i % STAGES) * STAGE;\n"


def test_a_kernel_wrong_once_its_ring_wraps_fails_its_check(
    tmp_path, monkeypatch, combine
):
    # Every tile after the ring's last slot read from that slot: right for a
    # block's first 4 tiles (a 4-bit ring), wrong from its 5th.
    assert decode_cuda.SOURCE.count(SLOT) == 1
    emulated = Emulator(
        decode_cuda.INPUTS,
        decode_cuda.OUTPUTS,
        decode_cuda.SOURCE.replace(
            SLOT, SLOT.replace("i % STAGES", "min(i, STAGES - 1)")
        ),
        decode_cuda.HEADER,
        folder=tmp_path,
    )

    def run(queries, latent, scale, mask=None, packed=None, **sizes):
        launch = decode_cuda.prepare(queries, latent, scale, mask, packed, **sizes)
        assert dict(launch["template"])["STAGES"] == decode_cuda.RING[1]
        o, ml = emulated(**launch)
        return combine(o, ml, queries.dtype)

    monkeypatch.setattr(decode_cuda, "sm_count", lambda: 4)
    monkeypatch.setattr(decode_cuda, "latent_attention", run)
    assert not decode.kernel_agrees((20, 512, mx.bfloat16, QUANTIZED, mx.bfloat16))


def test_a_kernel_wrong_beyond_the_first_sequence_fails_its_check(kernel, monkeypatch):
    def first_only(*args):
        out = kernel(*args)
        return mx.concatenate([out[:1], mx.zeros_like(out[1:])])

    monkeypatch.setattr(decode_cuda, "latent_attention", first_only)
    assert not decode.kernel_agrees((20, 512, mx.bfloat16, mx.bfloat16, None))


def test_a_row_whose_every_position_is_masked_attends_as_the_reference(kernel):
    q, x = queries(), latent()
    mask = mx.array([[False] * 150, [i % 3 == 0 for i in range(150)]])[:, None, None]
    got = kernel(q, x, 0.05, mask)
    assert close(got, decode.reference_attention(q, x, 0.05, mask), mx.float32)


def portable_logits(model, monkeypatch, **kwargs):
    with monkeypatch.context() as m:
        m.setenv("MLX_LM_MLA_DECODE", "fold")
        return decode_logits(model, **kwargs)


def test_decode_steps_through_the_kernel_give_stocks_logits(
    installed, through_the_kernel
):
    model, _ = tiny.build_model("glm4_moe_lite")
    mlx_lm_mla.uninstall()
    expected = decode_logits(model)
    mlx_lm_mla.install()
    got = decode_logits(model)
    assert len(through_the_kernel) > 20
    assert mx.allclose(got, expected, atol=1e-4, rtol=1e-4).item()


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_steps_through_the_kernel_read_the_bytes_as_the_portable_path(
    installed, through_the_kernel, monkeypatch, bits
):
    model, _ = tiny.build_model("glm4_moe_lite")
    got = decode_logits(model, bits)
    assert through_the_kernel.count(True) > 20
    expected = portable_logits(model, monkeypatch, bits=bits)
    assert mx.allclose(got, expected, atol=1e-4, rtol=1e-4).item()


@pytest.mark.parametrize(
    "broken",
    [
        lambda *args: mx.zeros_like(args[0]),
        lambda *args: (_ for _ in ()).throw(RuntimeError("nvrtc: compile failed")),
    ],
    ids=["disagrees", "fails"],
)
def test_a_kernel_that_disagrees_or_fails_is_not_used(
    installed, timed, monkeypatch, caplog, broken
):
    timed[0].update(kernel=1.0, fold=2.0, stock=3.0)
    monkeypatch.setattr(decode_cuda, "available", lambda: True)
    monkeypatch.setattr(decode_cuda, "sm_count", lambda: 4)
    calls = []
    monkeypatch.setattr(
        decode_cuda, "latent_attention", lambda *a: calls.append(1) or broken(*a)
    )
    model, _ = tiny.build_model("glm4_moe_lite")
    with caplog.at_level(logging.WARNING, logger="mlx_lm_mla.decode"):
        got = decode_logits(model)
    expected = portable_logits(model, monkeypatch)
    assert mx.array_equal(got, expected).item()
    # Checked once for the step's kind, then never called again.
    assert len(calls) == 1
    assert [r.getMessage() for r in caplog.records if "kernel off" in r.getMessage()]
