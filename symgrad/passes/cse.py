"""Common-subexpression elimination by structural hashing.

Two nodes are the same computation when they apply the same op, with equal
attributes, to the same (already deduplicated) inputs; the graph keeps the
first and reroutes the users of the others to it. Forward and backward are
one graph here, so a value the backward recomputes (the cast of the learning
rate, a transposed weight) is found once for both.

A reduction computed both with and without `keepdims` is computed once; the
other form becomes a reshape of it (a view: no copy, no kernel).

Never merged: runtime leaves (`input`, `variable`: two inputs are two
arguments even when they look alike) and random ops (two draws differ).
"""

from __future__ import annotations

import math

import numpy as np
import sympy

from ..ir.graph import Graph
from ..ir.registry import REDUCE, lookup
from ..ir.value import Value, make
from .rewrite import DATA_LEAVES, is_nondeterministic, rebuild

# Ops whose operands may be swapped without changing a bit of the result.
COMMUTATIVE = frozenset({"add", "mul"})


def attr_key(value):
    """A hashable key equal for equal attribute values, distinct otherwise.

    Arrays compare by dtype, shape and bytes; floats by their bit pattern
    (so 0.0 and -0.0 differ and NaN equals NaN); numbers keep their type
    (1, 1.0 and True differ); sympy expressions structurally; anything else
    (a custom function's binding) by identity.
    """
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int):
        return ("int", value)
    if isinstance(value, float):
        return ("float", math.copysign(1.0, value), value.hex())
    if isinstance(value, np.generic):
        return attr_key(np.asarray(value))
    if isinstance(value, str):
        return ("str", value)
    if isinstance(value, sympy.Basic):
        return ("sympy", sympy.srepr(value))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(attr_key(v) for v in value))
    if value is None:
        return ("none",)
    return ("id", id(value))


def node_key(node: Value, input_ids: tuple):
    """The structural key of `node` over inputs already deduplicated to `input_ids`."""
    if node.op.name in COMMUTATIVE:
        input_ids = tuple(sorted(input_ids))
    attrs = tuple(sorted((k, attr_key(v)) for k, v in node.attrs.items()))
    return (id(node.op), input_ids, attrs, node.dtype, tuple(map(str, node.shape)))


def cse(graph: Graph, counts: dict | None = None) -> Graph:
    """The graph with each distinct computation made once."""
    seen: dict = {}
    reductions: dict = {}  # (op, input, axes, dtype) -> the first such reduction, either keepdims
    order: dict[int, int] = {}  # a node's position: commutative keys sort on it, deterministically
    merged = 0

    def at_node(node: Value) -> Value:
        nonlocal merged
        if node.op.name in DATA_LEAVES or is_nondeterministic(node):
            order.setdefault(id(node), len(order))
            return node
        key = node_key(node, tuple(order[id(i)] for i in node.inputs))
        first = seen.setdefault(key, node)
        if first is not node:
            merged += 1
        elif node.op.kind == REDUCE and "keepdims" in node.attrs:
            # r(x, A, keepdims=True) and r(x, A, keepdims=False) hold the same numbers: the second
            # one computed becomes a reshape (a free view) of the first.
            loose = (id(node.op), key[1], attr_key(tuple(node.attrs["axes"])), node.dtype)
            other = reductions.setdefault(loose, node)
            if other is not node:
                merged += 1
                first = make(lookup("reshape"), (other,), shape=node.shape)
                seen[key] = first
        order.setdefault(id(first), len(order))
        return first

    result = rebuild(graph, at_node)
    if counts is not None and merged:
        counts["merged"] = counts.get("merged", 0) + merged
    return result
