"""The width of the vectors the kernels are tiled in on this machine: 64 bytes where its 512-bit
multiply-adds run at least 1.5x the rate of 256-bit ones, else the target's own (32 on AVX2 and
AVX-512).

    vector_flags(flags) -> ["-DSG_VECTOR_BYTES=64"] or []     (runtime.default_flags adds it)
    vector_bytes(flags) -> 64 or 32                           measured once, kept in the cache

The C source picks its register tiles with the preprocessor (runtime.TARGETS). AVX-512's 32
registers hold a GEMM tile of 8 rows by 2 vectors in either width, but only the CPU knows whether
a 64-byte multiply-add is one operation or two: Intel's server cores have two 512-bit FMA units
(64-byte vectors: twice the float32 rate, and a GPT step 0.77x the time), while AMD's Zen 4
splits each 64-byte operation in two (no faster, and a tile twice as wide for the same work).
So it is measured, not looked up by CPU name: a microbenchmark (templates/runtime/vector_width.c.j2),
built with the programs' flags (at -O2 whatever their level: the loop must be its FMAs), times
chains of 64- and 32-byte FMAs on one thread, and 64 bytes are chosen where they run at least
`WIDE_GAIN` times the 32-byte rate; flags for AVX-512 on a CPU without it measure nothing. The
choice is kept as `<cache>/vector_width/<key>.json`, the key the CPU, the compiler, the flags and
the rule (about 0.1 s once, mostly the compiler; delete the file, or call `vector_bytes(flags,
refresh=True)`, to measure again), and is one of a program's flags, so it is part of every
build's key. Flags given to a build explicitly (`flags=`) are used as they are.

`$SYMGRAD_VECTOR_BYTES` chooses without measuring: 64, or 32 for the target's own width (64 on a
machine without AVX-512 computes the same numbers, slowly: each vector is two or four registers).
A `-DSG_VECTOR_BYTES=...` in the flags themselves is left as it is.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import tempfile
import time
from pathlib import Path

from ...settings import cache_dir
from ..render.templates import render
from .cache_files import keep, now_utc, read_kept
from .cache_keys import _host_cpu, compiler_identity, sha256_json
from .toolchain import CompilerNotFound, compiler_command, openmp_link

WIDE_GAIN = 1.5        # 64-byte FMAs this many times the 32-byte rate (two 512-bit units: 2.0; Zen 4: 1.0)
ITERATIONS = 1 << 18   # rounds of 12 FMAs per timed call: about a millisecond at either width
REPEATS = 7            # timed calls per width, taking turns; the fastest of each counts
FORMAT = 1             # bumped when what is measured or kept changes
DEFINE = "-DSG_VECTOR_BYTES=64"

# (compiler command, flags, $SYMGRAD_VECTOR_BYTES) -> the flags chosen: asked once a process.
_CHOSEN: dict[tuple, list[str]] = {}


def vector_flags(flags: list[str]) -> list[str]:
    """What to add to `flags` for this machine's vector width: [DEFINE] where 64-byte vectors are
    chosen (by `$SYMGRAD_VECTOR_BYTES`, else measured), else nothing."""
    if any(flag.startswith("-DSG_VECTOR_BYTES") for flag in flags):
        return []
    configured = os.environ.get("SYMGRAD_VECTOR_BYTES", "").strip()
    if configured not in ("", "32", "64"):
        raise ValueError(f"SYMGRAD_VECTOR_BYTES={configured!r}: expected 64, 32 (the target's own width), "
                         f"or unset (measured)")
    key = (tuple(compiler_command()), tuple(flags), configured)
    if key not in _CHOSEN:
        chosen = int(configured) if configured else vector_bytes(flags)
        _CHOSEN[key] = [DEFINE] if chosen == 64 else []
    return list(_CHOSEN[key])


def vector_bytes(flags: list[str], refresh: bool = False) -> int:
    """64 where code built with `flags` runs 64-byte multiply-adds at `WIDE_GAIN` times the rate of
    32-byte ones on this CPU, else 32: kept in the cache, else measured now and kept. A compiler
    that cannot build the probe gives 32 (the compiler's own check says what is wrong)."""
    try:
        key = dict(format=FORMAT, gain=WIDE_GAIN, cpu=_host_cpu(), compiler=compiler_identity(), flags=list(flags))
    except CompilerNotFound:
        return 32
    path = cache_dir() / "vector_width" / f"{sha256_json(key)[:32]}.json"
    kept = None if refresh else read_kept(path, key)
    if kept is not None and kept.get("bytes") in (32, 64):
        return kept["bytes"]
    try:
        rates = measure(flags)
    except (OSError, subprocess.SubprocessError, RuntimeError):
        return 32
    chosen = 64 if rates is not None and rates[64] >= WIDE_GAIN * rates[32] else 32
    # a cache that cannot be written only means measuring again next time
    keep(path, key, bytes=chosen, measured=now_utc(),
         gflops=None if rates is None else {str(w): round(r, 2) for w, r in rates.items()})
    return chosen


def measure(flags: list[str]) -> dict[int, float] | None:
    """GFLOP/s of one thread's float32 FMAs in 32- and 64-byte vectors, built with `flags`; None
    where the flags target no 64-byte registers (nothing to choose). Raises RuntimeError where the
    probe does not build."""
    widths = (32, 64)
    with tempfile.TemporaryDirectory(prefix="symgrad-vector-width-") as tmp:
        source, library = Path(tmp) / "vector_width.c", Path(tmp) / "vector_width.so"
        source.write_text(render("runtime/vector_width.c.j2", widths=widths))
        probe_flags = [flag for flag in flags if not flag.startswith("-O")] + ["-O2"]
        done = subprocess.run([*compiler_command(), *probe_flags, "-fPIC", "-shared", str(source), "-o", str(library),
                               *openmp_link(flags)], capture_output=True, text=True, timeout=120)
        if done.returncode != 0 or not library.is_file():
            raise RuntimeError(f"the vector width probe did not build: {done.stderr.strip()[-300:]}")
        lib = ctypes.CDLL(str(library))
        if not lib.sg_probe_has_wide_registers():
            return None
        chains = {}
        for w in widths:
            chains[w] = getattr(lib, f"sg_probe_fma{w}")
            chains[w].argtypes = [ctypes.c_int64, ctypes.c_float, ctypes.c_float]
            chains[w].restype = ctypes.c_float
            chains[w](ITERATIONS // 8, 0.999999, 1e-7)  # warm up: the wide units power on after a first use
        best = {w: float("inf") for w in widths}
        for _ in range(REPEATS):
            for w in widths:
                start = time.perf_counter()
                chains[w](ITERATIONS, 0.999999, 1e-7)
                best[w] = min(best[w], time.perf_counter() - start)
        return {w: 12 * 2 * (w // 4) * ITERATIONS / best[w] / 1e9 for w in widths}
