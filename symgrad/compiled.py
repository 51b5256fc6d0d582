"""What `sg.function` and `sg.train_step` return: compiled graphs with checked calls.

The call objects are the same for every backend. Each call checks names,
types, dtypes, shapes, contiguity and Dim consistency in Python before any
backend code runs, so a refused call changes nothing and never reaches
native code. Variables (parameters, optimizer state, hyperparameters) live
in arrays the object owns, and the program updates them in place.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict
from typing import Iterable, Mapping

import numpy as np
import sympy

from . import backends
from .ir import dtypes as D
from .ir import shapes as S
from .ir.graph import Graph, toposort
from .ir.ops import check_labels, label_checks
from .ir.value import Value
from .optim.optimizer import check_hyperparameter

_SIGNATURES_KEPT = 8  # validated input signatures remembered per compiled object


def bind_inputs(inputs: Iterable[Value], arrays: Iterable) -> dict:
    """Check each array against its input's dtype and shape; return the Dim bindings.

    Raises TypeError (not an array, wrong dtype) or ValueError (rank, size,
    inconsistent Dim, not C-contiguous), naming the input and both shapes.
    """
    bindings: dict = {}
    pending = []
    for node, array in zip(inputs, arrays):
        expected = f"{S.format_shape(node.shape)} ({node.dtype})"
        if not isinstance(array, np.ndarray):
            raise TypeError(f"input {node.name!r}: expected a numpy array of shape {expected}, "
                            f"got {type(array).__name__}")
        _refuse_subclass(f"input {node.name!r}", array)
        got = f"{list(array.shape)} ({array.dtype})"
        if array.dtype != D.to_numpy(node.dtype):
            raise TypeError(f"input {node.name!r}: expected dtype {node.dtype}, got {array.dtype} "
                            f"(shape {expected} expected, {got} given); convert with .astype(np.{node.dtype})")
        if array.ndim != node.ndim:
            raise ValueError(f"input {node.name!r}: expected shape {expected}, got {got}")
        if not array.flags.c_contiguous:
            raise ValueError(f"input {node.name!r}: array of shape {list(array.shape)} is not C-contiguous; "
                             f"pass np.ascontiguousarray(...)")
        for axis, (size, actual) in enumerate(zip(node.shape, array.shape)):
            if isinstance(size, int):
                if size != actual:
                    raise ValueError(f"input {node.name!r}: expected shape {expected}, got {got} "
                                     f"(axis {axis} must be {size})")
            elif isinstance(size, sympy.Symbol):
                if actual < 1:
                    raise ValueError(f"input {node.name!r}: Dim {size} must be at least 1, got shape {got}")
                if size in bindings and bindings[size] != actual:
                    raise ValueError(f"input {node.name!r}: expected shape {expected}, got {got}: "
                                     f"{size} is {bindings[size]} from an earlier input, here {actual}")
                bindings[size] = actual
            else:
                pending.append((node, axis, size, actual, expected, got))
    for node, axis, size, actual, expected, got in pending:
        value = S.evaluate(size, bindings)
        if value != actual:
            raise ValueError(f"input {node.name!r}: expected shape {expected}, got {got} "
                             f"(axis {axis} is {size} = {value})")
    return bindings


def _refuse_subclass(what: str, array) -> None:
    """Refuse an ndarray subclass whose raw data is not what it means (a masked array's mask, a
    matrix's algebra): the backends compute on the raw data. A memory map is its data: accepted."""
    if isinstance(array, np.ndarray) and type(array) is not np.ndarray and not isinstance(array, np.memmap):
        kind = f"{type(array).__module__}.{type(array).__name__}"
        raise TypeError(f"{what}: expected a plain numpy.ndarray, got {kind}, an ndarray subclass whose "
                        f"raw data the compiled code would read without its meaning; pass a plain array "
                        f"(a masked array's .filled(value), np.asarray(matrix))")


def collect_inputs(values: Iterable[Value]) -> list[Value]:
    """The input nodes the values depend on, in the order they were created."""
    return sorted((n for n in toposort(values) if n.op.name == "input"), key=lambda n: n.attrs["serial"])


def _leaf_kind(leaf: Value) -> str:
    """What a graph leaf is, in words: "input", or its variable role (symgrad.sources.ROLES)."""
    return leaf.attrs.get("role", leaf.op.name)


def _check_unique_names(graph: Graph) -> None:
    seen: dict[str, Value] = {}
    for v in [*graph.inputs, *graph.variables]:
        other = seen.setdefault(v.name, v)
        if other is not v:
            raise ValueError(f"two different graph leaves are named {v.name!r} ({_leaf_kind(other)} "
                             f"{other.type_str} and {_leaf_kind(v)} {v.type_str}); names must be unique")


def gradient_buffer_name(param: Value) -> str:
    """The name under which `step.accumulate()` sums `param`'s gradient for `step.apply()`."""
    return f"{param.name}.grad"


def _check_no_gradient_buffer_names(variables: Iterable[Value], params: list[Value], what: str) -> None:
    """Refuse a variable named as a param's gradient buffer: the step's programs share their
    variables by name, so accumulate() would sum into it and apply() would step the param by it."""
    buffers = {gradient_buffer_name(p): p for p in params}
    for v in variables:
        param = buffers.get(v.name)
        if param is not None:
            raise ValueError(f"{what}: {_leaf_kind(v)} {v.name!r} has the name of the gradient buffer of "
                             f"param {param.name!r}, which step.accumulate() and step.apply() use; "
                             f"rename the {_leaf_kind(v)}")


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


def _hold(compiled: "Compiled") -> None:
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
        _check_unique_names(graph)
        self.graph = graph
        self.backend = backend
        self._variables = {v.name: v for v in graph.variables}
        self._storage = {v.name: np.array(v.attrs["init"], copy=True) for v in graph.variables}
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
        _refuse_subclass(f"variable {name!r}", value)
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
        _hold(self)

    def __call__(self, *arrays):
        names = [v.name for v in self.graph.inputs]
        if len(arrays) != len(names):
            raise TypeError(f"expected {len(names)} positional input(s) {names}, got {len(arrays)}")
        outputs = self._run(list(arrays))
        return outputs[0] if self._single else tuple(outputs)


def _arrays_by_name(graph: Graph, batch: dict, what: str) -> list:
    """The arrays of `batch` in the graph's input order; a TypeError naming missing and extra names."""
    names = [v.name for v in graph.inputs]
    missing = [n for n in names if n not in batch]
    extra = [n for n in batch if n not in names]
    if missing or extra:
        raise TypeError(f"{what} takes inputs {names}: "
                        + (f"missing {missing}" if missing else "")
                        + ("; " if missing and extra else "")
                        + (f"unexpected {extra}" if extra else ""))
    return [batch[n] for n in names]


class TrainStep(Compiled):
    """`sg.train_step(...)`: forward, backward and update in one call; returns the loss.

    Besides the fused step, three programs are compiled on first use by the
    same backend, sharing this step's variable storage:

    - `accumulate(**batch)` adds the batch's gradients into buffers
      `<param>.grad` (and performs the layers' own updates, such as
      BatchNorm's running statistics), without touching the parameters;
    - `apply()` runs the optimizer on the buffered gradients, then zeroes them;
    - `predict(**inputs)` computes the `predict=` value(s) only: no
      backward, no optimizer, no gradient buffers.

    Accumulation sums, as PyTorch's `loss.backward()` does over
    micro-batches: with a mean-reduced loss, four accumulations of 16 rows
    give four times the mean gradient of the 64 rows. Divide the loss by the
    number of micro-batches (as one does in PyTorch) to make
    `accumulate` x4 + `apply()` equal one step on the whole batch.
    `step(**batch)` neither reads nor clears the buffers.
    """

    def __init__(self, graph: Graph, backend: str, params: list[Value], update_rule=None, grads=None,
                 predict=None, effects_pairs=(), **options):
        _check_no_gradient_buffer_names(graph.variables, params, "train_step")
        super().__init__(graph, backend, **options)
        self.params = VariableView(self, [p.name for p in params])
        self.state = VariableView(self, [v.name for v in graph.variables
                                         if v.attrs["role"] != "param"])
        self._options = options
        # update_rule(params, grads) -> update pairs: the optimizer, with clipping and groups
        self._param_values, self._update_rule, self._grads = list(params), update_rule, grads
        self._effects = list(effects_pairs)
        self._predict = predict
        self._input_names = [v.name for v in graph.inputs]
        self._programs: dict[str, Compiled] = {}
        self._buffers = None
        _hold(self)  # its programs share its storage: the step holds what they train too

    def __call__(self, **batch) -> float:
        names = self._input_names
        if len(batch) == len(names):
            try:  # the usual call: exactly the input names (no missing, so no extra either)
                arrays = [batch[n] for n in names]
            except KeyError:
                arrays = _arrays_by_name(self.graph, batch, "train step")
        else:
            arrays = _arrays_by_name(self.graph, batch, "train step")
        (loss,) = self._run(arrays)
        return float(loss)

    # ---- accumulation, apply, predict: extra programs over the same storage ----
    def _gradient_buffers(self) -> list[Value]:
        from .sources import variable
        if self._buffers is None:
            self._buffers = [variable(gradient_buffer_name(p), np.zeros(p.shape, D.to_numpy(p.dtype)), role="grad")
                             for p in self._param_values]
        return self._buffers

    def _build(self, kind: str) -> Graph:
        from . import effects
        from . import functional as F
        if kind == "accumulate":
            if self._grads is None:
                raise RuntimeError("accumulate: this step was not built by sg.train_step")
            loss = self.graph.outputs[0]
            sums = [(b, b + g) for b, g in zip(self._gradient_buffers(), self._grads)]
            return Graph(self.graph.inputs, [loss], effects.merge(sums, self._effects))
        if kind == "apply":
            if self._update_rule is None:
                raise RuntimeError("apply: this step was not built by sg.train_step")
            buffers = self._gradient_buffers()
            updates = self._update_rule(self._param_values, buffers)
            zeros = [(b, F.broadcast_to(F.constant(0, b.dtype), b.shape)) for b in buffers]
            return Graph([], [], effects.merge(updates, zeros))
        if kind == "predict":
            if self._predict is None:
                raise RuntimeError("predict: pass the value to compute when building the step, "
                                   "sg.train_step(loss, params, optimizer, predict=logits)")
            outs = [self._predict] if isinstance(self._predict, Value) else list(self._predict)
            graph = Graph(collect_inputs(outs), outs, effects.collect(outs))
            _check_no_gradient_buffer_names(graph.variables, self._param_values, "predict")
            return graph
        raise ValueError(f"unknown program {kind!r}; expected accumulate, apply or predict")

    def _check_shared_names(self, kind: str, graph: Graph) -> None:
        """Refuse a program whose variable shares a name with a different param of the step's
        programs: they share storage by name. (The optimizer's state and hyperparameters are
        made anew for each program under the same names; a param is the user's own leaf, shared
        as that very value.)"""
        known = {name: v for other in self._programs.values() for name, v in other._variables.items()}
        known.update(self._variables)
        for theirs in graph.variables:
            ours = known.get(theirs.name)
            if ours is not None and ours is not theirs and "param" in (_leaf_kind(ours), _leaf_kind(theirs)):
                raise ValueError(f"{kind}: {_leaf_kind(theirs)} {theirs.name!r} there and {_leaf_kind(ours)} "
                                 f"{ours.name!r} in the step are different variables of one name; rename one")

    def program_for(self, kind: str) -> Compiled:
        """The compiled "accumulate", "apply" or "predict" program (compiled on first use).

        Its `source`, and `workspace_bytes` where the backend reports one,
        describe that program alone.
        """
        if kind not in self._programs:
            graph = self._build(kind)
            self._check_shared_names(kind, graph)
            sub = Compiled(graph, self.backend, **self._options)
            for name, array in sub._storage.items():
                mine = self._storage.get(name)
                if mine is None:
                    self._storage[name] = array
                    self._variables[name] = sub._variables[name]  # step.state[name] = ... checks against it
                    if name not in self.state._names and sub._variables[name].attrs["role"] != "param":
                        self.state._names.append(name)
                elif mine.shape != array.shape or mine.dtype != array.dtype:
                    raise ValueError(f"{kind}: variable {name!r} is {array.dtype}{list(array.shape)} there, "
                                     f"{mine.dtype}{list(mine.shape)} in the step")
            sub._storage = self._storage  # one storage: the programs see each other's updates
            sub._lock = self._lock  # ...and one lock: a step and an apply() take turns too
            sub._attach()
            self._programs[kind] = sub
        return self._programs[kind]

    def accumulate(self, **batch) -> float:
        """Add this batch's gradients into the `<param>.grad` buffers; returns the loss.

        The parameters do not change until `apply()`. Gradients sum over
        calls, as repeated `loss.backward()` calls do in PyTorch.
        """
        program = self.program_for("accumulate")
        (loss,) = program._run(_arrays_by_name(program.graph, batch, "accumulate"))
        return float(loss)

    def apply(self) -> None:
        """Update the parameters from the accumulated gradients, then zero the buffers."""
        self.program_for("apply")._run([])

    def predict(self, **inputs):
        """The `predict=` value(s) on these inputs: forward only, nothing trained.

        Returns one array, or a tuple when `predict=` was a list. Build the
        value with the model in eval mode (`model.eval()`) for inference
        semantics: dropout off, BatchNorm on running statistics. A value
        built in training mode keeps its layers' updates (fresh dropout
        masks, running statistics), as under torch.no_grad() in train mode.
        """
        program = self.program_for("predict")
        outputs = program._run(_arrays_by_name(program.graph, inputs, "predict"))
        return outputs[0] if isinstance(self._predict, Value) else tuple(outputs)

    # ---- checkpoints: symgrad/checkpoint.py ----
    def state_dict(self) -> "OrderedDict[str, np.ndarray]":
        """Current parameters and module buffers by dotted name, as torch's `model.state_dict()`:
        `model.load_state_dict(step.state_dict())` gives the module the trained values."""
        from . import checkpoint
        return checkpoint.state_dict(self)

    def save(self, path) -> None:
        """Write parameters, buffers, optimizer state, the generator's state and the learning rate
        to one safetensors file; `load` resumes from it bit for bit."""
        from . import checkpoint
        checkpoint.save(self, path)

    def load(self, path) -> None:
        """Restore from a `save` file or a model's safetensors state_dict (torch's included); checks
        every name, shape and dtype first and changes nothing if one is wrong."""
        from . import checkpoint
        checkpoint.load(self, path)

    @property
    def lr(self) -> float:
        """The learning rate, changeable between steps without recompiling."""
        return float(self._read_variable("lr"))

    @lr.setter
    def lr(self, value: float) -> None:
        """Refused (ValueError) unless a finite non-negative number, as the optimizer's lr= is."""
        self._write_variable("lr", value)


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


def _param_groups(params) -> tuple[list[Value], list[dict]]:
    """The parameters, and per parameter its group's optimizer options ({} outside groups).

    `params` is a list of sg.param values (or a name -> param mapping, as named_parameters()
    gives), or torch's parameter groups: a list of dicts, each with "params" and options.
    """
    if isinstance(params, Mapping):
        params = list(params.values())
    params, flat, options = list(params), [], []
    for k, entry in enumerate(params):
        if isinstance(entry, Mapping):
            if "params" not in entry:
                raise TypeError(f"train_step: parameter group {k} has no 'params' entry")
            members = entry["params"]
            members = list(members.values()) if isinstance(members, Mapping) else list(members)
            group = {key: value for key, value in entry.items() if key != "params"}
            flat += members
            options += [group] * len(members)
        else:
            flat.append(entry)
            options.append({})
    for k, p in enumerate(flat):
        if not isinstance(p, Value) or p.op.name != "variable" or p.attrs["role"] != "param":
            raise TypeError(f"train_step: params[{k}] must be an sg.param, got {p!r}")
        if not D.is_float(p.dtype):
            raise TypeError(f"train_step: param {p.name!r} is {p.dtype}; only float params train")
    repeated = sorted({p.name for p in flat if sum(q is p for q in flat) > 1})
    if repeated:
        raise ValueError(f"train_step: parameters {repeated} appear more than once (in two groups?)")
    return flat, options


def train_step(loss: Value, params, optimizer, backend: str = "numpy", predict=None,
               clip_grad_norm: float | None = None, **options) -> TrainStep:
    """Compile forward, backward and the optimizer's update into one call.

    `step(**batch)` runs it on arrays given by input name and returns the
    loss; `step.params[name]` reads the current values. Updates that layers
    attach to values the loss computes (BatchNorm running statistics,
    dropout's random-stream counter) are performed by the step too.
    `predict=` names the value (or list of values) that `step.predict(**inputs)`
    computes, typically the model's output built in eval mode; see TrainStep
    for `accumulate` / `apply`.

    params: sg.param values, or torch's parameter groups (dicts with "params" and the
    optimizer options that differ for them, such as {"weight_decay": 0.0}).
    clip_grad_norm: the max_norm of torch.nn.utils.clip_grad_norm_, applied to the gradients
    inside the step (and to the buffers in apply()); a runtime hyperparameter,
    `step.state["clip_grad_norm"]`.
    """
    from . import effects
    from .autodiff import grad
    from .optim import clip

    if not isinstance(loss, Value) or loss.shape != () or not D.is_float(loss.dtype):
        raise ValueError(f"train_step: loss must be a float scalar value, got {loss!r}")
    params, group_options = _param_groups(params)
    if predict is not None:
        outs = [predict] if isinstance(predict, Value) else list(predict)
        for k, v in enumerate(outs):
            if not isinstance(v, Value):
                raise TypeError(f"train_step: predict[{k}] must be a graph value, got {type(v).__name__}")
    max_norm = None if clip_grad_norm is None else clip.max_norm_variable(clip_grad_norm)

    def update_rule(params: list[Value], grads: list[Value]) -> list:
        """The optimizer's updates from these gradients, clipped first (the step's and apply()'s)."""
        if max_norm is not None:
            grads = clip.clip_grad_norm(grads, max_norm)
        return optimizer.updates(params, grads, group_options)

    start = time.perf_counter()
    grads = grad(loss, params)
    layer_updates = effects.collect([loss])
    updates = effects.merge(update_rule(params, grads), layer_updates)
    graph = Graph(collect_inputs([loss]), [loss], updates)
    graph.nodes  # noqa: B018 -- the topological sort belongs to graph building in the report's timings
    built = time.perf_counter() - start
    step = TrainStep(graph, backend, params, update_rule=update_rule, grads=grads, predict=predict,
                     effects_pairs=layer_updates, **options)
    step.timings = {"graph": built}  # autodiff + optimizer graph, for report()
    return step
