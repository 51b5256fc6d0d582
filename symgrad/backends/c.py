"""The C/OpenMP backend: a kernel plan rendered through templates/c/, built by cffi.

`compile(graph)` lowers the graph (symgrad.backends.lowering), renders one
C11 file (symgrad.backends.render with the C/OpenMP row of
symgrad.backends.languages) with one function per kernel and one entry point,

    int symgrad_run(const int64_t* dims, void** inputs, void** variables,
                    void** outputs, char* workspace, const int64_t* offsets,
                    sg_context* context);

beside two small ones: `symgrad_workspace_bytes` (how many temporaries, and
the bytes each needs for given dims) and `symgrad_set_num_threads` (caps the
calling thread's OpenMP team). Its matmuls call the runtime
(symgrad.backends.runtime), whose header it includes and whose library,
built once per compiler and flags, it links; it builds the file through
the cache (symgrad.backends.cache). Python owns all memory: inputs, variables and
outputs are NumPy arrays passed with `ffi.from_buffer` (no copies);
temporaries live in one workspace array whose layout is computed here from
the Dim bindings, and checked against the sizes the code itself reports.
User names never enter C except inside comments, escaped.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np

from ..ir import dtypes as D
from ..ir import shapes as S
from ..ir.graph import Graph
from ..ir.ops import check_labels, label_checks
from . import cache, runtime
from .. import passes
from .expressions import comment  # noqa: F401  (re-exported: what C comments may hold)
from .languages import (C_BAD_LABEL as BAD_LABEL, C_ENTRY as ENTRY, C_OPENMP, C_SET_THREADS as SET_THREADS,
                        C_SIGNATURE as SIGNATURE, C_WORKSPACE_SIZES as WORKSPACE_SIZES, COLUMN_TILE,  # noqa: F401
                        PARALLEL_MIN)  # noqa: F401
from .lowering import Plan, lower
from . import program_cache
from .memory import ArenaSpec, MemoryPlan, latest_or_assumed, memory_plan
from .render_program import render
from .report import program_report, timed as _timed

_refcount = getattr(sys, "getrefcount", None)  # CPython's; elsewhere outputs are always new arrays
# The program's sg_context (symgrad_runtime.h): Python owns one per program and reads `failed`.
CDEF = ("typedef struct { const char* failed; ...; } sg_context;\n"
        f"{SIGNATURE};\n"
        f"int64_t {WORKSPACE_SIZES}(const int64_t* dims, int64_t* nbytes);\n"
        f"void {SET_THREADS}(int threads);")
LAYOUTS_KEPT = 4                # workspaces kept for the most recent distinct Dim bindings
ALIGN = 64                      # bytes: every workspace buffer starts on a cache line


def render_source(plan: Plan, labels: list = ()) -> str:
    """The C source of a kernel plan; `labels`: (input position, number of classes) of the
    class-label inputs the entry checks before it computes anything."""
    return render(plan, C_OPENMP, labels)


def c_source(graph: Graph) -> str:
    """The C source that `backend="c"` compiles for `graph`; no compiler runs. Its matmuls call the
    runtime (symgrad.backends.runtime.source() holds their code)."""
    return render_source(lower(passes.optimize(graph), variables=graph.variables, matmul_epilogues=True),
                         _label_inputs(graph))


def build_program(source: str, flags: list[str] | None = None) -> cache.BuiltModule:
    """What a C program includes and links: its `source` built (cached) with the runtime's header on
    its include path, linked to the runtime library built with the same `flags` (once per compiler
    and flags; default `cache.default_flags()`)."""
    return cache.build(source, CDEF, flags=flags, headers={runtime.HEADER: runtime.header()},
                       link=runtime.build(flags))


def _label_inputs(graph: Graph) -> list:
    """(input position, number of classes) of each class-label input of `graph` (before the
    passes, which drop the class_labels nodes that mark them)."""
    return [(position, node.attrs["num_classes"]) for position, node in label_checks(graph)]


# ---- the program ------------------------------------------------------------------------

class _ForkedChild:
    """Whether this process was forked (os.fork, multiprocessing's default "fork" start method,
    DataLoader-style workers): then its C programs run on one thread.

    libgomp keeps the threads of a parallel region in a pool for the next one. A forked child
    inherits the pool's bookkeeping but not its threads (fork copies only the calling thread),
    so the child's next parallel region on more than one thread waits for them forever. With
    the OpenMP team capped at one thread (omp_set_num_threads(1) in the calling thread, before
    every call) no region ever reaches the pool. A process started with "spawn" or "forkserver"
    keeps every thread.
    """

    forked = False

    @classmethod
    def after_fork(cls) -> None:
        cls.forked = True


os.register_at_fork(after_in_child=_ForkedChild.after_fork)


class CProgram:
    """A graph compiled to a native module: `run` computes outputs and updates variables in place."""

    backend = "c"
    checks_labels = True  # the entry refuses class labels outside [0, classes) itself (BAD_LABEL)

    def __init__(self, graph: Graph, flags: list[str] | None = None, optimize: bool = True):
        self.graph = graph  # as given: its variables are the program's variable slots
        self.timings: dict[str, float] = {}
        self._optimize = optimize
        self._compiled_graph = None  # (optimized graph, pass report, plan), made on first need
        with _timed(self.timings, "lookup"):
            key = program_cache.key(graph, self.backend, flags=flags, optimize=optimize)
            entry = program_cache.load(key, graph)
        self._program_key = key
        self.from_program_cache = entry is not None
        if entry is None:
            with _timed(self.timings, "passes"):
                optimized, pass_report = self._passes()
            with _timed(self.timings, "lower"):
                plan = self._lower(optimized)
            self._compiled_graph = (optimized, pass_report, plan)
            with _timed(self.timings, "render"):
                self.source = render_source(plan, labels=_label_inputs(graph))
            self.dims, self.arena = list(plan.dims), ArenaSpec.of(plan)
            program_cache.store(key, self.source, self.dims, self.arena)
        else:
            self.source, self.dims, self.arena = entry["source"], entry["dims"], entry["arena"]
        started = time.time()
        with _timed(self.timings, "build"):
            built = build_program(self.source, flags)
        # The library predates this build call: it came from the cache, no compiler ran.
        self.from_cache = built.library_path.stat().st_mtime < started
        self.module = built.module
        self.module_name = built.module_name
        self.source_path = built.source_path
        self.library_path = built.library_path
        self._ffi = built.module.ffi
        self._entry = getattr(built.module.lib, ENTRY)
        self._workspace_bytes = getattr(built.module.lib, WORKSPACE_SIZES)
        self._set_threads = getattr(built.module.lib, SET_THREADS)
        self._context = self._ffi.new("sg_context*")  # what the program keeps between its calls
        self._layouts: dict[tuple, tuple] = {}
        self.memory_plans: dict[tuple, MemoryPlan] = {}  # per Dim binding, as planned for the calls
        self._variables = [(v.name, D.to_numpy(v.dtype), tuple(v.shape)) for v in graph.variables]
        self._inputs = [(v.name, D.to_numpy(v.dtype)) for v in graph.inputs]
        # Pointer arrays filled in place at each call; variable pointers cached while the
        # caller keeps passing the same arrays (the usual case: Compiled owns them).
        self._pointer_arrays = tuple(self._ffi.new("void*[]", max(n, 1)) for n in
                                     (len(graph.inputs), len(graph.variables), len(graph.outputs)))
        self._var_cache = None
        self._lock = threading.Lock()

    # The optimized graph, the pass report and the kernel plan: kept from a compile that made
    # them; remade on first use by a program whose source came from the program cache (the
    # stages are deterministic, so they describe that source).
    def _passes(self) -> tuple:
        report: dict = {}
        optimized = passes.optimize(self.graph, report=report) if self._optimize else self.graph
        return optimized, report

    def _lower(self, optimized: Graph) -> Plan:
        return lower(optimized, variables=self.graph.variables, matmul_epilogues=True)

    def _compiled(self) -> tuple:
        if self._compiled_graph is None:
            optimized, pass_report = self._passes()
            self._compiled_graph = (optimized, pass_report, self._lower(optimized))
        return self._compiled_graph

    @property
    def optimized(self) -> Graph:
        """The graph after the passes (the graph itself with optimize=False)."""
        return self._compiled()[0]

    @property
    def pass_report(self) -> dict:
        """What each pass did: nodes before and after (symgrad.passes.optimize's report)."""
        return self._compiled()[1]

    @property
    def plan(self) -> Plan:
        """The kernel plan the source renders."""
        return self._compiled()[2]

    def _layout(self, key: tuple, bindings: dict) -> tuple:
        """Per Dim binding: output shapes and the workspace (array, offsets), made once and reused."""
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) >= LAYOUTS_KEPT:  # bound the memory held for past batch sizes
                self.memory_plans.pop(next(iter(self._layouts)), None)
                self._layouts.pop(next(iter(self._layouts)))
            outs = [(S.evaluate_shape(v.shape, bindings), D.to_numpy(v.dtype)) for v in self.graph.outputs]
            inputs = [S.evaluate_shape(v.shape, bindings) for v in self.graph.inputs]
            ffi = self._ffi
            dims = ffi.new("int64_t[]", [int(bindings[d]) for d in self.dims] or [0])
            # Temporaries share one arena: buffers whose lifetimes do not overlap reuse bytes.
            planned = self._planned_arena({d: bindings[d] for d in self.dims}, dims)
            self.memory_plans[key] = planned
            offsets, total = planned.offsets, planned.arena_bytes
            raw = np.zeros(total + 2 * ALIGN, dtype=np.uint8)
            shift = (-raw.ctypes.data) % ALIGN
            workspace = raw[shift:shift + total + ALIGN]
            # The last element holds each output's last array (see _outputs), once there is one.
            layout = (outs, inputs, dims, workspace, ffi.from_buffer(workspace), ffi.new("int64_t[]", offsets or [0]),
                      [None] * len(outs))
            self._layouts[key] = layout
        return layout

    def _planned_arena(self, bindings: dict, dims) -> MemoryPlan:
        """The arena plan for one Dim binding (`dims`: the same values, as the C array), its sizes
        checked against the ones the compiled code says its kernels use.

        They differ only when the arena came from a damaged or forged program-cache entry: then
        it is planned again from the kernel plan (which describes this very source: the stages
        are deterministic) and the entry is rewritten. A call never gets a workspace too small.
        """
        ffi = self._ffi
        count = self._workspace_bytes(ffi.NULL, ffi.NULL)
        sizes = ffi.new("int64_t[]", max(count, 1))
        self._workspace_bytes(dims, sizes)
        needed = list(sizes)[:count]
        planned = memory_plan(self.arena, bindings, align=ALIGN)
        if planned.sizes == needed:
            return planned
        self.arena = ArenaSpec.of(self.plan)
        planned = memory_plan(self.arena, bindings, align=ALIGN)
        if planned.sizes != needed:
            raise RuntimeError(f"{self.module_name}: the memory plan sizes the workspace temporaries at "
                               f"{planned.sizes} bytes, the compiled code at {needed}")
        if self.from_program_cache:
            program_cache.store(self._program_key, self.source, self.dims, self.arena)
        return planned

    @property
    def memory_plan(self) -> MemoryPlan:
        """The arena plan (see `latest_or_assumed`): of the Dim binding first called with most
        recently, else assumed before any call."""
        return latest_or_assumed(self.arena, self.dims, self.memory_plans, ALIGN)

    def report(self, timings: dict | None = None) -> str:
        """Passes, kernels, save/recompute choices, the memory plan and compile time by stage
        (`timings`: earlier stages measured by the caller, such as graph building)."""
        return program_report(self, timings)

    def run(self, inputs: list, bindings: dict, variables: dict) -> list:
        """Compute the outputs, then write the updates into `variables` (name -> ndarray) in place.

        Calls are serialized: they share the workspace and the pointer arrays.
        """
        with self._lock:
            return self._run(inputs, bindings, variables)

    def run_checked(self, inputs: list, bindings: dict, variables: dict) -> list:
        """`run` for a caller that has already checked the inputs against the graph's inputs
        (ndarrays of its dtypes, C-contiguous, of the shapes `bindings` give) and serializes its
        calls itself: symgrad.compiled checks each input signature once and holds its storage's
        lock, and a small step should not pay for the same checks and a second lock."""
        return self._run(inputs, bindings, variables, check_inputs=False)

    def _outputs(self, outs: list, held: list, out_ptrs) -> list:
        """The arrays this call's outputs go to, their pointers set in `out_ptrs`. An output array of
        the last call that nobody kept (only `held` and its pointer view refer to it: a step's loss,
        read as a float and dropped) is written again, saving its allocation; otherwise a new one."""
        results = []
        for k, (shape, dtype) in enumerate(outs):
            last = held[k]
            if last is not None and _refcount is not None and _refcount(last[0]) == last[2]:  # nobody kept it
                array, pointer = last[0], last[1]
            else:
                array = np.empty(shape, dtype)
                pointer = self._ffi.from_buffer(array, require_writable=True)
                # Its references now (the local name, the pointer view's) are those it has unused
                # later (held's tuple instead of the name). Counted in a statement of its own: inside
                # the tuple display below, the tuple's first item would be counted too.
                unused = _refcount(array) if _refcount is not None else -1
                held[k] = (array, pointer, unused)
            out_ptrs[k] = pointer
            results.append(array)
        return results

    def _run(self, inputs: list, bindings: dict, variables: dict, check_inputs: bool = True) -> list:
        dims = self.dims
        try:
            key = tuple([int(bindings[d]) for d in dims]) if dims else ()
        except KeyError as exc:
            raise ValueError(f"no binding for Dim {exc.args[0]}") from None
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layout(key, bindings)
        outs, in_shapes, dims_ptr, _, ws_ptr, offsets, held = layout
        if len(inputs) != len(self._inputs):
            raise TypeError(f"expected {len(self._inputs)} inputs, got {len(inputs)}")
        from_buffer = self._ffi.from_buffer
        in_ptrs, var_ptrs, out_ptrs = self._pointer_arrays
        # The cdata views must outlive the call: `keep` holds them.
        keep = [None] * len(inputs)
        if check_inputs:
            for (name, dtype), shape, array in zip(self._inputs, in_shapes, inputs):
                if not isinstance(array, np.ndarray) or (array.dtype is not dtype and array.dtype != dtype) \
                        or array.shape != shape or not array.flags.c_contiguous:
                    raise ValueError(f"input {name!r}: expected a C-contiguous {dtype} array of shape {shape}, "
                                     f"got {getattr(array, 'dtype', type(array).__name__)} "
                                     f"{getattr(array, 'shape', '')}")
        for k, array in enumerate(inputs):
            in_ptrs[k] = keep[k] = from_buffer(array)
        cached = self._var_cache
        if cached is not None:
            # The usual case: the same variable arrays as last call (Compiled owns them); an array
            # replaced, reshaped or re-typed in place is checked again from scratch.
            for (name, dtype, shape), old in zip(self._variables, cached[0]):
                array = variables.get(name)
                if array is not old or array.shape != shape or (array.dtype is not dtype and array.dtype != dtype):
                    cached = self._var_cache = None
                    break
        if cached is None:
            arrays = [variables.get(name) for name, _, _ in self._variables]
            for (name, dtype, shape), array in zip(self._variables, arrays):
                if not isinstance(array, np.ndarray) or array.dtype != dtype or array.shape != shape \
                        or not array.flags.c_contiguous or not array.flags.writeable:
                    raise ValueError(f"variable {name!r}: expected a writeable C-contiguous {dtype} array of "
                                     f"shape {shape}, got {getattr(array, 'dtype', type(array).__name__)} "
                                     f"{getattr(array, 'shape', '')}")
            self._var_cache = (arrays, [from_buffer(a, require_writable=True) for a in arrays])
            for k, p in enumerate(self._var_cache[1]):
                var_ptrs[k] = p
        results = self._outputs(outs, held, out_ptrs)
        if _ForkedChild.forked:
            self._set_threads(1)  # this thread's OpenMP setting: set on each call, whichever thread calls
        status = self._entry(dims_ptr, in_ptrs, var_ptrs, out_ptrs, ws_ptr, offsets, self._context)
        if status != 0:
            if status == runtime.OUT_OF_MEMORY:
                failed = self._ffi.string(self._context.failed).decode()
                raise MemoryError(f"{self.module_name}: kernel {failed} could not allocate the memory it "
                                  f"needs; the call stopped there (outputs and variable updates of the "
                                  f"kernels before it may be written)")
            if status == BAD_LABEL:  # refused before anything ran: say which label, as Python would
                for position, node in label_checks(self.graph):
                    check_labels(inputs[position], S.evaluate(node.attrs["num_classes"], bindings), node,
                                 f"input {self.graph.inputs[position].name!r}")
            raise RuntimeError(f"the compiled program failed with status {status}")
        return results


def compile(graph: Graph, flags: list[str] | None = None, optimize: bool = True, **options) -> CProgram:
    """Compile `graph` to C and build it (cached): the backend protocol's entry point.

    flags: compiler flags instead of the default (`-O3 -march=native -fopenmp`, or SYMGRAD_CFLAGS).
    optimize: run the graph passes (symgrad.passes.optimize) first; False compiles the graph as given.
    """
    if options:
        raise TypeError(f"backend 'c' takes only flags= and optimize=, got {sorted(options)}")
    return CProgram(graph, flags=flags, optimize=optimize)
