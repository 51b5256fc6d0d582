"""The base of the native programs (C, CUDA): what a compiled graph is, whichever machine runs it.

A `NativeProgram` holds what the compile driver (symgrad.backends.driver) made: the
source, the optimized graph, the pass report, the kernel plan and the arena spec, and the
built module. It owns what every backend does the same way around a call:

- one layout per Dim binding (output and input shapes, the arena's memory plan, and what
  the backend makes of them: `_native_layout`), the most recent `LAYOUTS_KEPT` kept;
- the memory plan, checked against the sizes the compiled code reports where it reports
  them (`_workspace_sizes`), and `report()`;
- the lock that serializes calls, and the checks of the arrays a caller hands to `run`
  (symgrad.step.call_checks; `run_checked` is for a caller that has checked them itself).

A backend subclass supplies `_build`, `_native_layout` and `_run`, and calls `_settle_arena` once
it can ask its module for sizes (the build's last step).
"""

from __future__ import annotations

import functools
import os
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass

from ..step.call_checks import check_arrays
from ..ir import dtypes as D
from ..ir import shapes as S
from ..ir.graph import Graph
from . import driver
from .build import program_cache, toolchain
from .build.cache import BuiltModule
from .decide.fusion import DEFAULT_DIM
from .render.languages import Language
from .lower.memory import ArenaSpec, MemoryPlan, arena_sizes, latest_or_assumed, memory_plan
from .report import Report, program_report


class Building:
    """A program whose compiler runs on a thread of its own: a train step's predict program, built
    while the first steps run (on two cores its build took a fifth of a GPT's time to its first
    step), and the step's own, built while the predict program's passes run. `kind`: the
    program's class, for what is known of it before it exists; `nice`: how much lower in priority
    its compilers run; `result()` waits for the program and returns it, or raises what its build
    raised; `started()` waits only until its compilers run (or it has ended).

    `held`: the build waits, before its compilers start, until `release()` (a train step's first
    call has ended: its OpenMP team had the cores to itself, and the nanoGPT-size first step took
    0.32 s instead of 0.52 s beside the predict program's compilers), or HELD_AT_MOST seconds.
    Whatever waits for the program, forks the process or ends it releases the build first.

    A process forks only once every build has ended (`release_all`): a child gets no copy of the
    thread, and would wait for it, or find the build cache's lock held, forever."""

    _running: "set[Building]" = set()
    _guard = threading.Lock()
    HELD_AT_MOST = 3.0  # seconds: a step never called does not leave its predict program unbuilt

    def __init__(self, kind: type, build, nice: int, held: bool = False):
        """`build(compiling)`: makes the program, calling `compiling()` once its compilers run."""
        self.kind = kind
        self._program, self._error = None, None
        self._released = threading.Event()
        if not held:
            self._released.set()
        self._compiling = threading.Event()
        build = functools.partial(build, self._compiling.set)
        self._thread = threading.Thread(target=self._run, args=(build, nice), name="symgrad-build")
        with Building._guard:
            Building._running.add(self)
        self._thread.start()

    @classmethod
    def finished(cls, kind: type, program) -> "Building":
        """A build that needed no thread: `program`, built already."""
        done = cls.__new__(cls)
        done.kind, done._program, done._error, done._thread = kind, program, None, None
        done._released, done._compiling = threading.Event(), threading.Event()
        done._released.set()
        done._compiling.set()
        return done

    def _run(self, build, nice: int) -> None:
        try:
            self._released.wait(self.HELD_AT_MOST)
            toolchain.yield_to_other_work(nice)
            self._program = build()
        except BaseException as exc:  # raised by result(), on the thread that asks for the program
            self._error = exc
        finally:
            self._compiling.set()  # (it ran none, or they are done)
            with Building._guard:
                Building._running.discard(self)

    def release(self) -> None:
        """Let a held build start its compilers now."""
        self._released.set()

    def started(self, timeout: float | None = None) -> None:
        """Wait until the build's compilers run, or until it has ended (a build that needed none, or
        failed), or `timeout` seconds. The Python work a build does before its compilers start (its
        files, keys and locks) waits on Python's lock at each file it writes while another thread
        computes: a 12-layer GPT's compilers started 0.14 s late beside its predict program's passes.
        (A build waiting for another's compilers, this process's or another's, waits that long.)"""
        self._compiling.wait(timeout)

    def result(self):
        self.release()
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self._program

    @classmethod
    def release_all(cls, wait: bool = False) -> None:
        """Let every held build start its compilers; `wait`: then wait until every build has ended
        (before a fork; a test's builds at its end)."""
        with cls._guard:
            running = list(cls._running)
        for building in running:
            building.release()
        for building in running if wait else ():
            building._thread.join()


os.register_at_fork(before=lambda: Building.release_all(wait=True))
# At the interpreter's exit, before it waits for the build threads (threading's own hook, which
# concurrent.futures uses too): a held build starts at once rather than after HELD_AT_MOST.
getattr(threading, "_register_atexit", lambda hook: None)(Building.release_all)

# How much lower in priority the compilers of a build on its own thread run: the steps running
# meanwhile keep the cores. Their OpenMP teams wait at every kernel's barrier for each thread, and
# a compiler holding the core of one stretched a GPT step's 434 barriers.
BUILD_NICE = 10


@dataclass
class ArenaAhead:
    """A first call's arena made before the program exists, while its compiler runs (the cores'
    idle time for the Python thread that waits): the memory plan, and the backend's memory for
    it (None where it has none to make ahead). A 12-layer GPT's first step spent 0.1 s on them."""

    plan: MemoryPlan
    memory: object = None


class NativeProgram(ABC):
    """A graph compiled to a native module: `run` computes outputs and applies the updates."""

    backend = ""
    align = 64            # bytes: where each workspace temporary may start
    layouts_kept = 4      # layouts kept for the most recent distinct Dim bindings
    checks_labels = False  # whether the compiled entry refuses out-of-range class labels itself

    def __init__(self, graph: Graph, language: Language, optimize: bool = True, prepared=None, **build_options):
        """Compile `graph` for `language` (symgrad.backends.driver; `prepared`: its stages already
        run, `driver.prepare`'s Compilation) and build it with `self._build(**build_options)`."""
        self.graph = graph  # as given: its variables are the program's variable slots
        compilation = prepared if prepared is not None else driver.prepare(graph, language, optimize)
        entry = compilation.entry
        self.timings: dict[str, float] = compilation.timings
        self.source, self.dims, self.arena = entry.source, entry.dims, entry.arena
        self._program_entry = entry  # optimized, pass_report and plan: read from it (a cached one unpickles them then)
        self.from_program_cache = compilation.from_program_cache
        self._program_key = compilation.key
        driver.build(compilation, lambda source: self._build(**build_options))
        built = compilation.built
        self.from_cache = compilation.from_cache
        self.module = built.module
        self.module_name = built.module_name
        self.source_path = built.source_path
        self.library_path = built.library_path
        self._ffi = built.module.ffi
        self._layouts: dict[tuple, tuple] = {}
        self.memory_plans: dict[tuple, MemoryPlan] = {}  # per Dim binding, as planned for the calls
        self._ahead: dict[tuple, ArenaAhead] = compilation.ahead  # taken by the first call of its binding
        self._input_nodes = list(graph.inputs)
        # Calls are serialized: they share the workspace and whatever else a layout holds.
        self._lock = threading.Lock()

    @property
    def optimized(self) -> Graph:
        """The graph after the passes (the graph itself with optimize=False)."""
        return self._program_entry.optimized

    @property
    def pass_report(self) -> dict:
        """What each pass did (symgrad.passes.optimize's report)."""
        return self._program_entry.pass_report

    @property
    def plan(self):
        """The kernel plan the source renders (symgrad.backends.lower.lowering.Plan)."""
        return self._program_entry.plan

    @abstractmethod
    def _build(self, **options) -> BuiltModule:
        """The backend's compiler run on `self.source`, through the build cache."""
        raise NotImplementedError

    # ---- per Dim binding ----------------------------------------------------------------
    def _binding_key(self, bindings: dict) -> tuple:
        """The Dim values of `bindings`, in the entry point's order: the key of a layout."""
        try:
            return tuple([int(bindings[d]) for d in self.dims]) if self.dims else ()
        except KeyError as exc:
            raise ValueError(f"no binding for Dim {exc.args[0]}") from None

    def _layout(self, key: tuple, bindings: dict) -> tuple:
        """Per Dim binding, made once: (output shapes and dtypes, input shapes, *the backend's
        part: `_native_layout`)."""
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) >= self.layouts_kept:  # bound what is kept for past batch sizes
                oldest = next(iter(self._layouts))
                del self._layouts[oldest]
                self.memory_plans.pop(oldest, None)
            outs = [(S.evaluate_shape(v.shape, bindings), D.to_numpy(v.dtype)) for v in self.graph.outputs]
            inputs = [S.evaluate_shape(v.shape, bindings) for v in self.graph.inputs]
            # Temporaries share one arena: buffers whose lifetimes do not overlap reuse bytes.
            ahead = self._ahead.pop(key, None)
            planned = self._planned_arena(key, {d: bindings[d] for d in self.dims}, ahead)
            self.memory_plans[key] = planned
            memory = ahead.memory if ahead is not None and ahead.plan is planned else None
            layout = self._layouts[key] = (outs, inputs, *self._native_layout(key, planned, memory))
        return layout

    @abstractmethod
    def _native_layout(self, key: tuple, planned: MemoryPlan, memory=None) -> tuple:
        """What the backend keeps per Dim binding besides the shapes (native arrays, a workspace);
        `memory`: the arena's, made ahead by the backend (ArenaAhead), or None."""
        raise NotImplementedError

    def _workspace_sizes(self, key: tuple) -> list | None:
        """The bytes of each temporary as the compiled code computes them for these Dim values;
        None where the code does not report them."""
        return None

    def _scratch_bytes(self, key: tuple) -> int:
        """The bytes of the runtime's scratch region as the compiled code counts them for these Dim
        values (after the arena's temporaries); 0 where the code has none."""
        return 0

    def _settle_arena(self) -> None:
        """At the build, after the backend has loaded its module: the arena of a program-cache
        hit checked against the compiled code's own sizes (every Dim at DEFAULT_DIM).

        They differ only when the arena came from a damaged or forged entry: then it is planned
        again from the kernel plan (which describes this very source) and the entry is rewritten,
        here, so that a call only runs and never writes the cache (issue 33).
        """
        if not self.from_program_cache:
            return
        key = tuple(DEFAULT_DIM for _ in self.dims)
        needed = self._workspace_sizes(key)
        if needed is None or arena_sizes(self.arena, dict(zip(self.dims, key))) == needed:
            return
        self.arena = ArenaSpec.of(self.plan)
        program_cache.store(self._program_key, self.graph, program_cache.Entry(
            self.source, self.dims, self.arena, self.optimized, self.pass_report, self.plan))

    def _planned_arena(self, key: tuple, bindings: dict, ahead: ArenaAhead | None = None) -> MemoryPlan:
        """The arena plan for one Dim binding (`ahead`'s, where it was made while the compiler
        ran), its sizes checked against the compiled code's own, with the runtime's scratch
        region the compiled code asks for (`_scratch_bytes`).

        The build checked the arena at one binding (`_settle_arena`); should a forged arena agree
        there and not here, it is planned again from the kernel plan for this program (the cache
        is not written during a call). A call never gets a workspace too small.
        """
        planned = ahead.plan if ahead is not None else memory_plan(self.arena, bindings, align=self.align)
        planned.scratch_bytes = self._scratch_bytes(key)
        needed = self._workspace_sizes(key)
        if needed is None or planned.sizes == needed:
            return planned
        self.arena = ArenaSpec.of(self.plan)
        planned = memory_plan(self.arena, bindings, align=self.align)
        planned.scratch_bytes = self._scratch_bytes(key)
        if planned.sizes != needed:
            raise RuntimeError(f"{self.module_name}: the memory plan sizes the workspace temporaries at "
                               f"{planned.sizes} bytes, the compiled code at {needed}")
        return planned

    @property
    def memory_plan(self) -> MemoryPlan:
        """The arena plan (see `latest_or_assumed`): of the Dim binding first called with most
        recently, else assumed before any call."""
        planned = latest_or_assumed(self.arena, self.dims, self.memory_plans, self.align)
        if not self.memory_plans:  # the compiled code's scratch for the assumed Dims
            planned.scratch_bytes = self._scratch_bytes(self._binding_key(planned.bindings))
        return planned

    def report(self, timings: dict | None = None) -> Report:
        """The compilation report (symgrad.backends.report.Report): a summary, then passes,
        kernels, save/recompute choices, the memory plan and compile time by stage (`timings`:
        earlier stages measured by the caller, such as graph building)."""
        return program_report(self, timings)

    # ---- calls ----------------------------------------------------------------------------
    def run(self, inputs: list, bindings: dict, variables: dict) -> list:
        """Compute the outputs and apply the updates, the inputs checked first (C-contiguous
        ndarrays of the graph inputs' dtypes, of the shapes `bindings` give).

        Calls are serialized: they share the workspace and the native state.
        """
        with self._lock:
            return self._run(inputs, bindings, variables, check_inputs=True)

    def run_checked(self, inputs: list, bindings: dict, variables: dict) -> list:
        """`run` for a caller that has already checked the inputs against the graph's inputs
        (symgrad.step.call_checks.bind_inputs) and serializes its calls itself: symgrad.step.compiled
        checks each input signature once and holds its storage's lock, and a small step should
        not pay for the same checks and a second lock."""
        return self._run(inputs, bindings, variables, check_inputs=False)

    def _check_inputs(self, inputs: list, shapes: list) -> None:
        check_arrays("input", self._input_nodes, inputs, shapes)

    @abstractmethod
    def _run(self, inputs: list, bindings: dict, variables: dict, check_inputs: bool) -> list:
        """The backend's call of its entry point: outputs computed, updates applied."""
        raise NotImplementedError
