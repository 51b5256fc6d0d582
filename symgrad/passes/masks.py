"""Backward masks read from kept activations: a save-or-recompute rewrite.

relu's derivative only asks whether its input was positive, and
`relu(x) > 0` holds exactly when `x > 0` does, as `relu(x) <= 0` does when
`x <= 0` (NaN and -0.0 included: relu keeps a NaN, and maps -0.0 to 0). So a
node that reads `x` only through such a test may read `relu(x)` instead. The forward keeps `relu(x)` anyway (the next
layer's matmul and its weight gradient read it), so after CSE the backward
no longer needs the pre-activation `x` at all: it dies with the forward
instead of living through the backward (a whole activation of bytes).
"""

from __future__ import annotations

import functools

import sympy

from ..ir.elementwise import ARGS
from ..ir.graph import Graph
from ..ir.registry import ELEMENTWISE, lookup
from ..ir.value import Value, make
from .rewrite import apply_rules, matches, with_inputs


def _is_sign_test(r, sym) -> bool:
    """`sym > 0` or `sym <= 0` (either way round): tests that relu(sym) answers alike."""
    if isinstance(r, (sympy.StrictGreaterThan, sympy.LessThan)):
        return r.lhs == sym and r.rhs == 0
    if isinstance(r, (sympy.StrictLessThan, sympy.GreaterThan)):
        return r.rhs == sym and r.lhs == 0
    return False


@functools.lru_cache(maxsize=1024)
def _positive_tests_only(expr, sym) -> bool:
    """Whether `sym` occurs in `expr` only as `sym > 0` or `sym <= 0` (or `0 < sym`, `0 >= sym`)."""
    tests = [r for r in sympy.preorder_traversal(expr) if _is_sign_test(r, sym)]
    occurrences = sum(1 for a in sympy.preorder_traversal(expr) if a == sym)
    return bool(tests) and occurrences == len(tests)


@matches(kind=ELEMENTWISE)
def mask_from_relu(node: Value) -> Value | None:
    """f(..., x, ...) -> f(..., relu(x), ...) when f reads x only as `x > 0` (relu(x) > 0 <=> x > 0)."""
    if node.op.kind != ELEMENTWISE or node.op.expr is None or node.op.name in ("relu", "cast"):
        return None
    expr = sympy.sympify(node.op.expr)
    inputs = list(node.inputs)
    changed = False
    for k, x in enumerate(inputs):
        if x.op.name == "relu" or x.dtype not in ("float32", "float64") \
                or not _positive_tests_only(expr, ARGS[k]):
            continue
        inputs[k] = make(lookup("relu"), (x,))
        changed = True
    return with_inputs(node, tuple(inputs)) if changed else None


def masks(graph: Graph, counts: dict | None = None) -> Graph:
    """The graph with backward masks reading the kept activation instead of the pre-activation."""
    return apply_rules(graph, (mask_from_relu,), counts=counts)
