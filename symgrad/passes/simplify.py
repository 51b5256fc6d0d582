"""Algebraic simplification: identity rewrites, then sympy on elementwise chains.

Part one is a set of small rules (each docstring states its identity) run
to a fixed point by `rewrite.apply_rules`: arithmetic identities (`x*1`,
`x+0`, `--x`, `log(exp(x))`), movement algebra (transpose of transpose,
reshape chains, broadcasts absorbed by the elementwise ops that would
broadcast anyway), `sum` of a broadcast, and casts of casts.

Part two (passes/chains.py) composes each maximal chain of single-use
elementwise nodes into one sympy expression and takes a cheaper form of it
only where that form computes what the chain computes.

Floating-point notes. Every rule is exact for finite operands except where
its docstring says otherwise. `x*0 -> 0` is wrong for x = inf or nan and
`log(exp(x)) -> x` where exp overflows, so they are off unless
`assume_finite=True` (torch folds neither). A zero's sign is kept: `x + 0.0`
is not folded (+0.0 at x = -0.0), `x + -0.0` is. sympy's
algebra is real algebra: composing a chain evaluates x - (x - x) to x and
exp(log(x)) to x, rational rewriting removes singularities ((x*x - 1)/(x - 1)
-> x + 1). So a composed form is taken only where it is NaN and infinite at
the same probe operands (+-inf, NaN, +-0, negatives) as the chain computed
node by node (`keeps_special_values`), or under `assume_finite=True`. Forms
regroup roundings: results agree to float tolerance, not bit for bit.
"""

from __future__ import annotations

import math

import sympy

from ..ir import dtypes as D
from ..ir import shapes as S
from ..ir.graph import Graph
from ..ir.registry import ELEMENTWISE, REDUCE, lookup
from ..ir.value import Value, make
from .chains import is_scalar_const, simplify_chains
from .dce import RULES as NOOP_RULES
from .fold import fold_scalar
from .rewrite import apply_rules, const_like, is_value, matches, same_type, scalar_constant


def _op(name: str, *inputs: Value, **attrs) -> Value:
    return make(lookup(name), inputs, **attrs)




# ---- arithmetic identities ---------------------------------------------------

@matches("mul")
def mul_one(node: Value) -> Value | None:
    """x * 1 -> x and 1 * x -> x (exact, NaN and inf included)."""
    if node.op.name == "mul":
        a, b = node.inputs
        if is_value(b, 1):
            return same_type(node, a)
        if is_value(a, 1):
            return same_type(node, b)
    return None


def _signed_zero(v: Value, negative: bool) -> bool:
    """Whether `v` is the constant 0 with that sign bit (an integer 0, which has none, counts).

    The sign of a zero is a value: 1/x and atan2 read it, so x + 0.0 (+0.0 at x = -0.0) is not x
    and 1/(x + 0.0) is not 1/x (inf against -inf)."""
    if not is_value(v, 0):
        return False
    if not D.is_float(v.dtype):
        return True
    c = scalar_constant(v)
    return (not isinstance(c, sympy.Basic) and math.copysign(1.0, float(c)) < 0) == negative


@matches("add")
def add_zero(node: Value) -> Value | None:
    """x + -0.0 -> x and -0.0 + x -> x (exact). Not x + 0.0: that is +0.0 at x = -0.0."""
    if node.op.name == "add":
        a, b = node.inputs
        if _signed_zero(b, negative=True):
            return same_type(node, a)
        if _signed_zero(a, negative=True):
            return same_type(node, b)
    return None


@matches("sub")
def sub_zero(node: Value) -> Value | None:
    """x - 0.0 -> x (exact). Not x - -0.0: that is +0.0 at x = -0.0."""
    if node.op.name == "sub" and _signed_zero(node.inputs[1], negative=False):
        return same_type(node, node.inputs[0])
    return None


@matches("sub")
def zero_sub(node: Value) -> Value | None:
    """-0.0 - x -> -x (exact). Not 0.0 - x: that is +0.0 at x = 0.0, where -x is -0.0."""
    if node.op.name == "sub" and _signed_zero(node.inputs[0], negative=True):
        return same_type(node, _op("neg", node.inputs[1]))
    return None


@matches("mul")
def mul_minus_one(node: Value) -> Value | None:
    """x * -1 -> -x and -1 * x -> -x (exact)."""
    if node.op.name == "mul":
        a, b = node.inputs
        if is_value(b, -1):
            return same_type(node, _op("neg", a))
        if is_value(a, -1):
            return same_type(node, _op("neg", b))
    return None


@matches("mul")
def mul_zero(node: Value) -> Value | None:
    """x * 0 -> 0 and 0 * x -> 0: only for finite x (inf * 0 and nan * 0 are nan).

    Off by default; `simplify(graph, assume_finite=True)` turns it on.
    """
    if node.op.name == "mul":
        for zero in node.inputs:
            if is_value(zero, 0) and zero.dtype == node.dtype:
                c = const_like(0.0 if D.is_float(node.dtype) else False if node.dtype == "bool" else 0,
                               node.dtype)
                return _op("expand", c, shape=node.shape) if node.shape else c
    return None


@matches("neg")
def neg_neg(node: Value) -> Value | None:
    """-(-x) -> x (exact)."""
    if node.op.name == "neg" and node.inputs[0].op.name == "neg":
        return same_type(node, node.inputs[0].inputs[0])
    return None


@matches("log")
def log_exp(node: Value) -> Value | None:
    """log(exp(x)) -> x: only for finite exp(x) (the graph gives inf past x = 709.78 in float64, 88.7
    in float32, as NumPy and torch do). Off by default; `assume_finite=True` turns it on."""
    if node.op.name == "log" and node.inputs[0].op.name == "exp":
        return same_type(node, node.inputs[0].inputs[0])
    return None


@matches("neg")
def neg_scaled(node: Value) -> Value | None:
    """-(c * x) -> (-c) * x for a 0-d constant c, whose negation then folds (exact)."""
    if node.op.name == "neg" and node.inputs[0].op.name == "mul":
        a, b = node.inputs[0].inputs
        if is_scalar_const(b):
            a, b = b, a
        if is_scalar_const(a):
            return same_type(node, _op("mul", _op("neg", a), b))
    return None


@matches("mul")
def scaled_neg(node: Value) -> Value | None:
    """(-x) * c -> x * (-c) for a 0-d constant c, whose negation then folds (exact)."""
    if node.op.name == "mul":
        a, b = node.inputs
        if is_scalar_const(a):
            a, b = b, a
        if is_scalar_const(b) and a.op.name == "neg":
            return same_type(node, _op("mul", a.inputs[0], _op("neg", b)))
    return None


# ---- movement algebra ------------------------------------------------------

@matches("transpose")
def transpose_transpose(node: Value) -> Value | None:
    """transpose(transpose(x, p), q) -> transpose(x, p[q]) (x itself when p[q] is the identity)."""
    if node.op.name == "transpose" and node.inputs[0].op.name == "transpose":
        inner = node.inputs[0]
        p, q = inner.attrs["perm"], node.attrs["perm"]
        perm = tuple(p[j] for j in q)
        x = inner.inputs[0]
        return x if perm == tuple(range(len(perm))) else _op("transpose", x, perm=perm)
    return None


@matches("reshape")
def reshape_reshape(node: Value) -> Value | None:
    """reshape(reshape(x, s1), s2) -> reshape(x, s2): row-major order is kept by both."""
    if node.op.name == "reshape" and node.inputs[0].op.name == "reshape":
        x = node.inputs[0].inputs[0]
        return x if x.shape == node.shape else _op("reshape", x, shape=node.shape)
    return None


@matches("expand")
def expand_expand(node: Value) -> Value | None:
    """expand(expand(x, s1), s2) -> expand(x, s2): broadcasting composes."""
    if node.op.name == "expand" and node.inputs[0].op.name == "expand":
        return _op("expand", node.inputs[0].inputs[0], shape=node.shape)
    return None


def _strip_leading_ones(shape: tuple) -> tuple:
    k = 0
    while k < len(shape) and shape[k] == 1:
        k += 1
    return shape[k:]


def _same_but_leading_ones(a: tuple, b: tuple) -> bool:
    """Shapes that NumPy broadcasting treats alike: equal once leading 1s are dropped."""
    return _strip_leading_ones(a) == _strip_leading_ones(b)


@matches("expand")
def expand_of_reshape(node: Value) -> Value | None:
    """expand(reshape(x, (1,..,1) + shape(x)), s) -> expand(x, s): broadcasting adds leading 1s itself."""
    if node.op.name == "expand" and node.inputs[0].op.name == "reshape":
        x = node.inputs[0].inputs[0]
        if _same_but_leading_ones(x.shape, node.inputs[0].shape) and len(x.shape) <= node.ndim:
            return _op("expand", x, shape=node.shape)
    return None


@matches("reshape")
def reshape_of_broadcast_scalar(node: Value) -> Value | None:
    """reshape(expand(c, s1), s2) -> expand(c, s2) for a 0-d c: every element is c either way."""
    if node.op.name == "reshape" and node.inputs[0].op.name == "expand":
        c = node.inputs[0].inputs[0]
        if c.shape == ():
            return _op("expand", c, shape=node.shape)
    return None


@matches(kind=ELEMENTWISE)
def absorb_broadcast(node: Value) -> Value | None:
    """f(.., expand(x), ..) -> f(.., x, ..) for elementwise f when the result's shape is unchanged;
    likewise for a reshape that only adds or removes leading 1s. Elementwise ops broadcast their
    operands NumPy-style, so the explicit broadcast repeats what f does anyway."""
    if node.op.kind != ELEMENTWISE:
        return None
    for k, v in enumerate(node.inputs):
        if v.op.name == "expand" or (v.op.name == "reshape"
                                     and _same_but_leading_ones(v.shape, v.inputs[0].shape)):
            inputs = node.inputs[:k] + (v.inputs[0],) + node.inputs[k + 1:]
            try:
                shape = S.broadcast_shapes(*(i.shape for i in inputs))
            except ValueError:
                continue
            if shape == node.shape:
                return node.over(inputs)
    return None


@matches(kind=ELEMENTWISE)
def unary_through_broadcast(node: Value) -> Value | None:
    """f(expand(x, s)) -> expand(f(x), s) for unary elementwise f: f runs on fewer elements."""
    if node.op.kind == ELEMENTWISE and len(node.inputs) == 1 and node.inputs[0].op.name == "expand":
        x = node.inputs[0].inputs[0]
        inner = make(node.op, (x,), **node.attrs)
        return same_type(node, _op("expand", inner, shape=node.shape))
    return None


# ---- reductions --------------------------------------------------------------

def _broadcast_axes(x_shape: tuple, shape: tuple) -> set:
    lead = len(shape) - len(x_shape)
    return set(range(lead)) | {lead + i for i, s in enumerate(x_shape) if s == 1 and shape[lead + i] != 1}


@matches("sum")
def sum_of_broadcast(node: Value) -> Value | None:
    """sum(expand(x, s), axes) -> reshape(x) * n when `axes` are exactly the broadcast axes,
    n being the number of copies (exact in real arithmetic; in floats, one rounding instead of n)."""
    if node.op.name != "sum" or node.inputs[0].op.name != "expand" or not D.is_float(node.dtype):
        return None
    e = node.inputs[0]
    x = e.inputs[0]
    axes = set(node.attrs["axes"])
    broadcast = _broadcast_axes(x.shape, e.shape)
    if not broadcast <= axes or any(a not in broadcast and e.shape[a] != 1 for a in axes):
        return None
    count = S.numel([e.shape[a] for a in sorted(broadcast)])
    base = x if x.shape == node.shape else _op("reshape", x, shape=node.shape)
    if count == 1:
        return same_type(node, base)
    return same_type(node, _op("mul", base, const_like(count, node.dtype)))


@matches("sum")
def sum_of_sum(node: Value) -> Value | None:
    """sum(sum(x, A, keepdims=k), A2, keepdims=k) -> sum(x, A + A2, keepdims=k): one pass over x
    (exact in real arithmetic; the additions are grouped differently)."""
    if node.op.name != "sum" or node.inputs[0].op.name != "sum":
        return None
    inner = node.inputs[0]
    keep = node.attrs["keepdims"]
    if inner.attrs["keepdims"] != keep:
        return None
    x = inner.inputs[0]
    first = set(inner.attrs["axes"])
    remaining = list(range(x.ndim)) if keep else [a for a in range(x.ndim) if a not in first]
    axes = tuple(sorted(first | {remaining[a] for a in node.attrs["axes"]}))
    return same_type(node, _op("sum", x, axes=axes, keepdims=keep))


@matches("reshape")
def drop_kept_axes(node: Value) -> Value | None:
    """reshape(r(x, A, keepdims=True), shape without A) -> r(x, A, keepdims=False) for a reduction r:
    the reshape only removes the kept size-1 axes."""
    if node.op.name != "reshape" or node.inputs[0].op.kind != REDUCE:
        return None
    r = node.inputs[0]
    if not r.attrs["keepdims"]:
        return None
    dropped = tuple(s for a, s in enumerate(r.shape) if a not in r.attrs["axes"])
    if dropped != node.shape:
        return None
    return same_type(node, make(r.op, r.inputs, **{**r.attrs, "keepdims": False}))


@matches("sum")
def sum_of_scaled(node: Value) -> Value | None:
    """sum(c * x) -> c * sum(x) for a 0-d constant c (linearity; one multiply per result). Not for
    an infinite or NaN c: a sum of nothing is 0, c * 0 is NaN (a mean over an empty axis is a sum
    times 1/0; the fuzzer found sum(mean(x, 1)) of a [0, 0] x NaN on C)."""
    if node.op.name == "sum" and node.inputs[0].op.name == "mul":
        a, b = node.inputs[0].inputs
        if is_scalar_const(b):
            a, b = b, a
        c = scalar_constant(a) if is_scalar_const(a) else None
        if c is not None and not isinstance(c, sympy.Basic) and not math.isfinite(float(c)):
            return None
        # Same dtype throughout: otherwise the sum would run in a narrower type than before.
        if is_scalar_const(a) and b.shape == node.inputs[0].shape and a.dtype == b.dtype == node.dtype:
            return same_type(node, _op("mul", a, _op("sum", b, **node.attrs)))
    return None


@matches("sum")
def sum_of_neg(node: Value) -> Value | None:
    """sum(-x) -> -sum(x) (exact: negation commutes with rounding)."""
    if node.op.name == "sum" and node.inputs[0].op.name == "neg":
        return same_type(node, _op("neg", _op("sum", node.inputs[0].inputs[0], **node.attrs)))
    return None


# ---- casts -------------------------------------------------------------------

# (from, to) conversions that keep every value exactly.
LOSSLESS = frozenset({("bool", "int32"), ("bool", "int64"), ("bool", "float32"), ("bool", "float64"),
                      ("int32", "int64"), ("int32", "float64"), ("float32", "float64")})


@matches("cast")
def cast_cast(node: Value) -> Value | None:
    """cast(cast(x, b), c) -> cast(x, c) when x -> b is lossless (x itself when c is x's dtype)."""
    if node.op.name == "cast" and node.inputs[0].op.name == "cast":
        x = node.inputs[0].inputs[0]
        if (x.dtype, node.inputs[0].dtype) in LOSSLESS:
            return x if x.dtype == node.dtype else _op("cast", x, dtype=node.dtype)
    return None


RULES = (*NOOP_RULES, fold_scalar, mul_one, add_zero, sub_zero, zero_sub, mul_minus_one, neg_neg,
         neg_scaled, scaled_neg, transpose_transpose, reshape_reshape, expand_expand,
         expand_of_reshape, reshape_of_broadcast_scalar, absorb_broadcast, unary_through_broadcast,
         sum_of_broadcast, sum_of_sum, drop_kept_axes, sum_of_scaled, sum_of_neg, cast_cast)
FINITE_RULES = (mul_zero, log_exp)


def simplify(graph: Graph, assume_finite: bool = False, counts: dict | None = None) -> Graph:
    """The graph with every identity rule applied to a fixed point, then its chains simplified.

    assume_finite: also apply rewrites that are wrong for inf/nan operands
    (`x*0 -> 0`, sympy results that drop an operand).
    """
    rules = RULES + (FINITE_RULES if assume_finite else ())
    settled: set = set()  # the nodes no rule rewrites, kept from one round to the next (apply_rules)
    kept: dict = {}     # the chains left as they are, likewise (simplify_chains)
    for _ in range(4):  # a simplified chain may expose new identities, rarely more than once
        before = graph
        graph = apply_rules(graph, rules, counts=counts, settled=settled)
        graph = simplify_chains(graph, assume_finite, counts, kept)
        if graph is before:
            break
    return graph
