"""MLA decode attention as one CUDA kernel (``mx.fast.cuda_kernel``).

Each thread block takes one sequence, a group of heads and a share of the
positions; it copies tiles of raw latent rows (packed bytes with their scales
and biases, or exact values) into shared memory a few tiles ahead, decodes each
once for all its heads, and keeps a running softmax. The blocks a step are
sized to the GPU's SMs (``splits``), and a second kernel joins their partial
outputs (``COMBINE``).
``decode.reference_attention`` is its reference; ``decode.attend`` serves a
step by it only where it agreed and ran fastest, else by stock or the fold.
"""

import ctypes
import logging
import math
from typing import NamedTuple, Optional

import mlx.core as mx

from .switches import switch

log = logging.getLogger(__name__)

# Off with MLX_LM_MLA_CUDA_KERNEL=0 (or false, no, off; or by setting
# ENABLED), e.g. to compare; a value that is no switch leaves it on, warned of.
ENABLED = switch("MLX_LM_MLA_CUDA_KERNEL", True) is not False
TILE = 16  # positions decoded into shared memory at a time
# Raw rows a block stages ahead, at most: 2 to 4 tiles in the ring, so while
# it works on one tile the copies of the next one to three are in flight.
STAGED = 32 * 1024
RING = (2, 4)  # tiles in the ring, fewest and most
# Blocks a step per SM: one block (256 threads at 155-190 registers) is resident
# on an SM at a time, so a second wave adds no concurrency, only partials.
WAVES = 1
# The CUDA driver, asked once about the GPU (Linux, then Windows).
DRIVERS = ("libcuda.so.1", "libcuda.so", "nvcuda.dll")
_GPU = []
DTYPES = (mx.float32, mx.float16, mx.bfloat16)

# Value d of a latent row as the model sees it: exact rows hold it, quantized
# rows its bits (low bits first), and the row of values its group's scale and
# bias, in the latent's dtype, at byte offsets ``scale_at`` and ``bias_at``.
HEADER = """
// Copies of 16 bytes from global to shared memory that land later (cp.async,
// sm_80 on): mla_copy16 issues one, mla_commit closes this thread's copies
// since the last into a group, mla_wait<N> returns once at most N of its
// groups are still in flight. Both addresses 16-byte aligned. Before sm_80 a
// copy is made as it is issued (tests/cuda_emulator.py holds it until the wait).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
__device__ inline void mla_copy16(void* dst, const void* src) {
  const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\\n"
               :: "r"(to), "l"(src) : "memory");
}
__device__ inline void mla_commit() {
  asm volatile("cp.async.commit_group;\\n" ::: "memory");
}
template <int N>
__device__ inline void mla_wait() {
  asm volatile("cp.async.wait_group %0;\\n" :: "n"(N) : "memory");
}
#elif !defined(MLA_HELD_COPIES)
__device__ inline void mla_copy16(void* dst, const void* src) {
  *static_cast<uint4*>(dst) = *static_cast<const uint4*>(src);
}
__device__ inline void mla_commit() {}
template <int N>
__device__ inline void mla_wait() {}
#endif

// One value of x at its place in a staged row (rows out of alignment).
template <typename T>
__device__ inline void mla_put(uint8_t* to, T value) {
  *reinterpret_cast<T*>(to) = value;
}

// A staged row's scale or bias, assembled byte by byte: rows hold them at
// any alignment.
template <typename LT>
__device__ inline float mla_scalar(const uint8_t* v, int at) {
  LT x;
  uint8_t* bytes = reinterpret_cast<uint8_t*>(&x);
  for (int k = 0; k < int(sizeof(LT)); ++k) {
    bytes[k] = v[at + k];
  }
  return static_cast<float>(x);
}

// Values first .. first + 4 * 8 / BITS - 1 of a staged quantized row, from
// the 4-byte word at x (aligned) and their group's scale and bias.
template <int BITS, int G, typename LT>
__device__ inline void mla_unpack4(
    const uint8_t* x, const uint8_t* v, int scale_at, int bias_at, int first,
    float* out) {
  if constexpr (BITS > 0) {
    const unsigned word = *reinterpret_cast<const unsigned*>(x);
    const int at = (first / G) * int(sizeof(LT));
    const float s = mla_scalar<LT>(v, scale_at + at);
    const float b = mla_scalar<LT>(v, bias_at + at);
#pragma unroll
    for (int e = 0; e < 32 / BITS; ++e) {
      const int q = int(word >> (e * BITS)) & ((1 << BITS) - 1);
      out[e] = static_cast<float>(LT(float(q) * s + b));
    }
  }
}
"""

SOURCE = """
  // The lowest float, as a masked score is: a block whose positions are all
  // masked weighs nothing beside one that has any; all masked, all count.
  constexpr float LOW = -3.402823466e38f;
  // Rows are staged raw in shared memory, STAGES tiles of them in a ring:
  // exact rows whole; packed rows' bytes, then the 16-byte span of their row
  // of values that holds the scales and biases. Aligned rows come by copies
  // of 16 bytes that land later, others a value at a time.
  constexpr int PER = BITS == 0 ? 1 : 8 / BITS;  // values per byte or value
  constexpr int XE = BITS == 0 ? int(sizeof(LT)) : 1;  // bytes a value of x
  constexpr int XB = BITS == 0 ? D * XE : D / PER;     // bytes a row of x
  constexpr int XN = XB / XE;                          // values a row of x
  constexpr int XROW = (XB + 15) / 16 * 16;
  constexpr int V0 = BITS == 0 ? 0 : SCALE_AT / 16 * 16;
  constexpr int VEND = BITS == 0 ? 0 : BIAS_AT + D / G * int(sizeof(LT));
  constexpr int V1 = (VEND + 15) / 16 * 16;
  constexpr int ROW = XROW + V1 - V0;  // bytes a staged row
  constexpr int STAGE = TILE * ROW;
  extern __shared__ float smem[];
  // STAGES tiles of raw rows (see below); TILE x (D + 1) packed rows decoded;
  // HB x TILE scores, then weights; HB each: max, sum, carry.
  uint8_t* stage = reinterpret_cast<uint8_t*>(smem);
  float* xs = smem + STAGES * STAGE / 4;
  float* ps = xs + (BITS == 0 ? 0 : TILE * (D + 1));
  float* st = ps + HB * TILE;

  const int tid = threadIdx.x;
  const int split = blockIdx.x;
  const int h0 = blockIdx.y * HB;
  const int b = blockIdx.z;
  const int splits = gridDim.x;
  const int H = q_shape[1];
  const int L = x_shape[2];
  const int nh = min(HB, H - h0);
  int per = (L + splits - 1) / splits;
  per = ((per + TILE - 1) / TILE) * TILE;
  const int s0 = split * per;
  const int s1 = min(L, s0 + per);

  // Scores: each warp holds A heads' queries in registers, a lane the dims
  // lane, lane + 32, ...; a position's dot products are summed across lanes.
  constexpr int A = (HB + NT / 32 - 1) / (NT / 32);
  constexpr int KD = D / 32;
  const int warp = tid / 32;
  const int lane = tid % 32;
  float qr[A][KD];
#pragma unroll
  for (int a = 0; a < A; ++a) {
    const int h = warp * A + a;
#pragma unroll
    for (int k = 0; k < KD; ++k) {
      qr[a][k] = h < nh ? q[((int64_t)b * H + h0 + h) * D + lane + 32 * k] : 0.0f;
    }
  }
  if (tid < HB) {
    st[tid] = LOW;
    st[HB + tid] = 0.0f;
  }
  float acc[HB][D / NT];
#pragma unroll
  for (int h = 0; h < HB; ++h) {
#pragma unroll
    for (int j = 0; j < D / NT; ++j) {
      acc[h][j] = 0.0f;
    }
  }
  __syncthreads();

  const int tiles = s1 > s0 ? (s1 - s0 + TILE - 1) / TILE : 0;
  // Whether rows are aligned for 16-byte copies (the copies work their
  // addresses out from the arguments at each tile: fewer registers held).
  const uint8_t* xb = reinterpret_cast<const uint8_t*>(x + b * x_strides[0]);
  const uint8_t* vb = v + b * v_strides[0];
  const bool aligned =
      reinterpret_cast<unsigned long long>(stage) % 16 == 0;
  const bool x_async = aligned && XB % 16 == 0 && x_strides[3] == 1 &&
      (x_strides[2] * XE) % 16 == 0 &&
      reinterpret_cast<unsigned long long>(xb) % 16 == 0;
  const bool v_async = aligned && BITS > 0 && v_strides[3] == 1 &&
      v_strides[2] % 16 == 0 && V1 <= v_shape[3] &&
      reinterpret_cast<unsigned long long>(vb) % 16 == 0;

  // Tile i's copies go in flight as one group (none past the last tile).
  auto stage_tile = [&](int i) {
    uint8_t* rows = stage + (i % STAGES) * STAGE;
    const int64_t p0 = s0 + (int64_t)i * TILE;
    const int n = i < tiles ? min(TILE, s1 - s0 - i * TILE) : 0;
    if (x_async) {
#pragma unroll 1
      for (int k = tid; k < n * (XB / 16); k += NT) {
        const int t = k / (XB / 16);
        const int c = k % (XB / 16);
        const int64_t at = (b * x_strides[0] + (p0 + t) * x_strides[2]) * XE;
        mla_copy16(rows + t * ROW + c * 16,
                   reinterpret_cast<const uint8_t*>(x) + at + c * 16);
      }
    } else {
#pragma unroll 1
      for (int k = tid; k < n * XN; k += NT) {
        const int t = k / XN;
        const int e = k % XN;
        mla_put(rows + t * ROW + e * XE,
                x[b * x_strides[0] + (p0 + t) * x_strides[2] +
                  e * x_strides[3]]);
      }
    }
    if constexpr (BITS > 0) {
      // 16-byte pieces of the span, bytes of scales and biases (1 for exact
      // rows, which never get here: no division by zero in their kernels).
      constexpr int VN = BITS == 0 ? 1 : (V1 - V0) / 16;
      constexpr int VS = BITS == 0 ? 1 : VEND - SCALE_AT;
      if (v_async) {
#pragma unroll 1
        for (int k = tid; k < n * VN; k += NT) {
          const int t = k / VN;
          const int c = k % VN;
          const int64_t at = b * v_strides[0] + (p0 + t) * v_strides[2];
          mla_copy16(rows + t * ROW + XROW + c * 16, v + at + V0 + c * 16);
        }
      } else {
#pragma unroll 1
        for (int k = tid; k < n * VS; k += NT) {
          const int t = k / VS;
          const int e = k % VS;
          rows[t * ROW + XROW + SCALE_AT - V0 + e] =
              v[b * v_strides[0] + (p0 + t) * v_strides[2] +
                (SCALE_AT + e) * v_strides[3]];
        }
      }
    }
    mla_commit();
  };

#pragma unroll 1
  for (int i = 0; i < STAGES - 1; ++i) {
    stage_tile(i);
  }
  for (int i = 0; i < tiles; ++i) {
    const int t0 = s0 + i * TILE;
    const int nt = min(TILE, s1 - t0);
    const uint8_t* rows = stage + (i % STAGES) * STAGE;
    // The tile STAGES - 1 ahead goes in flight, into the buffer tile i - 1
    // used; then tile i has landed for this thread, and after the barrier
    // for every thread.
    stage_tile(i + STAGES - 1);
    mla_wait<STAGES - 1>();
    __syncthreads();

    // Packed rows are decoded into floats once for all heads, a 4-byte word
    // a thread at a time (at most 16 values held); exact rows are read in
    // place. MLX's group sizes (32, 64, 128) hold a word's values whole.
    static_assert(BITS == 0 || G % (4 * PER) == 0, "a word spans two groups");
    if constexpr (BITS > 0) {
#pragma unroll 1
      for (int k = tid; k < nt * (XB / 4); k += NT) {
        const int t = k / (XB / 4);
        const int w = k % (XB / 4);
        const uint8_t* row = rows + t * ROW;
        mla_unpack4<BITS, G, LT>(
            row + 4 * w, row + XROW, SCALE_AT - V0, BIAS_AT - V0, 4 * w * PER,
            xs + t * (D + 1) + 4 * w * PER);
      }
      __syncthreads();
    }
    auto value = [&](int t, int col) -> float {
      if constexpr (BITS == 0) {
        const LT* row = reinterpret_cast<const LT*>(rows + t * ROW);
        return static_cast<float>(row[col]);
      } else {
        return xs[t * (D + 1) + col];
      }
    };

    for (int t = 0; t < TILE; ++t) {
      float part[A];
#pragma unroll
      for (int a = 0; a < A; ++a) {
        part[a] = 0.0f;
      }
      if (t < nt) {
#pragma unroll
        for (int k = 0; k < KD; ++k) {
          const float x = value(t, lane + 32 * k);
#pragma unroll
          for (int a = 0; a < A; ++a) {
            part[a] += qr[a][k] * x;
          }
        }
      }
#pragma unroll
      for (int a = 0; a < A; ++a) {
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) {
          part[a] += __shfl_xor_sync(0xffffffffu, part[a], offset);
        }
      }
      if (lane == 0) {
#pragma unroll
        for (int a = 0; a < A; ++a) {
          const int h = warp * A + a;
          if (h < HB) {
            float score = LOW;
            if (h < nh && t < nt) {
              score = part[a];
              if constexpr (HAS_MASK) {
                score += static_cast<float>(mask[b * mask_strides[0] +
                    (h0 + h) * mask_strides[1] +
                    (int64_t)(t0 + t) * mask_strides[3]]);
              }
            }
            ps[h * TILE + t] = score;
          }
        }
      }
    }
    __syncthreads();

    if (tid < HB) {
      float top = st[tid];
      float new_top = top;
      for (int t = 0; t < nt; ++t) {
        new_top = fmaxf(new_top, ps[tid * TILE + t]);
      }
      float carry = expf(top - new_top);
      float total = st[HB + tid] * carry;
      for (int t = 0; t < TILE; ++t) {
        float w = t < nt ? expf(ps[tid * TILE + t] - new_top) : 0.0f;
        ps[tid * TILE + t] = w;
        total += w;
      }
      st[tid] = new_top;
      st[HB + tid] = total;
      st[2 * HB + tid] = carry;
    }
    __syncthreads();

    // Each position's values are read once into registers for all heads.
#pragma unroll
    for (int h = 0; h < HB; ++h) {
      const float carry = st[2 * HB + h];
#pragma unroll
      for (int j = 0; j < D / NT; ++j) {
        acc[h][j] *= carry;
      }
    }
    for (int t = 0; t < nt; ++t) {
      float xt[D / NT];
#pragma unroll
      for (int j = 0; j < D / NT; ++j) {
        xt[j] = value(t, tid + j * NT);
      }
#pragma unroll
      for (int h = 0; h < HB; ++h) {
        const float w = ps[h * TILE + t];
#pragma unroll
        for (int j = 0; j < D / NT; ++j) {
          acc[h][j] += w * xt[j];
        }
      }
    }
    __syncthreads();
  }

#pragma unroll
  for (int h = 0; h < HB; ++h) {
    if (h < nh) {
      int64_t row = ((int64_t)b * H + h0 + h) * splits + split;
#pragma unroll
      for (int j = 0; j < D / NT; ++j) {
        o[row * D + tid + j * NT] = acc[h][j];
      }
    }
  }
  if (tid < nh) {
    int64_t row = ((int64_t)b * H + h0 + tid) * splits + split;
    ml[row * 2] = st[tid];
    ml[row * 2 + 1] = st[HB + tid];
  }
"""

# A thread a column of one (sequence, head)'s output: each split's partial
# output weighed by its share of the softmax, every partial read once. A split
# whose positions are all masked (maximum LOW) weighs nothing beside one that
# has any; where every split is all masked, all weigh alike, as in SOURCE.
COMBINE = """
  constexpr float LOW = -3.402823466e38f;
  const int d = blockIdx.x * blockDim.x + threadIdx.x;
  const int H = ml_shape[1];
  const int splits = ml_shape[2];
  const int64_t head = (int64_t)blockIdx.z * H + blockIdx.y;
  const float* m = ml + head * splits * 2;
  const float* part = o + head * splits * D + d;
  float top = LOW;
  for (int s = 0; s < splits; ++s) {
    top = fmaxf(top, m[2 * s]);
  }
  float total = 0.0f;
  float sum = 0.0f;
#pragma unroll 4
  for (int s = 0; s < splits; ++s) {
    const float w = expf(m[2 * s] - top);
    total += m[2 * s + 1] * w;
    sum += part[(int64_t)s * D] * w;
  }
  out[head * D + d] = OT(sum / total);
"""

INPUTS = ["q", "x", "v", "mask"]
OUTPUTS = ["o", "ml"]
COMBINE_INPUTS = ["o", "ml"]
COMBINE_OUTPUTS = ["out"]
_kernels = {}  # shared memory bytes (or "combine") -> kernel


def available():
    """On MLX's CUDA backend, unless switched off."""
    cuda = getattr(mx, "cuda", None)
    return (
        ENABLED
        and cuda is not None
        and cuda.is_available()
        and mx.default_device() == mx.gpu
    )


def threads(width):
    """Threads a block: each holds whole columns of the output, so the count
    divides the latent's width."""
    return next((n for n in (256, 128, 64, 32) if width % n == 0), None)


def heads_per_block(heads):
    if heads <= 32:
        return heads
    return next(n for n in (32, 16, 8, 4, 2, 1) if heads % n == 0)


def staged_row(width, bits, group_size, size, scale_at):
    """Bytes a latent row takes in the kernel's ring: an exact row, or a
    packed row's bytes and the 16-byte span of its values from its first scale
    to its last bias (``size``: the latent dtype's bytes), each rounded up to
    16 bytes, as SOURCE lays them out."""
    if bits == 0:
        return -(-width * size // 16) * 16
    end = scale_at + 2 * (width // group_size) * size
    return -(-width * bits // 8 // 16) * 16 + -(-end // 16) * 16 - scale_at // 16 * 16


class GPU(NamedTuple):
    """What the kernel's launches are sized to, from the CUDA driver."""

    sms: int  # streaming multiprocessors
    shared_memory: int  # bytes of shared memory a block may take, opted in
    bandwidth: Optional[float]  # peak memory bytes/s (clock x bus), if told


# cuDeviceGetAttribute's numbers (cuda.h's CUdevice_attribute)
SM_COUNT, MEMORY_CLOCK_KHZ, BUS_WIDTH_BITS, SHARED_OPTIN = 16, 36, 37, 97


def gpu():
    """The GPU that MLX runs on, asked of the CUDA driver once a process (MLX
    does not give its SMs or limits)."""
    if not _GPU:
        _GPU.append(_driver_gpu())
    return _GPU[0]


def sm_count():
    """The SMs of the GPU that MLX runs on (``gpu``)."""
    return gpu().sms


def _driver_gpu():
    for name in DRIVERS:
        try:
            driver = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        raise RuntimeError(
            "the CUDA driver (libcuda) cannot be loaded, so the decode kernel's "
            "blocks cannot be sized to the GPU's SMs"
        )

    def status(name, *args):
        if not hasattr(driver, name):
            raise RuntimeError(f"the CUDA driver has no {name}")
        return getattr(driver, name)(*args)

    def call(name, *args):
        if found := status(name, *args):
            raise RuntimeError(f"the CUDA driver's {name} returned error {found}")

    device, value = ctypes.c_int(), ctypes.c_int()
    call("cuInit", 0)
    # MLX's device by its PCI address, asked of the default device as it is now
    # (mlx 0.31.1's default argument is the one at import); with one GPU, that.
    info = getattr(mx, "device_info", None)
    bus = info(mx.default_device()).get("pci_bus_id") if info else None
    if bus:
        call("cuDeviceGetByPCIBusId", ctypes.byref(device), bus.encode())
    else:
        call("cuDeviceGetCount", ctypes.byref(value))
        if value.value != 1:
            raise RuntimeError(
                f"{value.value} GPUs and MLX names none by its PCI address: the "
                "decode kernel cannot tell which GPU's SMs to size its blocks to"
            )
        call("cuDeviceGet", ctypes.byref(device), 0)

    def attribute(number):  # 0 where the driver does not tell it
        value.value = 0
        if status("cuDeviceGetAttribute", ctypes.byref(value), number, device):
            return 0
        return value.value

    sms, shared = attribute(SM_COUNT), attribute(SHARED_OPTIN)
    if not sms or not shared:
        raise RuntimeError(
            "the CUDA driver does not tell the GPU's SM count or shared memory "
            "a block: the decode kernel cannot be sized to it"
        )
    # Two transfers a clock (DDR), as NVIDIA's deviceQuery counts: 3.35 TB/s
    # for an H100 SXM's 2,619 MHz over 5,120 bits.
    clock, bus_bits = attribute(MEMORY_CLOCK_KHZ), attribute(BUS_WIDTH_BITS)
    bandwidth = 2 * clock * 1e3 * bus_bits / 8 if clock and bus_bits else None
    return GPU(sms, shared, bandwidth)


def splits(batch, groups, tiles, sms):
    """How many shares of its positions (whole tiles each) each sequence and
    head group takes: as many as fill ``WAVES`` blocks an SM, so a step runs
    in whole waves and writes as few partial outputs as keep every SM busy;
    one where the sequences and head groups alone fill the SMs."""
    wanted = max(1, WAVES * sms // (batch * groups))
    per = math.ceil(tiles / min(wanted, tiles))
    return math.ceil(tiles / per)


def rows_read(latent, packed=None):
    """What the kernel reads for ``latent``: (rows, values, group size, bits,
    dtype of the values, byte offset of the scales in a row of values); an
    exact latent is its own rows, at 0 bits."""
    if packed is None:
        return latent, mx.zeros((1, 1, 1, 1), mx.uint8), 1, 0, latent.dtype, 0
    x, v, (group_size, bits, _, dtype, rope_width, rope_dtype) = packed
    scale_at = rope_width * getattr(mx, rope_dtype).size
    return x, v, group_size, bits, getattr(mx, dtype), scale_at


def row_bytes(latent, packed=None):
    """Bytes the kernel stages a position of ``latent`` (``staged_row``)."""
    _, _, group_size, bits, dtype, scale_at = rows_read(latent, packed)
    return staged_row(latent.shape[-1], bits, group_size, dtype.size, scale_at)


def prepare(
    queries, latent, scale, mask=None, packed=None, sms=None, tile=TILE, stages=None
):
    """The kernel's inputs, template, grid, block and shared memory for
    ``decode.latent_attention``'s arguments (``packed``: the cache's keys,
    values and format, as ``latent_bytes`` gives them), or None where the kernel
    has no variant for them. ``sms``: the GPU's SM count (``sm_count()``);
    ``tile`` and ``stages``: positions a tile and tiles in the ring (default:
    as many as ``STAGED`` holds within ``RING``), for a sweep to measure."""
    B, H, _, D = queries.shape
    L = latent.shape[2]
    NT = threads(D)
    x, v, group_size, bits, dtype, scale_at = rows_read(latent, packed)
    if (
        NT is None
        or bits not in (0, 2, 4, 8)
        or dtype not in DTYPES
        or queries.dtype not in DTYPES
        or D % group_size
        or (mask is not None and mask.dtype not in DTYPES + (mx.bool_,))
    ):
        return None
    has_mask = mask is not None
    if not has_mask:
        mask = mx.zeros((1, 1, 1, 1), mx.float32)
    elif mask.dtype == mx.bool_:  # as decode's reference path reads it
        low = mx.array(mx.finfo(mx.float32).min, mx.float32)
        mask = mx.where(mask, mx.array(0.0, mx.float32), low)
    if has_mask:  # strides of 0 where broadcast: read in place
        mask = mx.broadcast_to(mask, (B, H, 1, L))
    q = mx.contiguous((queries * scale).astype(mx.float32).reshape(B, H, D))
    HB = heads_per_block(H)
    groups = math.ceil(H / HB)
    row = staged_row(D, bits, group_size, dtype.size, scale_at)
    stages = stages or max(RING[0], min(RING[1], STAGED // (tile * row)))
    # Whole tiles a block, as the kernel shares them out: no block left idle.
    parts = splits(B, groups, math.ceil(L / tile), sms or sm_count())
    template = [
        ("D", D),
        ("HB", HB),
        ("TILE", tile),
        ("STAGES", stages),
        ("NT", NT),
        ("BITS", bits),
        ("G", group_size),
        ("HAS_MASK", has_mask),
        ("SCALE_AT", scale_at),
        ("BIAS_AT", scale_at + D // group_size * dtype.size),
        ("LT", dtype),
        # MLX names a kernel by its template: every input dtype that varies.
        ("MT", mask.dtype),
    ]
    return dict(
        inputs=[q, x, v, mask],
        template=template,
        grid=(parts * NT, groups, B),
        threadgroup=(NT, 1, 1),
        # The ring of raw rows, then (packed rows) their floats, scores, stats.
        shared_memory=stages * tile * row
        + 4 * ((tile * (D + 1) if bits else 0) + HB * tile + 3 * HB),
        output_shapes=[(B, H, parts, D), (B, H, parts, 2)],
        output_dtypes=[mx.float32, mx.float32],
    )


def prepare_combine(o, ml, dtype):
    """``COMBINE``'s launch for the kernel's partial outputs: the attention,
    (B, H, 1, D) in ``dtype``."""
    B, H, _, D = o.shape
    return dict(
        inputs=[o, ml],
        template=[("D", D), ("OT", dtype)],
        grid=(D, H, B),
        threadgroup=(min(128, threads(D)), 1, 1),
        output_shapes=[(B, H, 1, D)],
        output_dtypes=[dtype],
    )


def kernel(shared_memory):
    if shared_memory not in _kernels:
        _kernels[shared_memory] = mx.fast.cuda_kernel(
            name="mla_latent_decode",
            input_names=INPUTS,
            output_names=OUTPUTS,
            source=SOURCE,
            header=HEADER,
            ensure_row_contiguous=False,
            shared_memory=shared_memory,
        )
    return _kernels[shared_memory]


def combine(o, ml, dtype):
    """Each split's output weighed by its share of the softmax, one kernel."""
    if "combine" not in _kernels:
        _kernels["combine"] = mx.fast.cuda_kernel(
            name="mla_latent_combine",
            input_names=COMBINE_INPUTS,
            output_names=COMBINE_OUTPUTS,
            source=COMBINE,
        )
    return _kernels["combine"](**prepare_combine(o, ml, dtype))[0]


def latent_attention(queries, latent, scale, mask=None, packed=None, **sizes):
    """The kernel's ``decode.latent_attention``, or None where it has no variant
    for these arguments on this GPU (float32 rows take 67 KB of shared memory
    a block, more than sm_75's 64 KB). ``sizes``: ``prepare``'s tile, stages."""
    launch = prepare(queries, latent, scale, mask, packed, **sizes)
    if launch is None or launch["shared_memory"] > gpu().shared_memory:
        return None
    run = kernel(launch.pop("shared_memory"))
    o, ml = run(**launch)
    return combine(o, ml, queries.dtype)
