"""The CUDA backend: the C backend's kernel plan rendered through the .cu templates, built by nvcc.

`compile(graph)` goes through the compile driver C uses (symgrad.backends.driver:
passes, lowering, render, program cache; the program base is symgrad.backends.native),
which renders one CUDA C++ file (the renderer C uses, symgrad.backends.render.renderer,
with the CUDA row of symgrad.backends.render.languages: one `__global__` function per
kernel, an `extern "C"` host API), builds it with nvcc through the cache
(symgrad.backends.build.cache, kind="cuda") and loads it with cffi's ABI mode.

Memory: variables (parameters, optimizer state), constants, inputs, outputs
and the workspace (gradients and other temporaries) live in device memory
held by the program's state until `close()`. A run copies in only the
inputs and copies out only the outputs; updates stay on the device, so
`read_variable` (what `step.params[name]` calls) copies to the host. The
workspace is one arena laid out per Dim binding by the static memory plan
(symgrad.backends.lower.memory, as for C, with 256-byte alignment): the entry
point takes each temporary's offset and the arena's size from the caller.

Programs compiled from the same `Compiled` object share its variable
storage dict (a TrainStep's accumulate / apply / predict programs): each
device copy carries a version, and a program pulls a variable from the
program holding the newest version before it runs (see `_Shared`, kept on that
storage dict, not in this module).

Without a CUDA device, `compile` raises a RuntimeError up front;
`compile(graph, build_only=True)` and `cuda_source(graph)` still render
(and for build_only, nvcc-compile) the source.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import sys
import weakref

import numpy as np

from ..step.call_checks import check_array
from ..ir import dtypes as D
from ..ir.graph import Graph
from .build import cache
from .driver import source_of
from .render.languages import CUDA, CUDA_ALIGN as ALIGN, CUDA_ENTRY as ENTRY, CUDA_SIGNATURE as SIGNATURE  # noqa: F401
from .plan import Plan
from .lower.memory import MemoryPlan
from .native import NativeProgram
from .render.program import render

CDEF = """
int sg_cuda_device_count(int* count, char* err, size_t errlen);
int sg_cuda_create(void** state, char* err, size_t errlen);
int sg_cuda_destroy(void* state, char* err, size_t errlen);
int sg_cuda_write_variable(void* state, int64_t index, const void* host, int64_t nbytes, char* err, size_t errlen);
int sg_cuda_read_variable(void* state, int64_t index, void* host, int64_t nbytes, char* err, size_t errlen);
int sg_cuda_run(void* state, const int64_t* dims, void** inputs, void** outputs, const int64_t* offsets,
                int64_t arena_bytes, char* err, size_t errlen);
"""
ERR_BYTES = 1024


class CudaError(RuntimeError):
    """A CUDA call failed (launch failure, out of memory, ...): the message carries CUDA's error string."""

    def __init__(self, message: str, code: int = -1):
        super().__init__(message)
        self.code = code


# ---- rendering: the one C-style renderer (symgrad.backends.render.renderer) with the CUDA row --------

def render_source(plan: Plan) -> str:
    """The CUDA source of a kernel plan."""
    return render(plan, CUDA)


def cuda_source(graph: Graph) -> str:
    """The CUDA C++ source (.cu text) that `backend="cuda"` compiles for `graph`; needs no GPU or nvcc."""
    if not isinstance(graph, Graph):
        raise TypeError(f"cuda_source: expected a symgrad Graph, got {type(graph).__name__}")
    return source_of(graph, CUDA)


# ---- the device, the architecture -------------------------------------------------------

def _load_driver():
    """libcuda (the driver API) loaded but not initialised, or (None, why) when it is missing."""
    try:
        return ctypes.CDLL("libcuda.so.1"), ""
    except OSError as exc:
        return None, f"the CUDA driver library libcuda.so.1 could not be loaded ({exc})"


@functools.lru_cache(maxsize=None)
def _driver():
    """libcuda (the driver API) initialised, or (None, why) when it is missing or finds no device."""
    lib, why = _load_driver()
    if lib is None:
        return None, why
    status = lib.cuInit(0)
    if status != 0:
        return None, f"cuInit failed with CUDA driver error {status}"
    return lib, ""


def device_count() -> tuple[int, str]:
    """(number of CUDA devices, why there are none): asks the driver, not nvcc."""
    lib, why = _driver()
    if lib is None:
        return 0, why
    count = ctypes.c_int(0)
    status = lib.cuDeviceGetCount(ctypes.byref(count))
    if status != 0:
        return 0, f"cuDeviceGetCount failed with CUDA driver error {status}"
    return count.value, "" if count.value else "the CUDA driver reports 0 devices"


@functools.lru_cache(maxsize=None)
def probe_device_count() -> tuple[int, str]:
    """`device_count()` asked in a child process, leaving CUDA uninitialised in this one.

    For test collection and other parents that fork: a process that has initialised CUDA
    cannot use it in forked children. Without a driver library nothing is started (loading
    libcuda does not initialise it).
    """
    lib, why = _load_driver()
    if lib is None:
        return 0, why
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    code = "from symgrad.backends.cuda import device_count; count, why = device_count(); print(count); print(why)"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    except (OSError, subprocess.SubprocessError) as exc:
        return 0, f"the device probe could not run ({exc})"
    count, _, why = done.stdout.partition("\n")
    if done.returncode != 0 or not count.strip().isdigit():
        return 0, f"the device probe failed: {(done.stderr or done.stdout).strip()[-500:]}"
    return int(count), why.strip()


def device_arch() -> str | None:
    """"sm_XY" of device 0, or None without a device."""
    lib, _ = _driver()
    if lib is not None and device_count()[0] > 0:
        major, minor = ctypes.c_int(0), ctypes.c_int(0)
        # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR / _MINOR
        if lib.cuDeviceGetAttribute(ctypes.byref(major), 75, 0) == 0 and \
                lib.cuDeviceGetAttribute(ctypes.byref(minor), 76, 0) == 0:
            return f"sm_{major.value}{minor.value}"
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            done = subprocess.run([smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
                                  capture_output=True, text=True, timeout=30)
            first = done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else ""
            if first and first.replace(".", "").isdigit():
                return "sm_" + first.replace(".", "")
        except (OSError, subprocess.SubprocessError):
            pass
    return None


def arch_flags(arch: str | None = None) -> list[str]:
    """nvcc flags for the GPU: `-arch=sm_XY` for the given or present device, else the fat binary.

    `$SYMGRAD_CUDA_ARCH` (e.g. "sm_86") overrides the detection.
    """
    arch = arch or os.environ.get("SYMGRAD_CUDA_ARCH") or device_arch()
    if arch:
        if not arch.startswith("sm_") or not arch[3:].rstrip("af").isdigit():
            raise ValueError(f"backend 'cuda': arch must look like 'sm_80', got {arch!r}")
        return [f"-arch={arch}"]
    return list(cache.NVCC_FAT_BINARY)


def nvcc_flags(arch: str | None = None) -> list[str]:
    """All nvcc flags: `$SYMGRAD_NVCCFLAGS` or cache.DEFAULT_NVCC_FLAGS, then the architecture flags."""
    return cache.default_nvcc_flags() + arch_flags(arch)


# ---- the program --------------------------------------------------------------------------

class _Shared:
    """Which program holds the newest device copy of each variable of one storage dict.

    Versions count updates; version 0 with no holder means the host array in the
    storage dict is current. Kept on the storage itself (`Compiled`'s, a
    symgrad.step.compiled.VariableStorage, carries it as `.sharing`): the programs of one
    TrainStep share it, and nothing outlives them in a table of this module. A plain
    dict cannot carry it; then each program attached to it keeps its own.
    """

    def __init__(self, storage: dict):
        self.storage = storage
        self.version: dict[str, int] = {}
        # Weak: programs are not kept alive by the storage they share; a program flushes what
        # it holds to the storage before it goes (close / __del__).
        self.holder: dict[str, weakref.ref] = {}

    def holding(self, name: str):
        """The program holding the newest value of `name`, or None (the host array is current)."""
        ref = self.holder.get(name)
        return ref() if ref is not None else None

    def held_by(self, name: str, program: "CudaProgram") -> bool:
        """Whether `program` holds the newest value of `name`. Compares the weak reference itself,
        not what it points to: a program the garbage collector finalises inside a reference cycle
        finds its weak references already cleared, and must still flush what it holds."""
        return self.holder.get(name) is program._ref

    @classmethod
    def of(cls, storage: dict) -> "_Shared":
        group = getattr(storage, "sharing", None)
        if group is None or group.storage is not storage:
            group = cls(storage)
            try:
                storage.sharing = group
            except AttributeError:  # a plain dict: this program's own
                pass
        return group


class CudaProgram(NativeProgram):
    """A graph compiled for the GPU: state in device memory, `run` copies only inputs and outputs."""

    backend = "cuda"
    align = ALIGN

    def __init__(self, graph: Graph, build_only: bool = False, flags: list[str] | None = None,
                 arch: str | None = None, optimize: bool = True):
        self.build_only = bool(build_only)
        self._state = None
        self._ref = weakref.ref(self)  # what the group records as holder (see _Shared.held_by)
        self._group: _Shared | None = None
        if not self.build_only:
            count, why = device_count()
            if count == 0:
                raise RuntimeError(f"backend='cuda': no CUDA device is present ({why}). Use backend='c' or "
                                   f"'numpy' here, or compile(..., build_only=True) / sg.cuda_source(graph) "
                                   f"to only generate and build the CUDA code.")
        super().__init__(graph, CUDA, optimize, flags=flags, arch=arch)
        self._lib = self.module.lib
        self._err = self._ffi.new("char[]", ERR_BYTES)
        self._variables = [(v.name, D.to_numpy(v.dtype), tuple(v.shape)) for v in graph.variables]
        self._var_index = {name: k for k, (name, _, _) in enumerate(self._variables)}
        self._updated = [t.name for t, _ in graph.updates]
        self._have: dict[str, int] = {}   # name -> version of the group this program's copy holds
        self._dirty: set[str] = set()     # written before any run linked a storage dict
        if self.build_only:
            return
        handle = self._ffi.new("void**")
        self._check(self._lib.sg_cuda_create(handle, self._err, ERR_BYTES), "creating the device state")
        self._state = handle[0]
        for v in graph.variables:
            self._upload(v.name, v.attrs["cell"].array if "cell" in v.attrs else v.attrs["init"])

    def _build(self, flags, arch) -> cache.BuiltModule:
        """nvcc through the cache; the library is loaded with cffi's ABI mode (`.module.ffi/.lib`)."""
        return cache.build(self.source, CDEF, flags=flags if flags is not None else nvcc_flags(arch), kind="cuda")

    # ---- native calls ------------------------------------------------------------
    def _check(self, status: int, what: str) -> None:
        if status != 0:
            message = self._ffi.string(self._err).decode("utf-8", "replace")
            raise CudaError(f"backend 'cuda': {what} failed: {message or f'error {status}'}", status)

    def _require_state(self) -> None:
        if self.build_only:
            raise RuntimeError("backend 'cuda': this program was compiled with build_only=True; it cannot run")
        if self._state is None:
            raise RuntimeError("backend 'cuda': the program was closed; its device memory is freed")

    def _upload(self, name: str, array) -> None:
        _, dtype, shape = self._variables[self._var_index[name]]
        array = np.asarray(array, dtype=dtype, order="C")  # (ascontiguousarray would make a 0-d array 1-d)
        if array.shape != shape:
            raise ValueError(f"variable {name!r}: expected shape {list(shape)}, got {list(array.shape)}")
        self._check(self._lib.sg_cuda_write_variable(self._state, self._var_index[name], self._ffi.from_buffer(array),
                                                     array.nbytes, self._err, ERR_BYTES),
                    f"uploading variable {name!r}")

    def _download(self, name: str) -> np.ndarray:
        _, dtype, shape = self._variables[self._var_index[name]]
        array = np.empty(shape, dtype)
        self._check(self._lib.sg_cuda_read_variable(self._state, self._var_index[name],
                                                    self._ffi.from_buffer(array, require_writable=True),
                                                    array.nbytes, self._err, ERR_BYTES),
                    f"downloading variable {name!r}")
        return array

    # ---- variables: resident on the device -----------------------------------------
    def attach(self, storage: dict) -> None:
        """Share `storage` (name -> host array; the dict `Compiled` passes to run) with the other
        programs attached to it. Until a program holds a newer value on its device, the host
        array is the current value."""
        if self._group is not None and self._group.storage is storage:
            return
        if self._group is not None:
            self._leave()
        self._group = _Shared.of(storage)
        for name in sorted(self._dirty):
            self._bump(name)
        self._dirty.clear()

    def read_variable(self, name: str) -> np.ndarray:
        """The variable's current value, copied to the host (from the device that holds it)."""
        group = self._group
        if group is None:
            self._require_state()
            if name not in self._var_index:
                raise KeyError(f"no variable named {name!r}")
            return self._download(name)
        holder = group.holding(name)
        if holder is None:
            return np.array(group.storage[name], copy=True)
        if holder is not self:
            return holder.read_variable(name)
        return self._download(name)

    def write_variable(self, name: str, value: np.ndarray) -> None:
        """Store a (checked, converted) value: into this program's device memory when it has the
        variable, else where the current value lives."""
        group = self._group
        if group is None:
            self._require_state()
            self._upload(name, value)
            self._dirty.add(name)
            return
        holder = group.holding(name)
        if name in self._var_index and self._state is not None:
            self._upload(name, value)
            self._bump(name)
        elif holder is not None and holder is not self:
            holder.write_variable(name, value)
        else:
            group.storage[name][...] = value
            group.version[name] = group.version.get(name, 0) + 1
            group.holder.pop(name, None)

    def _bump(self, name: str) -> None:
        """This program's device copy of `name` is now the newest value."""
        group = self._group
        group.version[name] = group.version.get(name, 0) + 1
        group.holder[name] = self._ref
        self._have[name] = group.version[name]

    def _sync(self) -> None:
        """Make this program's device copies current before a run (see `_Shared`)."""
        group = self._group
        for name, dtype, shape in self._variables:
            version = group.version.get(name, 0)
            if self._have.get(name) == version:
                continue
            holder = group.holding(name)
            if holder is not None and holder is not self:
                value = holder._download(name)
            else:
                value = group.storage.get(name)
                check_array(f"variable {name!r}", value, dtype, shape)  # as C checks the arrays it is given
            self._upload(name, value)
            self._have[name] = version

    def _flush(self) -> None:
        """Copy the newest values this program holds back to the host storage (which then holds them)."""
        group = self._group
        if group is None:
            return
        for name in list(group.holder):
            if group.held_by(name, self):
                if self._state is not None:
                    group.storage[name][...] = self._download(name)
                del group.holder[name]

    def _leave(self) -> None:
        """Flush, then leave the group."""
        self._flush()
        self._group = None

    # ---- running -------------------------------------------------------------------
    def _native_layout(self, key: tuple, planned: MemoryPlan, memory=None) -> tuple:
        """The dims array, the arena's offsets array and its size (the device's arena is allocated
        at the run, so no memory is made ahead)."""
        ffi = self._ffi
        return ffi.new("int64_t[]", list(key) or [0]), ffi.new("int64_t[]", planned.offsets or [0]), planned.arena_bytes

    def _run(self, inputs: list, bindings: dict, variables: dict, check_inputs: bool) -> list:
        """Copy the inputs in, run every kernel, copy the outputs out.

        Updates are applied to the device copies of the variables (not to the
        `variables` arrays): `read_variable` returns the current values.
        """
        self._require_state()
        outs, in_shapes, dims, offsets, arena_bytes = self._layout(self._binding_key(bindings), bindings)
        if check_inputs:
            self._check_inputs(inputs, in_shapes)
        ffi = self._ffi
        keep, in_ptrs = [], []
        for array in inputs:
            p = ffi.from_buffer(array)
            keep.append(p)
            in_ptrs.append(ffi.cast("void*", p))
        if self._group is None or self._group.storage is not variables:
            self.attach(variables)
        self._sync()
        results, out_ptrs = [], []
        for shape, dtype in outs:
            array = np.empty(shape, dtype)
            results.append(array)
            p = ffi.from_buffer(array, require_writable=True)
            keep.append(p)
            out_ptrs.append(ffi.cast("void*", p))
        status = self._lib.sg_cuda_run(self._state, dims, ffi.new("void*[]", in_ptrs or [ffi.NULL]),
                                       ffi.new("void*[]", out_ptrs or [ffi.NULL]), offsets, arena_bytes,
                                       self._err, ERR_BYTES)
        self._check(status, "running the step")
        for name in self._updated:
            self._bump(name)
        return results

    # ---- lifetime ------------------------------------------------------------------
    def close(self) -> None:
        """Free the device memory. Values this program held are copied to the host storage first,
        so they stay readable (`step.params`); running again raises."""
        with self._lock:  # not under a run: it would use the memory freed here
            if self._state is None:
                return
            try:
                self._flush()
            finally:
                state, self._state = self._state, None
                self._check(self._lib.sg_cuda_destroy(state, self._err, ERR_BYTES), "freeing device memory")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        # Collected: free the device memory; at interpreter shutdown or with a dead context there
        # may be nothing left to free, and a destructor must not raise.
        for finish in ("close", "_leave"):
            try:
                getattr(self, finish)()
            except Exception:  # noqa: BLE001
                pass


def compile(graph: Graph, build_only: bool = False, flags: list[str] | None = None, arch: str | None = None,
            optimize: bool = True, **options) -> CudaProgram:
    """Compile `graph` to CUDA and build it with nvcc (cached): the backend protocol's entry point.

    build_only: render and build, but neither require a device nor touch one (for CI and
    inspection: `.source`, `.source_path`, `.library_path`).
    flags: all nvcc flags instead of `nvcc_flags(arch)`. arch: e.g. "sm_90" instead of the
    device's own (or, with no device, the sm_80 + sm_90 fat binary).
    optimize: run the graph passes (symgrad.passes.optimize) first; False compiles the graph as given.
    Raises RuntimeError when no CUDA device is present and build_only is false.
    """
    if options:
        raise TypeError(f"backend 'cuda' takes build_only=, flags=, arch= and optimize=, got {sorted(options)}")
    return CudaProgram(graph, build_only=build_only, flags=flags, arch=arch, optimize=optimize)
