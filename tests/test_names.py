"""One namer (issue 14): a value is called the same in print(step.optimized_graph), step.source
and step.report(), for the seed softmax regression and an MLP step."""

from __future__ import annotations

import re

import numpy as np
import pytest

import symgrad as sg
from symgrad import nn
from symgrad.ir.printing import Namer

LOCAL = re.compile(r"const \w+ (t\d+) = .*?/\* (t\d+): (.*?) \*/")
KERNEL = re.compile(r"^\s+k\d+_(\w+?)_(t\d+)\s", re.M)
CHOICE = re.compile(r"^\s+(?:recompute|keep)\s+(t\d+) = (\w+)", re.M)


def _softmax_regression():
    x, y = sg.input("x", (sg.Dim("B"), 784)), sg.input("y", (sg.Dim("B"),), dtype="int64")
    W, b = sg.param("W", (784, 10)), sg.param("b", (10,))
    return sg.train_step(sg.cross_entropy(x @ W + b, y), [W, b], sg.optim.SGD(lr=0.1), backend="c")


def _mlp():
    sg.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    x, y = sg.input("x", (sg.Dim("B"), 6)), sg.input("y", (sg.Dim("B"),), dtype="int64")
    return sg.train_step(sg.cross_entropy(model(x), y), model.parameters(), sg.optim.Adam(lr=1e-3), backend="c")


@pytest.fixture(scope="module", params=["softmax_regression", "mlp"])
def step(request):
    return {"softmax_regression": _softmax_regression, "mlp": _mlp}[request.param]()


def _graph_lines(step) -> dict:
    """name -> 'type = op(...)' from the printed optimized graph."""
    lines = {}
    for line in str(step.optimized_graph).splitlines():
        name, sep, rest = line.strip().partition(": ")
        if sep and re.fullmatch(r"t\d+", name):
            lines[name] = rest
    return lines


def test_c_locals_and_comments_name_values_as_the_printed_graph(step):
    graph = _graph_lines(step)
    locals_ = LOCAL.findall(step.source)
    assert len(locals_) > 5
    for local, commented, text in locals_:
        assert local == commented, f"C local {local} computes {commented}"
        # the comment may add a note after the line: "(this row's part)"
        assert text.startswith(graph[local]), f"{local}: source says {text!r}, graph {graph[local]!r}"


def _ops_by_name(step) -> dict:
    """name -> op label of each value of the optimized graph, named as printing names them."""
    graph, name = step.optimized_graph, Namer()
    for v in [*graph.inputs, *graph.variables, *graph.nodes]:
        name(v)
    return {name(n): n.op.name for n in graph.nodes}


def test_report_names_kernels_and_choices_as_the_printed_graph(step):
    ops, printed, report = _ops_by_name(step), _graph_lines(step), str(step.report())
    named = KERNEL.findall(report) + [(op, name) for name, op in CHOICE.findall(report)]
    assert named
    for op, name in named:
        assert name in printed
        if op != "rows":  # a row kernel is named after the first value of its group, whatever its op
            assert ops[name] == op, f"report: {name} is {op}; graph: {printed[name]}"


def test_numpy_runs_the_graph_as_built():
    x = sg.input("x", (3,))
    f = sg.function([x], sg.exp(x) * 2.0, backend="numpy")
    assert f.optimized_graph is f.graph
    np.testing.assert_allclose(f(np.zeros(3, np.float32)), 2.0)
