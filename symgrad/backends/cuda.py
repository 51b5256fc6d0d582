"""The CUDA backend: the C backend's kernel plan rendered through templates/cuda/, built by nvcc.

`compile(graph)` lowers the graph (symgrad.backends.lowering, the same plan
as C), renders one CUDA C++ file (one `__global__` function per kernel, an
`extern "C"` host API), builds it with nvcc through the cache
(symgrad.backends.cache, kind="cuda") and loads it with cffi's ABI mode.

Memory: variables (parameters, optimizer state), constants, inputs, outputs
and the workspace (gradients and other temporaries) live in device memory
held by the program's state until `close()`. A run copies in only the
inputs and copies out only the outputs; updates stay on the device, so
`read_variable` (what `step.params[name]` calls) copies to the host. The
workspace is one arena laid out per Dim binding by the static memory plan
(symgrad.backends.memory, as for C, with 256-byte alignment): the entry
point takes each temporary's offset and the arena's size from the caller.

Programs compiled from the same `Compiled` object share its variable
storage dict (a TrainStep's accumulate / apply / predict programs): each
device copy carries a version, and a program pulls a variable from the
program holding the newest version before it runs (see `_Shared`).

Without a CUDA device, `compile` raises a RuntimeError up front;
`compile(graph, build_only=True)` and `cuda_source(graph)` still render
(and for build_only, nvcc-compile) the source.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import shutil
import subprocess
import sys
import threading
import weakref

import numpy as np

from ..ir import dtypes as D
from ..ir import shapes as S
from ..ir.graph import Graph
from . import cache
from .c import _Body, _convert, _fmt, _lowest, _Renderer, comment
from .cuda_printer import printer
from .. import passes
from .lowering import REDUCED, LoopKernel, MatmulKernel, Plan, ReduceKernel, RowKernel, View, lower
from .report import program_report, timed
from .templates import render
from .memory import MemoryPlan, latest_or_assumed, memory_plan

ENTRY = "sg_cuda_run"
CDEF = """
int sg_cuda_device_count(int* count, char* err, size_t errlen);
int sg_cuda_create(void** state, char* err, size_t errlen);
int sg_cuda_destroy(void* state, char* err, size_t errlen);
int sg_cuda_write_variable(void* state, int64_t index, const void* host, int64_t nbytes, char* err, size_t errlen);
int sg_cuda_read_variable(void* state, int64_t index, void* host, int64_t nbytes, char* err, size_t errlen);
int sg_cuda_run(void* state, const int64_t* dims, void** inputs, void** outputs, const int64_t* offsets,
                int64_t arena_bytes, char* err, size_t errlen);
"""
SIGNATURE = (f"int {ENTRY}(void* handle, const int64_t* dims, void** inputs, void** outputs, "
             f"const int64_t* offsets, int64_t arena_bytes, char* err, size_t errlen)")
ERR_BYTES = 1024
ALIGN = 256        # bytes: each workspace temporary starts where cudaMalloc would put a buffer
LAYOUTS_KEPT = 4   # layouts (memory plan, offsets array) kept for the most recent distinct Dim bindings


class CudaError(RuntimeError):
    """A CUDA call failed (launch failure, out of memory, ...): the message carries CUDA's error string."""

    def __init__(self, message: str, code: int = -1):
        super().__init__(message)
        self.code = code


# ---- rendering --------------------------------------------------------------------------

class _CudaRenderer(_Renderer):
    """Renders a kernel plan as CUDA: one __global__ function per kernel, launched by the entry point.

    Inherits from the C renderer only what is the same in both languages: operand loads,
    sizes and indices (`self.ex`), constant tables (`const`), each node's statement (printed
    by the CUDA printer) and the dispatch over kernel kinds."""

    printer = staticmethod(printer)
    language = "CUDA"
    restrict = "__restrict__"

    def _split(self, var: str, rest: str, sizes: list[str], prefix: str, body: list[str]) -> list[str]:
        """C lines splitting the flat index `var` into the row-major indices prefix0.. that `body` uses
        (an index no line reads is skipped: nvcc warns about unused variables)."""
        text = "\n".join(body)
        needed = [k for k in range(len(sizes)) if re.search(rf"\b{prefix}{k}\b", text)]
        if not needed:
            return []
        low = min(needed)
        lines = [f"int64_t {rest} = {var};"]
        for k in range(len(sizes) - 1, low - 1, -1):
            size = self._p(sizes[k])
            if k == 0:
                lines.append(f"const int64_t {prefix}0 = {rest};")
            elif k == low:
                lines.append(f"const int64_t {prefix}{k} = {rest} % {size};")
            elif k in needed:
                lines.append(f"const int64_t {prefix}{k} = {rest} % {size}; {rest} /= {size};")
            else:
                lines.append(f"{rest} /= {size};")
        return lines

    @staticmethod
    def _p(text: str) -> str:
        return text if text.isidentifier() or text.isdigit() else f"({text})"

    def _numel(self, sizes) -> str:
        """The product of loop sizes as a C expression (1 for none)."""
        return self.ex._paren(S.numel(tuple(sizes))) if sizes else "1"

    # The kernel contexts are built here, not taken from the C renderer's: C specialises its loops
    # for the CPU (OpenMP, SIMD, column sums); `element_lines`, `statement` and the printers are shared.
    def loop_kernel(self, k: LoopKernel) -> dict:
        sizes = [self.ex.size(s) for s in k.shape]
        loop_vars = [f"i{d}" for d in range(len(sizes))]
        body = self.element_lines(k, loop_vars)
        body.append(f"{k.out.name}[{self.ex.index(0, loop_vars, k.out_view.strides)}] = {k.result};")
        params, args = self.params([op.view.buffer for op in k.operands if op.view.buffer is not None], k.out)
        return dict(kind="loop", name=k.name, comments=[comment(line) for line in k.lines], params=params,
                    args=args, body=body, numel=self._numel(k.shape),
                    split=self._split("flat", "rest", sizes, "i", body))

    def reduce_kernel(self, k: ReduceKernel) -> dict:
        acc_t, in_t, out_t = D.C_TYPES[k.acc_dtype], D.C_TYPES[k.input.dtype], D.C_TYPES[k.out.dtype]
        outer = [f"o{d}" for d in range(len(k.kept))]
        inner = [f"r{d}" for d in range(len(k.reduced))]
        prologue = []
        if k.operands:  # a fused elementwise prologue, computed where the element is read
            prologue, load = self.element_lines(k, outer + inner), k.result
        else:
            view = View(k.input.kind, (), k.input.dtype, tuple(st for _, st in [*k.kept, *k.reduced]),
                        k.input.offset, k.input.buffer, k.input.literal)
            load = self.load(view, outer + inner)
        if k.op == "sum":
            init = [f"{acc_t} acc = 0;"]
            body = [f"acc += ({acc_t}){load};"]
            combine = ["s_acc[threadIdx.x] += s_acc[threadIdx.x + width];"]
            finish = [f"{k.out.name}[o] = {_convert('s_acc[0]', k.acc_dtype, k.out.dtype)};"]
        elif k.op == "max":
            init = [f"{acc_t} acc = {_lowest(k.acc_dtype)};"]
            body = [f"const {in_t} v = {load};",
                    "acc = (v > acc || v != v) ? v : acc;  /* NaN propagates, as in NumPy */"]
            combine = [f"const {acc_t} a = s_acc[threadIdx.x], b = s_acc[threadIdx.x + width];",
                       "s_acc[threadIdx.x] = (b > a || b != b) ? b : a;"]
            finish = [f"{k.out.name}[o] = ({out_t})s_acc[0];"]
        elif k.op == "argmax":
            # r, the flat index over the reduced axes, is the index argmax returns.
            init = [f"{acc_t} acc = {_lowest(k.acc_dtype)};", "int64_t best = -1;"]
            body = [f"const {in_t} v = {load};",
                    "if (best < 0 || v > acc || (v != v && acc == acc)) {  /* the first maximum; NaN wins */",
                    "    acc = v;",
                    "    best = r;",
                    "}"]
            combine = [f"if (sg_argmax_better<{acc_t}>(s_acc[threadIdx.x + width], s_best[threadIdx.x + width], "
                       f"s_acc[threadIdx.x], s_best[threadIdx.x])) {{",
                       "    s_acc[threadIdx.x] = s_acc[threadIdx.x + width];",
                       "    s_best[threadIdx.x] = s_best[threadIdx.x + width];",
                       "}"]
            finish = [f"{k.out.name}[o] = s_best[0] < 0 ? 0 : s_best[0];"]
            self.argmax = True
        else:
            raise NotImplementedError(f"no CUDA lowering for reduction {k.op!r}")
        body = prologue + body
        if k.epilogue_statements:  # the reduced value goes through the fused epilogue before it is stored
            value = {"sum": _convert("s_acc[0]", k.acc_dtype, k.reduced_dtype), "max": "s_acc[0]",
                     "argmax": "(s_best[0] < 0 ? 0 : s_best[0])"}[k.op]
            finish = [f"const {D.C_TYPES[k.reduced_dtype]} {REDUCED} = {value};", *self.epilogue_lines(k, "o")]
        buffers = [k.input.buffer] if k.input.buffer is not None else []
        buffers += [op.view.buffer for op in [*k.operands, *k.epilogue] if op.view.buffer is not None]
        params, args = self.params(buffers, k.out)
        return dict(kind="reduce", name=k.name, comments=[comment(line) for line in k.lines], params=params,
                    args=args, op=k.op, acc_t=acc_t, init=init, body=body, combine=combine, finish=finish,
                    n_out=self._numel([s for s, _ in k.kept]), n_red=self._numel([s for s, _ in k.reduced]),
                    split_out=self._split("o", "rest", [self.ex.size(s) for s, _ in k.kept], "o", [*init, *body]),
                    split_red=self._split("r", "rrest", [self.ex.size(s) for s, _ in k.reduced], "r", body))

    def row_kernel(self, k: RowKernel) -> dict:
        """One block per row: threads stride over the row's elements, each reduction combines the
        threads' accumulators with a deterministic block tree (`sg_block_sum` / `sg_block_max`), every
        thread computes the per-row values, thread 0 stores them."""
        sizes = [self.ex.size(s) for s in k.rows]
        loop_vars = [f"o{d}" for d in range(len(sizes))] + ["c"]
        passes, shared = [], []
        for p in self.row_pass_lines(k, loop_vars):
            finish = []
            for r, value in zip(p["reductions"], p["reduced"]):  # value: this thread's part, NaN folded in
                acc_t = D.C_TYPES[r.acc_dtype]
                if acc_t not in shared:
                    shared.append(acc_t)
                combined = f"sg_block_{r.op}<{acc_t}>({value}, s_{acc_t})"
                finish.append(f"const {D.C_TYPES[r.dtype]} {r.name} = {_convert(combined, r.acc_dtype, r.dtype)};")
            stores = [f"if (threadIdx.x == 0) {line}" for line in p["row_stores"]]
            passes.append(dict(p, finish=finish + p["after"] + stores))
        self.rows = True
        row = self.element_lines(_Body(k.operands, []), loop_vars)
        text = [*row, *(line for p in passes for line in [*p["body"], *p["finish"]])]
        reads = [o.view.buffer for o in [*k.operands, *(o for p in k.passes for o in p.operands)]
                 if o.view.buffer is not None]
        params, args = self.params(reads, k.outs)
        return dict(kind="row", name=k.name, comments=[comment(k.summary())] + [comment(l) for l in k.lines],
                    params=params, args=args, shared=shared, row=row, passes=passes, size=self.ex.size(k.size),
                    n_rows=self._numel(k.rows), split=self._split("o", "rest", sizes, "o", text))

    def matmul_kernel(self, k: MatmulKernel) -> dict:
        if k.out.dtype not in ("float32", "float64"):
            raise NotImplementedError(f"no CUDA matmul for dtype {k.out.dtype}")
        self.gemm = True
        a, b = k.a, k.b

        def ptr(v):
            return v.buffer.name if v.offset == 0 else f"{v.buffer.name} + {self.ex._paren(v.offset)}"

        params, args = self.params([a.buffer, b.buffer], k.out)
        return dict(kind="matmul", name=k.name, comments=[comment(line) for line in k.lines], params=params,
                    args=args, ctype=D.C_TYPES[k.out.dtype], M=self.ex.size(k.M), N=self.ex.size(k.N),
                    K=self.ex.size(k.K), a=ptr(a), b=ptr(b), out=k.out.name,
                    sam=self.ex.size(a.strides[0]), sak=self.ex.size(a.strides[1]),
                    sbk=self.ex.size(b.strides[0]), sbn=self.ex.size(b.strides[1]))

    def render(self) -> str:
        plan = self.plan
        self.gemm = self.argmax = self.rows = False
        kernels = self.kernels()
        dim_lines = [f"const int64_t d{k} = dims[{k}];  /* Dim {comment(d)} */" for k, d in enumerate(plan.dims)]
        dim_lines.append("(void)dims;")
        # Typed pointers for the buffers the launches pass (only those: nvcc warns about unused ones).
        used = {arg for kc in kernels for arg in kc["args"]}
        pointers = []
        for group, field, const in ((plan.inputs, "inputs", "const "), (plan.variables, "variables", ""),
                                    (plan.consts, "consts", "const "), (plan.outputs, "outputs", "")):
            for b in group:
                if b.name in used:
                    t = D.C_TYPES[b.dtype]
                    pointers.append(f"{const}{t}* {b.name} = ({const}{t}*)st->{field}[{b.index}];  "
                                    f"/* {comment(b.label)} */")
        for b in plan.workspace:
            if b.name in used:
                t = D.C_TYPES[b.dtype]
                pointers.append(f"{t}* {b.name} = ({t}*)((char*)st->workspace + offsets[{b.index}]);  "
                                f"/* {comment(b.label)} */")

        def buffers(group):
            return [dict(name=b.name, index=b.index, ctype=D.C_TYPES[b.dtype], numel=self.ex.size(b.numel),
                         label=comment(b.label)) for b in group]

        variables = []
        for b in plan.variables:
            if not isinstance(b.numel, (int, np.integer)):
                raise NotImplementedError(f"variable {b.label!r}: a symbolic size ({b.numel}) cannot be "
                                          f"allocated up front")
            variables.append(dict(name=b.name, index=b.index, label=comment(b.label),
                                  bytes=int(b.numel) * D.to_numpy(b.dtype).itemsize))
        consts = [dict(self.const(c), index=c.index) for c in plan.consts]
        arguments = [f"dims[{k}] = {comment(d)}" for k, d in enumerate(plan.dims)]
        arguments += [f"inputs[{b.index}] (host) = {comment(b.label)}: "
                      f"{D.SHORT_NAMES[b.dtype]}{_fmt(plan.graph.inputs[b.index].shape)}" for b in plan.inputs]
        arguments += [f"outputs[{b.index}] (host): {D.SHORT_NAMES[b.dtype]}{_fmt(plan.graph.outputs[b.index].shape)}"
                      for b in plan.outputs]
        arguments += [f"variable {b.index} (device) = {comment(b.label)}: "
                      f"{D.SHORT_NAMES[b.dtype]}{_fmt(plan.variable_nodes[b.index].shape)}" for b in plan.variables]
        arguments += [f"offsets[k]: byte offset of temporary ws<k> in the workspace ({len(plan.workspace)} buffers, "
                      f"multiples of {ALIGN}); arena_bytes: the workspace's size"]
        from .. import __version__
        return render("cuda/program.cu.j2", version=__version__,
                      header=[comment(line) for line in plan.header.splitlines()],
                      arguments=arguments, int_pow=self.int_pow, random=self.random, argmax=self.argmax,
                      rows=self.rows,
                      gemm=self.gemm, qualifiers="static __host__ __device__ __forceinline__",
                      consts=consts, kernels=kernels, variables=variables, inputs=buffers(plan.inputs),
                      outputs=buffers(plan.outputs), workspace=buffers(plan.workspace),
                      signature=SIGNATURE, dim_lines=dim_lines, pointers=pointers, align=ALIGN)


def render_source(plan: Plan) -> str:
    """The CUDA source of a kernel plan."""
    return _CudaRenderer(plan).render()


def cuda_source(graph: Graph) -> str:
    """The CUDA C++ source (.cu text) that `backend="cuda"` compiles for `graph`; needs no GPU or nvcc."""
    if not isinstance(graph, Graph):
        raise TypeError(f"cuda_source: expected a symgrad Graph, got {type(graph).__name__}")
    return render_source(lower(passes.optimize(graph), variables=graph.variables))


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
    storage dict is current. Kept per storage dict (the dict `Compiled` passes to run).
    """

    groups: dict[int, "_Shared"] = {}

    def __init__(self, storage: dict):
        self.storage = storage        # held: keeps id(storage) unique while the group lives
        self.version: dict[str, int] = {}
        # Weak: the group lives in a module-level table and must not keep programs alive; a program
        # flushes what it holds to the storage before it goes (close / __del__).
        self.holder: dict[str, weakref.ref] = {}
        self.members: set[int] = set()

    def holding(self, name: str):
        """The program holding the newest value of `name`, or None (the host array is current)."""
        ref = self.holder.get(name)
        return ref() if ref is not None else None

    @classmethod
    def of(cls, storage: dict) -> "_Shared":
        group = cls.groups.get(id(storage))
        if group is None or group.storage is not storage:
            group = cls.groups[id(storage)] = cls(storage)
        return group


class CudaProgram:
    """A graph compiled for the GPU: state in device memory, `run` copies only inputs and outputs."""

    backend = "cuda"

    def __init__(self, graph: Graph, build_only: bool = False, flags: list[str] | None = None,
                 arch: str | None = None, optimize: bool = True):
        self.graph = graph  # as given: its variables are the program's variable slots
        self.timings: dict[str, float] = {}
        self.pass_report: dict = {}
        with timed(self.timings, "passes"):
            self.optimized = passes.optimize(graph, report=self.pass_report) if optimize else graph
        with timed(self.timings, "lower"):
            self.plan = lower(self.optimized, variables=graph.variables)
        with timed(self.timings, "render"):
            self.source = render_source(self.plan)
        self.build_only = bool(build_only)
        self._state = None
        self._group: _Shared | None = None
        if not self.build_only:
            count, why = device_count()
            if count == 0:
                raise RuntimeError(f"backend='cuda': no CUDA device is present ({why}). Use backend='c' or "
                                   f"'numpy' here, or compile(..., build_only=True) / sg.cuda_source(graph) "
                                   f"to only generate and build the CUDA code.")
        with timed(self.timings, "build"):
            built = self._build(flags, arch)
        self.module = built.module
        self.module_name = built.module_name
        self.source_path = built.source_path
        self.library_path = built.library_path
        self._ffi, self._lib = built.module.ffi, built.module.lib
        self._err = self._ffi.new("char[]", ERR_BYTES)
        self._variables = [(v.name, D.to_numpy(v.dtype), tuple(v.shape)) for v in graph.variables]
        self._var_index = {name: k for k, (name, _, _) in enumerate(self._variables)}
        self._inputs = [(v.name, D.to_numpy(v.dtype)) for v in graph.inputs]
        self._updated = [t.name for t, _ in graph.updates]
        self._have: dict[str, int] = {}   # name -> version of the group this program's copy holds
        self._dirty: set[str] = set()     # written before any run linked a storage dict
        self._layouts: dict[tuple, tuple] = {}
        self.memory_plans: dict[tuple, MemoryPlan] = {}  # per Dim binding, as planned for the calls
        # Calls are serialized: they share the device buffers of one state.
        self._lock = threading.Lock()
        if self.build_only:
            return
        handle = self._ffi.new("void**")
        self._check(self._lib.sg_cuda_create(handle, self._err, ERR_BYTES), "creating the device state")
        self._state = handle[0]
        for v in graph.variables:
            self._upload(v.name, np.asarray(v.attrs["init"]))

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
        self._group.members.add(id(self))
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
        group.holder[name] = weakref.ref(self)
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
                if not isinstance(value, np.ndarray) or value.dtype != dtype or value.shape != shape:
                    raise ValueError(f"variable {name!r}: expected a {dtype} array of shape {list(shape)}, got "
                                     f"{getattr(value, 'dtype', type(value).__name__)} "
                                     f"{list(getattr(value, 'shape', ()))}")
            self._upload(name, value)
            self._have[name] = version

    def _flush(self) -> None:
        """Copy the newest values this program holds back to the host storage (which then holds them)."""
        group = self._group
        if group is None:
            return
        for name in list(group.holder):
            if group.holding(name) is self:
                if self._state is not None:
                    group.storage[name][...] = self._download(name)
                del group.holder[name]

    def _leave(self) -> None:
        """Flush, then leave the group (dropping it with its last member)."""
        self._flush()
        group, self._group = self._group, None
        if group is not None:
            group.members.discard(id(self))
            if not group.members:
                _Shared.groups.pop(id(group.storage), None)

    # ---- the memory plan ---------------------------------------------------------
    def _layout(self, key: tuple, bindings: dict) -> tuple:
        """Per Dim binding, made once: output and input shapes, the dims array, and the workspace
        arena's offsets and size from the static memory plan."""
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) >= LAYOUTS_KEPT:  # bound what is kept for past batch sizes
                oldest = next(iter(self._layouts))
                del self._layouts[oldest]
                self.memory_plans.pop(oldest, None)
            outs = [(S.evaluate_shape(v.shape, bindings), D.to_numpy(v.dtype)) for v in self.graph.outputs]
            in_shapes = [S.evaluate_shape(v.shape, bindings) for v in self.graph.inputs]
            # Temporaries share one arena: buffers whose lifetimes do not overlap reuse bytes.
            planned = memory_plan(self.plan, {d: bindings[d] for d in self.plan.dims}, align=ALIGN)
            self.memory_plans[key] = planned
            ffi = self._ffi
            layout = self._layouts[key] = (outs, in_shapes, ffi.new("int64_t[]", list(key) or [0]),
                                           ffi.new("int64_t[]", planned.offsets or [0]), planned.arena_bytes)
        return layout

    @property
    def memory_plan(self) -> MemoryPlan:
        """The arena plan (see `latest_or_assumed`): of the Dim binding first called with most
        recently, else assumed before any call."""
        return latest_or_assumed(self.plan, self.plan.dims, self.memory_plans, ALIGN)

    def report(self, timings: dict | None = None) -> str:
        """Passes, kernels, save/recompute choices, the memory plan and compile time by stage
        (`timings`: earlier stages measured by the caller, such as graph building)."""
        return program_report(self, timings)

    # ---- running -------------------------------------------------------------------
    def run(self, inputs: list, bindings: dict, variables: dict) -> list:
        """Copy the inputs in, run every kernel, copy the outputs out.

        Updates are applied to the device copies of the variables (not to the
        `variables` arrays): `read_variable` returns the current values.
        Calls are serialized: they share the state's device buffers.
        """
        with self._lock:
            return self._run(inputs, bindings, variables)

    def _run(self, inputs: list, bindings: dict, variables: dict) -> list:
        self._require_state()
        try:
            key = tuple(int(bindings[d]) for d in self.plan.dims)
        except KeyError as exc:
            raise ValueError(f"no binding for Dim {exc.args[0]}") from None
        if len(inputs) != len(self._inputs):
            raise TypeError(f"expected {len(self._inputs)} inputs, got {len(inputs)}")
        outs, in_shapes, dims, offsets, arena_bytes = self._layout(key, bindings)
        ffi = self._ffi
        keep, in_ptrs = [], []
        for (name, dtype), shape, array in zip(self._inputs, in_shapes, inputs):
            if not isinstance(array, np.ndarray) or array.dtype != dtype or array.shape != shape \
                    or not array.flags.c_contiguous:
                raise ValueError(f"input {name!r}: expected a C-contiguous {dtype} array of shape {shape}, got "
                                 f"{getattr(array, 'dtype', type(array).__name__)} {getattr(array, 'shape', '')}")
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
