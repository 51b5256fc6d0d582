"""A sympy C99 printer for kernel expressions, in the kernel's own precision.

float32 statements get float32 math (`expf`, `1.0F`, `fmaxf`), float64 ones
double math, integer ones integer arithmetic. Piecewise becomes a one-line
ternary, Heaviside and sign become comparisons, relationals and booleans C
operators. Whatever the printer does not know raises `CPrintError`: a kernel
that cannot be printed exactly is refused, never emitted with a comment
where code should be (sympy's default).
"""

from __future__ import annotations

import math
import re
import threading

import numpy as np
import sympy
from sympy.codegen.ast import float32, float64, real
from sympy.printing.c import C99CodePrinter
from sympy.printing.precedence import precedence

from ...ir import dtypes as D


_MARKER = re.compile("\x00([0-9]+)\x00")   # a named symbol's place in a printed expression (print_named)


class CPrintError(ValueError):
    """An expression the C printer cannot print exactly."""


class KernelPrinter(C99CodePrinter):
    """C99 printer for one dtype of computation ("float32", "float64", "int32", "int64", "bool").

    Symbols print as their names: kernels substitute operand symbols with
    symbols named after C locals (v0, t3) and Dims with their C arguments (d0).
    """

    # M_PI, M_LN2, ...: POSIX, not C11; literals instead. A class attribute, so sympy's
    # __init__ skips computing its macro table (milliseconds of a warm compile).
    math_macros: dict = {}

    def __init__(self, dtype: str = "float64"):
        self.dtype = dtype
        self._printed: dict = {}   # (expression, named symbols) -> its text with markers (print_named)
        self.is_float = D.is_float(dtype)
        aliases = {real: float32 if dtype == "float32" else float64}
        super().__init__({"type_aliases": aliases, "strict": True})
        self.math_macros = {}

    def print_named(self, expr, names: dict) -> str:
        """Print `expr` with symbols printed as `names[symbol]` (C text).

        Renaming while printing, not substituting first: a substitution
        re-evaluates the expression (Ne(v, v) would become False, wrong for NaN).
        An expression is printed once per printer with a marker for each named symbol, which
        each call then replaces by its names: every layer's nodes are the same expressions over
        other locals, and sympy's printing costs a fraction of a millisecond per node.
        """
        symbols = tuple(names)
        text = self._printed.get((expr, symbols))
        if text is None:
            self._names = {symbol: f"\x00{k}\x00" for k, symbol in enumerate(symbols)}
            try:
                text = self._printed[(expr, symbols)] = self.doprint(expr)
            finally:
                self._names = {}
        texts = [names[symbol] for symbol in symbols]
        return _MARKER.sub(lambda m: texts[int(m.group(1))], text) if texts else text

    def _print_Symbol(self, expr):
        names = getattr(self, "_names", None)
        if names and expr in names:
            return names[expr]
        return super()._print_Symbol(expr)

    # ---- refuse anything unknown, loudly --------------------------------
    def _print_not_supported(self, expr):
        raise CPrintError(f"cannot print {type(expr).__name__} `{expr}` as C")

    def emptyPrinter(self, expr):
        raise CPrintError(f"cannot print {type(expr).__name__} `{expr}` as C")

    # ---- literals ----------------------------------------------------------
    def literal(self, value) -> str:
        """A Python or NumPy number, exactly, in this printer's dtype."""
        return format_literal(value, self.dtype)

    def _print_Integer(self, expr):
        if self.is_float:
            return self.literal(float(int(expr))) if abs(int(expr)) < 2 ** 53 else self.literal(float(expr))
        return str(int(expr)) + ("LL" if abs(int(expr)) >= 2 ** 31 else "")

    def _print_Float(self, expr):
        return self.literal(float(expr))

    def _print_Rational(self, expr):
        if not self.is_float:
            raise CPrintError(f"cannot print the fraction {expr} in integer arithmetic")
        return f"{self._print_Integer(expr.p)}/{self._print_Integer(expr.q)}"

    def _print_NumberSymbol(self, expr):
        return self.literal(float(expr))

    _print_Exp1 = _print_NumberSymbol
    _print_Pi = _print_NumberSymbol
    _print_EulerGamma = _print_NumberSymbol
    _print_GoldenRatio = _print_NumberSymbol

    def _print_Infinity(self, expr):
        return self.literal(math.inf)

    def _print_NegativeInfinity(self, expr):
        return self.literal(-math.inf)

    def _print_NaN(self, expr):
        return self.literal(math.nan)

    def _print_ComplexInfinity(self, expr):
        raise CPrintError("cannot print complex infinity (zoo) as C")

    def _print_BooleanTrue(self, expr):
        return "1"

    def _print_BooleanFalse(self, expr):
        return "0"

    # ---- arithmetic --------------------------------------------------------
    def _print_Pow(self, expr):
        base, exp = expr.args
        if exp.is_Integer and 2 <= int(exp) <= 4:
            # Small integer powers as products: exact, and vectorizes without a call.
            b = self.parenthesize(base, 1000)  # always parenthesised below a product
            return "(" + "*".join([b] * int(exp)) + ")"
        if exp.is_Integer and int(exp) == -1 and self.is_float:
            return f"({self.literal(1.0)}/{self.parenthesize(base, 1000)})"
        if exp.is_Integer and -4 <= int(exp) <= -2 and self.is_float:
            b = self.parenthesize(base, 1000)
            return f"({self.literal(1.0)}/(" + "*".join([b] * -int(exp)) + "))"
        if not self.is_float:
            raise CPrintError(f"cannot print the power {expr} in integer arithmetic")
        return super()._print_Pow(expr)

    def _print_Mul(self, expr):
        # A product's constant factors as one literal when one of them is irrational: GELU's
        # sqrt(2/pi) (x + ...) prints as 0.7978846f*(x + ...), not sqrtf(2.0f)*(x + ...)/sqrtf(3.1415927f),
        # whose division by a constant the compiler must keep (it is not exact), at the cost of
        # several multiplies. (Rational factors stay: 1.0f/2.0f folds exactly.)
        constants = [a for a in expr.args if a.is_number]
        if self.is_float and any(not a.is_Rational for a in constants):
            value = sympy.Mul(*constants)
            if value.is_real and value.is_finite:
                rest = sympy.Mul(*[a for a in expr.args if not a.is_number])
                literal = self.literal(float(value.evalf(40)))
                return literal if rest == 1 else f"{literal}*{self.parenthesize(rest, precedence(expr))}"
        return super()._print_Mul(expr)

    def _print_Abs(self, expr):
        if self.is_float:
            return super()._print_Abs(expr)
        x = self.parenthesize(expr.args[0], 1000)
        return f"({x} < 0 ? -{x} : {x})"

    def _print_Max(self, expr):
        return self._minmax(expr.args, ">")

    def _print_Min(self, expr):
        return self._minmax(expr.args, "<")

    def _minmax(self, args, cmp):
        """Comparisons, not fmax/fmin (which drop a NaN): a NaN operand gives NaN, as in NumPy
        and torch. `a cmp b || a != a` keeps a when it wins or is NaN; otherwise b, NaN or not.
        Numbers go last: a literal is never NaN, so `a != a` is only ever asked of an expression."""
        first, *rest = sorted(args, key=lambda a: bool(a.is_number))
        out = self._print(first)
        for a in rest:
            b = self._print(a)
            nan_wins = f" || ({out}) != ({out})" if self.is_float else ""
            out = f"((({out}) {cmp} ({b}){nan_wins}) ? ({out}) : ({b}))"
        return out

    def _print_sign(self, expr):
        x = self._print(expr.args[0])
        one, zero = self.literal(1), self.literal(0)
        return f"(({x}) > 0 ? {one} : (({x}) < 0 ? -{one} : {zero}))"

    def _print_Heaviside(self, expr):
        x = self._print(expr.args[0])
        h0 = expr.args[1] if len(expr.args) > 1 else sympy.Rational(1, 2)
        at0 = self._print(h0)
        return f"(({x}) > 0 ? {self.literal(1)} : (({x}) < 0 ? {self.literal(0)} : {at0}))"

    def _print_Piecewise(self, expr):
        if expr.args[-1].cond != sympy.true:
            raise CPrintError(f"Piecewise without a default branch cannot be printed: {expr}")
        out = self._print(expr.args[-1].expr)
        for e, c in reversed(expr.args[:-1]):
            out = f"(({self._print(c)}) ? ({self._print(e)}) : ({out}))"
        return out

    def _print_ITE(self, expr):
        c, a, b = expr.args
        return f"(({self._print(c)}) ? ({self._print(a)}) : ({self._print(b)}))"

    def _print_Relational(self, expr):
        ops = {"==": "==", "!=": "!=", "<": "<", "<=": "<=", ">": ">", ">=": ">="}
        if expr.rel_op not in ops:
            raise CPrintError(f"cannot print relation {expr}")
        return f"({self._print(expr.lhs)} {ops[expr.rel_op]} {self._print(expr.rhs)})"

    def _print_And(self, expr):
        return "(" + " && ".join(self._print(a) for a in expr.args) + ")"

    def _print_Or(self, expr):
        return "(" + " || ".join(self._print(a) for a in expr.args) + ")"

    def _print_Not(self, expr):
        return f"(!{self._print(expr.args[0])})"

    def _print_Function(self, expr):
        if not self.is_float:
            raise CPrintError(f"cannot print {expr.func.__name__} in {self.dtype} arithmetic")
        return super()._print_Function(expr)


# sympy's function -> the C program's own float32 one (templates/program/expf.h.j2, erff.h.j2, logf.h.j2).
OWN_FLOAT32 = {"exp": "sg_expf", "tanh": "sg_tanhf", "erf": "sg_erff", "erfc": "sg_erfcf", "log": "sg_logf",
               "log1p": "sg_log1pf"}


class CKernelPrinter(KernelPrinter):
    """KernelPrinter for the C backend: float32 `exp`, `tanh`, `erf`, `erfc`, `log` and `log1p` call
    the program's own `sg_expf`, `sg_tanhf`, ... (OWN_FLOAT32).

    libm's are opaque calls, so a loop over them runs one element at a time; the program's own
    are plain arithmetic the compiler vectorizes, within 1, 2, 2, 8, 2 and 3 ulp. Softmax and
    cross-entropy spend most of their time in exp, a GELU's tanh form and its gradient in tanh,
    the exact GELU (torch's default) in erf and its gradient in erfc, softplus in log1p.
    """


def _own_in_float32(name: str, own: str):
    def print_function(self, expr):
        if self.dtype == "float32":
            return f"{own}({self._print(expr.args[0])})"
        return getattr(super(CKernelPrinter, self), f"_print_{name}")(expr)
    return print_function


for _name, _own in OWN_FLOAT32.items():
    setattr(CKernelPrinter, f"_print_{_name}", _own_in_float32(_name, _own))


def _refuse_outside_float(method):
    def print_math(self, expr, *args, **kwargs):
        if not self.is_float:
            raise CPrintError(f"cannot print {type(expr).__name__} in {self.dtype} arithmetic")
        return method(self, expr, *args, **kwargs)
    return print_math


# C99CodePrinter prints its known math functions (exp, log, tanh, ...) through one shared
# method installed as _print_<name>; in integer arithmetic each of them is refused, but for those
# KernelPrinter prints itself in every dtype (Abs: |x| of an integer as a comparison, not fabs).
for _attr in dir(C99CodePrinter):
    if _attr.startswith("_print_") and _attr not in KernelPrinter.__dict__ \
            and getattr(C99CodePrinter, _attr) is C99CodePrinter._print_math_func:
        setattr(KernelPrinter, _attr, _refuse_outside_float(C99CodePrinter._print_math_func))


def format_literal(value, dtype: str) -> str:
    """`value` as a C literal of `dtype`, exact (shortest round-trip digits)."""
    if dtype == "bool":
        return "1" if bool(value) else "0"
    if D.is_float(dtype):
        v = float(np.float32(value)) if dtype == "float32" else float(value)
        suffix = "f" if dtype == "float32" else ""
        cast = "(float)" if dtype == "float32" else ""
        if math.isnan(v):
            return f"{cast}NAN"
        if math.isinf(v):
            return f"{cast}INFINITY" if v > 0 else f"(-{cast}INFINITY)"
        if dtype == "float32":
            # The shortest digits that read back as this float32 (C rounds "0.1f" to the same value).
            f = np.float32(v)
            text = (np.format_float_positional(f, unique=True, trim="0") if v == 0 or 1e-4 <= abs(v) < 1e16
                    else np.format_float_scientific(f, unique=True, trim="0"))
        else:
            text = repr(v)  # the shortest round-trip digits of the double
        if "e" not in text and "." not in text and "inf" not in text:
            text += ".0"
        if text.endswith("."):
            text += "0"
        return f"({text}{suffix})" if text.startswith("-") else text + suffix
    v = int(value)
    text = str(v) if dtype == "int32" or abs(v) < 2 ** 31 else f"INT64_C({v})"
    return f"({text})" if v < 0 else text


_LOCAL = threading.local()


def printer(dtype: str) -> KernelPrinter:
    """The C backend's printer for arithmetic in `dtype`, one per thread (a printer keeps state while
    printing)."""
    cache = _LOCAL.__dict__.setdefault("printers", {})
    if dtype not in cache:
        cache[dtype] = CKernelPrinter(dtype)
    return cache[dtype]
