"""The reference interpreter: a graph run node by node with each op's NumPy implementation.

The specification every compiled backend is tested against, so it is written
to be obviously right, not fast. It lives in the IR, below the passes: constant
folding (passes/fold.py) computes with it, and the NumPy backend runs it.
"""

from __future__ import annotations

import numpy as np

from . import dtypes as D
from . import shapes as S
from .graph import Graph
from .registry import ELEMENTWISE


class Env:
    """What an op's NumPy implementation may read besides its operands."""

    def __init__(self, bindings: dict, inputs: dict, variables: dict, collective=None):
        self.bindings = bindings    # Dim symbol -> int
        self.inputs = inputs        # input node -> array
        self.variables = variables  # variable node -> array
        self.collective = collective  # all_reduce's hook: sums a flat array over the processes in place
        self._shapes: dict[int, tuple] = {}

    def shape(self, node) -> tuple:
        """The concrete shape of `node` under the current Dim bindings."""
        key = id(node)
        if key not in self._shapes:
            self._shapes[key] = S.evaluate_shape(node.shape, self.bindings)
        return self._shapes[key]


def evaluate(graph: Graph, inputs: list, variables: dict, bindings: dict, collective=None) -> tuple[list, list]:
    """Run `graph`: returns (output arrays, new values of the updated variables).

    `variables` maps a variable's name to its current array; nothing is written. `collective`:
    what all_reduce calls to sum a value over the processes (symgrad.ir.ops_collective).
    """
    env = Env(bindings, dict(zip(graph.inputs, inputs)),
              {v: variables[v.name] for v in graph.variables}, collective)
    values: dict[int, np.ndarray] = {}
    for node in graph.nodes:
        args = [values[id(i)] for i in node.inputs]
        values[id(node)] = run_node(node, args, env)
    outputs = [np.array(values[id(v)]) for v in graph.outputs]
    updates = [np.array(values[id(new)]) for _, new in graph.updates]
    return outputs, updates


def run_node(node, args: list, env: Env) -> np.ndarray:
    """One node's value from its operands' (`args`).

    An op other than an elementwise one that reads or makes a 16-bit float runs in float32 and
    rounds its result once, as torch's CPU kernels do: a bfloat16 matmul or sum accumulates in
    float32 (ml_dtypes' own matmul would return float32, its sum would round every partial sum).
    Elementwise ops compute in float32 themselves (elementwise.compute_dtype).
    """
    if node.op.kind != ELEMENTWISE and (D.is_half(node.dtype) or any(D.is_half(i.dtype) for i in node.inputs)):
        wide = [np.asarray(a).astype(np.float32) if D.is_half(i.dtype) else a for a, i in zip(args, node.inputs)]
        return np.asarray(node.op.numpy(wide, node, env)).astype(D.to_numpy(node.dtype), copy=False)
    return node.op.numpy(args, node, env)
