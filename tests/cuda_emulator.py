"""Runs a kernel written for ``mx.fast.cuda_kernel`` on the CPU, so its
arithmetic is tested where no GPU is: the same header and body, under the
signature MLX generates (each input, then ``<name>_shape`` / ``_strides`` where
the body names them, then the outputs), compiled with g++. A block's threads
are fibers switched at ``__syncthreads`` and at each warp shuffle; blocks run
one after another, so the dynamic shared memory is one array (NaN at each
block's start). The header's asynchronous copies (``mla_copy16``) land only at
the wait that covers them, for the thread that waits; or, with
``copies_land_at_issue``, as they are issued, the earliest a GPU may land them."""

import ctypes
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

MAX_NDIM = 10  # mlx/backend/cuda/device/config.h

PRELUDE = r"""
#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <math.h>
#include <ucontext.h>
#include <vector>

#define __device__
#define __global__
#define __shared__
#define __grid_constant__

struct __nv_bfloat16 {
  uint16_t bits;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) {  // round to nearest even, as CUDA's conversion
    uint32_t u;
    memcpy(&u, &f, 4);
    bits = uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
  }
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
  }
};
typedef _Float16 __half;
namespace mlx::core::cu {
alignas(16) float smem[1 << 18];
}
inline bool in_shared(const void* p) {
  const char* at = static_cast<const char*>(p);
  const char* base = reinterpret_cast<const char*>(mlx::core::cu::smem);
  return at >= base && at < base + sizeof(mlx::core::cu::smem);
}
// CUDA's 16-byte vector; each copy from global memory (a load in the
// kernel) is counted.
long vector_loads = 0;
struct alignas(16) uint4 {
  unsigned x, y, z, w;
  uint4() = default;
  uint4(const uint4& o) : x(o.x), y(o.y), z(o.z), w(o.w) {
    vector_loads += !in_shared(&o);
  }
};

struct Dim3 { unsigned x = 1, y = 1, z = 1; };
Dim3 threadIdx, blockIdx, blockDim, gridDim;

// A block's threads are fibers on one OS thread, switched at each wait: a
// barrier of the block (id 0) or of a warp (1 + warp) releases its waiters
// once all its threads have arrived.
struct Copy {
  void* to;
  const void* from;
};
struct Fiber {
  ucontext_t context;
  std::vector<char> stack;
  int waits_on = -1;
  unsigned long generation = 0;
  bool done = false;
  std::vector<Copy> issued;               // since the last commit
  std::vector<std::vector<Copy>> groups;  // committed, not yet landed
};
struct Barrier {
  int threads = 0, arrived = 0;
  unsigned long generation = 0;
};
std::vector<Fiber> fibers;
std::vector<Barrier> barriers;
ucontext_t scheduler;
int current = 0;

inline void wait_at(int id) {
  Barrier& barrier = barriers[id];
  if (++barrier.arrived == barrier.threads) {
    barrier.arrived = 0;
    ++barrier.generation;
    return;
  }
  fibers[current].waits_on = id;
  fibers[current].generation = barrier.generation;
  swapcontext(&fibers[current].context, &scheduler);
}
inline void __syncthreads() { wait_at(0); }

// cp.async as the header's mla_copy16 / mla_commit / mla_wait use it: a
// copy's bytes land only at the wait that covers its group, and only for
// the thread that waits, so a tile read before its wait (or before the
// barrier after it) reads what the buffer held before. Both addresses must
// be 16-byte aligned, as on a GPU.
#define MLA_HELD_COPIES
long async_copies = 0;
inline void mla_copy16(void* to, const void* from) {
  if ((reinterpret_cast<uintptr_t>(to) | reinterpret_cast<uintptr_t>(from)) % 16) {
    fprintf(stderr, "emulated kernel: misaligned 16-byte async copy\n");
    __builtin_trap();
  }
  ++async_copies;
#ifdef MLA_COPIES_LAND_AT_ISSUE  // a slot refilled while read is overwritten
  memcpy(to, from, 16);
#else
  fibers[current].issued.push_back(Copy{to, from});
#endif
}
inline void mla_commit() {
  Fiber& f = fibers[current];
  f.groups.push_back(std::move(f.issued));
  f.issued.clear();
}
template <int N>
inline void mla_wait() {
  Fiber& f = fibers[current];
  while (f.groups.size() > size_t(N)) {
    for (const Copy& c : f.groups.front()) memcpy(c.to, c.from, 16);
    f.groups.erase(f.groups.begin());
  }
}

// A warp's 32 threads exchange values through its slots, between two waits.
std::vector<std::array<float, 32>> warp_slots;
inline float __shfl_xor_sync(unsigned, float value, int offset) {
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  warp_slots[warp][lane] = value;
  wait_at(1 + warp);
  const float other = warp_slots[warp][lane ^ offset];
  wait_at(1 + warp);
  return other;
}
using std::min;
using std::max;

namespace mlx::core::cu {
using Shape = std::array<int32_t, MAX_NDIM>;
using Strides = std::array<int64_t, MAX_NDIM>;
}
""".replace("MAX_NDIM", str(MAX_NDIM))

CUDA_PRELUDE = """
#include <cooperative_groups.h>
#include <cuda/std/array>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;
}
""".replace("MAX_NDIM", str(MAX_NDIM))

CTYPES = {
    mx.float32: "float",
    mx.float16: "__half",
    mx.bfloat16: "__nv_bfloat16",
    mx.uint8: "uint8_t",
    mx.int32: "int32_t",
}
# An output's numpy buffer (bfloat16 as its bits).
NUMPY = {
    mx.float32: np.float32,
    mx.float16: np.float16,
    mx.bfloat16: np.uint16,
    mx.uint8: np.uint8,
    mx.int32: np.int32,
}


def _numpy(a):
    """The array's bytes as numpy (bfloat16 as its bits)."""
    if a.dtype == mx.bfloat16:
        return np.array(mx.view(a, mx.uint16))
    return np.array(a)


def _strided(x, unaligned=False):
    """A view of ``x`` in a larger buffer: every second row of its first axis,
    from an offset on its third, so the kernel must read through strides;
    ``unaligned``: from one value past 16-byte alignment, rows an odd number
    of values apart."""
    if x.ndim != 4 or x.size <= 1:
        return x
    B, A, L, W = x.shape
    pad = 1 if unaligned else 0
    buffer = np.zeros((2 * B, A, L + 7, W + pad), x.dtype)
    view = buffer[::2, :, 3 : 3 + L, pad:]
    view[...] = x
    return view


class Emulator:
    """``kernel(inputs=..., template=..., grid=..., threadgroup=...,
    output_shapes=..., output_dtypes=...)`` as ``mx.fast.cuda_kernel`` builds
    it, for ``source`` with ``header``, run on the CPU. Inputs are read through
    strides of a larger buffer, or, with ``ensure_row_contiguous`` (as MLX's
    argument), as row-contiguous arrays."""

    def __init__(
        self,
        input_names,
        output_names,
        source,
        header="",
        folder=None,
        ensure_row_contiguous=False,
        copies_land_at_issue=False,
    ):
        self.names, self.outputs = list(input_names), list(output_names)
        self.source, self.header = source, header
        self.row_contiguous = ensure_row_contiguous
        self.land_at_issue = copies_land_at_issue
        self.folder = Path(folder or tempfile.mkdtemp(prefix="cuda-emulator-"))
        self.libraries = {}
        self.unaligned = False  # inputs out of 16-byte alignment
        self.vector_loads = 0  # 16-byte loads from global memory, last launch
        self.async_copies = 0  # 16-byte copies that land later, last launch

    def _signature(self, dtypes, output_dtypes, template, grid_constant=""):
        """Parameters, the launcher's arguments for them, and the template's
        constants, in the order and form MLX generates them."""
        params, unpack = [], []
        for i, (name, dtype) in enumerate(zip(self.names, dtypes)):
            params.append(f"const {CTYPES[dtype]}* {name}")
            unpack.append(f"(const {CTYPES[dtype]}*)data[{i}]")
            for suffix, kind, src in (
                ("_shape", "Shape", "shapes"),
                ("_strides", "Strides", "strides"),
            ):
                if name + suffix in self.source:
                    params.append(f"const {grid_constant}{kind} {name}{suffix}")
                    unpack.append(f"to_{src}({src}, {i})")
        for j, (name, dtype) in enumerate(zip(self.outputs, output_dtypes)):
            params.append(f"{CTYPES[dtype]}* {name}")
            unpack.append(f"({CTYPES[dtype]}*)data[{len(self.names) + j}]")
        constants = []
        for name, value in template:
            if isinstance(value, mx.Dtype):
                constants.append(f"  using {name} = {CTYPES[value]};")
            elif isinstance(value, bool):
                constants.append(f"  constexpr bool {name} = {str(value).lower()};")
            else:
                constants.append(f"  constexpr int {name} = {value};")
        return ", ".join(params), ", ".join(unpack), "\n".join(constants)

    def cuda_source(self, dtypes, output_dtypes, template):
        """The translation unit MLX's CUDA backend compiles, with a stand-in for
        its own device header (the CPU wheel does not ship it)."""
        params, _, constants = self._signature(
            dtypes, output_dtypes, template, "__grid_constant__ "
        )
        return f"""{CUDA_PRELUDE}
{self.header}
namespace mlx::core::cu {{
namespace cg = cooperative_groups;
__global__ void kernel({params}) {{
{constants}
{self.source}
}}
}}
"""

    def _code(self, dtypes, output_dtypes, template):
        params, unpack, constants = self._signature(dtypes, output_dtypes, template)
        early = "#define MLA_COPIES_LAND_AT_ISSUE\n" if self.land_at_issue else ""
        return f"""{early}{PRELUDE}
{self.header}
namespace mlx::core::cu {{
void kernel({params}) {{
{constants}
{self.source}
}}
}}

static mlx::core::cu::Shape to_shapes(const int32_t* all, int i) {{
  mlx::core::cu::Shape s{{}};
  for (int k = 0; k < {MAX_NDIM}; ++k) s[k] = all[i * {MAX_NDIM} + k];
  return s;
}}
static mlx::core::cu::Strides to_strides(const int64_t* all, int i) {{
  mlx::core::cu::Strides s{{}};
  for (int k = 0; k < {MAX_NDIM}; ++k) s[k] = all[i * {MAX_NDIM} + k];
  return s;
}}

static void** g_data;
static const int32_t* g_shapes;
static const int64_t* g_strides;

static void run_thread() {{
  void** data = g_data;
  const int32_t* shapes = g_shapes;
  const int64_t* strides = g_strides;
  mlx::core::cu::kernel({unpack});
  fibers[current].done = true;
}}

extern "C" long loads16() {{ return vector_loads; }}
extern "C" long copies16() {{ return async_copies; }}

// 1 where a block wrote shared memory beyond the bytes it asked for (where
// asked, >= 0): the GPU gives it no more.
extern "C" int launch(void** data, const int32_t* shapes,
    const int64_t* strides, int gx, int gy, int gz, int nt, long asked) {{
  vector_loads = 0;
  async_copies = 0;
  g_data = data;
  g_shapes = shapes;
  g_strides = strides;
  gridDim = Dim3{{unsigned(gx), unsigned(gy), unsigned(gz)}};
  blockDim = Dim3{{unsigned(nt), 1, 1}};
  for (int z = 0; z < gz; ++z) for (int y = 0; y < gy; ++y)
  for (int x = 0; x < gx; ++x) {{
    blockIdx = Dim3{{unsigned(x), unsigned(y), unsigned(z)}};
    barriers.assign(1 + nt / 32, Barrier{{}});
    barriers[0].threads = nt;
    for (int w = 0; w < nt / 32; ++w) barriers[1 + w].threads = 32;
    warp_slots.assign(nt / 32, {{}});
    // Shared memory starts as garbage (NaN as floats): nothing read before
    // it is written or landed passes for data.
    memset(mlx::core::cu::smem, 0xFF, sizeof(mlx::core::cu::smem));
    fibers.assign(nt, Fiber{{}});
    for (int t = 0; t < nt; ++t) {{
      Fiber& f = fibers[t];
      f.stack.resize(1 << 16);
      getcontext(&f.context);
      f.context.uc_stack.ss_sp = f.stack.data();
      f.context.uc_stack.ss_size = f.stack.size();
      f.context.uc_link = &scheduler;
      makecontext(&f.context, run_thread, 0);
    }}
    for (int running = nt; running > 0;) {{
      bool moved = false;
      running = 0;
      for (int t = 0; t < nt; ++t) {{
        Fiber& f = fibers[t];
        if (f.done) continue;
        if (f.waits_on >= 0 &&
            barriers[f.waits_on].generation == f.generation) {{
          ++running;
          continue;  // still waiting
        }}
        f.waits_on = -1;
        current = t;
        threadIdx = Dim3{{unsigned(t), 0, 0}};
        swapcontext(&scheduler, &f.context);
        moved = true;
        running += !f.done;
      }}
      if (!moved && running) {{
        fprintf(stderr, "emulated kernel: threads wait at a barrier forever\\n");
        abort();
      }}
    }}
    const unsigned char* bytes =
        reinterpret_cast<const unsigned char*>(mlx::core::cu::smem);
    for (size_t i = asked < 0 ? sizeof(mlx::core::cu::smem) : size_t(asked);
         i < sizeof(mlx::core::cu::smem); ++i) {{
      if (bytes[i] != 0xFF) return 1;
    }}
  }}
  return 0;
}}
"""

    def _library(self, code):
        digest = hashlib.sha256(code.encode()).hexdigest()[:16]
        if digest not in self.libraries:
            src = self.folder / f"kernel-{digest}.cpp"
            lib = self.folder / f"kernel-{digest}.so"
            if not lib.exists():
                src.write_text(code)
                built = subprocess.run(
                    ["g++", "-std=c++20", "-O2", "-shared", "-fPIC"]
                    # A misaligned vector load traps, as on a GPU.
                    + ["-fsanitize=alignment", "-fsanitize-undefined-trap-on-error"]
                    + ["-Wno-unknown-pragmas", str(src), "-o", f"{lib}.{os.getpid()}"],
                    capture_output=True,
                    text=True,
                )
                if built.returncode:
                    raise RuntimeError(f"g++ could not build {src}:\n{built.stderr}")
                os.replace(f"{lib}.{os.getpid()}", lib)
            self.libraries[digest] = ctypes.CDLL(str(lib))
        return self.libraries[digest]

    def __call__(
        self,
        inputs,
        template,
        grid,
        threadgroup,
        output_shapes,
        output_dtypes,
        shared_memory=None,
    ):
        """The outputs; with ``shared_memory`` (bytes, as MLX's argument), an
        error where a block wrote shared memory beyond them."""
        code = self._code([a.dtype for a in inputs], output_dtypes, template)
        library = self._library(code)
        library.loads16.restype = ctypes.c_long
        library.copies16.restype = ctypes.c_long
        library.launch.restype = ctypes.c_int
        arrays = [np.ascontiguousarray(_numpy(a)) for a in inputs]
        if not self.row_contiguous:
            arrays = [_strided(a, self.unaligned) for a in arrays]
        outputs = [
            np.zeros(shape, NUMPY[dtype])
            for shape, dtype in zip(output_shapes, output_dtypes)
        ]
        shapes = np.zeros((len(arrays), MAX_NDIM), np.int32)
        strides = np.zeros((len(arrays), MAX_NDIM), np.int64)
        for i, a in enumerate(arrays):
            shapes[i, : a.ndim] = a.shape
            strides[i, : a.ndim] = [s // a.itemsize for s in a.strides]
        data = (ctypes.c_void_p * (len(arrays) + len(outputs)))(
            *[a.ctypes.data for a in arrays + outputs]
        )
        (gx, gy, gz), (tx, ty, tz) = grid, threadgroup
        assert ty == tz == 1 and gx % tx == 0, "one-dimensional blocks only"
        assert tx % 32 == 0, "whole warps only"
        beyond = library.launch(
            data,
            shapes.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
            strides.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)),
            gx // tx,
            gy,
            gz,
            tx,
            ctypes.c_long(-1 if shared_memory is None else shared_memory),
        )
        if beyond:
            raise RuntimeError(
                f"emulated kernel: a block wrote shared memory beyond the "
                f"{shared_memory} bytes it asked for"
            )
        self.vector_loads = library.loads16()
        self.async_copies = library.copies16()
        return [
            mx.view(mx.array(o), mx.bfloat16) if dtype == mx.bfloat16 else mx.array(o)
            for o, dtype in zip(outputs, output_dtypes)
        ]
