"""Step cache: a loss's forward graph and the optimizer -> the step graph autodiff and the
optimizer's updates made from them, so a warm `sg.train_step` skips both.

The program cache (symgrad.backends.build.program_cache) keys a program by the graph it
compiles; for a train step that graph is the loss's forward graph differentiated and given the
optimizer's updates, which costs more than all the rest of a warm compile (the small GPT's
autodiff and AdamW graph: 35 ms of its 65, sympy's derivatives made afresh in every process).
This cache keys what `train_step` makes *before* making it:

- the forward graph's structural fingerprint (symgrad.ir.fingerprint): the loss, the predict
  values and the updates the layers attach to them, with the parameters' positions in it;
- the optimizer: its class (one of symgrad's, whose code the key holds: an optimizer class
  defined elsewhere is not cached), its hyperparameters and each parameter group's, exactly;
- clip_grad_norm's value, the autocast in force, and the compiler's own code (every symgrad
  source file, the sympy version), so a change to autodiff or an optimizer misses.

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
import pickle
from pathlib import Path

import sympy

from ..backends.build import cache, program_cache
from ..ir import autocast, graph_pickle
from ..ir.fingerprint import description, fingerprint
from ..ir.graph import Graph
from ..optim.param_groups import SCHEDULER_KEYS

FORMAT = 1


def forward_graph(loss, predicted: list, inputs: list, step_effects: list, predict_effects: list) -> Graph:
    """The graph whose structure determines the step graph and the predict graph: the loss, the
    predict values and the layers' updates of each (their variables and new values as outputs:
    a Graph's updates would refuse one variable that both update differently), over `inputs`."""
    ends = [loss, *predicted, *(value for pairs in (step_effects, predict_effects) for pair in pairs for value in pair)]
    return Graph(inputs, ends)


def key(forward: Graph, params: list, group_options: list, optimizer, max_norm: float | None) -> str | None:
    """The step cache's key for training `params` of `forward` with `optimizer` (each parameter's
    group in `group_options`), gradients clipped at `max_norm`; None where something has no exact
    description (an optimizer class outside symgrad, a parameter the loss does not read, an
    attribute the fingerprint cannot describe): that step is made afresh every time."""
    optimizer_type = type(optimizer)
    if not optimizer_type.__module__.startswith("symgrad."):
        return None   # its update() is code the key does not hold
    structure = fingerprint(forward)
    if structure is None:
        return None
    position = {id(node): k for k, node in enumerate(forward.nodes)}
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
    parts = [str(FORMAT), program_cache.code_fingerprint(), structure, f"{optimizer_type.__module__}."
             f"{optimizer_type.__qualname__}", repr([position[id(p)] for p in params]),
             repr([groups[id(options)] for options in group_options]), *described]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _path(key: str) -> Path:
    return cache.cache_dir() / "steps" / f"{key}.pickle"


def load(key: str | None, forward: Graph) -> tuple | None:
    """(step graph, gradients, predict graph or None) stored under `key`, made from `forward`'s
    nodes; None on a miss (no entry, a damaged one, one that does not unpickle)."""
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
        # The derived ops' formulas were stored as sympy made them, canonical already: rebuilt
        # without evaluating them again (the same trees, half the load: 9 -> 5 ms for the small
        # GPT's step in a new process). The stored fingerprint covers every formula's text.
        with sympy.evaluate(False):
            _, graph, grads, predict_graph = graph_pickle.loads(compiled, forward)
    except Exception:  # noqa: BLE001  (a foreign or stale entry is a miss: made afresh and stored again)
        return None
    return graph, grads, predict_graph


def store(key: str | None, forward: Graph, graph: Graph, grads: list, predict_graph: Graph | None) -> None:
    """Record what `key` makes (nothing when it is None or something refuses the pickle); a failed
    write only costs a miss."""
    if key is None:
        return
    try:
        # The step graph's nodes first, in order: each node's inputs are then stored before it, so
        # a deep graph does not nest the pickler's recursion.
        compiled = graph_pickle.dumps((graph.nodes, graph, list(grads), predict_graph), forward)
    except (pickle.PicklingError, TypeError, AttributeError, RecursionError):
        return
    path = _path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        cache.atomic_write(path, hashlib.sha256(compiled).hexdigest().encode() + b"\n" + compiled)
    except OSError:
        pass
