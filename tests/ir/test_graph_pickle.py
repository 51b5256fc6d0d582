"""symgrad.ir.graph_pickle's sympy formulas: stored and loaded back as they were, not evaluated again."""

from __future__ import annotations

import sympy

import symgrad as sg  # noqa: F401  (registers the ops)
from symgrad.ir import graph_pickle
from symgrad.ir.elementwise import ARGS, derived_op
from symgrad.ir.graph import Graph
from symgrad.ir.registry import REGISTRY

EMPTY = Graph([], [])


def _formulas() -> list:
    """Every elementwise op's formula and its first derivatives: the derived ops a step graph holds."""
    out = []
    for op in REGISTRY.values():
        if op.expr is None:
            continue
        out.append(op.expr)
        for arg in ARGS[:op.arity]:
            derivative = sympy.diff(op.expr, arg)
            if derivative.args:
                out.append(derivative)
    return out


def test_every_formula_loads_back_equal_and_of_the_same_structure():
    formulas = _formulas()
    assert len(formulas) > 80
    loaded = graph_pickle.loads(graph_pickle.dumps(formulas, EMPTY), EMPTY)
    for made, back in zip(formulas, loaded, strict=True):
        assert back == made and sympy.srepr(back) == sympy.srepr(made)
        assert hash(back) == hash(made)


def test_a_formula_is_not_evaluated_again_when_loaded(monkeypatch):
    """sympy's own pickle rebuilds tanh(x0 * x1) through tanh.eval (a 12-layer GPT's cached step
    spent 7 of its 18 ms of loading there); the stored arguments are canonical already."""
    op = derived_op("test", sympy.tanh(ARGS[0] * ARGS[1]) + sympy.exp(-ARGS[0]) ** 2, 2)
    data = graph_pickle.dumps(op, EMPTY)
    calls = []
    monkeypatch.setattr(sympy.tanh, "eval", classmethod(lambda cls, arg: calls.append(arg)))
    sympy.core.cache.clear_cache()   # as in a new process, which loads a cached step
    back = graph_pickle.loads(data, EMPTY)
    assert calls == [] and back is op          # one derived op per formula: the same OpDef
    assert graph_pickle.loads(graph_pickle.dumps(op.expr, EMPTY), EMPTY) == op.expr and calls == []
