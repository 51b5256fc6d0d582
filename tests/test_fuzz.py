"""Differential fuzzer: random graphs on every backend against torch, forward and gradients.

Graphs come from tests/fuzz_graphs.py (elementwise, broadcasting, reductions and statistics,
matmul, movement, indexing, convolution, pooling and attention; mixed dtypes under torch's
promotion; values with +-0, +-inf, NaN, huge and tiny numbers mixed in). A C build costs seconds,
so the graphs are compiled in batches: each batch of GRAPHS_PER_MODULE graphs is one sg.function
(disjoint inputs per graph, every graph's output and its float inputs' gradients as outputs),
built once per backend. A graph symgrad refuses to build is a failure of its own, not the batch's.

Each graph computes `out`; its gradients are those of sum(out * cot) with a random cotangent
`cot`, or of sum(out) or mean(out) (a constant cotangent, broadcast). Every backend must agree
with torch (the same dtype; NaN where torch gives NaN, the same infinity where it gives one,
close elsewhere), and C must agree with the NumPy reference tightly.

Ill-conditioned results. Where a result differs, torch is run again with each computed value
moved by one rounding error of its op, each gradient contribution to a value moved by one ulp
before autograd sums them, and softmax's backward (attention's inner one too) moved by its own rounding
(fuzz_graphs.nudge_pattern: all up, all down, four random mixes, neighbours opposite ways; and the
backward's alone, up and down, where moving the forward hides them), once with only the zeros an op may
have flushed lifted to the smallest subnormal (torch.log1p(5e-324) is 0), and once with subnormal values
lifted to the smallest normal one (a subnormal divisor
makes a result depend on the order of a formula's operations at overflow: torch's gradient of
y / y is inf at y = 4.5e-309, the true 0 in symgrad). Two correct implementations differ by such
roundings, so an element is accepted where
symgrad's value is one of those runs' values (the same NaN or infinity, or close), or where torch's
own runs spread: a finite value within twice the spread of the finite runs (each side's roundings
can move it that far), or between two of the runs' finite values (the exact value lies between them;
torch's own value may be NaN, softplus(x) / (2 softplus(x)) at x = -745 with its exp flushed to 0). Examples: tanh(-19.05) is -1 in one libm and -0.9999999999999999 in the
other, and pow(-1.39, that) is finite or NaN; log_softmax of a dominant element is -1e-16 or
-2e-16 (a rounding of log(1 + 1e-16)) and a division by it differs by 2x; torch's vectorised
exp flushes exp(-745) to 0 where libm gives 5e-324, and a product with inf is NaN or inf. A
well-conditioned element (all runs agree) is held to the plain tolerance. Where the runs give both
+inf and -inf, one rounding decides the element's sign and whether it is finite (an infinity times a
value whose sign rounding decides: x - concat(x, x) summed over a broadcast, times an infinite conv
weight; a quotient of subnormals, sigmoid(x) / softplus(x) at x = -745): any value is accepted there,
as it is where the runs' finite values take both signs and another run is NaN or infinite (one
rounding moves the element across a pole: x / gelu_tanh(x) at x = -7.16, whose divisor is within a
rounding of 0). maximum and minimum of +0 and -0 may give either zero (torch's own scalar and
vectorised paths differ), so the runs also take the other one (fuzz_graphs.nudge_pattern).
Where torch leaves float64's range on the way (an op's result or gradient contribution overflows
from finite nonzero operands, fuzz_graphs.leaves_range) and all its runs are infinite or NaN, a
finite value is accepted: the exact value may be finite, and a composed formula may stay in range
where op-by-op steps do not (the gradient of v / (v * v) at v = 1e-146: C forms -1 / v^2, finite;
torch and the NumPy reference form v / (v * v)^2 = 1e438 first). torch's side
detaches every empty value (fuzz_graphs.build): nothing depends on it, and symgrad's gradient
through it is exactly 0, where torch's would be 0 times each local derivative, NaN at an infinite one.

SYMGRAD_FUZZ_EXAMPLES sets the number of graphs (2,000 by default, a CI run of about 100 s; on
several cores, `-n 2 --dist loadgroup` keeps each batch's tests on one pytest-xdist worker).
SYMGRAD_FUZZ_SEED sets the seed; unset, every run draws one, prints it, and names it in any
failure, with the command that replays the failing batch:
    SYMGRAD_FUZZ_EXAMPLES=50000 SYMGRAD_FUZZ_SEED=12345 python -m pytest -q tests/test_fuzz.py
    SYMGRAD_FUZZ_EXAMPLES=2000 SYMGRAD_FUZZ_SEED=12345 python -m pytest -q tests/test_fuzz.py -k batch3
"""

from __future__ import annotations

import math
import os
import random
import warnings

import numpy as np
import pytest
import torch

import symgrad as sg
from symgrad.backends.build.runtime import default_flags
from tests.conftest import BACKENDS
from tests.fuzz_graphs import (ALTERNATING_DOWN, ALTERNATING_UP, BACKWARD_DOWN, BACKWARD_UP, FLOAT, FLUSHED_ZEROS_LIFTED,
                               LIFT_SUBNORMALS,
                               FuzzGraph, build, draw_graphs, draw_values, input_specs, leaves_range, nudge_pattern)

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::RuntimeWarning")]


def _seed() -> tuple[int, bool]:
    """SYMGRAD_FUZZ_SEED, or one drawn for this run (the same in every pytest-xdist worker of a
    run, which share PYTEST_XDIST_TESTRUNUID); and whether it was drawn."""
    given = os.environ.get("SYMGRAD_FUZZ_SEED", "").strip()
    if given:
        return int(given), False
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    return (int(run[:8], 16) if run else random.SystemRandom().randrange(1, 2 ** 31)), True


EXAMPLES = int(os.environ.get("SYMGRAD_FUZZ_EXAMPLES", "2000"))
SEED, SEED_DRAWN = _seed()
GRAPHS_PER_MODULE = 250
BATCHES = math.ceil(EXAMPLES / GRAPHS_PER_MODULE)
REPLAY = f"SYMGRAD_FUZZ_SEED={SEED} SYMGRAD_FUZZ_EXAMPLES={EXAMPLES} python -m pytest tests/test_fuzz.py"

# gcc at -O3 spends ~45 s on one batch's source, at -O1 ~5 s. The defaults allow no value-changing
# optimisation (no -ffast-math, no FMA contraction in ISO C mode), so -O1 computes the same numbers.
C_FLAGS = ["-O1" if flag == "-O3" else flag for flag in default_flags()]

# Tolerances. The same float64 arithmetic on two backends differs only by summation order and
# libm's last bits; torch differs from NumPy's libm by a few ulps, which chains of ops amplify.
RTOL_C_NUMPY, RTOL_TORCH = 1e-10, 1e-7
# torch runs with rounding errors moved (fuzz_graphs.nudge_pattern), per differing graph: all up, all
# down, four random mixes, subnormal values lifted to the smallest normal one, and the backward's
# roundings alone moved up and down
NUDGE_PATTERNS = (0, 1, 2, 3, 4, 5, ALTERNATING_UP, ALTERNATING_DOWN, LIFT_SUBNORMALS, BACKWARD_UP,
                  BACKWARD_DOWN, FLUSHED_ZEROS_LIFTED)


class Batch:
    """GRAPHS_PER_MODULE graphs as one symgrad graph, their input values and torch's results."""

    def __init__(self, index: int):
        count = min(GRAPHS_PER_MODULE, EXAMPLES - index * GRAPHS_PER_MODULE)
        self.index = index
        self.graphs: list[FuzzGraph] = draw_graphs(SEED * 1_000_003 + index, count)
        rng = np.random.default_rng([SEED, index])
        self.built: dict[int, tuple] = {}                 # per graph symgrad built: its inputs and outputs
        self.arrays: dict[int, list[np.ndarray]] = {}     # per graph: its inputs' values (and cot's)
        self.expected: dict[int, list[np.ndarray]] = {}   # per graph: torch's out and gradients
        self.refused: dict[int, str] = {}                 # per graph symgrad could not build: why
        self._variants: dict[int, list] = {}
        self._range: dict[int, bool] = {}
        self.errors: dict[str, dict[int, str]] = {}         # per backend: the graphs that raised there, why
        for g, graph in enumerate(self.graphs):
            arrays = draw_values(graph, rng)
            out = _torch_out(graph, arrays)
            if out.is_floating_point() and graph.cotangent == "random":
                arrays.append(rng.standard_normal(tuple(out.shape)))
            self.arrays[g] = arrays
            self.expected[g] = _torch_results(graph, arrays)
            try:
                xs, outputs = _symgrad_graph(graph, g, out)
            except Exception as exc:  # noqa: BLE001 - a refusal is this graph's failure, reported with it
                self.refused[g] = f"{type(exc).__name__}: {exc}"
                continue
            self.built[g] = (xs, outputs)
        self._compiled = {}

    def run(self, backend: str) -> dict[int, list[np.ndarray]]:
        """Each built graph's out and gradients on `backend` (one compiled module per backend); a
        graph whose compilation or run raises is left out, its error in `errors[backend]`."""
        if backend not in self._compiled:
            self.errors[backend] = {}
            self._compiled[backend] = self._isolating(backend, list(self.built))
        return self._compiled[backend]

    def _isolating(self, backend: str, graphs: list) -> dict[int, list[np.ndarray]]:
        """`_run`, and where it raises, the same on each half of `graphs` until the graphs that raise
        are found (a handful of builds more for one such graph, none when nothing raises)."""
        try:
            return self._run(backend, graphs)
        except Exception as exc:  # noqa: BLE001 - reported as the failure of the graph that raised
            if len(graphs) == 1:
                self.errors[backend][graphs[0]] = f"{type(exc).__name__}: {exc}"
                return {}
            half = len(graphs) // 2
            return {**self._isolating(backend, graphs[:half]), **self._isolating(backend, graphs[half:])}

    def _run(self, backend: str, graphs: list) -> dict[int, list[np.ndarray]]:
        """One function of `graphs` on `backend`. A compiled one runs twice, its first outputs
        poisoned and dropped: a compiled program writes a call's outputs into the arrays of the call
        before when nobody kept them, so an element no kernel writes (a border an embed left
        unzeroed) shows as poison, not as whatever the allocator handed out (fresh pages are zero)."""
        options = {"flags": C_FLAGS} if backend == "c" else {}
        function = sg.function([x for g in graphs for x in self.built[g][0]],
                               [y for g in graphs for y in self.built[g][1]], backend=backend, **options)
        arrays = [a for g in graphs for a in self.arrays[g]]
        if backend != "numpy":
            first = function(*arrays)
            _poison(first)
            del first
        flat = iter([np.asarray(r) for r in function(*arrays)])
        return {g: [next(flat) for _ in self.built[g][1]] for g in graphs}

    def variants(self, g: int) -> list[list[np.ndarray]]:
        """torch's results for graph g with its values moved by rounding errors (one per pattern)."""
        if g not in self._variants:
            self._variants[g] = [_torch_results(self.graphs[g], self.arrays[g], nudge_pattern(self.graphs[g], p))
                                 for p in NUDGE_PATTERNS]
        return self._variants[g]

    def leaves_range(self, g: int) -> bool:
        """Whether torch's float64 run of graph g overflows somewhere (fuzz_graphs.leaves_range)."""
        if g not in self._range:
            with warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore")
                self._range[g] = leaves_range(self.graphs[g], self.arrays[g])
        return self._range[g]

    def replay(self) -> str:
        return f"replay: {REPLAY} -k batch{self.index}"


def _poison(arrays) -> None:
    """NaN in each float array, a value no fuzzed graph computes in an integer one, True in a bool one."""
    for array in arrays:
        if isinstance(array, np.ndarray) and array.flags.writeable and array.size:
            array.fill(np.nan if array.dtype.kind == "f" else True if array.dtype == bool else -987654)


def _symgrad_graph(graph: FuzzGraph, g: int, torch_out: torch.Tensor) -> tuple[list, list]:
    """The graph's inputs (its cotangent last, when random) and outputs: out, then the gradients
    of its float inputs when out is a float. An out of another shape or dtype than torch's is
    refused here (the batch's inputs follow torch's)."""
    xs = [sg.input(f"g{g}_x{k}", shape, dtype=dtype) for k, (shape, dtype) in enumerate(input_specs(graph))]
    out = build(graph, 0, xs)
    want = (tuple(torch_out.shape), str(torch_out.dtype).replace("torch.", ""))
    if (tuple(out.shape), out.dtype) != want:
        raise ValueError(f"out is {out.dtype}{list(out.shape)} where torch's is {want[1]}{list(want[0])}")
    floats = [x for x in xs if x.dtype == FLOAT]
    if out.dtype != FLOAT:
        return xs, [out]
    if graph.cotangent == "random":
        cot = sg.input(f"g{g}_cot", out.shape, dtype=out.dtype)
        loss = sg.sum(out * cot)
        xs = xs + [cot]
    else:
        loss = sg.sum(out) if graph.cotangent == "sum" else sg.mean(out)
    return xs, [out, *(sg.grad(loss, floats) if floats else [])]


def _torch_out(graph: FuzzGraph, arrays) -> torch.Tensor:
    return build(graph, 1, [torch.from_numpy(np.array(a)) for a in arrays[:len(graph.input_steps)]])


def _torch_results(graph: FuzzGraph, arrays, nudge=None) -> list[np.ndarray]:
    """torch's out and its float inputs' gradients (of sum(out * cot), sum(out) or mean(out))."""
    xs = [torch.tensor(a, requires_grad=a.dtype == np.float64) for a in arrays[:len(graph.input_steps)]]
    out = build(graph, 1, xs, nudge)
    floats = [x for x in xs if x.dtype == torch.float64]
    if out.dtype != torch.float64:
        return [out.numpy()]
    if graph.cotangent == "random":
        loss = (out * torch.from_numpy(arrays[-1])).sum()
    else:
        loss = out.sum() if graph.cotangent == "sum" else out.mean()
    grads = torch.autograd.grad(loss, floats, allow_unused=True) if loss.requires_grad else [None] * len(floats)
    return [out.detach().numpy()] + [np.zeros(x.shape) if d is None else d.numpy() for x, d in zip(floats, grads)]


# --------------------------------------------------------------------------
# Comparison


def _agrees(got: np.ndarray, want: np.ndarray, atol: float, rtol: float) -> np.ndarray:
    """Elementwise: the same NaN or infinity, or finite and within atol + rtol * |want|."""
    with np.errstate(invalid="ignore"):
        close = np.abs(got - want) <= atol + rtol * np.abs(want)
    return (np.isnan(got) & np.isnan(want)) | (got == want) | (np.isfinite(got) & np.isfinite(want) & close)


def _spread(want: np.ndarray, runs: list) -> np.ndarray:
    """How far torch's runs with moved rounding errors lie from `want`, elementwise (inf where one
    of them is NaN or infinite and want is not, or the other way round)."""
    spread = np.zeros(want.shape)
    for run in runs:
        with np.errstate(invalid="ignore"):
            apart = np.where(np.isfinite(run) & np.isfinite(want), np.abs(run - want), 0.0)
        apart[np.isfinite(run) != np.isfinite(want)] = np.inf
        spread = np.maximum(spread, apart)
    return spread


def _mismatch(got: np.ndarray, want: np.ndarray, rtol: float, others=(), spread=None,
              range_left: bool = False) -> str | None:
    """Why `got` does not match `want`, or None. Integers and booleans must be equal; floats agree
    (`_agrees`) with want or one of `others` (torch's runs with moved roundings), or lie within
    twice `spread` of want where that is finite, or lie between two runs, or (`range_left`) are
    finite where every run is not. The absolute tolerance, rtol on the scale of the
    array's largest magnitude (at least 1), allows the rounding that a sum cancelling to ~0 keeps."""
    if got.shape != want.shape:
        return f"shape {got.shape} != {want.shape}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype} != {want.dtype}"
    if got.dtype.kind != "f":
        bad = got != want
    else:
        finite = np.isfinite(want)
        atol = rtol * max(np.abs(want[finite]).max(initial=0.0), 1.0)
        ok = _agrees(got, want, atol, rtol)
        for other in others:
            ok |= _agrees(got, other, atol, rtol)
        if others:
            # Where torch's runs give +inf and -inf, one rounding decides the element's sign and
            # whether it is finite: an infinity times a value whose sign rounding decides (a
            # gradient that cancels to 0 in exact arithmetic, times an infinite weight: inf * 0 is
            # NaN), or a quotient of two subnormals (the gradient of log(softplus(x)) at x = -745 is
            # sigmoid(x) / softplus(x), 5e-324 / 5e-324 = 1 exactly; torch's 1 / 5e-324 * 5e-324 is
            # inf, and moved by one rounding 0 / 0 or -inf). Any value is as right as torch's there.
            both = np.any([o == np.inf for o in others], axis=0) & np.any([o == -np.inf for o in others], axis=0)
            ok |= both
            # A value between two of the runs' finite values is as right as either: each is one
            # rounding away from the exact result, which lies between them (softplus(x) / (2
            # softplus(x)) at x = -745 is 5e-324 / 1e-323 = 0.5; one ulp of the sum moves it to
            # 1/3 or 1, and torch's flushed exp to 0 / 0; pow(w, 0.5) lies between pow(w, 1/3) and w).
            with np.errstate(invalid="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)   # an element no run has finite
                finite_runs = np.array([np.where(np.isfinite(o), o, np.nan) for o in others])
                lowest, highest = np.nanmin(finite_runs, axis=0), np.nanmax(finite_runs, axis=0)
                ok |= np.isfinite(got) & (lowest < highest) & (lowest <= got) & (got <= highest)
            # Where the runs' finite values take both signs and another run is NaN or infinite,
            # one rounding moves the element across a pole: a divisor within one rounding of 0
            # (x / gelu_tanh(x) at x = -7.16, where 1 + tanh(u) is 5e-17 and one ulp of tanh, or
            # torch's vectorised tanh, makes it 0). Its size is as undetermined as its sign there.
            with np.errstate(invalid="ignore"):
                both_signs = np.any([np.isfinite(o) & (o > 0) for o in others], axis=0) \
                    & np.any([np.isfinite(o) & (o < 0) for o in others], axis=0)
            ok |= both_signs & np.any([~np.isfinite(o) for o in others], axis=0)
            # NaN where a run moved by one rounding is infinite: the element is one rounding from a
            # pole, where inf * 0 is NaN (log1p(tanh x)'s gradient cot / (1 + y) * (1 - y**2) at
            # x = -19.06, where NumPy's tanh is -1.0 and torch's one ulp above: seed 1999, 8,000
            # graphs; torch's runs with y moved onto -1 are inf, its tanh backward reading the y it saved).
            ok |= np.isnan(got) & np.any([np.isinf(o) for o in others], axis=0)
            if range_left:
                # torch left float64's range on the way (fuzz_graphs.leaves_range) and every run of
                # it is infinite or NaN here: the exact value may be finite, formed by a formula that
                # stays in range (C's composed chains do where NumPy's op-by-op steps overflow too).
                stuck = np.all([~np.isfinite(o) for o in others], axis=0) & ~np.isfinite(want)
                ok |= stuck & np.isfinite(got)
        if spread is not None:
            with np.errstate(invalid="ignore"):
                ok |= np.isfinite(got) & finite & (np.abs(got - want) <= atol + rtol * np.abs(want) + 2 * spread)
        bad = ~ok
    if not bad.any():
        return None
    first = tuple(int(i) for i in np.argwhere(bad)[0]) if bad.ndim else ()
    return f"{int(bad.sum())} element(s) differ, the first at {first}: {got[first]!r} against {want[first]!r}"


def _describe_failures(batch: Batch, results: dict, reference: dict, rtol: float, names: tuple,
                       torch_reference: bool) -> list[str]:
    """One line block per graph whose outputs differ, or that symgrad refused to build or that
    raised on this backend: the graph, its inputs and both results."""
    failures = []
    for g, graph in enumerate(batch.graphs):
        if g in batch.refused:
            failures.append(f"graph {g}: symgrad refused it: {batch.refused[g]}\n  {graph}")
            continue
        if g not in results:
            failures.append(f"graph {g}: {names[0]} raised {batch.errors[names[0]].get(g)}\n  {graph}")
            continue
        if g not in reference:
            continue   # the reference raised: its own test reports it
        for k, (got, want) in enumerate(zip(results[g], reference[g])):
            if _mismatch(got, want, rtol) is None:
                continue
            runs = [run[k] for run in batch.variants(g)]
            torch_runs = runs if torch_reference else [batch.expected[g][k]] + runs
            why = _mismatch(got, want, rtol, others=torch_runs, spread=_spread(batch.expected[g][k], runs)
                            if got.dtype.kind == "f" and want.shape == got.shape else None,
                            range_left=batch.leaves_range(g))
            if why:
                what = "out" if k == 0 else f"d/dx{k - 1} (of the float inputs)"
                failures.append(f"graph {g} {what}: {why}\n  {graph}\n  inputs (last: cot)={batch.arrays[g]!r}\n"
                                f"  {names[0]}={got!r}\n  {names[1]}={want!r}")
                break
    return failures


def _report(batch: Batch, results, reference, rtol: float, names: tuple, torch_reference: bool) -> str:
    with np.printoptions(threshold=16, edgeitems=3, precision=6, linewidth=200):
        failures = _describe_failures(batch, results, reference, rtol, names, torch_reference)
    if not failures:
        return ""
    return (f"{len(failures)} of {len(batch.graphs)} graphs differ (seed {SEED}{', drawn' if SEED_DRAWN else ''}; "
            f"{batch.replay()}):\n" + "\n".join(failures[:10]))


@pytest.fixture(scope="module", autouse=True)
def _announce_seed(request):
    """The seed on the terminal before the first batch, so any failure can be replayed."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():   # past pytest's capture, -q or not
            reporter.write_line(f"fuzz: {EXAMPLES} graphs in {BATCHES} batches, seed {SEED} "
                                f"({'drawn for this run' if SEED_DRAWN else 'SYMGRAD_FUZZ_SEED'}); replay: {REPLAY}")


# One xdist group per batch: with `-n 2 --dist loadgroup` a batch's tests share one worker, which
# builds it once (a 50,000-graph run on 2 cores: 200 batches, about 2,500 s).
@pytest.fixture(scope="module", params=[pytest.param(i, marks=pytest.mark.xdist_group(f"batch{i}"))
                                        for i in range(BATCHES)], ids=lambda i: f"batch{i}")
def batch(request) -> Batch:
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        return Batch(request.param)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_match_torch(batch, backend):
    """Every graph's output and float inputs' gradients agree with torch on every backend."""
    failures = _report(batch, batch.run(backend), batch.expected, RTOL_TORCH, (backend, "torch"), True)
    assert not failures, failures


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "numpy"])
def test_compiled_backends_match_numpy(batch, backend):
    """Compiled float64 code agrees with the NumPy reference to 1e-10 (where torch's own results
    are well-conditioned; see the module's docstring)."""
    failures = _report(batch, batch.run(backend), batch.run("numpy"), RTOL_C_NUMPY, (backend, "numpy"), False)
    assert not failures, failures
