"""Numeric checks that a rewritten form of an expression computes what the original does.

A simplified derivative or a composed chain of elementwise ops is found by sympy's real algebra;
these checks evaluate both forms at probe points in float64 and take the rewrite only where it
stays finite where the original is (`stays_finite`), keeps its NaNs and infinities at special
operands (`keeps_special_values`), or its infinities everywhere (`keeps_infinities`).
"""

from __future__ import annotations

import numpy as np
import sympy

from .numpy_expr import numpy_function

# Operand values at which `stays_finite` compares two forms of an expression. The magnitudes
# reach past exp's float64 range (exp(1000) = inf), so a form such as exp(x)/(exp(x) + 1)**2
# shows here, in float64, the inf/inf that float32 meets from x = 89.
_FINITE_PROBES = np.array([-1e4, -1000.0, -300.0, -30.0, -2.5, -1.0, -0.3, 0.0,
                           0.4, 1.5, 3.0, 30.0, 300.0, 1000.0, 1e4])
_PROBE_POINTS = 256  # operand tuples per comparison, drawn from the probes (fixed seed)


def _probe_points(symbols: list, probes: np.ndarray) -> list:
    """Operand columns for comparing two forms: random tuples of `probes` (fixed seed), then
    each operand alone at every probe with the others at 1, the plain one-variable sweep."""
    rng = np.random.default_rng(0)
    points = [rng.choice(probes, _PROBE_POINTS) for _ in symbols]
    for k in range(len(symbols)):
        for j, column in enumerate(points):
            sweep = probes if j == k else np.ones_like(probes)
            points[j] = np.concatenate([column, sweep])
    return points


def _evaluate(expr, symbols: list, points: list) -> np.ndarray:
    """`expr` at the probe points: a sympy expression, or a reference with its own
    `evaluate({symbol: column})` (a chain evaluated node by node, passes/simplify.py)."""
    with np.errstate(all="ignore"):
        if hasattr(expr, "evaluate"):
            out = expr.evaluate(dict(zip(symbols, points)))
        else:
            out = numpy_function(symbols, expr)(*points)
        out = np.asarray(out, dtype=np.complex128)
    return np.broadcast_to(out, points[0].shape)


def _compare(candidate: sympy.Expr, reference: sympy.Expr, probes: np.ndarray, agree) -> bool:
    """`agree(got, want, points)` over the probe points; a candidate NumPy cannot evaluate is
    refused, a sympy reference it cannot evaluate gives no evidence either way (True)."""
    symbols = sorted(candidate.free_symbols | reference.free_symbols, key=lambda s: s.name)
    if not symbols:
        return True
    points = _probe_points(symbols, probes)
    try:
        want = _evaluate(reference, symbols, points)
    except Exception:  # noqa: BLE001 - no NumPy twin for some function: nothing to compare
        # ... unless the reference is the graph's own ops run node by node: that it cannot be
        # evaluated means something is wrong, and the rewrite is not taken.
        return not hasattr(reference, "evaluate")
    try:
        got = _evaluate(candidate, symbols, points)
    except Exception:  # noqa: BLE001 - a form that cannot be evaluated is not taken
        return False
    return bool(agree(got, want, points))


def stays_finite(candidate: sympy.Expr, reference: sympy.Expr) -> bool:
    """Whether `candidate` is finite wherever `reference` is, at probe points of their symbols.

    Two forms of one function can differ in where they overflow: sigmoid's derivative
    y*(1 - y) is finite for every x, its rational form exp(x)/(exp(x) + 1)**2 is inf/inf = nan
    past x = 89 in float32. A rewrite (a simplified derivative, a simplified chain) is only
    taken when this holds.
    """
    return _compare(candidate, reference, _FINITE_PROBES,
                    lambda got, want, points: np.all(np.isfinite(got) | ~np.isfinite(want)))


# Operand values at which `keeps_special_values` compares two forms: the IEEE specials, signed
# zeros, negatives (outside log's and sqrt's domains) and ordinary magnitudes.
_SPECIAL_PROBES = np.array([-np.inf, -1e4, -2.5, -1.0, -0.3, -0.0, 0.0, 0.4, 1.0, 3.0, 1e4, np.inf, np.nan])


def keeps_special_values(candidate: sympy.Expr, reference: sympy.Expr) -> bool:
    """Whether `candidate` is NaN exactly where `reference` is, and the same infinity wherever
    `reference` is infinite at operands that are not all finite.

    sympy rewrites by real algebra, exact only for finite operands: it evaluates x - (x - x)
    to x (inf at x = inf where IEEE gives NaN), exp(log(x)) to x (-1 at x = -1, where log
    is NaN) and x*y/y to x. Such a rewrite of a chain is refused unless the user assumed
    finite operands. Overflow at finite operands is `stays_finite`'s question, not this one's.
    """
    def agree(got, want, points):
        nan_got, nan_want = np.isnan(got), np.isnan(want)
        special_operands = np.any([~np.isfinite(column) for column in points], axis=0)
        infinite = np.isinf(want) & special_operands
        return np.array_equal(nan_got, nan_want) and np.array_equal(got[infinite], want[infinite])
    return _compare(candidate, reference, _SPECIAL_PROBES, agree)


def keeps_infinities(candidate: sympy.Expr, reference: sympy.Expr) -> bool:
    """Whether `candidate` is the same infinity wherever `reference` is infinite, at finite
    operands too (the finite and the special probes).

    A form found by real algebra can lose an overflow (log(exp(x)) -> x is 1000 where the chain
    gives inf) or a zero's sign (0 - x -> -x, so 1/(0 - x) -> -1/x is -inf at x = +0 where the
    chain gives inf). A composed chain is held to this, for it must compute what its nodes do;
    a derivative's rewrite is not (div's -y/x1 is finite where x1**2 overflows, as torch's)."""
    def agree(got, want, points):
        infinite = np.isinf(want)
        return np.array_equal(got[infinite], want[infinite])
    return all(_compare(candidate, reference, probes, agree) for probes in (_FINITE_PROBES, _SPECIAL_PROBES))


def keeps_finite_values(candidate: sympy.Expr, reference: sympy.Expr, finite_operands_only: bool = False) -> bool:
    """Whether `candidate` is, within rounding (a relative 1e-6), what `reference` is wherever that
    is finite: at finite probes, and at the special ones unless `finite_operands_only`.

    sympy's real algebra knows nothing of underflow or of inf * 0: it composes sign(gelu(x)) to
    sign(x), gelu(x) being x times a positive factor, but in floating point that factor underflows
    to 0 below x = -30 or so (and is inf/inf = NaN at -inf), where the chain gives 0 and sign(x)
    gives -1. The NaN and infinity checks above do not see a finite value changed."""
    def agree(got, want, points):
        finite = np.isfinite(want)
        return bool(np.all(np.isclose(got[finite], want[finite], rtol=1e-6, atol=1e-12)))
    probe_sets = (_FINITE_PROBES,) if finite_operands_only else (_FINITE_PROBES, _SPECIAL_PROBES)
    return all(_compare(candidate, reference, probes, agree) for probes in probe_sets)
