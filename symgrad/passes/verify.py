"""The graph verifier: the invariants every pass must keep.

Run after each pass in the tests (and by `optimize(..., verify=True)`), so a
pass that breaks the IR is caught where it does so, not later in a backend.
"""

from __future__ import annotations

import numpy as np
import sympy

from ..ir import shapes as S
from ..ir.graph import Graph, same_named_leaves
from ..ir.value import Value


class VerifyError(ValueError):
    """A graph breaks an IR invariant; the message names the node."""


def _describe(node: Value) -> str:
    label = f" {node.name!r}" if node.name else ""
    return f"{node.op.name}{label} {node.type_str}"


def verify(graph: Graph) -> Graph:
    """Check `graph`'s invariants and return it; raise VerifyError naming the first broken one.

    - every node's shape and dtype are what its op's shape rule gives for its inputs and attrs;
    - nodes are in topological order (each after its inputs) and appear once;
    - const values have the node's shape; symbolic ones are 0-d expressions of Dims;
    - updates write variables, each at most once, with a value of the variable's type;
    - every input node reached is a graph input; leaf names are unique.
    """
    position: dict[int, int] = {}
    for k, node in enumerate(graph.nodes):
        if id(node) in position:
            raise VerifyError(f"node {_describe(node)} appears twice in the node list")
        for i in node.inputs:
            if id(i) not in position:
                raise VerifyError(f"node {_describe(node)} comes before its input {_describe(i)}")
        position[id(node)] = k
        try:
            shape, dtype = node.op.infer(node.inputs, dict(node.attrs))
        except (ValueError, TypeError) as exc:
            raise VerifyError(f"node {_describe(node)}: its shape rule rejects it: {exc}") from None
        if tuple(shape) != node.shape or dtype != node.dtype:
            raise VerifyError(f"node {_describe(node)}: its op's shape rule gives "
                              f"{dtype} {S.format_shape(shape)}")
        if node.op.name == "const":
            _check_const(node)

    inputs = {id(v) for v in graph.inputs}
    for node in graph.nodes:
        if node.op.name == "input" and id(node) not in inputs:
            raise VerifyError(f"input {node.name!r} is used but is not among the graph's inputs")

    written: set[int] = set()
    for target, new in graph.updates:
        if target.op.name != "variable":
            raise VerifyError(f"update target {_describe(target)} is not a variable")
        if target.shape != new.shape or target.dtype != new.dtype:
            raise VerifyError(f"update of {target.name!r}: new value is {new.type_str}, "
                              f"variable is {target.type_str}")
        if id(target) in written:
            raise VerifyError(f"variable {target.name!r} is updated twice")
        written.add(id(target))

    pair = same_named_leaves(graph)
    if pair is not None:
        other, leaf = pair
        raise VerifyError(f"two different leaves are named {leaf.name!r} "
                          f"({_describe(other)} and {_describe(leaf)})")
    return graph


def _check_const(node: Value) -> None:
    value = node.attrs["value"]
    if isinstance(value, np.ndarray):
        if value.shape != node.shape:
            raise VerifyError(f"const {node.type_str} holds an array of shape {list(value.shape)}")
    elif node.shape != ():
        raise VerifyError(f"const {node.type_str} holds a scalar; only 0-d consts may")
    elif isinstance(value, sympy.Basic):
        stray = [s for s in value.free_symbols if not isinstance(s, S.Dim)]
        if stray:
            raise VerifyError(f"const {node.type_str} = {value} uses symbols {stray} that are not Dims")
