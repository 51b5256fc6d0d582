"""`sg.train_step`: forward, backward and the optimizer's update compiled into one call, and the
accumulate / apply / predict programs that share its variables."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Mapping

import numpy as np

from .. import backends
from ..backends.build.collector import cyclic_gc_paused
from .call_checks import (arrays_by_name, check_no_gradient_buffer_names, collect_inputs, gradient_buffer_name,
                          leaf_kind, refuse_positional)
from .compiled import Compiled, VariableView
from ..ir import dtypes as D
from ..ir.graph import Graph
from ..ir.value import Value


class TrainStep(Compiled):
    """`sg.train_step(...)`: forward, backward and update in one call; returns the loss.

    Besides the fused step, three programs are compiled by the same backend, sharing this
    step's variable storage (predict with the step, when `predict=` is given; accumulate and
    apply on first use):

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

    `from_step_cache`: whether the step graph (autodiff's and the optimizer's) came from the step
    cache (symgrad/step/step_cache.py), as it does for the same model, optimizer and options
    built again, in this process or a later one.
    """

    from_step_cache = False

    def __init__(self, graph: Graph, backend: str, params: list[Value], update_rule=None, grads=None,
                 predict=None, effects_pairs=(), background: bool = False, **options):
        check_no_gradient_buffer_names(graph.variables, params, "train_step")
        super().__init__(graph, backend, background=background, yield_cores=False, **options)
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
        self._held_builds: list = []  # programs' builds waiting for the first call to end (predict's)
        self._predict_graph: Graph | None = None  # predict's graph made already (by the step cache)

    def __call__(self, *positional, **batch) -> float:
        if positional:
            refuse_positional(self.graph, "a train step", "step", len(positional))
        names = self._input_names
        if len(batch) == len(names):
            try:  # the usual call: exactly the input names (no missing, so no extra either)
                arrays = [batch[n] for n in names]
            except KeyError:
                arrays = arrays_by_name(self.graph, batch, "train step")
        else:
            arrays = arrays_by_name(self.graph, batch, "train step")
        (loss,) = self._run(arrays)
        return float(loss)

    def _run(self, arrays: list) -> list:
        try:
            return super()._run(arrays)
        finally:
            if self._held_builds:
                self._release_builds()

    def _release_builds(self) -> None:
        """Let the programs built beside the steps start their compilers: the first call has
        ended (it had the cores to itself), or another program is asked for."""
        held, self._held_builds = self._held_builds, []
        for building in held:
            building.release()

    # ---- accumulation, apply, predict: extra programs over the same storage ----
    def _gradient_buffers(self) -> list[Value]:
        from ..api.sources import filled, variable
        if self._buffers is None:
            self._buffers = [variable(gradient_buffer_name(p), filled(p.shape, 0, D.to_numpy(p.dtype)), role="grad")
                             for p in self._param_values]
        return self._buffers

    def _build(self, kind: str) -> Graph:
        from ..api import effects
        from ..api import functional as F
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
            graph = self._predict_graph or Graph(collect_inputs(outs), outs, effects.collect(outs))
            check_no_gradient_buffer_names(graph.variables, self._param_values, "predict")
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
            if ours is not None and ours is not theirs and "param" in (leaf_kind(ours), leaf_kind(theirs)):
                raise ValueError(f"{kind}: {leaf_kind(theirs)} {theirs.name!r} there and {leaf_kind(ours)} "
                                 f"{ours.name!r} in the step are different variables of one name; rename one")

    def program_for(self, kind: str, background: bool = False) -> Compiled:
        """The compiled "accumulate", "apply" or "predict" program (compiled on first use; sg.train_step
        asks for "predict" as it builds the step).

        Its `source`, and `workspace_bytes` where the backend reports one,
        describe that program alone. `background`: its compiler's build on a thread of its own
        (Compiled's), started once the step's first call has ended (or another program is asked
        for), the program waited for when first used.
        """
        if kind not in self._programs:
            self._release_builds()
            graph = self._build(kind)
            self._check_shared_names(kind, graph)
            sub = Compiled(graph, self.backend, background=background, shared=self._storage, **self._options)
            if background and "_building" in vars(sub):  # its compilers wait for the first step to end
                self._held_builds.append(sub._building)
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
            for name, cell in sub._cells.items():
                self._cells.setdefault(name, cell)  # step.state / step.load reach a predict-only param's cell
            sub._storage = self._storage  # one storage: the programs see each other's updates
            sub._lock = self._lock  # ...and one lock: a step and an apply() take turns too
            sub._attach()
            self._programs[kind] = sub
        return self._programs[kind]

    def accumulate(self, *positional, **batch) -> float:
        """Add this batch's gradients into the `<param>.grad` buffers; returns the loss.

        The parameters do not change until `apply()`. Gradients sum over
        calls, as repeated `loss.backward()` calls do in PyTorch.
        """
        program = self.program_for("accumulate")
        if positional:
            refuse_positional(program.graph, "accumulate", "step.accumulate", len(positional))
        (loss,) = program._run(arrays_by_name(program.graph, batch, "accumulate"))
        return float(loss)

    def apply(self) -> None:
        """Update the parameters from the accumulated gradients, then zero the buffers."""
        self.program_for("apply")._run([])

    def predict(self, *positional, **inputs):
        """The `predict=` value(s) on these inputs: forward only, nothing trained.

        Returns one array, or a tuple when `predict=` was a list. Build the
        value with the model in eval mode (`model.eval()`) for inference
        semantics: dropout off, BatchNorm on running statistics. A value
        built in training mode keeps its layers' updates (fresh dropout
        masks, running statistics), as under torch.no_grad() in train mode.
        """
        program = self.program_for("predict")
        if positional:
            refuse_positional(program.graph, "predict", "step.predict", len(positional))
        outputs = program._run(arrays_by_name(program.graph, inputs, "predict"))
        return outputs[0] if isinstance(self._predict, Value) else tuple(outputs)

    # ---- checkpoints: symgrad/step/checkpoint.py ----
    def state_dict(self) -> "OrderedDict[str, np.ndarray]":
        """Current parameters and module buffers by dotted name, as torch's `model.state_dict()`
        (one key per parameter: the step knows a tied parameter by its first name). They are the
        model's own values already; `other.load_state_dict(step.state_dict())` gives them to
        another symgrad or torch module."""
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

    def export(self, out_dir, name: str | None = None, backend: str = "c", programs=None) -> dict:
        """Write this step as a standalone C training library and program into `out_dir`:
        `<name>.c` (code only), `<name>.h`, `<name>.safetensors` (the current values), the
        programs' sources, the runtime, `train_main.c` and a `Makefile` (the export back end,
        symgrad/backends/export/). `name` (default: the calling file's stem) prefixes every C
        symbol; backend="cuda" writes the programs as `.cu`, behind the same API;
        programs=("predict",) exports an inference-only library. Returns {file kind: path}."""
        from . import exporting
        return exporting.export(self, out_dir, name=name, backend=backend, programs=programs)

    @property
    def lr(self) -> float:
        """The learning rate, changeable between steps without recompiling (with parameter groups,
        the first group's; each group's is `step.param_groups[k]["lr"]`)."""
        return float(self._read_variable("lr"))

    @lr.setter
    def lr(self, value: float) -> None:
        """Set every parameter group's learning rate. Refused (ValueError) unless a finite
        non-negative number, as the optimizer's lr= is."""
        from ..optim.optimizer import check_hyperparameter
        from ..optim.param_groups import is_lr_variable
        check_hyperparameter("step.lr", value)
        for name in [n for n in self._variables if is_lr_variable(n)] or ["lr"]:
            self._write_variable(name, value)

    @property
    def param_groups(self) -> list:
        """torch's parameter groups of this step: dicts with "params", "lr" and the optimizer's
        options; "lr" is this step's runtime value (read and set without recompiling), the other
        options are compiled in. A scheduler constructed on the step drives these."""
        groups = getattr(self, "_param_groups", None)
        if groups is None:
            raise AttributeError("param_groups: this step was not built by sg.train_step")
        return groups


def param_groups(params) -> tuple[list[Value], list[dict]]:
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


# Seconds train_step waits for its step's compilers to start before the predict program's passes
# (a build's work before them takes 0.01-0.05 s alone; `_compiled_step`).
STARTED_AT_MOST = 0.25


def train_step(loss: Value, params=None, optimizer=None, backend: str | None = None, predict=None,
               clip_grad_norm: float | None = None, autocast: str | None = None, **options) -> TrainStep:
    """Compile forward, backward and the optimizer's update into one call.

    `step(**batch)` runs it on arrays (NumPy, or torch CPU tensors) given by input name and
    returns the loss; `step.params[name]` reads the current values. Updates that layers
    attach to values the loss computes (BatchNorm running statistics,
    dropout's random-stream counter) are performed by the step too.
    `predict=` names the value (or list of values) that `step.predict(**inputs)`
    computes, typically the model's output built in eval mode; see TrainStep
    for `accumulate` / `apply`.

    params: sg.param values, or torch's parameter groups (dicts with "params" and the
    optimizer options that differ for them, such as {"weight_decay": 0.0}); left out when the
    optimizer was constructed with them, as torch's: `sg.train_step(loss, optimizer=
    sg.optim.AdamW(model.parameters(), lr=1e-3))`. Each group's lr is a runtime value.
    clip_grad_norm: the max_norm of torch.nn.utils.clip_grad_norm_, applied to the gradients
    inside the step (and to the buffers in apply()); a runtime hyperparameter,
    `step.state["clip_grad_norm"]`.
    autocast: "bfloat16" or "float16": the loss's graph rebuilt under torch's CPU autocast
    policy (symgrad.ir.autocast; as if built inside `sg.autocast(autocast)`): matmuls and
    attention on 16-bit operands with float32 accumulation, reductions and the update in float32,
    parameters float32 master weights cast once per step.
    """
    from ..optim import clip

    if not isinstance(loss, Value) or loss.shape != () or not D.is_float(loss.dtype):
        raise ValueError(f"train_step: loss must be a float scalar value, got {loss!r}")
    if autocast is not None:
        from ..ir.autocast_graph import autocast_graph
        loss = autocast_graph([loss], autocast)[0]
    from ..optim.optimizer import Optimizer
    if optimizer is None and isinstance(params, Optimizer):
        params, optimizer = None, params  # train_step(loss, opt): the optimizer holds the parameters
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"train_step: optimizer must be an sg.optim optimizer, such as "
                        f"sg.optim.SGD(model.parameters(), lr=0.1); got {type(optimizer).__name__}")
    groups = optimizer.groups_for_step(params)  # torch's parameter groups, each with its runtime lr
    params = [p for group in groups for p in dict.__getitem__(group, "params")]
    group_options = [group for group in groups for _ in dict.__getitem__(group, "params")]
    if predict is not None:
        outs = [predict] if isinstance(predict, Value) else list(predict)
        for k, v in enumerate(outs):
            if not isinstance(v, Value):
                raise TypeError(f"train_step: predict[{k}] must be a graph value, got {type(v).__name__}")
    max_norm = None if clip_grad_norm is None else clip.max_norm_variable(clip_grad_norm)
    # Autodiff, the optimizer's graph and the compile allocate millions of objects that live on: the
    # cyclic collector's passes would walk them all, for little garbage (backends.build.collector). Back on
    # before the step's build is waited for, its first pass over them (0.06 s at 12 GPT layers)
    # runs while the compiler does.
    with cyclic_gc_paused():
        step = _compiled_step(loss, params, group_options, groups, optimizer, backend, predict, max_norm,
                              options)
    step.program  # noqa: B018 -- the step's own build waited for: what it raises, train_step raises
    return step


def _compiled_step(loss: Value, params: list, group_options: list, groups: list, optimizer, backend,
                   predict, max_norm, options: dict) -> TrainStep:
    """train_step's graph (autodiff, the optimizer's updates, the layers' own) and its TrainStep,
    the step's compiler started, and the predict program's."""
    from ..api import effects
    from ..autodiff import grad
    from ..optim import clip
    from ..optim import param_groups as groups_of
    from . import step_cache

    def update_rule(params: list[Value], grads: list[Value]) -> list:
        """The optimizer's updates from these gradients, clipped first (the step's and apply()'s)."""
        if max_norm is not None:
            grads = clip.clip_grad_norm(grads, max_norm)
        return optimizer.updates(params, grads, group_options)

    start = time.perf_counter()
    layer_updates = effects.collect([loss])
    predicted = [] if predict is None else [predict] if isinstance(predict, Value) else list(predict)
    predict_updates = effects.collect(predicted) if predicted else []
    forward = step_cache.forward_of(loss, predicted, collect_inputs([loss, *predicted]), layer_updates,
                                    predict_updates)
    key = step_cache.key(forward, params, group_options, optimizer,
                         None if max_norm is None else float(max_norm.attrs["init"]))
    made = step_cache.load(key, forward, params)
    if made is None:
        grads = grad(loss, params)
        updates = effects.merge(update_rule(params, grads), layer_updates)
        graph = Graph(collect_inputs([loss]), [loss], updates)
        graph.nodes  # noqa: B018 -- the topological sort belongs to graph building in the report's timings
        predict_graph = None
    else:
        graph, grads, predict_graph = made
    built = time.perf_counter() - start
    # The step's compiler runs on a thread, always: predict's passes run here meanwhile, and once
    # train_step has turned the collector back on, its first pass.
    step = TrainStep(graph, backends.resolve(backend), params, update_rule=update_rule, grads=grads,
                     predict=predict, effects_pairs=layer_updates, background=True, **options)
    # autodiff + the optimizer's graph, or the step cache's load of them, for report()
    step.timings = {"graph" if made is None else "step_cache": built}
    step.from_step_cache = made is not None
    step.optimizer = optimizer
    step._param_groups = groups_of.bind(step, groups)  # group["lr"] is the step's runtime lr from now on
    if predict is not None:
        # Built now, with the step, not inside the first step.predict() call (an evaluation loop's
        # first batch would pay for a compile); its passes now (a refusal raises here), its
        # compiler on a thread of its own once the first step has ended, while the next ones run
        # (GPT small on two cores: the first step a second sooner than after it; the nanoGPT
        # size's 0.2 s sooner than beside it). accumulate / apply, for gradient accumulation only,
        # are built when first called.
        step._predict_graph = predict_graph
        building = vars(step).get("_building")
        if building is not None:
            # The step's compilers started first: beside these passes, the Python work before them
            # waited for the lock at each file it wrote (a 12-layer GPT's: 0.14 s later, 4 layers':
            # after the passes, 0.06 s). Not longer than STARTED_AT_MOST: a build waiting for the
            # compilers of another (an earlier step's predict program, another process) would keep
            # these passes waiting with it.
            building.started(STARTED_AT_MOST)
        step.program_for("predict", background=True)
    if made is None:  # pickled while the step's compiler runs (a 4-layer GPT's: 6 ms)
        step_cache.store(key, forward, graph, grads, step._programs["predict"].graph if predict is not None else None)
    return step
