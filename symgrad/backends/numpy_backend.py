"""The reference backend: the IR's interpreter (symgrad/ir/interpret.py) behind the program
interface every backend offers."""

from __future__ import annotations

from ..ir.graph import Graph
from ..ir.interpret import evaluate  # the interpreter (tests import it from here too)


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
        self._collective = None

    def on_collective(self, hook) -> None:
        """Have all_reduce call `hook(flat_array)` to sum its value over the processes in place
        (None: this process alone)."""
        self._collective = hook

    def run(self, inputs: list, bindings: dict, variables: dict) -> list:
        """Compute the outputs, then write the updates into `variables` in place."""
        outputs, updates = evaluate(self.optimized, inputs, variables, bindings, self._collective)
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
