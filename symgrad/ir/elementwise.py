"""Elementwise ops defined by sympy expressions, and their derivatives.

An elementwise op is one sympy expression over the scalar symbols x0, x1, ...
Its NumPy reference comes from `sympy.lambdify`, its C/CUDA body from a sympy
code printer, and its VJP from `sympy.diff`: nothing about a derivative is
written by hand. Each partial derivative is computed once per op and cached.

Where a derivative reads better in terms of the op's own output (sigmoid:
y*(1-y), exp: y, tanh: 1-y**2), it is rewritten so, and the backward reuses
the value the forward computed instead of recomputing transcendental calls.
"""

from __future__ import annotations

import random
from functools import lru_cache
from typing import Callable, Sequence

import numpy as np
import sympy

from . import dtypes as D
from . import shapes as S
from .registry import ELEMENTWISE, REGISTRY, OpDef, register

# x0..x7: the op's operands; y: its own output; g: the incoming cotangent.
ARGS = sympy.symbols("x0:8", real=True)
OUT = sympy.Symbol("y", real=True)
COTANGENT = sympy.Symbol("g", real=True)

# Output dtype rules: "promote" (NumPy result type), "float" (promote, then at
# least float32: exp of an int is a float, as in torch), "bool" (comparisons).
# "select" (where): promote over every operand but the first, the condition.
DTYPE_RULES = ("promote", "float", "bool", "select")


def _infer(name: str, arity: int, dtype_rule: str):
    def infer(inputs, attrs):
        if len(inputs) != arity:
            raise TypeError(f"{name}: takes {arity} operand(s), got {len(inputs)}")
        shape = S.broadcast_shapes(*(v.shape for v in inputs), op=name)
        if dtype_rule == "bool":
            return shape, "bool"
        operands = inputs[1:] if dtype_rule == "select" else inputs
        dtype = D.promote(*(v.dtype for v in operands))
        if dtype_rule == "float" and not D.is_float(dtype):
            dtype = D.DEFAULT_FLOAT
        return shape, dtype
    return infer


def _numpy_impl(expr: sympy.Expr, arity: int) -> Callable:
    fn = sympy.lambdify(ARGS[:arity], expr, modules="numpy")

    def run(args, node, env):
        # Broadcast first: sympy prints Max/Min/Piecewise with helpers that
        # want operands of one shape.
        args = np.broadcast_arrays(*args) if len(args) > 1 else args
        with np.errstate(all="ignore"):  # inf/nan follow IEEE, as in torch
            out = fn(*args)
        out = np.asarray(out).astype(D.to_numpy(node.dtype), copy=False)
        return np.broadcast_to(out, env.shape(node)) if out.shape != env.shape(node) else out
    return run


def define(name: str, expr: sympy.Expr, arity: int, dtype_rule: str = "promote",
           doc: str = "", vjp: Callable | None = None, differentiable: bool = True) -> OpDef:
    """Register an elementwise op over ARGS[:arity]; its VJP comes from sympy.diff."""
    if dtype_rule not in DTYPE_RULES:
        raise ValueError(f"{name}: unknown dtype rule {dtype_rule!r}")
    stray = expr.free_symbols - set(ARGS[:arity])
    if stray:
        raise ValueError(f"{name}: expression uses symbols {sorted(map(str, stray))} "
                         f"beyond its operands {list(ARGS[:arity])}")
    op = OpDef(name=name, kind=ELEMENTWISE, infer=_infer(name, arity, dtype_rule),
               numpy=_numpy_impl(expr, arity), doc=doc or f"{name}: {expr}",
               expr=expr, arity=arity)
    op.vjp = vjp if vjp is not None else (elementwise_vjp if differentiable else None)
    return register(op)


# ---- derivatives ---------------------------------------------------------

def _cost(expr: sympy.Expr) -> int:
    """Calls to transcendental functions and non-integer powers: what is slow to evaluate."""
    cost = 0
    for node in sympy.preorder_traversal(expr):
        if isinstance(node, sympy.Function) and not isinstance(node, (sympy.Piecewise,)):
            cost += 1
        elif isinstance(node, sympy.Pow) and not node.exp.is_Integer:
            cost += 1
    return cost


def _in_terms_of_output(expr: sympy.Expr, partial: sympy.Expr) -> sympy.Expr | None:
    """Rewrite a unary op's derivative in terms of y = expr(x0), if that is cheaper.

    Inverts y = f(x0) with sympy.solve, substitutes, and keeps the result only
    when it verifies numerically at sample points and costs fewer calls.
    """
    x = ARGS[0]
    try:
        candidates = sympy.solve(sympy.Eq(OUT, expr), x)
    except (NotImplementedError, ValueError, TypeError):
        return None
    rng = random.Random(0)
    f = sympy.lambdify(x, expr, "math")
    d = sympy.lambdify(x, partial, "math")
    best = None
    for inverse in candidates:
        rewritten = sympy.simplify(partial.subs(x, inverse))
        if rewritten.has(x) or _cost(rewritten) >= _cost(partial):
            continue
        r = sympy.lambdify(OUT, rewritten, "math")
        try:
            ok = all(abs(r(f(t)) - d(t)) <= 1e-9 * (1 + abs(d(t)))
                     for t in (rng.uniform(0.1, 0.9) for _ in range(5)))
        except (ValueError, ZeroDivisionError, OverflowError, TypeError):
            ok = False
        if ok and (best is None or _cost(rewritten) < _cost(best)):
            best = rewritten
    return best


@lru_cache(maxsize=None)
def partial_derivative(op_name: str, i: int) -> sympy.Expr:
    """d op / d x_i as a sympy expression over ARGS and OUT, cached per op."""
    op = REGISTRY[op_name]
    partial = sympy.diff(op.expr, ARGS[i])
    if partial.has(sympy.Piecewise, sympy.Heaviside, sympy.sign):
        partial = sympy.piecewise_fold(partial)
    elif _cost(partial) > 0:
        partial = sympy.simplify(partial)
    if op.arity == 1 and _cost(partial) > 0:
        partial = _in_terms_of_output(op.expr, partial) or partial
    return partial


def elementwise_vjp(node, g, wants: Sequence[bool]):
    """The VJP of any sympy-defined op: g * d op/d x_i, one fused node per input."""
    out = []
    for i, want in enumerate(wants):
        if not want:
            out.append(None)
            continue
        out.append(apply_expression(COTANGENT * partial_derivative(node.op.name, i),
                                    {COTANGENT: g, OUT: node, **dict(zip(ARGS, node.inputs))},
                                    name=f"{node.op.name}_vjp{i}"))
    return out


def apply_expression(expr: sympy.Expr, values: dict, name: str):
    """Build graph code computing `expr`, whose symbols stand for `values`.

    The trivial shapes of a VJP (g, -g, g*v) reuse the neg and mul ops; any
    other expression becomes one node of a derived elementwise op (registered
    once per name), which sympy can differentiate again for higher orders.
    """
    from .. import functional as F

    expr = sympy.sympify(expr)
    used = sorted(expr.free_symbols, key=lambda s: s.name)
    if expr in values:
        return values[expr]
    if expr.is_Mul and len(expr.args) == 2:
        a, b = expr.args
        if a == -1 and b in values:
            return F.neg(values[b])
        if a in values and b in values:
            return F.mul(values[a], values[b])
    renamed = expr.xreplace(dict(zip(used, ARGS)))
    op = derived_op(name, renamed, len(used))
    return F.apply_elementwise(op, [values[s] for s in used])


def derived_op(name: str, expr: sympy.Expr, arity: int) -> OpDef:
    """The op computing `expr`, registered under `name` (suffixed if the name is taken)."""
    key = (expr, arity)
    cache = _DERIVED.setdefault(name, {})
    if key not in cache:
        unique = name if name not in REGISTRY else f"{name}_{len(cache) + 1}"
        while unique in REGISTRY:
            unique += "_"
        cache[key] = define(unique, expr, arity, dtype_rule="float", doc=f"{unique}: {expr}")
    return cache[key]


_DERIVED: dict[str, dict] = {}
