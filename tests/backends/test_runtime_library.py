"""The C runtime (symgrad/backends/build/runtime.py): the GEMMs compiled once per compiler and flags
into the build cache and linked by every program, which keeps no state of its own and returns
status codes; it allocates nothing while it runs (its buffers are the caller's scratch region)."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from unittest import mock

import numpy as np
import pytest

import symgrad as sg
from symgrad.backends import c
from symgrad.backends.build import cache, runtime, toolchain

pytest.importorskip("symgrad.backends.c")

# These tests are about where the runtime is built, when, and what links it, not how fast it runs:
# they build it at -O0 (about 2 s; 13 s at the default -O3), and again with other flags.
QUICK_FLAGS = ["-O0", "-fopenmp", "-std=c11", "-fno-math-errno"]
PORTABLE_FLAGS = ["-O0", "-march=x86-64", "-fopenmp", "-std=c11", "-fno-math-errno"]


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty cache dir of the test's own, builds at QUICK_FLAGS, and no in-process memory of
    builds."""
    directory = tmp_path / "cache"
    monkeypatch.setenv("SYMGRAD_CACHE_DIR", str(directory))
    monkeypatch.setenv("SYMGRAD_CFLAGS", " ".join(QUICK_FLAGS))
    monkeypatch.setattr(cache, "_LOADED", {})
    return directory


@pytest.fixture
def runtime_builds(monkeypatch):
    """The runtime libraries compiled in this process (the same function builds a program, which
    links the runtime: link_args)."""
    spy = mock.Mock(wraps=toolchain.compile_shared)
    monkeypatch.setattr(toolchain, "compile_shared", spy)
    return lambda: [call for call in spy.call_args_list if not call.kwargs.get("python")
                    and not call.kwargs.get("link_args")]


def _mlp(width: int):
    x, w1, w2 = sg.input("x", (32, 20)), sg.input("w1", (20, width)), sg.input("w2", (width, 3))
    return [x, w1, w2], sg.relu(x @ w1) @ w2


def _function(width: int, **options):
    inputs, y = _mlp(width)
    return sg.function(inputs, [y], backend="c", **options)


def _check(fn, width: int):
    """`fn` (a `_function(width)`) computes what the reference interpreter does."""
    inputs, y = _mlp(width)
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(v.shape).astype(np.float32) for v in inputs]
    (want,) = sg.function(inputs, [y], backend="numpy")(*arrays)
    np.testing.assert_allclose(fn(*arrays)[0], want, rtol=1e-4, atol=1e-4)


def _runtime_libraries(directory) -> list:
    """The runtime libraries in a cache directory (their metadata says kind "runtime")."""
    return [p for p in directory.glob("_symgrad_*.so")
            if json.loads(p.with_suffix(".json").read_text()).get("kind") == "runtime"]


def test_a_program_includes_the_runtime_instead_of_holding_the_gemm():
    """The model's source calls the GEMMs by name through symgrad_runtime.h; their bodies, the
    vector helpers and the team's clock are in the runtime's source alone."""
    fn = _function(40)
    src = fn.source
    assert f'#include "{runtime.HEADER}"' in src
    assert "sg_gemm_f32(" in src and "sg_gemm_dot3_f32(" in src
    for body in ("sg_micro_f32", "sg_gemm_blocked_f32", "sg_transpose_block_f32", "typedef float sg_vec_f32",
                 "omp_get_wtime", "abort("):
        assert body not in src, body
    lib = runtime.source()
    for body in ("static SG_NOINLINE void sg_micro_f32(", "static int sg_gemm_blocked_f32(", "int sg_gemm_f32(",
                 "int sg_gemm_dot3_f32(", "int sg_gemm_tn12_f64("):
        assert body in lib, body
    assert "abort(" not in lib
    declarations = runtime.header().split("sg_gemm_f32(")[1]   # declared, never defined: no body follows a ")"
    assert "int sg_gemm_dot3_f32(" in runtime.header() and ")\n{" not in declarations and ") {" not in declarations


def test_no_writable_data_in_a_program_or_the_runtime(fresh):
    """Neither binary defines a writable variable of its own (data or bss): state shared by every
    call and thread. What a call keeps lives in the caller's sg_context. (Names beginning with an
    underscore are the toolchain's and cffi's wrapper's; completed.0 is gcc's crtstuff.)"""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("needs nm (binutils)")
    fn = _function(40)
    (library,) = _runtime_libraries(fresh)
    for binary in (fn.library_path, library):
        listing = subprocess.run([nm, "--defined-only", str(binary)], capture_output=True, text=True,
                                 check=True).stdout
        variables = [line.split()[2] for line in listing.splitlines()
                     if len(line.split()) == 3 and line.split()[1] in "bBdD"]
        assert variables and not [v for v in variables if not v.startswith(("_", "completed."))], variables


def test_the_runtime_source_kept_in_the_cache_is_checked_before_use(fresh, monkeypatch):
    """A warm compile reads the runtime's source from the cache instead of rendering it; an
    edited copy fails its checksum and is rendered again."""
    runtime._rendered.cache_clear()
    text = runtime.source()
    (kept,) = (fresh / "runtime").glob("*.c")
    assert kept.read_text() == text
    kept.write_text(text.replace("context->team_warm |= parallel;", ""))
    runtime._rendered.cache_clear()
    assert runtime.source() == text and kept.read_text() == text
    calls = []
    real = runtime._context
    monkeypatch.setattr(runtime, "_context", lambda targets: calls.append(targets) or real(targets))
    runtime._rendered.cache_clear()
    assert runtime.source() == text and runtime.header() and not calls   # read back: no context computed


def test_two_programs_link_one_runtime_built_once(fresh, runtime_builds):
    """The first program builds the runtime; the next one, another model, links the same file.
    Other flags build another runtime, which only their programs link."""
    first, second = _function(40), _function(24)
    assert len(runtime_builds()) == 1
    (library,) = _runtime_libraries(fresh)
    for fn in (first, second):
        assert library.name.encode() in fn.library_path.read_bytes()  # DT_NEEDED: the runtime's soname
        _check(fn, 40 if fn is first else 24)
    portable = _function(40, flags=PORTABLE_FLAGS)
    assert len(runtime_builds()) == 2
    (other,) = set(_runtime_libraries(fresh)) - {library}
    assert other.name.encode() in portable.library_path.read_bytes()
    assert library.name.encode() not in portable.library_path.read_bytes()
    _check(portable, 40)
    _check(first, 40)  # both runtimes in one process: each program calls its own


def test_a_damaged_runtime_is_rebuilt_not_loaded(fresh, runtime_builds, monkeypatch):
    _function(40)
    (library,) = _runtime_libraries(fresh)
    data = bytearray(library.read_bytes())
    data[len(data) // 2] ^= 0xFF
    # A new file in its place: the loaded library's pages (the old file's) stay as they were.
    damaged = library.with_suffix(".damaged")
    damaged.write_bytes(bytes(data))
    os.replace(damaged, library)
    monkeypatch.setattr(cache, "_LOADED", {})  # as a new process would: nothing loaded yet
    fn = _function(16)
    assert len(runtime_builds()) == 2
    assert _runtime_libraries(fresh) == [library] and library.read_bytes() != bytes(data)
    _check(fn, 16)


def test_a_cache_directory_deleted_and_compiled_again_works(fresh, runtime_builds):
    """The runtime is loaded (its file gone) when the directory is deleted: the programs compiled
    next, the same model and a new one, rebuild it and link it, and run."""
    _check(_function(40), 40)
    shutil.rmtree(fresh)
    again, new = _function(40), _function(8)
    assert len(runtime_builds()) == 2 and len(_runtime_libraries(fresh)) == 1
    _check(again, 40)
    _check(new, 8)


def test_a_program_loads_in_a_fresh_process_without_symgrad(fresh):
    """A program is a plain shared library that finds its runtime beside it (its run path is
    $ORIGIN): cffi's ABI mode loads it from the cache directory in a process that never imported
    symgrad."""
    fn = _function(40)
    script = textwrap.dedent(f"""
        import sys, cffi
        ffi = cffi.FFI()
        ffi.cdef({c.CDEF!r})
        lib = ffi.dlopen({str(fn.library_path)!r})
        assert "symgrad" not in sys.modules
        print(lib.symgrad_workspace_bytes(ffi.NULL, ffi.NULL) >= 0)
        """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=fresh)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-2000:]


CAPPED = """
import resource, sys
import numpy as np
import symgrad as sg
M, K, N, transposed = {shape}
a = sg.input("a", (K, M) if transposed else (M, K))
b = sg.input("b", (K, N))
fn = sg.function([a, b], [(sg.transpose(a) if transposed else a) @ b], backend="c")
rng = np.random.default_rng(0)
A = rng.standard_normal(a.shape).astype(np.float32)
B = rng.standard_normal(b.shape).astype(np.float32)
want = (A.T if transposed else A).astype(np.float64) @ B
np.testing.assert_allclose(fn(A, B)[0], want, rtol=1e-3, atol=1e-2)
print("scratch", fn.program.memory_plan.scratch_bytes)
vm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:"))
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
# 4 MB more address space than now: less than the GEMM's packing buffers, were they allocated per call.
resource.setrlimit(resource.RLIMIT_AS, (vm * 1024 + (4 << 20), hard))
try:
    for _ in range(3):
        np.testing.assert_allclose(fn(A, B)[0], want, rtol=1e-3, atol=1e-2)
    print("computed")
except MemoryError as exc:
    print("MemoryError:", exc)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize("shape, threads", [
    ((64, 2047, 1024, False), 1),    # the blocked GEMM: its packed panel of B (8 MB)
    ((200, 8192, 400, False), 2),    # few row blocks on 2 threads: A packed for the team (6.7 MB)
    ((2, 1 << 19, 10, False), 1),    # the narrow dot kernel: B^T (20 MB)
    ((2, 1 << 19, 10, True), 1),     # the narrow transposed kernel: B's copy (20 MB)
], ids=["blocked", "columns-pack", "dot", "tn"])
def test_a_gemm_allocates_nothing_while_it_runs(shape, threads):
    """The GEMM's buffers are the runtime's scratch region, planned with the workspace before the
    first call: with the address space then capped just above what the process holds (less than
    those buffers), later calls still compute the product: nothing is allocated during a call."""
    # Every buffer of 128 KB or more mapped afresh (glibc would otherwise raise that threshold
    # after the first call, and serve a buffer from heap memory freed earlier).
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MALLOC_MMAP_THRESHOLD_="131072")
    done = subprocess.run([sys.executable, "-c", CAPPED.format(shape=shape)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "computed", lines
    assert int(lines[-2].split()[1]) > 4 << 20   # the region the cap would not have left room for


def test_the_context_python_declares_is_the_runtimes():
    """The program is loaded in cffi's ABI mode, which lays sg_context out from c.CDEF: its fields
    must be symgrad_runtime.h's, in order."""
    header = runtime.header()
    declared = re.search(r"typedef struct \{([^}]*)\} sg_context;", header).group(1)
    fields = " ".join(line.strip() for line in declared.splitlines() if line.strip())
    assert fields == c.CDEF_CONTEXT_FIELDS
