"""Run a CUDA plan's kernels on the CPU, one thread after another: a check of what they compute
where no GPU is (tests/backends/test_cuda_kernels.py).

Only kernels whose threads never meet can run so: no shared memory, no barrier, each thread's
grid-stride loop independent of the others' (loop kernels and fused attention; not the reductions,
row kernels or the GEMM). Their `__global__` functions are cut out of the rendered .cu and built
by the host C++ compiler with the CUDA words defined away; a launch becomes one call per thread of
a single block of `LANES` threads (threadIdx.x 0, 1, ...), each walking its grid-stride loop, so a
kernel that reads a lane's number sees it as on a GPU. Launches run in the plan's order; fused
attention's gradient runs its key rows' pass (`<name>_keys`) after its query rows'.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np

from symgrad.backends import cuda
from symgrad.ir import dtypes as D
from symgrad.ir import shapes as S

CXX = shutil.which("g++") or shutil.which("c++")
LANES = 32  # one warp: lanes 0..31
SHIM = """#include <math.h>
#include <stdint.h>
#define __global__ extern "C"
#define __launch_bounds__(n)
struct sg_dim { unsigned x, y, z; };
extern "C" { sg_dim blockIdx, threadIdx, blockDim, gridDim; }
#define SG_THREADS 256
#define SG_KEY_BLOCK 32
"""
RUNS_ON_CPU = ("loop", "attention")  # the kinds whose threads never meet


def _signatures(source: str) -> tuple[str, dict]:
    """The `__global__` functions of `source` (each to its closing brace at a line's start), and
    each one's parameter names in order."""
    kernels = re.findall(r"^__global__ void .*?^}\n", source, flags=re.S | re.M)
    params = {}
    for text in kernels:
        name, listed = re.match(r"__global__ void __launch_bounds__\(\w+\) (\w+)\(([^)]*)\)", text).groups()
        params[name] = [part.split()[-1] for part in listed.split(",")]
    return "\n".join(kernels), params


def run(plan, arrays: list, bindings: dict, directory: Path) -> list:
    """The outputs of `plan` (lowered for CUDA) on `arrays` (its inputs) at Dim values `bindings`."""
    assert all(k.kind in RUNS_ON_CPU for k in plan.kernels), [k.kind for k in plan.kernels]
    text, params = _signatures(cuda.render_source(plan))
    (directory / "kernels.cpp").write_text(SHIM + text)
    subprocess.run([CXX, "-O1", "-shared", "-fPIC", "-o", str(directory / "kernels.so"),
                    str(directory / "kernels.cpp")], check=True, capture_output=True, text=True)
    lib = ctypes.CDLL(str(directory / "kernels.so"))
    buffers = {b.name: np.ascontiguousarray(a, D.to_numpy(b.dtype)) for b, a in zip(plan.inputs, arrays)}
    for b in [*plan.outputs, *plan.workspace]:  # NaN: an element a kernel should write and did not shows
        buffers[b.name] = np.full(int(S.evaluate(b.numel, bindings)), np.nan, D.to_numpy(b.dtype))
    dims = {f"d{k}": bindings[d] for k, d in enumerate(plan.dims)}
    for field, value in (("blockIdx", 0), ("blockDim", LANES), ("gridDim", 1)):
        ctypes.c_uint.in_dll(lib, field).value = value  # (.x: the struct's first field)
    lane = ctypes.c_uint.in_dll(lib, "threadIdx")
    for kernel in plan.kernels:
        passes = [kernel.name] + ([f"{kernel.name}_keys"] if getattr(kernel, "op", "") == "attention_grad" else [])
        for name in passes:
            args = [ctypes.c_int64(dims[p]) if p in dims else buffers[p].ctypes.data_as(ctypes.c_void_p)
                    for p in params[name]]
            for k in range(LANES):
                lane.value = k
                getattr(lib, name)(*args)
    return [buffers[b.name] for b in plan.outputs]


# ---- the tiled GEMM: a block's threads do meet (shared memory, barriers) -------------------------

GEMM_SHIM = """#include <barrier>
#include <thread>
#include <vector>
#include <stdint.h>
#define __global__
#define __launch_bounds__(n)
#define __shared__ static  /* one block at a time: the kernel's statics are its block's shared memory */
struct sg_dim { unsigned x, y, z; };
static sg_dim blockIdx, blockDim, gridDim;
static thread_local sg_dim threadIdx;
static std::barrier<>* sg_block_barrier;
static void __syncthreads() { sg_block_barrier->arrive_and_wait(); }
"""
GEMM_RUN = """
extern "C" void sg_run_gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t sam, int64_t sak,
                            const float* B, int64_t sbk, int64_t sbn, float* C, int axes, int64_t count,
                            const int64_t* steps, unsigned grid_z)
{
    sg_batch batch = {axes, count, {0}, {0}, {0}, {0}};
    for (int d = 0; d < axes; ++d) {
        batch.size[d] = steps[4 * d];
        batch.a[d] = steps[4 * d + 1];
        batch.b[d] = steps[4 * d + 2];
        batch.c[d] = steps[4 * d + 3];
    }
    gridDim = {(unsigned)((N + SG_TILE - 1) / SG_TILE), (unsigned)((M + SG_TILE - 1) / SG_TILE), grid_z};
    blockDim = {SG_GEMM_THREADS, 1, 1};
    std::barrier<> barrier(SG_GEMM_THREADS);
    sg_block_barrier = &barrier;
    for (unsigned z = 0; z < gridDim.z; ++z)
        for (unsigned y = 0; y < gridDim.y; ++y)
            for (unsigned x = 0; x < gridDim.x; ++x) {
                blockIdx = {x, y, z};
                std::vector<std::thread> threads;
                for (unsigned t = 0; t < SG_GEMM_THREADS; ++t)
                    threads.emplace_back([=] {
                        threadIdx = {t, 0, 0};
                        sg_gemm<float>(M, N, K, A, sam, sak, B, sbk, sbn, C, batch);
                    });
                for (auto& thread : threads)
                    thread.join();
            }
}
"""


def gemm(M: int, N: int, K: int, a: np.ndarray, a_strides: tuple, b: np.ndarray, b_strides: tuple,
         batch: list, grid_z: int, directory: Path) -> np.ndarray:
    """templates/cuda/gemm.cu.j2's sg_gemm<float> on the CPU, each block's threads as host threads
    meeting at its barriers: the products of `a` and `b` (flat float32, read at (row, column)
    strides `a_strides`, `b_strides`) for every index of `batch` ((size, a step, b step, out step)
    per axis, outer to inner), launched with `grid_z` blocks along z; returns the flat output."""
    from symgrad.backends import templates
    source = GEMM_SHIM + templates.render("cuda/gemm.cu.j2", batch_axes=len(batch) or 1) + GEMM_RUN
    (directory / "gemm.cpp").write_text(source)
    subprocess.run([CXX, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-o", str(directory / "gemm.so"),
                    str(directory / "gemm.cpp")], check=True, capture_output=True, text=True)
    lib = ctypes.CDLL(str(directory / "gemm.so"))
    count = int(np.prod([size for size, *_ in batch], dtype=np.int64))
    out = np.full(count * M * N, np.nan, np.float32)
    steps = np.array([step for axis in batch for step in axis] or [0], np.int64)
    pointer = [np.ascontiguousarray(x).ctypes.data_as(ctypes.c_void_p) for x in (a, b, out, steps)]
    i64 = ctypes.c_int64
    lib.sg_run_gemm(i64(M), i64(N), i64(K), pointer[0], i64(a_strides[0]), i64(a_strides[1]), pointer[1],
                    i64(b_strides[0]), i64(b_strides[1]), pointer[2], ctypes.c_int(len(batch)), i64(count),
                    pointer[3], ctypes.c_uint(grid_z))
    return out
