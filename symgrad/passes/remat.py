"""Recompute for the backward: a cheap forward value the backward reads is computed again there.

A training step's memory peaks where its backward starts: every forward value the backward
reads is still held. An elementwise value whose inputs the backward holds anyway need not be
held too, nor one computed from such inputs through elementwise values the forward alone reads
(a LayerNorm's output from the normalized input it holds for its own gradient). GELU's output is the example: the next matmul reads it in the forward, and the
backward reads it for that matmul's weight gradient, while GELU's derivative reads its input,
which is held in any case. Here the backward's readers get a copy of the node over the same
inputs; the forward's value dies with the forward, and the kernel order (symgrad.backends.
schedule) runs the copy when its readers need it. torch's activation checkpointing does this by
hand, per module; here it is decided once, from the graph.

Only values worth it: big ones (at least MIN_ELEMENTS, or sized by a Dim), of a cost per element
of at most MAX_COST, the chain recomputed with it included (recomputing a few elementwise ops costs
less than storing and reading the value back),
never a random draw. The pass runs last: CSE would merge the copy back.
"""

from __future__ import annotations

from ..ir import shapes as S
from ..ir.elementwise import FUNCTION_COST, expr_cost
from ..ir.graph import Graph, ancestors
from ..ir.registry import ELEMENTWISE, MOVEMENT, SOURCE
from ..ir.value import Value
from .rewrite import is_nondeterministic, rebuild, with_inputs

MIN_ELEMENTS = 1 << 16  # smaller values: a kernel more costs more than their bytes save
MAX_COST = 6 * FUNCTION_COST  # operations per element (ir.elementwise.expr_cost): a few functions; GELU (tanh) counts 39


def _big(node: Value) -> bool:
    numel = S.numel(node.shape)
    return not isinstance(numel, int) or numel >= MIN_ELEMENTS


def _views_and_readers(graph: Graph, node: Value) -> tuple[list, list]:
    """The views of `node` (reshapes, transposes, ... of it, transitively) and the nodes that read
    it or one of its views as anything but a view: its value's real readers."""
    views, readers, stack = [], [], [node]
    while stack:
        for u in graph.users[id(stack.pop())]:
            if u.op.kind == MOVEMENT and len(u.inputs) == 1:
                views.append(u)
                stack.append(u)
            else:
                readers.append(u)
    return views, readers


def recomputable(graph: Graph, forward: set | None = None) -> set:
    """ids of the forward values the backward gets its own copy of (see the module docstring), and
    of their views: a backward reader of a view reads the same view of the copy. `forward`: the
    ids of the nodes the outputs depend on, when the caller has them."""
    forward = ancestors(graph.outputs) if forward is None else forward
    users = graph.users

    def held_for_backward(v: Value) -> bool:
        return v.op.kind == SOURCE or any(id(u) not in forward for u in users[id(v)])

    def elementwise(v: Value) -> bool:
        return v.op.kind == ELEMENTWISE and v.op.expr is not None and not is_nondeterministic(v)

    chosen = set()
    for n in graph.nodes:
        if id(n) not in forward or not elementwise(n) or not _big(n):
            continue
        views, readers = _views_and_readers(graph, n)
        if not (any(id(u) in forward for u in readers) and any(id(u) not in forward for u in readers)):
            continue
        chain = _chain_from_held(n, held_for_backward, elementwise)
        if chain is not None:
            chosen.add(id(n))
            chosen.update(chain)
            chosen.update(id(v) for v in views if id(v) in forward)
    return chosen


def _chain_from_held(node: Value, held, elementwise) -> set | None:
    """ids of the forward-only elementwise values recomputed with `node` so that its copy reads only
    values the backward holds anyway (`held`), or None where that costs more than MAX_COST per
    element or needs a value that is neither (a reshape in the chain is made again with it, costing
    nothing here, though a reshape of a strided view is a copy in the lowering; a transpose is not
    followed: the copy would read across the grain). A LayerNorm's output `xhat * weight + bias` is
    one: the backward holds xhat for LayerNorm's own gradient, and the product `xhat * weight` is
    read by the forward alone; GELU's output is another, with no chain (its input is held)."""
    chain, cost, stack = set(), expr_cost(node.op.expr), list(node.inputs)
    while stack:
        value = stack.pop()
        if id(value) in chain or held(value):
            continue
        if value.op.name == "reshape":  # a view of the same elements in order, as the lowering reads
            chain.add(id(value))        # it (GELU's output reshaped, then cast by autocast)
            stack.extend(value.inputs)
            continue
        if not elementwise(value):
            return None
        chain.add(id(value))
        cost += expr_cost(value.op.expr)
        stack.extend(value.inputs)
    return chain if cost <= MAX_COST else None


def remat(graph: Graph, counts: dict | None = None) -> Graph:
    """The graph with each recomputable forward value (and its views) copied for its backward readers."""
    forward = ancestors(graph.outputs)
    chosen = recomputable(graph, forward)
    if not chosen:
        return graph
    copies: dict[int, Value] = {}

    def copy(v: Value) -> Value:
        if id(v) not in copies:
            inputs = tuple(copy(i) if id(i) in chosen else i for i in v.inputs)  # a view: over the copy
            copies[id(v)] = v.over(inputs)
        return copies[id(v)]

    def rewrite(node: Value) -> Value:
        if id(node) in forward:  # forward nodes are never rebuilt: their inputs are forward nodes
            return node
        return with_inputs(node, tuple(copy(i) if id(i) in chosen else i for i in node.inputs))

    result = rebuild(graph, rewrite)
    if counts is not None and copies:
        counts["recomputed"] = sum(1 for v in copies.values() if v.op.kind != MOVEMENT)
    return result
