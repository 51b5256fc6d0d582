"""The machine's peaks, which `step.profile()` holds each kernel's rate against: measured once per
machine by a small C program, kept in the cache directory.

    peaks() -> Peaks(gflops, gbs, threads, ...)

- FMA throughput: every thread of the OpenMP team runs 12 independent chains of vector
  multiply-adds (more than the FMA units' latency x throughput, so the loop runs at their rate),
  as wide as the compiler's target allows (AVX-512, AVX, else 16 bytes); 2 FLOPs per lane.
- Memory bandwidth: the team runs STREAM's triad a[i] = b[i] + s c[i] over arrays of
  `STREAM_BYTES` each, ten times the L3 of most machines; 12 bytes moved per element (two read,
  one written), counted as the profile counts a kernel's bytes (what it reads plus what it writes).

Each is the best of `REPEATS` runs. Both (templates/runtime/peaks.c.j2) are built with the flags programs are built with
(`runtime.default_flags()`) and run on the team a program's calls get (OMP_NUM_THREADS, else every
core), so a kernel's share of the peak compares like with like. The result is kept as
`<cache>/peaks/<key>.json`, the key a hash of what the figures depend on: the CPU model, the
cores this process may use, the team size, the compiler and the flags. A machine under load when
it was measured measures low: delete the file (or call `peaks(refresh=True)`) to measure again.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, dataclass

from .build import cache, runtime
from .render.templates import render

REPEATS = 5
FMA_ITERATIONS = 1 << 22        # per chain per run: ~50 ms on one core of a 3 GHz AVX2 machine
STREAM_BYTES = 64 << 20         # per array (three of them)
FORMAT = 1                      # bumped when what is measured or kept changes

CDEF = ("int sg_peak_lanes(void); int sg_peak_threads(void); float sg_peak_fma(int64_t iterations); "
        "double sg_peak_triad(int64_t n, int repeats);")


@dataclass(frozen=True)
class Peaks:
    """What this machine's team of threads reaches at best: `gflops` (GFLOP/s of float32 vector
    FMAs) and `gbs` (GB/s, 10^9 bytes, of the triad), with what they were measured on."""

    gflops: float
    gbs: float
    threads: int
    lanes: int          # float32 lanes of the vectors the FMA loop used
    cpu: str
    measured: str       # UTC time of the measurement

    @property
    def balance(self) -> float:
        """FLOPs per byte at which a kernel stops being bound by memory: gflops / gbs."""
        return self.gflops / self.gbs

    def __str__(self) -> str:
        return (f"peaks: {self.gflops:.1f} GFLOP/s FMA, {self.gbs:.1f} GB/s memory "
                f"({self.threads} thread(s), {self.cpu}, measured {self.measured})")


def _cpu() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _build() -> cache.BuiltModule:
    """The microbenchmarks (templates/runtime/peaks.c.j2), built with the programs' flags (cached)."""
    return cache.build(render("runtime/peaks.c.j2"), CDEF, flags=runtime.default_flags())


def _key(lib) -> dict:
    """What the figures depend on; its hash names the file that keeps them."""
    return dict(format=FORMAT, cpu=_cpu(), cores=_cores(), threads=int(lib.sg_peak_threads()),
                compiler=cache.compiler_identity(), flags=runtime.default_flags(),
                omp_places=os.environ.get("OMP_PLACES"), omp_proc_bind=os.environ.get("OMP_PROC_BIND"))


def measure(lib) -> tuple[float, float]:
    """(GFLOP/s, GB/s) of this machine's team, measured now (about a second)."""
    lanes, threads = int(lib.sg_peak_lanes()), int(lib.sg_peak_threads())
    lib.sg_peak_fma(FMA_ITERATIONS // 16)  # wake the team
    best = 0.0
    for _ in range(REPEATS):
        start = time.perf_counter()
        lib.sg_peak_fma(FMA_ITERATIONS)
        seconds = time.perf_counter() - start
        best = max(best, 12 * 2 * lanes * FMA_ITERATIONS * threads / seconds / 1e9)
    n = STREAM_BYTES // 4
    seconds = lib.sg_peak_triad(n, REPEATS)
    if seconds <= 0:
        raise MemoryError(f"measuring the memory bandwidth: could not allocate 3 x {STREAM_BYTES >> 20} MiB")
    return best, 12 * n / seconds / 1e9


def peaks(refresh: bool = False) -> Peaks:
    """This machine's peaks: from `<cache>/peaks/`, else measured now (about a second) and kept.
    `refresh`: measure again and replace what was kept."""
    lib = _build().module.lib
    key = _key(lib)
    path = cache.cache_dir() / "peaks" / f"{cache.sha256_json(key)[:32]}.json"
    kept = None if refresh else cache.read_kept(path, key)
    if kept is not None:
        try:
            return Peaks(**kept["peaks"])
        except (KeyError, TypeError):
            pass  # a damaged file: measure again
    gflops, gbs = measure(lib)
    found = Peaks(gflops=round(gflops, 2), gbs=round(gbs, 2), threads=key["threads"], lanes=int(lib.sg_peak_lanes()),
                  cpu=key["cpu"], measured=cache.now_utc())
    cache.keep(path, key, peaks=asdict(found))  # a cache that cannot be written: measured again next time
    return found
