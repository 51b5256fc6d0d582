"""sympy expressions as NumPy functions, with the IR's meaning of each function.

The one place sympy expressions become NumPy code: the reference interpreter (an elementwise op's
NumPy implementation, symgrad.ir.elementwise) and every numerical comparison of two forms
(symgrad.ir.form_checks) evaluate alike.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Callable

import numpy as np
import sympy

# Functions NumPy lacks, for which lambdify would fall back to scalar-only math.*:
# elementwise versions, so a user's op such as erf (GELU) runs on arrays.
_NUMPY_EXTRAS = {name: np.vectorize(getattr(math, fn), otypes=[np.float64])
                 for name, fn in (("erf", "erf"), ("erfc", "erfc"), ("gamma", "gamma"),
                                  ("loggamma", "lgamma"))}


# What lambdify's "numpy" module namespace adds to NumPy's own names. Passing the module
# object (printer: NumPyPrinter all the same) spares lambdify's `from numpy import *`, which
# imports every lazy NumPy submodule (f2py, testing, ...): over 0.1 s of a fresh process.
_NUMPY_NAMES = {"numpy": np, "I": 1j, "Heaviside": np.heaviside}


def _sign_as_torch(u):
    """sign(u) as torch.sign and the C printer compute it: 0 at NaN (NumPy's sign gives NaN)."""
    return sympy.Piecewise((1, u > 0), (-1, u < 0), (0, True))


def numpy_function(symbols, expr: sympy.Expr) -> Callable:
    """`expr` as a NumPy function of `symbols`, with the IR's meaning of each function.

    The one place sympy expressions become NumPy code: the reference interpreter and every
    numerical comparison of two forms (`stays_finite`) evaluate alike. sign(NaN) is 0, as in
    torch (abs's derivative at NaN is 0 for a finite cotangent); NumPy's sign would give NaN.
    """
    return _lambdified(tuple(symbols), expr)


@lru_cache(maxsize=1024)
def _lambdified(symbols: tuple, expr: sympy.Expr) -> Callable:
    """numpy_function's result, made once per expression and symbols: lambdify writes and compiles
    Python source (milliseconds), and a rewrite's every form is evaluated by several checks
    (stays_finite, keeps_special_values, keeps_infinities), each lambdifying it anew."""
    expr = expr.replace(sympy.sign, _sign_as_torch) if expr.has(sympy.sign) else expr
    return sympy.lambdify(symbols, expr, modules=[_NUMPY_EXTRAS, _NUMPY_NAMES, np])
