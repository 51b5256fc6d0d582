"""The reference backend: executes the IR node by node with NumPy.

This is the specification every compiled backend is tested against, so it
is written to be obviously right, not fast.
"""

from __future__ import annotations

import numpy as np

from ..ir import shapes as S
from ..ir.graph import Graph


class Env:
    """What an op's NumPy implementation may read besides its operands."""

    def __init__(self, bindings: dict, inputs: dict, variables: dict):
        self.bindings = bindings    # Dim symbol -> int
        self.inputs = inputs        # input node -> array
        self.variables = variables  # variable node -> array
        self._shapes: dict[int, tuple] = {}

    def shape(self, node) -> tuple:
        """The concrete shape of `node` under the current Dim bindings."""
        key = id(node)
        if key not in self._shapes:
            self._shapes[key] = S.evaluate_shape(node.shape, self.bindings)
        return self._shapes[key]


def evaluate(graph: Graph, inputs: list, variables: dict, bindings: dict) -> tuple[list, list]:
    """Run `graph`: returns (output arrays, new values of the updated variables).

    `variables` maps a variable's name to its current array; nothing is written.
    """
    env = Env(bindings, dict(zip(graph.inputs, inputs)),
              {v: variables[v.name] for v in graph.variables})
    values: dict[int, np.ndarray] = {}
    for node in graph.nodes:
        args = [values[id(i)] for i in node.inputs]
        values[id(node)] = node.op.numpy(args, node, env)
    outputs = [np.array(values[id(v)]) for v in graph.outputs]
    updates = [np.array(values[id(new)]) for _, new in graph.updates]
    return outputs, updates


class NumpyProgram:
    """A graph ready to run on NumPy; the same interface as the compiled backends."""

    backend = "numpy"

    def __init__(self, graph: Graph, optimize: bool = False):
        self.graph = graph
        self.pass_report: dict = {}
        if optimize:
            from ..passes import optimize as run_passes
            graph = run_passes(graph, report=self.pass_report)
        self.optimized = graph  # what runs: the graph itself unless optimize=True
        self.source = str(graph)  # there is no generated code; the graph text stands in
        self.module = None

    def run(self, inputs: list, bindings: dict, variables: dict) -> list:
        """Compute the outputs, then write the updates into `variables` in place."""
        outputs, updates = evaluate(self.optimized, inputs, variables, bindings)
        for (target, _), new in zip(self.optimized.updates, updates):
            variables[target.name][...] = new
        return outputs


def compile(graph: Graph, optimize: bool = False, **options) -> NumpyProgram:
    """The NumPy 'compilation': nothing to build.

    optimize: run the graph passes first (default False: the reference runs the graph as built).
    """
    if options:
        raise TypeError(f"backend 'numpy' takes only optimize=, got {sorted(options)}")
    return NumpyProgram(graph, optimize=optimize)
