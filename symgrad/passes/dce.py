"""Dead-code elimination: what no output or update needs, and what does nothing.

A graph's nodes are by construction only those reachable from its outputs
and updates, so a gradient nobody asked for is already gone once it is
unreachable. This pass removes the rest of the dead weight:

- updates that write a variable with its own, unchanged value;
- wrappers that only matter to autodiff, which has already run:
  `custom(result, *inputs)` and `stop_gradient(x)`; and `class_labels(y)`,
  whose check runs before the call;
- no-op casts, reshapes, transposes and expands.
"""

from __future__ import annotations

from ..ir.graph import Graph
from ..ir.value import Value
from .rewrite import apply_rules, matches


@matches("custom")
def drop_custom(node: Value) -> Value | None:
    """custom(result, *inputs) -> result: the wrapper only carries a backward rule."""
    if node.op.name == "custom":
        return node.inputs[0]
    return None


@matches("stop_gradient")
def drop_stop_gradient(node: Value) -> Value | None:
    """stop_gradient(x) -> x: an identity once gradients have been taken."""
    if node.op.name == "stop_gradient":
        return node.inputs[0]
    return None


@matches("class_labels")
def drop_class_labels(node: Value) -> Value | None:
    """class_labels(y) -> y: the labels' range is checked by the call, not by compiled code."""
    if node.op.name == "class_labels":
        return node.inputs[0]
    return None


@matches("cast")
def drop_noop_cast(node: Value) -> Value | None:
    """cast(x, dtype(x)) -> x."""
    if node.op.name == "cast" and node.inputs[0].dtype == node.dtype:
        return node.inputs[0]
    return None


@matches("reshape")
def drop_noop_reshape(node: Value) -> Value | None:
    """reshape(x, shape(x)) -> x."""
    if node.op.name == "reshape" and node.inputs[0].shape == node.shape:
        return node.inputs[0]
    return None


@matches("transpose")
def drop_noop_transpose(node: Value) -> Value | None:
    """transpose(x, (0, 1, ..., n-1)) -> x."""
    if node.op.name == "transpose" and tuple(node.attrs["perm"]) == tuple(range(node.ndim)):
        return node.inputs[0]
    return None


@matches("expand")
def drop_noop_expand(node: Value) -> Value | None:
    """expand(x, shape(x)) -> x."""
    if node.op.name == "expand" and node.inputs[0].shape == node.shape:
        return node.inputs[0]
    return None


RULES = (drop_custom, drop_stop_gradient, drop_class_labels, drop_noop_cast, drop_noop_reshape,
         drop_noop_transpose, drop_noop_expand)


def drop_identity_updates(graph: Graph) -> Graph:
    """update v <- v is no update: remove it."""
    kept = [(t, n) for t, n in graph.updates if n is not t]
    return graph if len(kept) == len(graph.updates) else graph.with_(updates=kept)


def dce(graph: Graph, counts: dict | None = None) -> Graph:
    """The graph without identity wrappers, no-op movement/casts and identity updates.

    Unreachable nodes vanish with them: a new Graph holds only what its
    outputs and updates reach.
    """
    return drop_identity_updates(apply_rules(graph, RULES, counts=counts))
