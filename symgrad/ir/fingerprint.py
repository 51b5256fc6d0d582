"""A graph's structural fingerprint: one hash for every graph that compiles to the same code.

Two graphs get the same fingerprint when they have the same nodes in the
same topological order: the same ops (for elementwise ops, the same sympy
expression too, since a user may define two ops of one name in two
processes; symgrad's own ops by name, their formulas being symgrad's code,
which the caches' keys hold), inputs, shapes, dtypes and attributes, and the
same inputs, outputs and updates. What the code does not depend on is left out: the
initial values of variables (they are data, copied in at run time) and the
creation counter of sources.

A graph holding an attribute the fingerprint cannot describe exactly (a
Python object such as a custom Function's backward) has no fingerprint:
`fingerprint` returns None and the caller compiles it without a cache. A
missing fingerprint costs time; a wrong one would run the wrong code, so
anything unknown is refused rather than guessed.
"""

from __future__ import annotations

import hashlib

import numpy as np
import sympy

from .graph import Graph

#: Attributes that never change the emitted code (a parameter's cell holds its current value: data too).
IGNORED_ATTRS = frozenset({"init", "serial", "cell"})


class _Unhashable(Exception):
    """An attribute value with no exact, process-independent description."""


def _describe(value) -> str:
    """A text that two values share only when they are equal (as far as code generation sees)."""
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)
    if isinstance(value, float):
        return value.hex()
    if isinstance(value, np.generic):
        return f"{value.dtype}:{value.item()!r}"
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_describe(v) for v in value) + ")"
    if isinstance(value, sympy.Basic):
        return sympy.srepr(value)
    if isinstance(value, np.ndarray):
        digest = hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()
        return f"ndarray({value.dtype},{value.shape},{digest})"
    raise _Unhashable(type(value).__name__)


def description(value) -> str | None:
    """The exact text `fingerprint` gives an attribute's value (two values share it only when equal),
    or None where it has none."""
    try:
        return _describe(value)
    except _Unhashable:
        return None


def _op_text(op, memo: dict) -> str:
    text = memo.get(id(op))
    if text is None:
        # A builtin op's formula is symgrad's code (which the caches' keys hold): printing it with
        # sympy would cost a millisecond per op in every new process.
        expr = "" if op.expr is None else "builtin" if op.builtin else sympy.srepr(op.expr)
        extra = _describe(sorted(op.extra.items()))
        text = memo[id(op)] = f"{op.name}|{op.kind}|{op.arity}|{expr}|{extra}"
    return text


# Where a graph keeps its fingerprint once computed (a Graph is immutable, as its cached nodes are):
# a graph that a cache stored keeps it too (symgrad.ir.graph_pickle), so its programs' keys are not
# computed again (5 ms for the small GPT's step graph).
_KEPT = "_fingerprint"


def fingerprint(graph: Graph) -> str | None:
    """The sha256 (hex) of the graph's structure, or None when an attribute cannot be described."""
    kept = vars(graph)
    if _KEPT not in kept:
        kept[_KEPT] = _fingerprint(graph)
    return kept[_KEPT]


def _fingerprint(graph: Graph) -> str | None:
    nodes = graph.nodes
    index = {id(node): k for k, node in enumerate(nodes)}
    ops: dict = {}
    shapes: dict = {}   # (shape, its entries' types) -> text: a graph has a few dozen distinct shapes
    lines = []
    try:
        for node in nodes:
            attrs = node.attrs
            described = ",".join(f"{k}={_describe(attrs[k])}" for k in sorted(attrs)
                                 if k not in IGNORED_ATTRS) if attrs else ""
            shape = node.shape
            shape_key = (shape, tuple(map(type, shape)))   # 3 and sympy's Integer(3) are equal, described apart
            shape_text = shapes.get(shape_key)
            if shape_text is None:
                shape_text = shapes[shape_key] = _describe(shape)
            inputs = ",".join([str(index[id(i)]) for i in node.inputs])
            lines.append(f"{_op_text(node.op, ops)}|{node.dtype}|{shape_text}|[{inputs}]|{described}\n")
    except _Unhashable:
        return None
    ends = [[index[id(v)] for v in graph.inputs], [index[id(v)] for v in graph.outputs],
            [(index[id(t)], index[id(n)]) for t, n in graph.updates]]
    lines.append(repr(ends))
    return hashlib.sha256("".join(lines).encode()).hexdigest()
