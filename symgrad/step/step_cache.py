"""Step cache: a loss's forward graph and the optimizer -> the step graph autodiff and the
optimizer's updates made from them, so a warm `sg.train_step` skips both.

The program cache (symgrad.backends.build.program_cache) keys a program by the graph it
compiles; for a train step that graph is the loss's forward graph differentiated and given the
optimizer's updates, which costs more than all the rest of a warm compile (the small GPT's
autodiff and AdamW graph: 35 ms of its 65, sympy's derivatives made afresh in every process).
This cache keys what `train_step` makes *before* making it:

- the forward graph's structural fingerprint (symgrad.ir.fingerprint): the loss, the predict
  values and the updates the layers attach to each, with the parameters' positions in it;
- the optimizer: its class (one of symgrad's, whose code the key holds: an optimizer class
  defined elsewhere is not cached), its hyperparameters and each parameter group's, exactly;
- clip_grad_norm's value, the autocast in force, and the compiler's own code (every symgrad
  source file, the sympy version), so a change to autodiff or an optimizer misses.

A graph whose derivative is code the key does not hold is made afresh every time: an op of the
user's with a backward rule of its own (elementwise.define(vjp=...), a registered OpDef), as is
a step whose optimizer class is defined outside symgrad.

An entry is the step graph, the gradients (which accumulate() sums) and the predict graph,
pickled against the forward graph (symgrad.ir.graph_pickle): loaded against the forward graph
built again, the step graph computes from the model's own parameters and the caller's inputs,
and only the backward and the optimizer's nodes are new. The graphs keep their fingerprints, so
the programs' keys are not computed again. One file per entry, `steps/<key>.pickle` under the
cache directory, the sha256 of the pickle in its first line: a damaged or foreign entry reads as
a miss and is written again. Like the program cache's, the pickle is trusted as far as the cache
directory is.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from ..backends.build import cache, program_cache
from ..ir import autocast, graph_pickle
from ..ir.elementwise import elementwise_vjp
from ..ir.fingerprint import description, fingerprint
from ..ir.graph import Graph
from ..ir.value import Value
from ..optim.param_groups import SCHEDULER_KEYS

FORMAT = 2  # 2: the pickler's references reduced, not persistent ids (symgrad.ir.graph_pickle)


@dataclass(frozen=True)
class Forward:
    """The loss's forward graph as the step cache keys it. `graph`'s outputs: the loss, the
    predict values, then the variable and new value of each update the loss's layers attach, then
    of each that the predict values' attach (outputs, not updates: a Graph would refuse one
    variable that both update differently). `layout`: how many predict values and updates of
    each (the fingerprint knows the outputs in order, not where one group ends)."""
    graph: Graph
    layout: tuple


def forward_of(loss: Value, predicted: list, inputs: list, step_effects: list, predict_effects: list) -> Forward:
    """The Forward of a step: `loss` and `predicted` over `inputs`, with the updates each carries."""
    ends = [loss, *predicted, *(value for pairs in (step_effects, predict_effects) for pair in pairs for value in pair)]
    return Forward(Graph(inputs, ends), (len(predicted), len(step_effects), len(predict_effects)))


def _own_backward(op) -> bool:
    """Whether autodiff differentiates `op` by a rule that is not symgrad's code nor read from the
    formula the fingerprint holds: a user's op with a VJP or a decomposition of its own."""
    if op.builtin or op.extra.get("derived"):
        return False
    return op.vjp is not elementwise_vjp or op.decompose is not None


def key(forward: Forward, params: list, group_options: list, optimizer, max_norm: float | None) -> str | None:
    """The step cache's key for training `params` of `forward` with `optimizer` (each parameter's
    group in `group_options`), gradients clipped at `max_norm`; None where something has no exact
    description (an optimizer class outside symgrad, an op with a backward of the user's, a
    parameter the loss does not read, an attribute the fingerprint cannot describe): that step is
    made afresh every time."""
    optimizer_type = type(optimizer)
    if not optimizer_type.__module__.startswith("symgrad."):
        return None   # its update() is code the key does not hold
    nodes = forward.graph.nodes
    if any(_own_backward(op) for op in {id(n.op): n.op for n in nodes}.values()):
        return None
    structure = fingerprint(forward.graph)
    if structure is None:
        return None
    position = {id(node): k for k, node in enumerate(nodes)}
    if any(id(p) not in position for p in params):
        return None   # a parameter the loss does not read: not a node of the forward graph
    groups: dict[int, int] = {}
    described = []
    for options in group_options:
        if id(options) not in groups:
            groups[id(options)] = len(groups)
            entries = sorted((k, v) for k, v in dict.items(options) if k != "params" and k not in SCHEDULER_KEYS)
            described.append(description((getattr(options, "lr_name", None), entries)))
    described += [description(sorted(optimizer.hyperparameters().items())), description(optimizer._lr_name),
                  description(max_norm), description(autocast.active())]
    if any(text is None for text in described):
        return None
    parts = [str(FORMAT), program_cache.code_fingerprint(), structure, repr(forward.layout),
             f"{optimizer_type.__module__}.{optimizer_type.__qualname__}", repr([position[id(p)] for p in params]),
             repr([groups[id(options)] for options in group_options]), *described]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _path(key: str) -> Path:
    return cache.cache_dir() / "steps" / f"{key}.pickle"


def load(key: str | None, forward: Forward, params: list) -> tuple | None:
    """(step graph, gradients, predict graph or None) stored under `key`, made from `forward`'s
    nodes for `params`; None on a miss (no entry, a damaged one, one that does not unpickle or
    does not hold a step of this loss)."""
    if key is None:
        return None
    try:
        data = _path(key).read_bytes()
    except OSError:
        return None
    checksum, _, compiled = data.partition(b"\n")
    if checksum != hashlib.sha256(compiled).hexdigest().encode():
        return None
    try:
        _, graph, grads, predict_graph = graph_pickle.loads(compiled, forward.graph)
    except Exception:  # noqa: BLE001  (a foreign or stale entry is a miss: made afresh and stored again)
        return None
    # What a foreign entry with a good checksum would get wrong: the step of another loss, other
    # parameters, another predict (Values compared by identity: `==` on two makes a graph node).
    ends = forward.graph.outputs
    predicted = ends[1:1 + forward.layout[0]]
    if not (isinstance(graph, Graph) and graph.outputs and graph.outputs[0] is ends[0]
            and isinstance(grads, list) and len(grads) == len(params) and all(isinstance(g, Value) for g in grads)
            and (predict_graph is None if not predicted else isinstance(predict_graph, Graph)
                 and len(predict_graph.outputs) == len(predicted)
                 and all(a is b for a, b in zip(predict_graph.outputs, predicted)))):
        return None
    return graph, grads, predict_graph


def store(key: str | None, forward: Forward, graph: Graph, grads: list, predict_graph: Graph | None) -> None:
    """Record what `key` makes (nothing when it is None or something refuses the pickle); a failed
    write only costs a miss."""
    if key is None:
        return
    try:
        # The step graph's nodes first, in order: each node's inputs are then stored before it, so
        # a deep graph does not nest the pickler's recursion.
        compiled = graph_pickle.dumps((graph.nodes, graph, list(grads), predict_graph), forward.graph)
    except Exception:  # noqa: BLE001  (anything the pickle refuses: not stored, made afresh next time)
        return
    path = _path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        cache.atomic_write(path, hashlib.sha256(compiled).hexdigest().encode() + b"\n" + compiled)
    except OSError:
        pass
