"""Differential fuzzer: random graphs on every backend against torch, forward and gradients.

Graphs come from tests/fuzz_graphs.py (elementwise, broadcasting, reduction,
matmul and movement ops; shapes of 0 to 3 axes with sizes 0, 1 and odd ones;
values with +-0, +-inf, NaN, huge and tiny numbers mixed in). A C build costs
about a second, so the graphs are compiled in batches: each batch of
GRAPHS_PER_MODULE graphs is one sg.function (disjoint inputs per graph, every
graph's output and its input gradients as outputs), built once per backend.

Each graph computes `out`; its gradients are those of sum(out * cot) with a
random finite cotangent `cot`. Every backend must agree with torch (NaN where
torch gives NaN, the same infinity where it gives one, close elsewhere), and
C must agree with the NumPy reference tightly.

Every backend runs every graph, specials included: the C pipeline composes a chain
(passes/simplify.py) only into a form that is NaN and infinite where the chain is.

SYMGRAD_FUZZ_EXAMPLES sets the number of graphs (2,000 by default, a CI run);
SYMGRAD_FUZZ_SEED changes the seed, e.g. for a nightly run:
    SYMGRAD_FUZZ_EXAMPLES=100000 SYMGRAD_FUZZ_SEED=$RANDOM python -m pytest -q tests/test_fuzz.py
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

import symgrad as sg
from symgrad.backends.cache import default_flags
from tests.conftest import BACKENDS
from tests.fuzz_graphs import FuzzGraph, build, draw_graphs, draw_values, input_shapes

EXAMPLES = int(os.environ.get("SYMGRAD_FUZZ_EXAMPLES", "2000"))
SEED = int(os.environ.get("SYMGRAD_FUZZ_SEED", "0"))
GRAPHS_PER_MODULE = 250
BATCHES = math.ceil(EXAMPLES / GRAPHS_PER_MODULE)

# gcc at -O3 spends ~45 s on one batch's source, at -O1 ~5 s. The defaults allow no value-changing
# optimisation (no -ffast-math, no FMA contraction in ISO C mode), so -O1 computes the same numbers.
C_FLAGS = ["-O1" if flag == "-O3" else flag for flag in default_flags()]

# Tolerances. The same float64 arithmetic on two backends differs only by summation order and
# libm's last bits; torch differs from NumPy's libm by a few ulps, which chains of ops amplify.
RTOL_C_NUMPY, RTOL_TORCH = 1e-10, 1e-7


class Batch:
    """GRAPHS_PER_MODULE graphs as one symgrad graph, their input values and torch's results."""

    def __init__(self, index: int):
        count = min(GRAPHS_PER_MODULE, EXAMPLES - index * GRAPHS_PER_MODULE)
        self.graphs: list[FuzzGraph] = draw_graphs(SEED * 1_000_003 + index, count)
        rng = np.random.default_rng([SEED, index])
        self.inputs, self.outputs, self.arrays = [], [], []
        self.expected: dict[int, list[np.ndarray]] = {}   # per graph: torch's out and gradients
        self.spans, self.input_spans = [], []   # per graph: the slices of outputs and arrays it owns
        for g, graph in enumerate(self.graphs):
            shapes = input_shapes(graph)
            xs = [sg.input(f"g{g}_x{k}", s, dtype="float64") for k, s in enumerate(shapes)]
            out = build(graph, 0, xs)
            cot = sg.input(f"g{g}_cot", out.shape, dtype="float64")
            grads = sg.grad(sg.sum(out * cot), xs)
            arrays = draw_values(graph, shapes, rng) + [rng.standard_normal(out.shape)]
            start, input_start = len(self.outputs), len(self.arrays)
            self.inputs += [*xs, cot]
            self.outputs += [out, *grads]
            self.arrays += arrays
            self.spans.append(slice(start, len(self.outputs)))
            self.input_spans.append(slice(input_start, len(self.arrays)))
            self.expected[g] = _torch_results(graph, arrays)
        self._compiled = {}

    def run(self, backend: str) -> dict[int, list[np.ndarray]]:
        """Each graph's out and gradients on `backend` (one compiled module per backend)."""
        if backend not in self._compiled:
            options = {"flags": C_FLAGS} if backend == "c" else {}
            function = sg.function(self.inputs, self.outputs, backend=backend, **options)
            flat = iter(np.asarray(r) for r in function(*self.arrays))
            self._compiled[backend] = {g: [next(flat) for _ in range(span.stop - span.start)]
                                       for g, span in enumerate(self.spans)}
        return self._compiled[backend]


def _torch_results(graph: FuzzGraph, arrays) -> list[np.ndarray]:
    """torch's out and gradients of sum(out * cot) for one graph."""
    xs = [torch.tensor(a, requires_grad=True) for a in arrays[:-1]]
    out = build(graph, 1, xs)
    grads = torch.autograd.grad(out, xs, grad_outputs=torch.tensor(arrays[-1]), allow_unused=True)
    return [out.detach().numpy()] + [np.zeros(x.shape) if g is None else g.numpy() for x, g in zip(xs, grads)]


def _mismatch(got: np.ndarray, want: np.ndarray, rtol: float) -> str | None:
    """Why `got` does not match `want`, or None: NaN exactly where want is NaN, the same
    infinities, finite values within rtol. The absolute tolerance, rtol on the scale of the
    array's largest magnitude (at least 1), allows the rounding that a sum cancelling to ~0 keeps."""
    if got.shape != want.shape:
        return f"shape {got.shape} != {want.shape}"
    got, want = got.astype(np.float64), want.astype(np.float64)
    nan_want, nan_got = np.isnan(want), np.isnan(got)
    if (nan_want != nan_got).any():
        return "NaN in different places"
    inf = np.isinf(want) | np.isinf(got)
    if (got[inf] != want[inf]).any():
        return "infinities differ"
    finite = ~(nan_want | inf)
    if finite.any():
        scale = np.abs(want[finite]).max()
        if not np.allclose(got[finite], want[finite], rtol=rtol, atol=rtol * max(scale, 1.0)):
            return f"max abs diff {np.abs(got[finite] - want[finite]).max():.3g}"
    return None


def _report(batch: Batch, results, reference, rtol: float, names: tuple) -> list[str]:
    """One line block per graph whose outputs differ: the graph, its inputs and both results."""
    with np.printoptions(threshold=16, edgeitems=3, precision=6, linewidth=200):
        return _describe_failures(batch, results, reference, rtol, names)


def _describe_failures(batch: Batch, results: dict, reference, rtol: float, names: tuple) -> list[str]:
    failures = []
    for g, got_all in results.items():
        for k, (got, want) in enumerate(zip(got_all, reference[g])):
            why = _mismatch(got, want, rtol)
            if why:
                what = "out" if k == 0 else f"d/dx{k - 1}"
                inputs = batch.arrays[batch.input_spans[g]]
                failures.append(f"graph {g} {what}: {why}\n  {batch.graphs[g]}\n  inputs (last: cot)={inputs!r}\n"
                                f"  {names[0]}={got!r}\n  {names[1]}={want!r}")
                break
    return failures


@pytest.fixture(scope="module", params=range(BATCHES), ids=lambda i: f"batch{i}")
def batch(request) -> Batch:
    return Batch(request.param)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_match_torch(batch, backend):
    """Every graph's output and input gradients agree with torch on every backend."""
    failures = _report(batch, batch.run(backend), batch.expected, RTOL_TORCH, (backend, "torch"))
    assert not failures, f"{len(failures)} of {len(batch.graphs)} graphs differ:\n" + "\n".join(failures[:10])


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "numpy"])
def test_compiled_backends_match_numpy(batch, backend):
    """Compiled float64 code agrees with the NumPy reference to 1e-10."""
    failures = _report(batch, batch.run(backend), batch.run("numpy"), RTOL_C_NUMPY, (backend, "numpy"))
    assert not failures, f"{len(failures)} of {len(batch.graphs)} graphs differ:\n" + "\n".join(failures[:10])
