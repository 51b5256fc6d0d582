"""Random graphs: every pass keeps the NumPy reference's results on generated DAGs.

A graph is drawn as a sequence of ops (elementwise, reductions, movement,
matmul, scalar constants) over two inputs, each op reading any earlier
value; its gradients with respect to both inputs are part of the graph.
Every pass, and the pipeline, must give the same outputs (and a graph the
verifier accepts).
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import symgrad as sg
from symgrad.backends.numpy_backend import evaluate
from symgrad.step.call_checks import bind_inputs
from symgrad.ir.graph import Graph
from symgrad.passes import cse, dce, fold, optimize, simplify, verify

PASSES = {"dce": dce, "fold": fold, "simplify": simplify, "cse": cse, "pipeline": optimize}

# Unary ops, kept inside their domains: log and sqrt read x*x + 1 (>= 1), so the
# rewrites valid only on a domain (exp(log(x)) -> x for x > 0) stay exact here.
UNARY = {
    "neg": lambda x: -x,
    "exp": sg.exp,
    "log": lambda x: sg.log(x * x + 1.0),
    "tanh": sg.tanh,
    "sigmoid": sg.sigmoid,
    "relu": sg.relu,
    "abs": sg.abs,
    "sin": sg.sin,
    "sqrt": lambda x: sg.sqrt(x * x + 1.0),
    "cast_roundtrip": lambda x: sg.cast(sg.cast(x, "float32"), "float64"),
    "stop_gradient": sg.stop_gradient,
    "exp_log": lambda x: sg.exp(sg.log(sg.exp(x))),
    "neg_neg": lambda x: -(-x),
}
BINARY = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / (b * b + 1.0),
    "maximum": sg.maximum,
    "minimum": sg.minimum,
    "where": lambda a, b: sg.where(a > b, a, b * 0.5),
}
SCALARS = (0.0, 1.0, -1.0, 2.0, 0.5)


def _reshapes(shape: tuple) -> list:
    n = int(np.prod(shape)) if shape else 1
    options = [(n,), (1, n)] + [(d, n // d) for d in range(2, n) if n % d == 0]
    return [s for s in options if s != shape]


def _expands(shape: tuple) -> list:
    if shape == ():
        return [(3,), (2, 3)]
    if len(shape) == 1:
        return [(2,) + shape, (3,) + shape]
    return [(2,) + shape] + ([(3, shape[1])] if shape[0] == 1 else []) + ([(shape[0], 4)] if shape[1] == 1 else [])


def _step(draw, pool: list):
    """One random op over values of `pool`; returns its result."""
    kind = draw(st.sampled_from(["unary", "binary", "binary", "scalar", "reduce", "movement", "matmul"]))
    x = pool[draw(st.integers(0, len(pool) - 1))]
    if kind == "unary":
        return UNARY[draw(st.sampled_from(sorted(UNARY)))](x)
    if kind == "binary":
        y = pool[draw(st.integers(0, len(pool) - 1))]
        try:
            return BINARY[draw(st.sampled_from(sorted(BINARY)))](x, y)
        except ValueError:  # shapes that do not broadcast: fall back to a unary op
            return sg.tanh(x)
    if kind == "scalar":
        c = draw(st.sampled_from(SCALARS))
        return draw(st.sampled_from([lambda: x * c, lambda: c * x, lambda: x + c, lambda: x - c, lambda: c - x]))()
    if kind == "reduce" and x.ndim:
        axis = draw(st.integers(0, x.ndim - 1))
        keep = draw(st.booleans())
        return (sg.sum if draw(st.booleans()) else sg.max)(x, axis=axis, keepdims=keep)
    if kind == "movement":
        move = draw(st.sampled_from(["transpose", "reshape", "expand"]))
        if move == "transpose" and x.ndim == 2:
            return sg.transpose(sg.transpose(x)) if draw(st.booleans()) else sg.transpose(x)
        if move == "reshape" and _reshapes(x.shape):
            return sg.reshape(x, draw(st.sampled_from(_reshapes(x.shape))))
        return sg.broadcast_to(x, draw(st.sampled_from(_expands(x.shape))))
    if kind == "matmul" and x.ndim == 2:
        partners = [y for y in pool if y.ndim == 2 and y.shape[0] == x.shape[1]]
        y = draw(st.sampled_from(partners)) if partners else sg.transpose(x)
        return x @ y
    return sg.sin(x)


@st.composite
def random_graphs(draw):
    """(graph, input arrays): a random DAG over a[3,4] and b[4], its output and both gradients."""
    a = sg.input("a", (3, 4), dtype="float64")
    b = sg.input("b", (4,), dtype="float64")
    pool = [a, b]

    steps = draw(st.integers(1, 8))
    for _ in range(steps):
        pool.append(_step(draw, pool))
    out = pool[-1]
    # Use a few values, not just the last, so shared subexpressions feed several outputs.
    extra = pool[draw(st.integers(2, len(pool) - 1))]
    loss = sg.sum(out * out) + sg.sum(extra)
    ga, gb = sg.grad(loss, [a, b])
    seed = draw(st.integers(0, 2 ** 16))
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal((3, 4)), rng.standard_normal(4)]
    return Graph([a, b], [out, loss, ga, gb]), arrays


def _run(graph: Graph, arrays: list) -> list:
    outputs, _ = evaluate(graph, arrays, {}, bind_inputs(graph.inputs, arrays))
    return outputs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_graphs())
def test_every_pass_keeps_results_on_random_graphs(case):
    graph, arrays = case
    want = _run(graph, arrays)
    assume(all(np.isfinite(w).all() for w in want))
    text = str(graph)
    for name, run_pass in PASSES.items():
        optimized = run_pass(graph)
        verify(optimized)
        got = _run(optimized, arrays)
        for k, (g, w) in enumerate(zip(got, want)):
            assert g.shape == w.shape and g.dtype == w.dtype
            np.testing.assert_allclose(g, w, rtol=1e-7, atol=1e-9, err_msg=f"{name}: output {k}\n{graph}")
    assert str(graph) == text  # no pass changed its input
    assert len(optimize(graph).nodes) <= len(graph.nodes)
