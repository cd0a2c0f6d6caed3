"""MLA decode attention as one CUDA kernel (``mx.fast.cuda_kernel``).

Each thread block takes one sequence, a group of heads and a share of the
positions; it decodes a tile of latent rows (packed bytes, scales and biases, or
exact values) into shared memory once for all its heads, and keeps a running
softmax. The blocks a step are sized to the GPU's SMs (``splits``), and a
second kernel joins their partial outputs (``COMBINE``).
``decode.reference_attention`` is its reference; ``decode.attend`` serves a
step by it only where it agreed and ran fastest, else by stock or the fold.
"""

import ctypes
import logging
import math
import os

import mlx.core as mx

log = logging.getLogger(__name__)

# Off with MLX_LM_MLA_CUDA_KERNEL=0 (or by setting ENABLED), e.g. to compare.
ENABLED = os.environ.get("MLX_LM_MLA_CUDA_KERNEL", "1") != "0"
TILE = 16  # positions decoded into shared memory at a time
# Blocks a step per SM: one block (256 threads at ~164 registers) is resident
# on an SM at a time, so a second wave adds no concurrency, only partials.
WAVES = 1
# The CUDA driver, asked once for the SM count (Linux, then Windows).
DRIVERS = ("libcuda.so.1", "libcuda.so", "nvcuda.dll")
_SMS = []
DTYPES = (mx.float32, mx.float16, mx.bfloat16)

# Value d of a latent row as the model sees it: exact rows hold it, quantized
# rows its bits (low bits first), and the row of values its group's scale and
# bias, in the latent's dtype, at byte offsets ``scale_at`` and ``bias_at``.
HEADER = """
template <typename LT>
__device__ inline float mla_scalar(const uint8_t* row, int64_t step, int at) {
  LT x;  // assembled byte by byte: rows hold scales at any alignment
  uint8_t* bytes = reinterpret_cast<uint8_t*>(&x);
  for (int k = 0; k < int(sizeof(LT)); ++k) {
    bytes[k] = row[(at + k) * step];
  }
  return static_cast<float>(x);
}

// Values k * PER .. k * PER + PER - 1 of a latent row: one byte of a quantized
// row (its values low bits first, one group's scale and bias), or one value.
template <int BITS, int G, typename LT, typename XT>
__device__ inline void mla_unpack(
    const XT* x, int64_t step, const uint8_t* v, int64_t vstep,
    int scale_at, int bias_at, int k, float* out) {
  if constexpr (BITS == 0) {
    out[0] = static_cast<float>(x[k * step]);
  } else {
    constexpr int per = 8 / BITS;
    const int byte = int(x[k * step]);
    const int at = (k * per / G) * int(sizeof(LT));
    const float s = mla_scalar<LT>(v, vstep, scale_at + at);
    const float b = mla_scalar<LT>(v, vstep, bias_at + at);
#pragma unroll
    for (int e = 0; e < per; ++e) {
      const int q = (byte >> (e * BITS)) & ((1 << BITS) - 1);
      // Rounded to the latent's dtype, as the dequantized latent is.
      out[e] = static_cast<float>(LT(float(q) * s + b));
    }
  }
}

// Values first .. first + 16 * 8 / BITS - 1 of a quantized row from one
// 16-byte load at x (aligned), each group's scale and bias read once.
template <int BITS, int G, typename LT, typename XT>
__device__ inline void mla_unpack16(
    const XT* x, const uint8_t* v, int64_t vstep,
    int scale_at, int bias_at, int first, float* out) {
  if constexpr (BITS > 0) {
    constexpr int per = 8 / BITS;
    constexpr int groups = 16 * per > G ? 16 * per / G : 1;
    const uint4 word = *reinterpret_cast<const uint4*>(x);
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(&word);
    float s[groups], b[groups];
#pragma unroll
    for (int j = 0; j < groups; ++j) {
      const int at = (first / G + j) * int(sizeof(LT));
      s[j] = mla_scalar<LT>(v, vstep, scale_at + at);
      b[j] = mla_scalar<LT>(v, vstep, bias_at + at);
    }
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      const int j = k * per / G;
#pragma unroll
      for (int e = 0; e < per; ++e) {
        const int q = (int(bytes[k]) >> (e * BITS)) & ((1 << BITS) - 1);
        out[k * per + e] = static_cast<float>(LT(float(q) * s[j] + b[j]));
      }
    }
  }
}
"""

SOURCE = """
  // The lowest float, as a masked score is: a block whose positions are all
  // masked weighs nothing beside one that has any; all masked, all count.
  constexpr float LOW = -3.402823466e38f;
  extern __shared__ float smem[];
  float* xs = smem;                   // TILE x (D + 1) latent rows
  float* ps = xs + TILE * (D + 1);    // HB x TILE scores, then weights
  float* st = ps + HB * TILE;         // HB each: max, sum, carry

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

  // Quantized rows read 16 bytes at a time where whole vectors of them are
  // aligned (a power-of-two group, so a vector's groups are whole or one).
  constexpr int PER = BITS == 0 ? 1 : 8 / BITS;  // values per byte or value
  constexpr int VW = 16 * PER;                   // values per 16 bytes
  constexpr bool CAN_WIDE = BITS > 0 && D % VW == 0 && (G & (G - 1)) == 0;
  bool wide = false;
  if constexpr (CAN_WIDE) {
    wide = x_strides[3] == 1 && x_strides[2] % 16 == 0 &&
        reinterpret_cast<unsigned long long>(x + b * x_strides[0]) % 16 == 0;
  }

  for (int t0 = s0; t0 < s1; t0 += TILE) {
    const int nt = min(TILE, s1 - t0);
    if constexpr (CAN_WIDE) {
      for (int i = tid; wide && i < TILE * (D / VW); i += NT) {
        const int t = i / (D / VW);
        const int c = i % (D / VW);
        float* out = xs + t * (D + 1) + c * VW;
        if (t < nt) {
          const int64_t p = t0 + t;
          mla_unpack16<BITS, G, LT>(
              x + b * x_strides[0] + p * x_strides[2] + c * 16,
              v + b * v_strides[0] + p * v_strides[2], v_strides[3],
              SCALE_AT, BIAS_AT, c * VW, out);
        } else {
#pragma unroll
          for (int e = 0; e < VW; ++e) {
            out[e] = 0.0f;
          }
        }
      }
    }
    for (int i = tid; !wide && i < TILE * (D / PER); i += NT) {
      const int t = i / (D / PER);
      const int k = i % (D / PER);
      float values[PER];
      if (t < nt) {
        const int64_t p = t0 + t;
        mla_unpack<BITS, G, LT>(
            x + b * x_strides[0] + p * x_strides[2], x_strides[3],
            v + b * v_strides[0] + p * v_strides[2], v_strides[3],
            SCALE_AT, BIAS_AT, k, values);
      } else {
#pragma unroll
        for (int e = 0; e < PER; ++e) {
          values[e] = 0.0f;
        }
      }
#pragma unroll
      for (int e = 0; e < PER; ++e) {
        xs[t * (D + 1) + k * PER + e] = values[e];
      }
    }
    __syncthreads();

    for (int t = 0; t < TILE; ++t) {
      float part[A];
#pragma unroll
      for (int a = 0; a < A; ++a) {
        part[a] = 0.0f;
      }
      if (t < nt) {
#pragma unroll
        for (int k = 0; k < KD; ++k) {
          const float x = xs[t * (D + 1) + lane + 32 * k];
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
        xt[j] = xs[t * (D + 1) + tid + j * NT];
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


def sm_count():
    """The streaming multiprocessors of the GPU that MLX runs on, asked of the
    CUDA driver once a process (MLX does not give the count)."""
    if not _SMS:
        _SMS.append(_driver_sm_count())
    return _SMS[0]


def _driver_sm_count():
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

    def call(name, *args):
        status = getattr(driver, name)(*args)
        if status:
            raise RuntimeError(f"the CUDA driver's {name} returned error {status}")

    device, value = ctypes.c_int(), ctypes.c_int()
    call("cuInit", 0)
    # MLX's device by its PCI address; with one GPU, that one.
    bus = getattr(mx, "device_info", dict)().get("pci_bus_id")
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
    call("cuDeviceGetAttribute", ctypes.byref(value), 16, device)  # SM count
    return value.value


def splits(batch, groups, tiles, sms):
    """How many shares of its positions (whole tiles each) each sequence and
    head group takes: as many as fill ``WAVES`` blocks an SM, so a step runs
    in whole waves and writes as few partial outputs as keep every SM busy;
    one where the sequences and head groups alone fill the SMs."""
    wanted = max(1, WAVES * sms // (batch * groups))
    per = math.ceil(tiles / min(wanted, tiles))
    return math.ceil(tiles / per)


def prepare(queries, latent, scale, mask=None, packed=None, sms=None):
    """The kernel's inputs, template, grid, block and shared memory for
    ``decode.latent_attention``'s arguments (``packed``: the cache's keys,
    values and format, as ``latent_bytes`` gives them), or None where the kernel
    has no variant for them. ``sms``: the GPU's SM count (``sm_count()``)."""
    B, H, _, D = queries.shape
    L = latent.shape[2]
    NT = threads(D)
    if packed is None:
        x, v, (group_size, bits) = latent, mx.zeros((1, 1, 1, 1), mx.uint8), (1, 0)
        dtype, scale_at = latent.dtype, 0
    else:
        x, v, (group_size, bits, _, dtype, rope_width, rope_dtype) = packed
        dtype = getattr(mx, dtype)
        scale_at = rope_width * getattr(mx, rope_dtype).size
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
    # Whole tiles a block, as the kernel shares them out: no block left idle.
    parts = splits(B, groups, math.ceil(L / TILE), sms or sm_count())
    template = [
        ("D", D),
        ("HB", HB),
        ("TILE", TILE),
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
        shared_memory=4 * (TILE * (D + 1) + HB * TILE + 3 * HB),
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


def latent_attention(queries, latent, scale, mask=None, packed=None):
    """The kernel's ``decode.latent_attention``, or None where it has no variant."""
    launch = prepare(queries, latent, scale, mask, packed)
    if launch is None:
        return None
    run = kernel(launch.pop("shared_memory"))
    o, ml = run(**launch)
    return combine(o, ml, queries.dtype)
