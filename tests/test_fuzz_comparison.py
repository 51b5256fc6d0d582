"""The differential fuzzer's comparison rules (tests/test_fuzz.py), each on a case it exists for.

The fuzzer accepts a symgrad value that differs from torch's only where torch's own float64 result
is not determined by its inputs; these tests pin each rule to the case that needs it and to a case
it must still reject, so a rule that stops accepting or starts accepting everything fails here."""

from __future__ import annotations

import numpy as np

from tests.fuzz_graphs import (ALTERNATING_DOWN, ALTERNATING_UP, BACKWARD_DOWN, BACKWARD_UP, FLUSHED_ZEROS_LIFTED,
                               FuzzGraph, Step, leaves_range, nudge_pattern)
from tests.test_fuzz import _mismatch, _torch_results


def _graph(*steps, cotangent="sum") -> FuzzGraph:
    return FuzzGraph(steps=tuple(steps), specials=False, cotangent=cotangent)


def _input(shape):
    return Step("input", (), (("shape", shape),))


def test_quotient_whose_backward_overflows_leaves_range():
    """v / (v * v) at v = 1e-146: torch's division backward forms v / (v * v)^2 = 1e438."""
    graph = _graph(_input((2,)), Step("mul", (0, 0)), Step("div", (0, 1)))
    assert leaves_range(graph, [np.array([1e-146, 1.0])])
    assert not leaves_range(graph, [np.array([0.5, 2.0])])


def test_overflowing_result_leaves_range_and_a_pole_does_not():
    """pow(x, y) = 1e314 overflows from finite operands; 1 / 0 is a pole (an operand is 0)."""
    power = _graph(_input((1,)), _input((1,)), Step("pow", (0, 1)))
    assert leaves_range(power, [np.array([3.6e7]), np.array([41.6])])
    assert not leaves_range(power, [np.array([3.0]), np.array([2.0])])
    pole = _graph(_input((1,)), _input((1,)), Step("div", (0, 1)))
    assert not leaves_range(pole, [np.array([1.0]), np.array([0.0])])


def test_finite_value_where_torch_overflowed_needs_the_range_event():
    """A finite value where every torch run is inf is accepted only when torch left the range."""
    got, want = np.array([2.85e150]), np.array([np.inf])
    assert _mismatch(got, want, 1e-7, others=[want, want]) is not None
    assert _mismatch(got, want, 1e-7, others=[want, want], range_left=True) is None
    # a run that stays finite decides the element: the range event excuses nothing then
    assert _mismatch(got, want, 1e-7, others=[want, np.array([1.0])], range_left=True) is not None


def test_any_value_where_one_rounding_flips_the_infinity():
    """Runs at +inf and -inf (sigmoid(x) / softplus(x) at x = -745, 5e-324 / 5e-324): any value;
    runs at +inf only: a finite value is still wrong."""
    got, want = np.array([1.0]), np.array([np.inf])
    assert _mismatch(got, want, 1e-7, others=[want, -want]) is None
    assert _mismatch(got, want, 1e-7, others=[want, want]) is not None


def test_a_value_between_two_runs_is_accepted_and_one_outside_is_not():
    """pow(w, softplus(x) / (2 softplus(x))) at x = -745: torch NaN (its exp flushed to 0, 0 / 0),
    its runs pow(w, 1) and pow(w, 1/3) (one ulp of the sum each way); the exact pow(w, 0.5) lies
    between them, a value beyond them does not."""
    w = 0.142
    want, runs = np.array([np.nan]), [np.array([w]), np.array([w ** (1 / 3)]), np.array([np.nan])]
    assert _mismatch(np.array([w ** 0.5]), want, 1e-7, others=runs) is None
    assert _mismatch(np.array([0.9]), want, 1e-7, others=runs) is not None


def test_the_backward_alone_moved_shows_log_softmax_cancelling_at_a_dominant_element():
    """log(log_softmax(x)) at an element far above the rest: log_softmax is a few 1e-16 there,
    the gradient of log, 1 / y, a few -1e15, and log_softmax's backward g - p sum(g) cancels to
    about -1, one ulp of g (0.5) each rounding. Moving the forward too moves y by its own error,
    1 / y much less, and hides that; the backward's runs alone span it (CI's seed 2913878664:
    eight elements, 37.4 above; symgrad -1.0, exact -0.789, torch -0.78, the other runs -0.75 to
    -0.84). Two elements here, 35.6 apart: the sum of the exponentials, 1 + 3.4e-16, is then one
    rounding whatever order a CPU adds in. (Eight elements at 37.4 are not: torch's AVX-512 path
    rounds that log_softmax to 0 exactly, and log(0) leaves no finite gradient to compare.)"""
    graph = _graph(_input((2,)), Step("log_softmax", (0,), (("axis", -1),)), Step("log", (1,)))
    x = np.array([35.6, 0.0])
    want = _torch_results(graph, [x])[1]
    runs = {p: _torch_results(graph, [x], nudge_pattern(graph, p))[1] for p in (0, 1, BACKWARD_UP, BACKWARD_DOWN)}
    moved_forward = abs(runs[0][0] - runs[1][0])
    moved_backward = abs(runs[BACKWARD_UP][0] - runs[BACKWARD_DOWN][0])
    assert moved_backward > 1.0 > 0.2 > moved_forward, (moved_forward, moved_backward)
    got = want.copy()
    got[0] = want[0] - 0.3                     # a few ulps of g away, as another order of the formula is
    assert _mismatch(got, want, 1e-7, others=[runs[0], runs[1]]) is not None
    assert _mismatch(got, want, 1e-7, others=list(runs.values())) is None
    got[0] = want[0] - 5.0                     # beyond any one rounding: still wrong
    assert _mismatch(got, want, 1e-7, others=list(runs.values())) is not None


def test_any_value_where_one_rounding_moves_the_element_across_a_pole():
    """The gradient of x / gelu_tanh(x) at x = -7.16 (seed 1839660200): the divisor is 5e-17 of
    1 + tanh(u), within one rounding of 0; torch's runs give +-4.4e11 and NaN, symgrad the exact
    -1.6e14. Runs of one sign with a NaN, or of both signs all finite, still decide."""
    want = np.array([np.nan])
    across = [np.array([4.37e11]), np.array([-4.37e11]), np.array([np.nan])]
    assert _mismatch(np.array([-1.56e14]), want, 1e-7, others=across) is None
    one_sign = [np.array([4.37e11]), np.array([4.38e11]), np.array([np.nan])]
    assert _mismatch(np.array([-1.56e14]), want, 1e-7, others=one_sign) is not None
    finite = [np.array([4.37e11]), np.array([-4.37e11])]
    assert _mismatch(np.array([-1.56e14]), np.array([4.37e11]), 1e-7, others=finite) is not None


def test_nan_where_one_rounding_makes_a_run_infinite():
    """The gradient of log1p(tanh(x)) at x = -19.06 (seed 1999): NumPy's tanh is -1.0, torch's one
    ulp above, so NumPy's reference computes inf * 0 = NaN and torch 2.72; torch's runs with y moved
    onto -1 are inf. NaN is accepted there; where every run is finite it is not."""
    want = np.array([2.7247945141502945])
    assert _mismatch(np.array([np.nan]), want, 1e-7, others=[want, np.array([np.inf])]) is None
    assert _mismatch(np.array([np.nan]), want, 1e-7, others=[want, np.array([1.36])]) is not None


def test_maximum_of_signed_zeros_takes_either_zero():
    """torch.maximum(+0., -0.) is +0 on fewer than 8 elements and -0 on 8 or more: the rounding runs
    take the other zero at such ties, so 1 / maximum(x, -x) at x = 0 is +inf or -inf."""
    graph = _graph(_input((3,)), Step("neg", (0,)), Step("maximum", (0, 1)), Step("pow_scalar", (2,), (("c", -1.0),)))
    x = np.array([0.0, 1.0, -2.0])
    want = _torch_results(graph, [x])[0]
    runs = [_torch_results(graph, [x], nudge_pattern(graph, p))[0] for p in (0, 1)]
    assert {float(want[0]), float(runs[0][0])} == {np.inf, -np.inf}
    np.testing.assert_allclose(runs[0][1:], want[1:], rtol=1e-15)   # no tie: the same values, rounded
    got = want.copy()
    got[0] = -want[0]
    assert _mismatch(got, want, 1e-7, others=runs) is None


def test_alternating_runs_move_neighbours_apart():
    """An average pool's two windows over the same elements (the padding at either end) sum them in
    different orders: equal exactly, a few roundings apart in C, and softmax over the pair at 1.25e7
    (pow(7.7, 8)) magnifies that to 6e-9 (seed 1963984122, C against NumPy). Random signs move such
    a pair alike in one pattern of two; the alternating patterns move it apart, each way."""
    graph = _graph(_input((2,)), Step("exp", (0,)), Step("softmax", (1,), (("axis", -1),)))
    x = np.array([16.3, 16.3])
    want = _torch_results(graph, [x])[0]
    up, down = (_torch_results(graph, [x], nudge_pattern(graph, p))[0] for p in (ALTERNATING_UP, ALTERNATING_DOWN))
    assert down[0] < want[0] < up[0] and up[1] < want[1] < down[1], (up, want, down)


def test_the_backward_alone_moved_moves_gelu_tanhs_own_tanh():
    """gelu_tanh's derivative at x = -7.16 is -4.9e-15: (1 + t) / 2 and the x (1 - t^2) term cancel,
    t = tanh(-18.8) within one rounding of -1. torch's backward computes t itself: its scalar path
    gets -1 + 1.1e-16 and the derivative, its vectorised path (16 elements or more here) -1 and 0;
    times an infinite weight, +inf or NaN (seed 42, 2,000 graphs, batch 4: symgrad +inf, torch NaN).
    The backward's runs move that t by one rounding: one gives +inf. At x = -7.3 both paths round t
    to -1 (the exact derivative is -7e-16); the move down stays at -1, as tanh does, so no run gives
    -inf, which stays wrong at both points."""
    graph = _graph(_input((32,)), _input((32,)), Step("gelu_tanh", (0,)), Step("mul", (2, 1)))
    x, w = np.repeat([-7.1555194935208215, -7.3], 16), np.full(32, -np.inf)
    want = _torch_results(graph, [x, w])[1]
    assert np.isnan(want).all()
    runs = [_torch_results(graph, [x, w], nudge_pattern(graph, p))[1] for p in (BACKWARD_UP, BACKWARD_DOWN)]
    assert _mismatch(np.full(32, np.inf), want, 1e-7, others=runs) is None
    for wrong in (np.repeat([-np.inf, np.inf], 16), np.repeat([np.inf, -np.inf], 16)):
        assert _mismatch(wrong, want, 1e-7, others=runs) is not None


def test_the_backward_alone_moved_moves_attentions_softmax():
    """The gradient of exp(attention(q, k, k)) where the scores reach 30 times a unit q: dO = exp(O)
    is huge, and the softmax inside attention's backward, P (dP - rowsum(P dP)), cancels terms of
    that size (CI's seed 2708621339: d/dq of 2.7e17 with symgrad's fused op and torch's math backend
    1.7% apart). Moving the forward's values leaves that cancellation where torch computed it; the
    backward's runs move the softmax's backward by its own rounding and span it. Here the gradient
    of q's second row cancels (8e11 out of terms of 1e25, its runs 30-80% apart), its first row's
    (2e25) does not, and stays held to the plain tolerance. Each row is compared on its own: the
    array's absolute tolerance, on the scale of its largest element, would pass the second row."""
    graph = _graph(_input((2, 4)), _input((2, 4)), Step("attention", (0, 1, 1), (("causal", False),)),
                   Step("exp", (2,)))
    rng = np.random.default_rng(0)
    for _ in range(5):
        q, k = rng.normal(size=(2, 4)), 30 * rng.normal(size=(2, 4))
    want = _torch_results(graph, [q, k])[1]
    runs = {p: _torch_results(graph, [q, k], nudge_pattern(graph, p))[1] for p in (0, 1, BACKWARD_UP, BACKWARD_DOWN)}
    moved_forward = np.abs(runs[0] - runs[1]) / np.abs(want)
    moved_backward = np.abs(runs[BACKWARD_UP] - runs[BACKWARD_DOWN]) / np.abs(want)
    assert moved_forward.max() < 1e-9 and (moved_backward[1] > 0.1).all(), (moved_forward, moved_backward)
    assert (moved_backward[0] < 1e-9).all(), moved_backward
    cancelling, forward_runs, all_runs = want[1], [runs[0][1], runs[1][1]], [run[1] for run in runs.values()]
    assert _mismatch(cancelling * 1.1, cancelling, 1e-7, others=forward_runs) is not None
    assert _mismatch(cancelling * 1.1, cancelling, 1e-7, others=all_runs) is None   # another order of the formula
    assert _mismatch(cancelling * 10, cancelling, 1e-7, others=all_runs) is not None  # beyond one rounding
    assert _mismatch(want[0] * 1.001, want[0], 1e-7, others=[run[0] for run in runs.values()]) is not None


def test_log1p_of_the_smallest_subnormal_may_be_a_flushed_zero():
    """torch.log1p(5e-324) is 0, where the exact value is 5e-324 (seed 21, 6,000 graphs, batch 19:
    log(log1p(exp(x))) at x = -744.44 is -inf in torch and -744.44, the exact value, in symgrad).
    log1p's rounding is "underflow", and the run that lifts only such zeros to the smallest subnormal
    (exp's 5e-324 left as it is: moved up, its log1p is right) gives symgrad's value in every
    element. A value no run gives stays wrong."""
    graph = _graph(_input((108,)), Step("exp", (0,)), Step("log1p", (1,)), Step("log", (2,)))
    x = np.full(108, -744.4400719213812)
    want = _torch_results(graph, [x])[0]
    assert np.isneginf(want).all()
    runs = [_torch_results(graph, [x], nudge_pattern(graph, p))[0] for p in (0, 1, FLUSHED_ZEROS_LIFTED)]
    assert _mismatch(np.log(np.log1p(np.exp(x))), want, 1e-7, others=runs) is None
    assert _mismatch(np.full(108, -700.0), want, 1e-7, others=runs) is not None
