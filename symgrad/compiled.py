"""What `sg.function` returns, and the base of `sg.train_step`'s: compiled graphs with checked calls.

The call objects are the same for every backend. Each call checks names,
types, dtypes, shapes, contiguity and Dim consistency in Python before any
backend code runs, so a refused call changes nothing and never reaches
native code. Variables (parameters, optimizer state, hyperparameters) live
in arrays the object owns, and the program updates them in place.
"""

from __future__ import annotations

import threading
import weakref
from typing import Mapping

import numpy as np

from . import backends
from .call_checks import bind_inputs, check_unique_names, collect_inputs, refuse_subclass
from .ir import dtypes as D
from .ir import shapes as S
from .ir.graph import Graph
from .ir.ops import check_labels, label_checks
from .ir.value import Value
from .optim.optimizer import check_hyperparameter

_SIGNATURES_KEPT = 8  # validated input signatures remembered per compiled object


class VariableStorage(dict):
    """name -> host array: the variables of a compiled object, shared by the programs of one
    TrainStep. A backend that keeps copies of its own (cuda) records beside the arrays which
    program holds the newest value of each (`sharing`): state of this storage, not of a module."""

    sharing = None


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


# id(variable) -> (weak reference to the variable, weak reference to the step or function built last
# that updates it, that object's storage): where a variable's trained value lives, for
# Module.state_dict(). Keyed by id, not by the value (Value.__eq__ builds a graph node); an entry
# goes when its variable dies. The storage is held so that a value stays readable after its step
# is collected (a CUDA program copies its device values there when it is freed).
_HOLDERS: dict[int, tuple[weakref.ref, weakref.ref, dict]] = {}


def hold(compiled: "Compiled") -> None:
    """Record `compiled` as the holder of the current value of every variable its graph updates."""
    for target, _ in compiled.graph.updates:
        key = id(target)
        _HOLDERS[key] = (weakref.ref(target, lambda _ref, key=key: _HOLDERS.pop(key, None)),
                         weakref.ref(compiled), compiled._storage)


def current_value(variable: Value) -> np.ndarray:
    """A copy of `variable`'s value now: as the step or function built last that updates it holds
    it (the trained value), or its initial value when nothing compiled updates it."""
    entry = _HOLDERS.get(id(variable))
    if entry is None or entry[0]() is not variable:
        return np.array(variable.attrs["init"], copy=True)
    holder = entry[1]()
    if holder is not None:
        return holder._read_variable(variable.name)
    return np.array(entry[2][variable.name], copy=True)


class Compiled:
    """A graph compiled by one backend, with the storage of its variables."""

    def __init__(self, graph: Graph, backend: str, **options):
        check_unique_names(graph)
        self.graph = graph
        self.backend = backend
        self._variables = {v.name: v for v in graph.variables}
        self._storage = VariableStorage((v.name, np.array(v.attrs["init"], copy=True)) for v in graph.variables)
        self._bound: dict[tuple, dict] = {}  # validated input signature -> Dim bindings
        # Calls, reads and writes of the variables take turns, on every backend: a step reads the
        # parameters and writes them back, and two at once would lose one's update. The programs
        # of one TrainStep share its storage, and this lock with it.
        self._lock = threading.Lock()
        self.program = backends.get(backend).compile(graph, **options)
        # Labels are values, not signatures: checked on every call, here unless the program does.
        self._label_checks = [] if getattr(self.program, "checks_labels", False) else label_checks(graph)
        self._attach()

    def _attach(self) -> None:
        # A backend keeping variables in its own memory (cuda) is told which storage dict it
        # shares with the other programs of this object, before any read, write or run.
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
    def module(self):
        """The imported generated module (None for the numpy backend)."""
        return self.program.module

    def report(self) -> str:
        """A readable multi-line compilation report: nodes before and after each pass, kernels,
        save/recompute choices, arena bytes beside the naive total and the lower bound, and the
        compile time by stage (the program's own report, with the graph-build time added)."""
        reporter = getattr(self.program, "report", None)
        if reporter is None:
            return (f"backend {self.backend!r} compiles no kernels: {len(self.graph.nodes)} nodes, "
                    f"run node by node (no passes, no memory plan)")
        timings = self.__dict__.get("timings") or {}  # not __getattr__: that reads the program's
        try:
            return reporter(timings=timings)
        except TypeError:  # a program whose report takes no timings
            return reporter()

    def __getattr__(self, name):
        # module_name, source_path, report(), ...: whatever the program offers.
        if name.startswith("_") or name in ("program", "graph"):
            raise AttributeError(name)
        return getattr(self.program, name)

    def _read_variable(self, name: str) -> np.ndarray:
        reader = getattr(self.program, "read_variable", None)
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
        writer = getattr(self.program, "write_variable", None)
        with self._lock:
            if writer:
                writer(name, converted)
            else:
                self._storage[name][...] = converted

    def _run(self, arrays: list) -> list:
        # bind_inputs depends only on each array's type, shape, dtype and contiguity: a call
        # repeating a validated signature reuses its bindings (one dict hit instead of the
        # checks). Only validated signatures enter the cache, so a bad array still raises.
        try:
            key = tuple([(a.shape, a.dtype, a.flags.c_contiguous) for a in arrays
                         if type(a) is np.ndarray])
        except AttributeError:
            key = None
        cache = self._bound
        bindings = cache.get(key) if key is not None and len(key) == len(arrays) else None
        if bindings is None:
            bindings = bind_inputs(self.graph.inputs, arrays)
            if key is not None and len(key) == len(arrays) and len(arrays) == len(self.graph.inputs):
                if len(cache) >= _SIGNATURES_KEPT:
                    cache.pop(next(iter(cache)))
                cache[key] = bindings
        for position, node in self._label_checks:
            check_labels(arrays[position], S.evaluate(node.attrs["num_classes"], bindings), node,
                         f"input {self.graph.inputs[position].name!r}")
        # The arrays match a checked signature: a backend that can skip checking them again does.
        program = self.program
        with self._lock:
            return getattr(program, "run_checked", program.run)(arrays, bindings, self._storage)


class CompiledFunction(Compiled):
    """`sg.function(inputs, outputs)`: call with arrays in input order, get arrays back."""

    def __init__(self, graph: Graph, backend: str, single: bool, **options):
        super().__init__(graph, backend, **options)
        self._single = single  # outputs given as one value: return one array
        hold(self)

    def __call__(self, *arrays):
        names = [v.name for v in self.graph.inputs]
        if len(arrays) != len(names):
            raise TypeError(f"expected {len(names)} positional input(s) {names}, got {len(arrays)}")
        outputs = self._run(list(arrays))
        return outputs[0] if self._single else tuple(outputs)


def function(inputs, outputs, backend: str = "numpy", **options) -> CompiledFunction:
    """Compile a graph from `inputs` (a list of sg.input values) to `outputs`.

    The call takes NumPy arrays positionally in input order and returns one
    array, or a tuple when `outputs` is a list. Parameters the outputs read
    keep their initial values. Updates that layers attach to the values the
    outputs compute run on every call, as they do in a train step: Dropout
    draws a fresh mask each call (reproducibly from sg.manual_seed), BatchNorm
    in training mode updates its running statistics.
    """
    from . import effects

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
    return CompiledFunction(Graph(inputs, outs, effects.collect(outs)), backend, single, **options)
