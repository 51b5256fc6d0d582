"""What `sg.function` returns, and the base of `sg.train_step`'s: compiled graphs with checked calls.

The call objects are the same for every backend. Each call checks names,
types, dtypes, shapes, contiguity and Dim consistency in Python before any
backend code runs, so a refused call changes nothing and never reaches
native code. A parameter's or buffer's value lives in its cell (symgrad/api/cells.py),
shared by every object built from it; the object's other variables
(optimizer state, hyperparameters) live in arrays it owns. The program
updates both in place.
"""

from __future__ import annotations

import threading
from typing import Mapping

import numpy as np

from .. import backends
from ..backends import host_memory
from ..api.cells import cell_of
from .call_checks import (arrays_by_name, bind_inputs, check_label_ranges, check_unique_names, collect_inputs,
                          computed_label_ranges, host_array, refuse_subclass)
from ..ir import dtypes as D
from ..ir import shapes as S
from ..ir.graph import Graph
from ..ir.ops import check_labels, label_checks
from ..ir.value import Value
from ..optim.optimizer import check_hyperparameter

_SIGNATURES_KEPT = 8  # validated input signatures remembered per compiled object
# The program's attributes a compiled object shows as its own: where the build put its files, what
# the caches gave, what the passes, the lowering and the memory plan made (symgrad.backends.native).
PROGRAM_ATTRIBUTES = frozenset({
    "source_path", "library_path", "from_cache", "from_program_cache", "pass_report", "plan", "optimized",
    "dims", "arena", "memory_plan", "memory_plans", "timings", "flags", "quiet"})


class VariableStorage(dict):
    """name -> host array: the variables of a compiled object, shared by the programs of one
    TrainStep. A backend that keeps copies of its own (cuda) records beside the arrays which
    program holds the newest value of each (`sharing`): state of this storage, not of a module.
    `seen`: for such a backend, the version of each parameter's cell that its copies hold."""

    sharing = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: dict[str, int] = {}


# Whether any compiled object in this process keeps variables in memory of its own (cuda). Until
# one does, every cell's array is its current value and calls need not track versions.
_RESIDENT_EXISTS = False


class VariableView(Mapping):
    """A dict-like view of some variables: read copies, assign checked values.

    Reading returns a copy, so user code cannot alias (and corrupt) the
    compiled step's storage; assigning checks dtype and shape, then copies in.
    """

    def __init__(self, owner: "Compiled", names: list[str]):
        self._owner, self._names = owner, names

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._names:
            raise self._missing(name)
        return self._owner._read_variable(name)

    def __setitem__(self, name: str, value) -> None:
        if name not in self._names:
            raise self._missing(name)
        self._owner._write_variable(name, value)

    def _missing(self, name) -> KeyError:
        """The error for a name this view does not hold: the name, the names it holds, and where a
        gradient buffer comes from (a Mapping raises KeyError, so `in` and `get` keep working)."""
        text = f"no variable named {name!r}; have {self._names}"
        if isinstance(name, str) and name.endswith(".grad"):
            text += " (a parameter's .grad buffer is made by the step's first accumulate())"
        return KeyError(text)

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __repr__(self) -> str:
        return "{" + ", ".join(f"{n!r}: array{list(self._owner._storage[n].shape)}" for n in self._names) + "}"


def _cells_of(graph: Graph) -> dict:
    """name -> cell of the graph's parameters and buffers; two variables of one cell are refused."""
    cells, first = {}, {}
    for v in graph.variables:
        cell = cell_of(v)
        if cell is None:
            continue
        other = first.setdefault(id(cell), v)
        if other is not v:
            raise ValueError(f"variables {other.name!r} and {v.name!r} are one parameter under two names "
                             f"(a module renamed it after the graph used it): build the graph again "
                             f"from the module's leaves")
        cells[v.name] = cell
    return cells


def _shared_lock(cells) -> threading.RLock:
    """The lock of the objects built earlier from these cells (a new one if none was): calls of a
    step and of a function of one model take turns, as the programs of one step do. Reentrant: a
    call reads, under it, a value that another object sharing it holds. (A graph joining cells
    of objects that have different locks takes the first; the others keep theirs.)"""
    lock = next((c.lock for c in cells if c.lock is not None), None) or threading.RLock()
    for cell in cells:
        if cell.lock is None:
            cell.lock = lock
    return lock


def _matches(array: np.ndarray, variable: Value) -> bool:
    """Whether `array` can hold `variable`: its shape and dtype."""
    return array.shape == tuple(variable.shape) and array.dtype == np.dtype(D.to_numpy(variable.dtype))


class Compiled:
    """A graph compiled by one backend, with the storage of its variables."""

    def __init__(self, graph: Graph, backend: str, background: bool = False, yield_cores: bool = True,
                 shared: dict | None = None, **options):
        """`background`: where the backend can (C), its compiler builds the program on a thread of
        its own while this object is already usable; `program` waits for it when first asked.
        `yield_cores`: that build's compilers run at a lower priority, leaving the cores to the
        calls made meanwhile (False: the build that is waited for first). `shared`: the storage
        of the programs this one will share it with (a TrainStep's): a variable found there, of
        the same shape and dtype, is not copied again."""
        check_unique_names(graph)
        self.graph = graph
        self.backend = backend
        self._variables = {v.name: v for v in graph.variables}
        # name -> cell: the parameters and buffers, whose values the model owns (symgrad/api/cells.py).
        # `_used_cells` are this graph's, brought up to date around its calls; `_cells` also
        # those of the programs sharing this object's storage (a TrainStep's), for reads and writes.
        self._used_cells = _cells_of(graph)
        self._cells = dict(self._used_cells)
        self._updated_cells = [t.name for t, _ in graph.updates if t.name in self._cells]
        self._bound: dict[tuple, dict] = {}  # validated input signature -> Dim bindings
        # Calls, reads and writes of the variables take turns, on every backend: a step reads the
        # parameters and writes them back, and two at once would lose one's update. The programs
        # of one TrainStep share its storage, and this lock with it; so do all objects built
        # from one model's parameters (their cells carry it).
        self._lock = _shared_lock(self._cells.values())
        module = backends.get(backend)
        starter = getattr(module, "compile_in_background", None) if background else None
        if starter is not None:
            self._building = starter(graph, yield_cores=yield_cores, **options)
            kind = self._building.kind  # the program's class: what is known of it before it is built
        else:
            self._program = kind = module.compile(graph, **options)
        # A backend keeping variables in memory of its own (cuda) works on copies of the cells'
        # values; the others run on the cells' arrays themselves, so every object built from a
        # model computes with its current values and trains them in place.
        self._resident = getattr(kind, "read_variable", None) is not None
        if self._resident:
            global _RESIDENT_EXISTS
            _RESIDENT_EXISTS = True
        # The variables no cell holds (an optimizer's state) are copies of their initial values,
        # all in one region of memory (host_memory.copies), but for those the storage shared with
        # holds already (a region holding one unused copy would stay mapped with the rest).
        shared = shared or {}
        made = {v.name: shared[v.name] for v in graph.variables
                if v.name not in self._cells and v.name in shared and _matches(shared[v.name], v)}
        own = [v for v in graph.variables if v.name not in self._cells and v.name not in made]
        made.update(zip((v.name for v in own), host_memory.copies(v.attrs["init"] for v in own)))
        self._storage = VariableStorage(
            (v.name, self._cells[v.name].read() if self._resident else self._cells[v.name].array)
            if v.name in self._cells else (v.name, made[v.name])
            for v in graph.variables)
        # Labels are values, not signatures: checked on every call, here unless the program does.
        self._label_checks = [] if getattr(kind, "checks_labels", False) else label_checks(graph)
        # Indices the graph computes (a position embedding's arange(T)) have a range in Dims, checked
        # in Python on every new signature: compiled code does not check them.
        self._label_ranges = computed_label_ranges(graph)
        self._attach()

    @property
    def program(self):
        """The backend's compiled program (numpy's: the graph's interpreter), waited for where its
        compiler still runs on a thread of its own (`background`)."""
        program = self.__dict__.get("_program")
        if program is None:
            program = self._program = self._building.result()
        return program

    def _attach(self) -> None:
        # A backend keeping variables in its own memory (cuda) is told which storage dict it
        # shares with the other programs of this object, before any read, write or run.
        if not self._resident:
            return
        attach = getattr(self.program, "attach", None)
        if attach is not None:
            attach(self._storage)

    def close(self) -> None:
        """Free the backend's native resources (device memory); current values stay readable."""
        for sub in getattr(self, "_programs", {}).values():
            sub.close()
        closer = getattr(self.program, "close", None)
        if closer is not None:
            closer()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # What was built, for reading and importing.
    @property
    def source(self) -> str:
        """The emitted source, byte for byte what was compiled (graph text for numpy)."""
        return self.program.source

    @property
    def optimized_graph(self) -> Graph:
        """The graph the program computes: after the passes on C and CUDA, the graph as built on
        NumPy. Printed, it names each value as `source` (its C locals and comments) and
        `report()` (kernels, recompute choices) do: t12 is the same value in all three.
        (`graph` is the graph as built, before the passes, and numbers its values differently.)"""
        return self.program.optimized

    @property
    def decisions(self) -> str:
        """What decide chose for the compiled program, printed: fusion, epilogues, row groups, each
        matmul's implementation, the kernel order ("" for numpy, which plans nothing)."""
        plan = getattr(self.program, "plan", None)
        return plan.decisions if plan is not None else ""

    @property
    def module(self):
        """The imported generated module (None for the numpy backend)."""
        return self.program.module

    @property
    def module_name(self) -> str | None:
        """The generated module's name, `_symgrad_<hash>`: with the cache directory
        (`library_path.parent`) on sys.path, `import` it by that name in any process, symgrad or
        not (docs/guide.md, "Importing a compiled program without symgrad"); None for numpy."""
        return getattr(self.program, "module_name", None)

    def report(self) -> "backends.report.Report":
        """The compilation report (symgrad.backends.report.Report): `print(step.report())` shows
        a summary that fits a screen (step memory at its peak and the largest buffers, compile
        time by stage, the passes' effect in nodes, the ten largest kernels), then the sections,
        each printable alone: `report.passes` (nodes before and after each pass), `.kernels`,
        `.decisions` (save or recompute), `.memory` (the arena beside the naive total and the
        lower bound) and `.compile_time` (by stage, the graph-build time added)."""
        from ..backends.report import Report, Section

        reporter = getattr(self.program, "report", None)
        if reporter is None:
            return Report(Section("summary", "summary", (
                f"backend {self.backend!r} compiles no kernels: {len(self.graph.nodes)} nodes, "
                f"run node by node (no passes, no memory plan)",)))
        timings = self.__dict__.get("timings") or {}  # not __getattr__: that reads the program's
        try:
            return reporter(timings=timings)
        except TypeError:  # a program whose report takes no timings
            return reporter()

    def profile(self, *positional, steps: int = 20, trace=None, shown: int = 20, **named):
        """Where a call's time goes: `steps` calls on these inputs (by name, or by position in
        input order), timed per kernel by the generated code itself (a build of the same program
        with a clock read around each kernel call, symgrad.backends.profile; C only).

        Returns a Profile: `print()` it for the table (the `shown` slowest kernels grouped by
        graph region, the rest in one line; per kernel its calls, ms per step, share of the step,
        FLOPs and bytes per call, GFLOP/s or GB/s against the machine's measured peaks); its
        `rows` hold the same as data. `trace="trace.json"`: also write the calls in Chrome's trace
        event format (Perfetto, chrome://tracing). The variables are put back as they were: the
        profiled calls do not train the model or advance its random streams."""
        from ..backends.profile import profile_program
        from .call_checks import arrays_by_name
        if positional and named:
            raise TypeError("profile takes the inputs by name or by position, not both")
        arrays = list(positional) if positional else arrays_by_name(self.graph, named, "profile")
        if len(arrays) != len(self.graph.inputs):
            raise TypeError(f"profile takes {len(self.graph.inputs)} input(s) "
                            f"{[v.name for v in self.graph.inputs]}, got {len(arrays)}")
        # Dim values for the kernels' FLOP and byte counts (each array's shape; a torch tensor's too)
        bindings = bind_inputs(self.graph.inputs, [a if isinstance(a, np.ndarray) else np.asarray(a) for a in arrays])
        with self._lock:
            saved = {name: self._read_variable(name) for name in self._variables}
            try:
                result = profile_program(self.program, lambda: self._run(arrays), bindings, steps=steps, trace=trace,
                                         name=type(self).__name__)
            finally:
                for name, value in saved.items():
                    self._write_variable(name, value)
        result.shown = shown
        return result

    def __getattr__(self, name):
        # What was built, as the program holds it (PROGRAM_ATTRIBUTES); the rest of the program,
        # its calls and hooks included, is `program`'s own.
        if name in PROGRAM_ATTRIBUTES:
            return getattr(self.program, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _read_variable(self, name: str) -> np.ndarray:
        """A copy of the variable's current value (a parameter's from its cell: the model's)."""
        cell = self._cells.get(name)
        if cell is not None:
            with self._lock:
                return cell.read()
        return self._read_native(name)

    def _read_native(self, name: str) -> np.ndarray:
        """A copy of the value as this object's program holds it."""
        # Only a resident program holds values of its own: the others' are the storage's, read
        # without waiting for a program still building.
        reader = self.program.read_variable if self._resident else None
        with self._lock:
            return reader(name) if reader else self._storage[name].copy()

    def _write_variable(self, name: str, value) -> None:
        node = self._variables[name]
        refuse_subclass(f"variable {name!r}", value)
        array = np.asarray(value)
        if array.shape != tuple(node.shape):
            raise ValueError(f"variable {name!r}: expected shape {S.format_shape(node.shape)}, got {list(array.shape)}")
        if not np.can_cast(array.dtype, D.to_numpy(node.dtype), casting="same_kind"):
            raise TypeError(f"variable {name!r}: cannot store {array.dtype} values in {node.dtype}")
        converted = array.astype(D.to_numpy(node.dtype))
        if node.attrs["role"] == "hyper":
            check_hyperparameter(f"variable {name!r} (a hyperparameter)", converted.item())
        writer = self.program.write_variable if self._resident else None
        cell = self._cells.get(name)
        with self._lock:
            if cell is not None:  # the model's value: for every object built from it
                cell.write(converted)
            elif writer:
                writer(name, converted)
            else:
                self._storage[name][...] = converted

    def _run(self, arrays: list) -> list:
        # bind_inputs depends only on each array's type, shape, dtype and contiguity: a call
        # repeating a validated signature reuses its bindings (one dict hit instead of the
        # checks). Only validated signatures enter the cache, so a bad array still raises.
        key = tuple([(a.shape, a.dtype, a.flags.c_contiguous) for a in arrays if type(a) is np.ndarray])
        if len(key) != len(arrays):  # not all plain arrays: a torch CPU tensor becomes one (host_array)
            arrays = [host_array(f"input {node.name!r}", a) for node, a in zip(self.graph.inputs, arrays)]
            key = tuple([(a.shape, a.dtype, a.flags.c_contiguous) for a in arrays if type(a) is np.ndarray])
        cache = self._bound
        bindings = cache.get(key) if len(key) == len(arrays) else None
        if bindings is None:
            bindings = bind_inputs(self.graph.inputs, arrays)
            if self._label_ranges:
                check_label_ranges(self._label_ranges, bindings)
            if len(key) == len(arrays) and len(arrays) == len(self.graph.inputs):
                if len(cache) >= _SIGNATURES_KEPT:
                    cache.pop(next(iter(cache)))
                cache[key] = bindings
        for position, node in self._label_checks:
            check_labels(arrays[position], S.evaluate(node.attrs["num_classes"], bindings), node,
                         f"input {self.graph.inputs[position].name!r}")
        # The arrays match a checked signature: a backend that can skip checking them again does.
        program = self.program
        with self._lock:
            if not _RESIDENT_EXISTS:  # every cell's array is current, and this call updates it in place
                return getattr(program, "run_checked", program.run)(arrays, bindings, self._storage)
            self._before_run()
            try:
                return getattr(program, "run_checked", program.run)(arrays, bindings, self._storage)
            finally:  # a failed call may have written some updates: count them as changes anyway
                self._after_run()

    def _before_run(self) -> None:
        """Bring the values this call reads up to date (once a backend keeping copies exists): a
        copy older than its cell is replaced by the cell's value (cuda); a cell's array is
        brought up to date from the copy that holds a newer value (numpy, c)."""
        if self._resident:
            seen = self._storage.seen
            for name, cell in self._used_cells.items():
                if seen.get(name) != cell.version:
                    cell.flush()
                    self.program.write_variable(name, cell.array)
                    seen[name] = cell.version
        else:
            for cell in self._used_cells.values():
                if cell.holder is not None:
                    cell.flush()

    def _after_run(self) -> None:
        """Record what the call changed: the copies elsewhere are stale; a program keeping its
        own copies holds the newest values."""
        for name in self._updated_cells:
            cell = self._cells[name]
            if self._resident:
                cell.held_by(self, name)
                self._storage.seen[name] = cell.version
            else:
                cell.version += 1


class CompiledFunction(Compiled):
    """`sg.function(inputs, outputs)`: call with arrays in input order, get arrays back."""

    def __init__(self, graph: Graph, backend: str, single: bool, **options):
        super().__init__(graph, backend, **options)
        self._single = single  # outputs given as one value: return one array

    def __call__(self, *arrays, **named):
        names = [v.name for v in self.graph.inputs]
        if named:
            if arrays:
                raise TypeError(f"function takes its inputs {names} by position or by name, not both")
            arrays = arrays_by_name(self.graph, named, "function")
        elif len(arrays) != len(names):
            raise TypeError(f"function takes {len(names)} positional input(s) {names} (or them by name), "
                            f"got {len(arrays)}")
        outputs = self._run(list(arrays))
        return outputs[0] if self._single else tuple(outputs)


def function(inputs, outputs, backend: str | None = None, **options) -> CompiledFunction:
    """Compile a graph from `inputs` (a list of sg.input values) to `outputs`.

    The call takes NumPy arrays (or torch CPU tensors, read in place where
    contiguous) positionally in input order, or by input name, and returns one
    array, or a tuple when `outputs` is a list. `backend`: by default "c" where
    a C compiler is found, else "numpy" with a warning (backends.resolve).
    Parameters the outputs read have their current values at each call,
    whenever the function was built: what a train step of the same model has
    trained so far, or what `load_state_dict` set (they are the model's,
    symgrad/api/cells.py). Updates that layers attach to the values the outputs compute run on every call,
    as they do in a train step: Dropout draws a fresh mask each call
    (reproducibly from sg.manual_seed), BatchNorm in training mode updates its
    running statistics.
    """
    from ..api import effects

    single = isinstance(outputs, Value)
    outs = [outputs] if single else list(outputs)
    inputs = [inputs] if isinstance(inputs, Value) else list(inputs)
    for k, v in enumerate([*inputs, *outs]):
        if not isinstance(v, Value):
            raise TypeError(f"function: expected graph values, got {type(v).__name__} at position {k}")
    given = {id(v) for v in inputs}
    missing = [v.name for v in collect_inputs(outs) if id(v) not in given]
    if missing:
        raise ValueError(f"function: outputs depend on inputs {missing} that are not in the inputs list")
    return CompiledFunction(Graph(inputs, outs, effects.collect(outs)), backends.resolve(backend), single,
                            **options)
