"""Run generated CUDA programs on the CPU: what their kernels compute, checked where no GPU is
(tests/backends/test_cuda_kernels.py).

A program's .cu is built by the host C++ compiler against a stand-in for the CUDA runtime and its
language words (RUNTIME, written as the `cuda_runtime.h` it includes): device memory is host
memory, a copy is memcpy, and a launch `kernel<<<grid, block>>>(args)` (rewritten by `host_source`
into `sg_launch(grid, block, ...)`) runs the grid's blocks one after another, each block's threads
as fibers on one host thread, each running to its next `__syncthreads()` and handing over to the
next (a kernel with no barrier: its threads one after another), its `__shared__` arrays the
kernel's statics (one block at a time). A thread reads its own threadIdx, so warp lanes are
what a GPU's are. Grid-stride kernels get at most MAX_BLOCKS blocks (their loops cover the rest; the GEMM's
grid, which tiles its output, is kept whole): quicker, and the same sums per element.

`use(monkeypatch, directory)` makes `backend="cuda"` build this way.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

CXX = shutil.which("g++")
MAX_BLOCKS = 4  # of a grid-stride kernel: still several blocks, each striding
RUNTIME = """/* A host stand-in for the CUDA runtime (tests/backends/cuda_on_cpu.py): each library's own state. */
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>
#include <ucontext.h>
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __shared__ static  /* one block at a time: a kernel's statics are its block's shared memory */
struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct sg_index { unsigned x, y, z; };
static sg_index blockIdx, threadIdx, blockDim, gridDim;
/* A block's threads as fibers on the calling thread: each runs until its next barrier, then hands
   over to the next one still running, round the block, so it resumes once all have arrived. */
struct sg_fiber { ucontext_t context; sg_index thread; bool done; };
static std::vector<sg_fiber> sg_fibers;
static char* sg_stacks;  /* SG_STACK bytes per fiber, untouched until used */
static unsigned sg_stacks_for;
static bool sg_in_team;
static unsigned sg_current;
static ucontext_t sg_main;
static std::function<void()> sg_body;
enum { SG_STACK = 1 << 18 };
static void sg_hand_over(bool finished)
{
    const unsigned from = sg_current, n = (unsigned)sg_fibers.size();
    sg_fibers[from].done = finished;
    for (unsigned step = 1; step <= n; ++step) {
        const unsigned to = (from + step) %% n;
        if (!sg_fibers[to].done) {
            sg_current = to;
            threadIdx = sg_fibers[to].thread;
            if (to != from)
                swapcontext(&sg_fibers[from].context, &sg_fibers[to].context);
            return;
        }
    }
    setcontext(&sg_main);  /* every thread of the block is done */
}
static void __syncthreads()
{
    if (!sg_in_team) {  /* a barrier in a kernel cuda_on_cpu.py's _teams did not see one in */
        fprintf(stderr, "cuda_on_cpu: __syncthreads() in a kernel run thread after thread\\n");
        abort();
    }
    sg_hand_over(false);
}
static void sg_fiber_main() { sg_body(); sg_hand_over(true); }
/* Every block of the grid, one after another: its threads run `body` as fibers meeting at its
   barriers (`team`), else one after another. */
template <typename F> void sg_launch(dim3 grid, dim3 block, bool strided, bool team, F body)
{
    if (strided && grid.x > %(max_blocks)d)
        grid.x = %(max_blocks)d;
    blockDim = {block.x, block.y, block.z};
    gridDim = {grid.x, grid.y, grid.z};
    const unsigned threads = block.x * block.y * block.z;
    sg_body = body;
    sg_fibers.assign(threads, sg_fiber{});
    sg_in_team = team;
    if (team && threads > sg_stacks_for) {
        std::free(sg_stacks);
        sg_stacks = (char*)std::malloc((size_t)threads * SG_STACK);
        sg_stacks_for = threads;
    }
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                blockIdx = {x, y, z};
                for (unsigned t = 0; t < threads; ++t) {
                    sg_fiber& f = sg_fibers[t];
                    f.thread = {t %% block.x, t / block.x %% block.y, t / (block.x * block.y)};
                    f.done = false;
                    if (!team) {
                        threadIdx = f.thread;
                        body();
                        continue;
                    }
                    getcontext(&f.context);
                    f.context.uc_stack.ss_sp = sg_stacks + (size_t)t * SG_STACK;
                    f.context.uc_stack.ss_size = SG_STACK;
                    f.context.uc_link = &sg_main;
                    makecontext(&f.context, sg_fiber_main, 0);
                }
                if (team) {
                    sg_current = 0;
                    threadIdx = sg_fibers[0].thread;
                    swapcontext(&sg_main, &sg_fibers[0].context);
                }
            }
}
enum cudaError_t { cudaSuccess = 0, cudaErrorMemoryAllocation = 2, cudaErrorInsufficientDriver = 35,
                   cudaErrorNoDevice = 100 };
enum cudaMemcpyKind { cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2 };
inline cudaError_t cudaMalloc(void** p, size_t n)
{
    *p = std::aligned_alloc(256, (n + 255) / 256 * 256 + 256);
    return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
template <typename T> cudaError_t cudaMalloc(T** p, size_t n) { return cudaMalloc((void**)p, n); }
inline cudaError_t cudaFree(void* p) { std::free(p); return cudaSuccess; }
inline cudaError_t cudaMemcpy(void* to, const void* from, size_t n, cudaMemcpyKind)
{
    std::memcpy(to, from, n);
    return cudaSuccess;
}
inline cudaError_t cudaMemset(void* p, int value, size_t n)
{
    std::memset(p, value, n);
    return cudaSuccess;
}
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
inline cudaError_t cudaGetDeviceCount(int* count) { *count = 1; return cudaSuccess; }
inline const char* cudaGetErrorString(cudaError_t) { return "an error of the CPU stand-in"; }
inline const char* cudaGetErrorName(cudaError_t) { return "cudaErrorOnCpu"; }
""" % {"max_blocks": MAX_BLOCKS}
LAUNCH = re.compile(r"([A-Za-z_]\w*(?:<[\w ]+>)?)<<<(.*?)>>>\(", re.S)


def _teams(source: str) -> set:
    """The kernels of `source` whose threads meet (a barrier, or a block-wide helper that holds one)."""
    kernels = re.findall(r"^(?:template <typename T>\n)?__global__ void (?:__launch_bounds__\(\w+\)\s*)?"
                         r"(\w+)\((.*?)^}\n", source, flags=re.S | re.M)
    return {name for name, body in kernels if "__syncthreads" in body or "sg_block_" in body}


def host_source(source: str) -> str:
    """`source` with each launch `f<<<grid, block>>>(args)` as `sg_launch(grid, block, strided, team,
    [&] { f(args); })` (strided: a grid-stride kernel, every one but the GEMM; team: its threads meet)."""
    teams = _teams(source)
    out, at = [], 0
    for match in LAUNCH.finditer(source):
        if match.start() < at:
            continue
        depth, end = 1, match.end()
        while depth:  # the argument list's closing parenthesis
            depth += {"(": 1, ")": -1}.get(source[end], 0)
            end += 1
        name, config = match.group(1), match.group(2)
        strided = "false" if name.startswith("sg_gemm") else "true"
        team = "true" if name.split("<")[0] in teams else "false"
        out += [source[at:match.start()],
                f"sg_launch({config}, {strided}, {team}, [&] {{ {name}({source[match.end():end - 1]}); }})"]
        at = end
    return "".join(out) + source[at:]


def build(source: str, directory: Path) -> Path:
    """The shared library of CUDA program `source`, built for the CPU in `directory`."""
    (directory / "cuda_runtime.h").write_text(RUNTIME)
    (directory / "program.cpp").write_text(host_source(source))
    library = directory / "program.so"
    done = subprocess.run([CXX, "-std=c++17", "-O0", "-shared", "-fPIC", "-fno-gnu-unique", "-w", "-I", str(directory),
                           "-o", str(library), str(directory / "program.cpp")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    return library


def use(monkeypatch, directory: Path) -> None:
    """Make `backend="cuda"` build with g++ into `directory` and run on the CPU: the program, its call
    checks, its workspace plan and its host API are the real ones; only compiler and device differ."""
    import cffi
    from symgrad.backends.build import cache
    from symgrad.backends import cuda
    count = iter(range(1 << 30))

    def built(program, flags, arch):
        where = directory / f"program{next(count)}"
        where.mkdir()
        ffi = cffi.FFI()
        ffi.cdef(cuda.CDEF)
        module = type("Module", (), {})()
        module.ffi, module.lib = ffi, ffi.dlopen(str(build(program.source, where)))
        return cache.BuiltModule(module, "on_cpu", where / "program.cpp", where / "program.so", where)

    monkeypatch.setattr(cuda, "device_count", lambda: (1, ""))
    monkeypatch.setattr(cuda.CudaProgram, "_build", built)
