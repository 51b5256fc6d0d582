"""Rounding functions that sympy lacks, as sympy functions every backend prints.

sympy has floor and ceiling (C's floor/ceil); torch also rounds toward zero
(`trunc`) and to the nearest integer with ties to even (`round`). Each class
here stays unevaluated in expressions, evaluates with NumPy's twin in the
reference interpreter (lambdify calls `_imp_`), prints as the C99/CUDA libm
call in the kernel's precision (`truncf` / `trunc`), and has derivative 0
(as torch's: the steps are not differentiable, and their gradient is zero).
"""

from __future__ import annotations

import fractions
import math

import numpy as np
import sympy


class _Rounding(sympy.Function):
    """One-argument rounding to an integer value: real, derivative 0, printed as `c_name`."""

    nargs = 1
    is_real = True
    c_name = ""

    @classmethod
    def eval(cls, arg):
        # An exact number rounds to its integer, as sympy's floor(2.5) does: left unevaluated,
        # round(0) stays in the branches Piecewise folds out of a composed chain, and sympy's
        # comparisons of such branches can recurse for minutes (softplus(round(relu(x))))
        if not arg.is_Rational:
            return None
        exact = cls._exact(fractions.Fraction(int(arg.p), int(arg.q)))
        # -0.5 rounds to -0.0, which no sympy integer is: left as it is
        return None if exact == 0 and arg.is_negative else sympy.Integer(exact)

    def fdiff(self, argindex=1):
        return sympy.S.Zero

    def _ccode(self, printer):
        suffix = "f" if getattr(printer, "dtype", "float64") == "float32" else ""
        return f"{self.c_name}{suffix}({printer._print(self.args[0])})"

    _cxxcode = _ccode
    _cudacode = _ccode


class trunc(_Rounding):  # noqa: N801  (the name printed in graphs and reports)
    """Rounding toward zero: trunc(-1.5) = -1 (torch.trunc, C trunc)."""

    c_name = "trunc"
    _exact = staticmethod(math.trunc)
    _imp_ = staticmethod(np.trunc)


class round_half_even(_Rounding):  # noqa: N801
    """Rounding to the nearest integer, ties to even: 0.5 -> 0, 1.5 -> 2 (torch.round, NumPy's
    round). C's nearbyint rounds in the current rounding mode, which is to nearest-even unless
    a program changes it; C's round() would take ties away from zero."""

    c_name = "nearbyint"
    _exact = staticmethod(round)  # Python rounds a Fraction's ties to even
    _imp_ = staticmethod(np.round)
