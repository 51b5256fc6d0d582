"""The C/OpenMP backend: a kernel plan rendered through the .c templates, built as a plain shared
library and called through cffi's ABI mode.

`compile(graph)` goes through the compile driver (symgrad.backends.driver: passes,
lowering, render, program cache), which renders one C11 file (symgrad.backends.render.renderer
with the C/OpenMP row of symgrad.backends.render.languages) with one function per kernel and
one entry point,

    int symgrad_run(const int64_t* dims, void** inputs, void** variables,
                    void** outputs, char* workspace, const int64_t* offsets,
                    sg_context* context);

beside three small ones: `symgrad_workspace_bytes` (how many temporaries, and
the bytes each needs for given dims), `symgrad_scratch_bytes` (the runtime's scratch
region for given dims: the runtime's own count of what its calls use) and
`symgrad_set_num_threads` (caps the calling thread's OpenMP team). Its matmuls call the runtime
(symgrad.backends.build.runtime), whose header it includes and whose library,
built once per compiler and flags, it links; it builds the file through
the cache (symgrad.backends.build.cache). What every native program does alike (layouts per
Dim binding, memory plan, report, locking, input checks) is symgrad.backends.native's;
this module keeps the cffi build and call, and two hooks through which a data-parallel caller
(symgrad.tools.distributed) acts during a call: `on_gradient_final` (a gradient buffer is final: send
it; `gradients_final_after` says after which kernel each is) and `on_collective` (an all_reduce: sum
this buffer over the processes). Python owns all memory: inputs, variables and outputs are NumPy
arrays passed with `ffi.from_buffer` (no copies); temporaries live in one workspace array whose
layout is computed here from the Dim bindings, and checked against the sizes the code itself reports; the
runtime's scratch region (its GEMMs' packed panels, a Winograd convolution's
transformed tiles) follows them in the same array, sized by the code itself, so a
call allocates nothing.
User names never enter C except inside comments, escaped.
"""

from __future__ import annotations

import functools
import os
import sys
from contextlib import contextmanager

import numpy as np

from .. import settings
from ..step.call_checks import check_array
from ..ir import dtypes as D
from ..ir import shapes as S
from ..ir.graph import Graph
from ..ir import sympy_memo
from ..ir.ops import check_labels, label_checks
from . import host_memory
from .build import cache, importable, runtime, toolchain
from .driver import prepare, source_of
from .render.expressions import comment  # noqa: F401  (re-exported: what C comments may hold)
from .render.kernel_functions import calls
from .kinds.collective import DTYPES as COLLECTIVE_DTYPES
from .render.languages import (C_BAD_LABEL as BAD_LABEL, C_ENTRY as ENTRY, C_OPENMP,
                               C_SCRATCH_BYTES as SCRATCH_BYTES, C_SET_THREADS as SET_THREADS,
                               C_SIGNATURE as SIGNATURE, C_WORKSPACE_SIZES as WORKSPACE_SIZES, COLUMN_TILE,
                               PARALLEL_MIN)  # noqa: F401
from .plan import Plan, gradients_final_after
from .lower.memory import MemoryPlan, memory_plan
from .native import BUILD_NICE, ArenaAhead, Building, NativeProgram
from .render.program import render
from .status import Status

_refcount = getattr(sys, "getrefcount", None)  # CPython's; elsewhere outputs are always new arrays
# The program's sg_context, field for field as symgrad_runtime.h declares it (the program is loaded
# in cffi's ABI mode, which needs the whole layout): Python owns one per program and reads `failed`.
CDEF_CONTEXT_FIELDS = ("int team_warm; double last_call_end; int status; const char* failed; "
                       "void (*gradient_final)(void* data, int64_t variable); void* gradient_final_data; "
                       "int (*collective)(void* data, void* values, int64_t count, int dtype); void* collective_data; "
                       "void* scratch; int64_t scratch_bytes;")
CDEF = (f"typedef struct {{ {CDEF_CONTEXT_FIELDS} }} sg_context;\n"
        f"{SIGNATURE};\n"
        f"int64_t {WORKSPACE_SIZES}(const int64_t* dims, int64_t* nbytes);\n"
        f"int64_t {SCRATCH_BYTES}(const int64_t* dims);\n"
        f"void {SET_THREADS}(int threads);")
ALIGN = 64                      # bytes: every workspace buffer starts on a cache line
HELPERS = importable.c_helpers(ENTRY, WORKSPACE_SIZES, SCRATCH_BYTES, ALIGN)  # the importable module's NumPy call


def render_source(plan: Plan, labels: list = ()) -> str:
    """The C source of a kernel plan; `labels`: (input position, number of classes) of the
    class-label inputs the entry checks before it computes anything."""
    return render(plan, C_OPENMP, labels)


def c_source(graph: Graph) -> str:
    """The C source that `backend="c"` compiles for `graph`; no compiler runs. Its matmuls call the
    runtime (symgrad.backends.build.runtime.source() holds their code)."""
    return source_of(graph, C_OPENMP)


def build_program(source: str, flags: list[str] | None = None, cdef: str = CDEF, announce: str | None = None,
                  ) -> cache.BuiltModule:
    """What a C program includes and links: its `source` built (cached) with the runtime's header on
    its include path, linked to the runtime library built with the same `flags` (once per compiler
    and flags; default `runtime.default_flags()`: the compiler's, with this machine's vector width).
    `cdef`: its declarations (a profiling build has two more, symgrad.backends.profile); `announce`:
    what is compiling, said on stderr if the compiler runs longer than a second (None: nothing is
    said). Its importable module (`import <module_name>` with the cache directory on sys.path) adds
    `run` and `workspace_sizes` (symgrad.backends.build.importable.c_helpers)."""
    flags = runtime.default_flags() if flags is None else flags
    return cache.build(source, cdef, flags=flags, kind="program", headers={runtime.HEADER: runtime.header()},
                       link=runtime.build(flags), announce=announce, helpers=HELPERS)


def describe(plan: Plan, source: str, name: str = "a C program") -> str:
    """`name`: N kernels in M functions, what a long build announces (build.progress)."""
    functions = calls(source, [k.name for k in plan.kernels])
    return f"{name}: {len(plan.kernels)} kernels in {len(functions)} functions"


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


class CProgram(NativeProgram):
    """A graph compiled to a native module: `run` computes outputs and updates variables in place.

    Python owns all memory: the arrays are passed by pointer, the temporaries live in one
    workspace array per Dim binding."""

    backend = "c"
    align = ALIGN
    checks_labels = True  # the entry refuses class labels outside [0, classes) itself (BAD_LABEL)

    def __init__(self, graph: Graph, flags: list[str] | None = None, optimize: bool = True,
                 quiet: bool | None = None, prepared=None):
        super().__init__(graph, C_OPENMP, optimize, prepared, flags=flags, quiet=quiet)
        self.flags = flags  # as given (None: the default); a profiling build of the program uses them too
        self.quiet = quiet
        lib = self.module.lib
        self._entry = getattr(lib, ENTRY)
        self._workspace_bytes = getattr(lib, WORKSPACE_SIZES)
        self._scratch_bytes_of = getattr(lib, SCRATCH_BYTES)
        self._set_threads = getattr(lib, SET_THREADS)
        self._settle_arena()  # the build's last step: a cached arena checked against the code's sizes
        self._context = self._ffi.new("sg_context*")  # what the program keeps between its calls
        self._context_layout = None  # the layout whose scratch region the context holds
        self._collective_error = None  # what the collective hook raised, for the call to raise
        self._variables = [(v.name, D.to_numpy(v.dtype), tuple(v.shape)) for v in graph.variables]
        # Pointer arrays filled in place at each call; variable pointers cached while the
        # caller keeps passing the same arrays (the usual case: Compiled owns them).
        self._pointer_arrays = tuple(self._ffi.new("void*[]", max(n, 1)) for n in
                                     (len(graph.inputs), len(graph.variables), len(graph.outputs)))
        self._var_cache = None

    def on_gradient_final(self, callback) -> None:
        """Have each later call run `callback(k)` as soon as variable slot k (a gradient buffer,
        `graph.variables[k]`) holds its final value, while the rest of the call runs; None: stop.

        The callback runs on the calling thread, between two kernels, holding the program's lock;
        it must not call the program. An exception inside it cannot cross the C code: cffi prints
        it and the call goes on, so a caller that must know catches it inside."""
        if callback is None:
            self._gradient_final = None
            self._context.gradient_final = self._ffi.NULL
            return
        self._gradient_final = self._ffi.callback("void(void*, int64_t)", lambda _data, slot: callback(int(slot)))
        self._context.gradient_final = self._gradient_final  # held by self: C keeps only the pointer

    def gradients_final_after(self) -> dict[int, list[int]]:
        """Kernel position -> the variable slots that on_gradient_final's callback reports after that
        kernel of `self.plan` (symgrad.backends.plan.gradients_final_after): when each gradient becomes
        final, for a caller that plans around it (symgrad.tools.distributed's buckets)."""
        return gradients_final_after(self.plan)

    def on_collective(self, hook) -> None:
        """Have each all_reduce of later calls run `hook(values)` on a flat NumPy view of its buffer,
        which the hook must sum over the processes in place; None: this process alone. An exception
        in the hook ends the call (status SG_COLLECTIVE_FAILED) and is raised by it."""
        if hook is None:
            self._collective = None
            self._context.collective = self._ffi.NULL
            return
        ffi, dtypes = self._ffi, [np.dtype(name) for name in COLLECTIVE_DTYPES]

        def call(_data, values, count, dtype):
            try:
                kind = dtypes[dtype]
                hook(np.frombuffer(ffi.buffer(values, count * kind.itemsize), dtype=kind))
                return int(Status.OK)
            except BaseException as exc:  # cannot cross the C code: raised when the entry returns
                self._collective_error = exc
                return int(Status.COLLECTIVE_FAILED)
        self._collective = ffi.callback("int(void*, void*, int64_t, int)", call)
        self._context.collective = self._collective  # held by self: C keeps only the pointer

    def _build(self, flags: list[str] | None, quiet: bool | None = None) -> cache.BuiltModule:
        # Described only if the compiler runs: a cached module needs neither the plan nor the text scan.
        announce = None if settings.quiet(quiet) else (lambda: describe(self.plan, self.source))
        return build_program(self.source, flags, announce=announce)

    @contextmanager
    def running(self, entry):
        """Calls inside the `with` run `entry` instead of this program's own: the entry of another
        build of the same plan (the profiling build, symgrad.backends.profile), which takes the same
        arguments and workspace. The caller holds the lock that serializes the calls."""
        own, self._entry = self._entry, entry
        try:
            yield
        finally:
            self._entry = own

    def _native_layout(self, key: tuple, planned: MemoryPlan, memory=None) -> tuple:
        """The dims array, the workspace (array, pointer: `memory` where it was made ahead, of
        `arena_memory`'s size) and its offsets, each output's last array (see `_outputs`), once
        there is one, and the runtime's scratch region (pointer, bytes): an array of its own."""
        ffi = self._ffi
        workspace = memory if memory is not None else arena_memory(planned.arena_bytes)
        scratch = arena_memory(planned.scratch_bytes)
        return (ffi.new("int64_t[]", list(key) or [0]), workspace, ffi.from_buffer(workspace),
                ffi.new("int64_t[]", planned.offsets or [0]), [None] * len(self.graph.outputs),
                (ffi.from_buffer(scratch), planned.scratch_bytes))  # the pointer keeps its array alive

    def _scratch_bytes(self, key: tuple) -> int:
        """The runtime's scratch region for these Dim values, as the compiled code counts it
        (symgrad_scratch_bytes) for the calling thread's OpenMP team."""
        return int(self._scratch_bytes_of(self._ffi.new("int64_t[]", list(key) or [0])))

    def _workspace_sizes(self, key: tuple) -> list:
        """The bytes of each temporary, as the compiled code computes them (symgrad_workspace_bytes)."""
        ffi = self._ffi
        count = self._workspace_bytes(ffi.NULL, ffi.NULL)
        sizes = ffi.new("int64_t[]", max(count, 1))
        self._workspace_bytes(ffi.new("int64_t[]", list(key) or [0]), sizes)
        return list(sizes)[:count]

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

    def _variable_pointers(self, variables: dict, var_ptrs) -> None:
        """Point `var_ptrs` at the variable arrays, checked (writeable, C-contiguous, of their
        dtype and shape) whenever they are not the same arrays as last call."""
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
                check_array(f"variable {name!r}", array, dtype, shape, writeable=True)
            self._var_cache = (arrays, [self._ffi.from_buffer(a, require_writable=True) for a in arrays])
            for k, p in enumerate(self._var_cache[1]):
                var_ptrs[k] = p

    def _run(self, inputs: list, bindings: dict, variables: dict, check_inputs: bool) -> list:
        key = self._binding_key(bindings)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layout(key, bindings)
        outs, in_shapes, dims_ptr, _, ws_ptr, offsets, held, (scratch, scratch_bytes) = layout
        if check_inputs:
            self._check_inputs(inputs, in_shapes)
        from_buffer = self._ffi.from_buffer
        in_ptrs, var_ptrs, out_ptrs = self._pointer_arrays
        # The cdata views must outlive the call: `keep` holds them.
        keep = [None] * len(inputs)
        for k, array in enumerate(inputs):
            in_ptrs[k] = keep[k] = from_buffer(array)
        self._variable_pointers(variables, var_ptrs)
        results = self._outputs(outs, held, out_ptrs)
        if _ForkedChild.forked:
            self._set_threads(1)  # this thread's OpenMP setting: set on each call, whichever thread calls
        context = self._context
        if self._context_layout is not layout:  # set once per layout, not on every call
            context.scratch, context.scratch_bytes = scratch, scratch_bytes
            self._context_layout = layout
        status = self._entry(dims_ptr, in_ptrs, var_ptrs, out_ptrs, ws_ptr, offsets, context)
        if status != 0:
            if self._scratch_short(status, key):  # this thread's team outgrew the region: planned again
                return self._run(inputs, bindings, variables, check_inputs)
            self._failed(status, inputs, bindings)
        return results

    def _scratch_short(self, status: int, key: tuple) -> bool:
        """Whether the entry refused a call (nothing computed) because the runtime's scratch region
        is smaller than this thread's team needs (a team larger than the one it was sized for);
        then the layout is dropped, to be made again at the size the code now asks for."""
        context = self._context
        if status != Status.OUT_OF_MEMORY or context.failed == self._ffi.NULL:
            return False
        if self._ffi.string(context.failed).decode() != SCRATCH_BYTES:
            return False
        if self._scratch_bytes(key) <= context.scratch_bytes:
            return False
        self._layouts.pop(key, None)
        self.memory_plans.pop(key, None)
        return True

    def _failed(self, status: int, inputs: list, bindings: dict) -> None:
        """Raise what a nonzero status of the entry means."""
        if status == Status.COLLECTIVE_FAILED:
            error, self._collective_error = self._collective_error, None
            raise error
        if status == Status.OUT_OF_MEMORY:
            failed = self._ffi.string(self._context.failed).decode()
            if failed == SCRATCH_BYTES:
                raise MemoryError(f"{self.module_name}: the runtime's scratch region is smaller than this "
                                  f"thread's OpenMP team needs; nothing was computed")
            raise MemoryError(f"{self.module_name}: kernel {failed} could not allocate the memory it "
                              f"needs; the call stopped there (outputs and variable updates of the "
                              f"kernels before it may be written)")
        if status == BAD_LABEL:  # refused before anything ran: say which label, as Python would
            for position, node in label_checks(self.graph):
                check_labels(inputs[position], S.evaluate(node.attrs["num_classes"], bindings), node,
                             f"input {self.graph.inputs[position].name!r}")
        raise RuntimeError(f"the compiled program failed with status {status}")


def arena_memory(nbytes: int) -> np.ndarray:
    """Zeroed host memory for `nbytes` of a workspace (host_memory's: mapped and faulted in before
    it returns, the call that uses it, or the build's thread, being next), starting at a multiple
    of ALIGN, with ALIGN bytes to spare after them (never empty)."""
    raw = host_memory.zeros(nbytes + 2 * ALIGN, np.uint8, now=True)
    shift = (-raw.ctypes.data) % ALIGN
    return raw[shift:shift + nbytes + ALIGN]


def _arena_ahead(entry) -> dict:
    """{(): ArenaAhead} for a program without Dims (every call's shapes known now): its first call's
    arena planned and its memory mapped while the compiler runs; {} for one with Dims."""
    if entry.dims:
        return {}
    planned = memory_plan(entry.arena, {}, align=ALIGN)
    return {(): ArenaAhead(planned, arena_memory(planned.arena_bytes))}


def compile(graph: Graph, flags: list[str] | None = None, optimize: bool = True, quiet: bool | None = None,
            **options) -> CProgram:
    """Compile `graph` to C and build it (cached): the backend protocol's entry point.

    flags: compiler flags instead of the default (`-O3 -march=native -fopenmp`, or SYMGRAD_CFLAGS).
    optimize: run the graph passes (symgrad.passes.optimize) first; False compiles the graph as given.
    quiet: say nothing on stderr during a long build (default: `$SYMGRAD_QUIET`, symgrad.settings.quiet).
    """
    if options:
        raise TypeError(f"backend 'c' takes only flags=, optimize= and quiet=, got {sorted(options)}")
    return CProgram(graph, flags=flags, optimize=optimize, quiet=quiet)


def compile_in_background(graph: Graph, flags: list[str] | None = None, optimize: bool = True,
                          quiet: bool | None = None, yield_cores: bool = True) -> Building:
    """`compile`, its compiler's build on a thread of its own: the passes, the lowering and the
    render run here (a refusal of the graph raises from this call), the build and the load there;
    `.result()` is the CProgram. A program the program cache holds is loaded here, at once.
    `yield_cores`: its compilers run at a lower priority (BUILD_NICE), leaving the cores to the
    steps running meanwhile, and start once the caller releases the build (`Building.release`:
    a train step's first call has ended); False for the build a caller waits for first (a train
    step's own)."""
    # The program cache's entry (0.1 s of pickling at 12 GPT layers): the build a caller waits for
    # first writes it on its thread once its compilers run, not before they start (if none ran,
    # after the build); a build beside the steps, here and now, not on its thread while they run.
    compilation = prepare(graph, C_OPENMP, optimize, store=yield_cores)

    def meanwhile(compiling=lambda: None) -> None:
        compiling()  # (Building.started: the caller's work meanwhile may go on)
        sympy_memo.flush()  # what the passes derived, written while the compiler runs
        if not yield_cores:  # the build waited for: its first call's arena too (a later one's, when called)
            compilation.ahead.update(_arena_ahead(compilation.entry))
            if () in compilation.ahead:  # its placement stored with the entry: a warm load places nothing
                entry = compilation.entry
                entry.arena = entry.arena.with_placement(compilation.ahead[()].plan, ALIGN)
        compilation.store()

    def build(compiling=lambda: None) -> CProgram:
        with toolchain.while_compiling(functools.partial(meanwhile, compiling)):
            program = CProgram(graph, flags=flags, optimize=optimize, quiet=quiet, prepared=compilation)
        compilation.store()
        return program
    if compilation.from_program_cache:
        # A warm compile: its library is cached too, and loading it here costs less than the
        # steps would lose to a thread competing with their OpenMP team for the cores.
        return Building.finished(CProgram, build())
    # What the build reads on its way to the compiler, read here (the runtime's header and library,
    # cffi): on the build's thread it would wait for Python's lock, shared with the caller's work
    # meanwhile (a train step's predict passes), and the compiler would start that much later.
    runtime.header()
    runtime.build(flags)
    cache.import_ahead()
    # A build beside the steps starts its compilers once the first step has ended (Building's held).
    return Building(CProgram, build, nice=BUILD_NICE if yield_cores else 0, held=yield_cores)
