"""Constant folding: what depends on no input and no variable is computed now.

Values are computed with the ops' NumPy reference implementations (the
oracle, so folding cannot disagree with it). Sizes stay symbolic: a scalar
built from constants that mention a `Dim` (`1.0 * 1/B`) is folded with
sympy into one symbolic constant (`1/B`), evaluated when the sizes are known.

A folded value replaces its subgraph only when that does not make the
constants stored in the program bigger, and a value whose elements are all
equal is kept as a broadcast scalar: `expand(0.0, [784, 10])` never becomes
7840 stored zeros.
"""

from __future__ import annotations

import numpy as np
import sympy

from ..ir import dtypes as D
from ..ir import shapes as S
from ..ir.elementwise import ARGS
from ..ir.graph import Graph
from ..ir.interpret import Env
from ..ir.registry import COLLECTIVE, ELEMENTWISE, SOURCE, lookup
from ..ir.value import Value, make
from .rewrite import DATA_LEAVES, is_nondeterministic, matches, rebuild, short_rational

# Results smaller than this are always folded; larger ones only when no
# bigger than the constant arrays they are computed from.
SMALL = 64
# Constant values above this many elements are not computed at all.
MAX_ELEMENTS = 1 << 20


class _ConcreteEnv(Env):
    """What a reference op may read while folding: concrete shapes only, and no cache keyed by
    id() (short-lived rebuilt nodes die during a pass, and their ids are reused)."""

    def __init__(self):
        super().__init__({}, {}, {})

    def shape(self, node) -> tuple:
        return S.evaluate_shape(node.shape, {})


_ENV = _ConcreteEnv()


def _concrete(shape) -> bool:
    return all(isinstance(s, int) for s in shape)


def _as_sympy(value):
    """A 0-d constant as an exact sympy number when it has a short form; else None."""
    if isinstance(value, sympy.Basic):
        return value
    v = np.asarray(value)
    if v.shape != () or v.dtype.kind not in "biuf":
        return None
    return short_rational(v.item() if v.dtype.kind == "f" else int(v.item()))


def _symbolic(node: Value, values: list):
    """`node` (a 0-d float elementwise op) over sympy operands, as one sympy expression, or None."""
    op = node.op
    if (op.kind != ELEMENTWISE or op.expr is None or node.shape != () or not D.is_float(node.dtype)
            or any(i.dtype == "bool" for i in node.inputs)):
        return None
    operands = [_as_sympy(v) for v in values]
    if any(o is None for o in operands):
        return None
    result = op.expr.xreplace(dict(zip(ARGS, operands)))
    if not isinstance(result, sympy.Expr) or result.has(sympy.Piecewise, sympy.zoo, sympy.nan, sympy.oo):
        return None
    if not result.free_symbols:
        return np.asarray(float(result))  # rounded once, from the exact value
    if not all(isinstance(s, S.Dim) for s in result.free_symbols):
        return None
    return result


def _stored(node: Value) -> int:
    """Elements a const node stores (a 0-d value costs one)."""
    value = node.attrs.get("value")
    return value.size if isinstance(value, np.ndarray) else 1


def _uniform(value: np.ndarray) -> bool:
    """Whether every element is the first (bitwise, so -0.0 differs from 0.0 and NaN matches NaN)."""
    raw = np.ascontiguousarray(value).reshape(-1).view(np.uint8).reshape(value.size, -1)
    return bool(np.all(raw == raw[:1]))


def constant_value(node: Value, values: list):
    """The value of `node` over its inputs' constant `values`: an ndarray, a sympy scalar, or None."""
    if any(v is None for v in values) or node.op.kind == COLLECTIVE:  # summed over processes: never constant
        return None
    if any(isinstance(v, sympy.Basic) for v in values):
        return _symbolic(node, values)
    if not _concrete(node.shape) or S.numel(node.shape) > MAX_ELEMENTS:
        return None
    return np.asarray(node.op.numpy(values, node, _ENV))


def leaf_value(node: Value):
    """The value of a const or iota leaf: an ndarray, a sympy scalar of Dims, or None."""
    if node.op.name == "const":
        value = node.attrs["value"]
        if isinstance(value, sympy.Basic) and value.free_symbols:
            return value
    elif node.op.name != "iota":
        return None
    if not _concrete(node.shape) or S.numel(node.shape) > MAX_ELEMENTS:
        return None
    return np.asarray(node.op.numpy([], node, _ENV))


def as_const(node: Value, value) -> Value:
    """A const node holding `value` with `node`'s shape and dtype."""
    if isinstance(value, sympy.Basic):
        return make(lookup("const"), value=value, shape=(), dtype=node.dtype)
    array = np.array(value, dtype=D.to_numpy(node.dtype))
    if array.shape == ():
        return make(lookup("const"), value=array.item(), shape=(), dtype=node.dtype)
    array.flags.writeable = False
    return make(lookup("const"), value=array, shape=array.shape, dtype=node.dtype)


def fold(graph: Graph, counts: dict | None = None) -> Graph:
    """The graph with every constant subgraph (worth storing) replaced by one const."""
    values: dict[int, object] = {}
    stored: dict[int, int] = {}  # elements of constant arrays a constant node is computed from
    folded = 0

    def at_node(node: Value) -> Value:
        nonlocal folded
        if node.op.kind == SOURCE:
            if node.op.name not in DATA_LEAVES:
                values[id(node)] = leaf_value(node)
                stored[id(node)] = _stored(node) if node.op.name == "const" else 0
            return node
        if is_nondeterministic(node):
            return node
        value = constant_value(node, [values.get(id(i)) for i in node.inputs])
        if value is None:
            return node
        if isinstance(value, np.ndarray) and value.size > 1 and _uniform(value):
            # A constant of one repeated value stays a broadcast scalar, never a stored array.
            if node.op.name == "expand" and node.inputs[0].op.name == "const" and node.inputs[0].shape == ():
                values[id(node)], stored[id(node)] = value, 1
                return node
            new = make(lookup("expand"), (as_const(node, value.flat[0]),), shape=node.shape)
            values[id(new)], stored[id(new)] = value, 1
            folded += 1
            return new
        size = 1 if isinstance(value, sympy.Basic) else value.size
        budget = max([stored[id(i)] for i in node.inputs] + [SMALL])
        if size > budget:
            values[id(node)] = value  # still known, for the users' sake
            stored[id(node)] = max(stored[id(i)] for i in node.inputs)
            return node
        new = as_const(node, value)
        values[id(new)], stored[id(new)] = value, size
        folded += 1
        return new

    result = rebuild(graph, at_node)
    if counts is not None and folded:
        counts["folded"] = counts.get("folded", 0) + folded
    return result


@matches(kind=ELEMENTWISE)
def fold_scalar(node: Value) -> Value | None:
    """op(c1, ..., cn) -> c: an elementwise op over 0-d constants is a 0-d constant."""
    if node.op.kind != ELEMENTWISE or node.shape != () or is_nondeterministic(node):
        return None
    if not all(i.op.name == "const" and i.shape == () for i in node.inputs):
        return None
    value = constant_value(node, [leaf_value(i) for i in node.inputs])
    return None if value is None else as_const(node, value)
