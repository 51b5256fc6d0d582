"""Division, remainder and bitwise functions that sympy lacks, as sympy functions every backend prints.

torch divides integers with the quotient rounded down (`//`, floor_divide, div(rounding_mode=
"floor")) or toward zero (div(rounding_mode="trunc")), and has two remainders: `remainder` (`%`,
the divisor's sign, as Python) and `fmod` (the dividend's sign, as C). Each is one class here,
unevaluated in expressions, with:

- a NumPy reference (`_imp_`, which lambdify calls) that spells out torch's formula, so the
  reference interpreter is the specification the C and CUDA helpers are checked against;
- its C/CUDA text (`_ccode`): a helper of templates/program/integer.h.j2 (`sg_div_floor_i64`, ...) or
  plain C where C already means the same (`fmodf`, `&`);
- its partial derivatives (`fdiff`) as torch's autograd defines them: the quotients are steps
  (derivative 0); remainder(a, b) = a - b * floor_divide(a, b) and fmod(a, b) = a - b *
  trunc_divide(a, b), so their derivatives are 1 and -floor_divide(a, b) (-trunc_divide(a, b)).

What C leaves undefined is defined here, on every backend alike:

- Integer division by zero gives 0, quotient and remainder both (NumPy's choice; torch raises
  "ZeroDivisionError" on the CPU, and a C `/` traps). Float division by zero follows IEEE as
  torch does: 1 // 0.0 = inf, 0.0 // 0.0 = nan, remainder(1.0, 0.0) = nan.
- The most negative integer divided by -1 wraps to itself (torch and NumPy give INT_MIN for
  floor division; torch's fmod and truncating division trap with SIGFPE there), and its
  remainder is 0. A C `INT_MIN / -1` is undefined (it traps on x86), so the helpers negate in
  unsigned arithmetic instead.
- Shifts by a negative amount or by the width or more (undefined in C) give what torch's CPU
  kernels give: 0 for a left shift, the sign (0 or -1) for a right shift. A left shift of a
  negative value is done on the unsigned bits (two's complement, as torch).

Integer helpers compute in int64: an int32 operand widens, and the int64 result narrows back to
the same bits torch's int32 kernel gives (a shift by 32..63 leaves no low bits, or only sign bits).
"""

from __future__ import annotations

import numpy as np
import sympy

# The C/CUDA helpers the printed expressions may call, in the order templates/program/integer.h.j2
# defines them; a program defines only those its kernels call (symgrad/backends/render/expressions.py).
HELPERS = ("sg_div_floor_i64", "sg_div_trunc_i64", "sg_remainder_i64", "sg_fmod_i64",
           "sg_shl_i64", "sg_shr_i64", "sg_div_floorf", "sg_div_floor", "sg_remainderf", "sg_remainder",
           # Not integer arithmetic: the 16-bit floats' rounding (symgrad/backends/expressions.convert),
           # a helper called by name as these are, so it shares their template and its inclusion.
           "sg_round_bf16", "sg_round_f16")

INT_BITS = 64  # the helpers' width (see the module docstring)


def _integers(*arrays) -> bool:
    """Whether every operand is an integer or bool array: integer semantics, not IEEE."""
    return all(np.asarray(a).dtype.kind in "biu" for a in arrays)


def _nonzero_divisor(b):
    """b with its zeros replaced by 1, so NumPy never divides by zero (the result is masked)."""
    return np.where(b == 0, np.ones_like(b), b)


def _int_result(b, value):
    """`value`, 0 where the divisor b is 0 (integer division by zero, see the module docstring)."""
    return np.where(b == 0, np.zeros_like(value), value)


def floor_divide_reference(a, b):
    """torch's floor division: ints rounded toward -inf; floats by c10's div_floor_floating."""
    a, b = np.asarray(a), np.asarray(b)
    with np.errstate(all="ignore"):
        if _integers(a, b):
            return _int_result(b, np.floor_divide(a, _nonzero_divisor(b)))
        # Python's and torch's algorithm, exact where floor(a / b) is not: a / b may round up
        # to an integer (1 / 0.1 = 10.0, but 1 // 0.1 = 9.0 since 0.1 is a bit above 1/10).
        mod = np.fmod(a, b)
        div = (a - mod) / b
        div = np.where((mod != 0) & ((b < 0) != (mod < 0)), div - 1, div)
        floordiv = np.floor(div)
        floordiv = np.where(div - floordiv > 0.5, floordiv + 1, floordiv)
        floordiv = np.where(div == 0, np.copysign(np.zeros_like(div), a / b), floordiv)
        return np.where(b == 0, a / b, floordiv)


def trunc_divide_reference(a, b):
    """torch's div(rounding_mode="trunc"): the quotient rounded toward zero (C's integer `/`)."""
    a, b = np.asarray(a), np.asarray(b)
    with np.errstate(all="ignore"):
        if _integers(a, b):
            safe = _nonzero_divisor(b)
            # a - fmod(a, b) is an exact multiple of b: its floor quotient is the truncated one.
            return _int_result(b, np.floor_divide(a - np.fmod(a, safe), safe))
        return np.trunc(a / b)


def remainder_reference(a, b):
    """torch.remainder: a - b * floor(a / b), with the divisor's sign (Python's %)."""
    a, b = np.asarray(a), np.asarray(b)
    with np.errstate(all="ignore"):
        if _integers(a, b):
            return _int_result(b, np.remainder(a, _nonzero_divisor(b)))
        mod = np.fmod(a, b)  # torch's formula: fmod, moved by b where the signs differ
        return np.where((mod != 0) & ((b < 0) != (mod < 0)), mod + b, mod)


def fmod_reference(a, b):
    """torch.fmod: a - b * trunc(a / b), with the dividend's sign (C's % and fmod)."""
    a, b = np.asarray(a), np.asarray(b)
    with np.errstate(all="ignore"):
        if _integers(a, b):
            return _int_result(b, np.fmod(a, _nonzero_divisor(b)))
        return np.fmod(a, b)


def _shift_operands(a, b):
    return np.asarray(a).astype(np.int64), np.asarray(b).astype(np.int64)


def left_shift_reference(a, b):
    """a << b in int64 bits: 0 where b < 0 or b >= 64 (torch's CPU kernel)."""
    a, b = _shift_operands(a, b)
    out_of_range = (b < 0) | (b >= INT_BITS)
    shifted = np.left_shift(a.view(np.uint64), np.clip(b, 0, INT_BITS - 1).astype(np.uint64)).view(np.int64)
    return np.where(out_of_range, np.int64(0), shifted)


def right_shift_reference(a, b):
    """a >> b, arithmetic: the sign (0 or -1) where b < 0 or b >= 64 (torch's CPU kernel)."""
    a, b = _shift_operands(a, b)
    return np.right_shift(a, np.where((b < 0) | (b >= INT_BITS), INT_BITS - 1, b))


class _Function(sympy.Function):
    """A function of this module: stays unevaluated, prints through `_ccode` (C and CUDA alike)."""

    reference = None  # the NumPy reference, a function of arrays

    @classmethod
    def _imp_(cls, *args):
        # lambdify calls _imp_ on the class (sympy's implemented-function protocol).
        return cls.reference(*args)

    def _eval_evalf(self, prec):
        """A value for numbers (constant folding reads one): the reference in float64."""
        if not all(a.is_number for a in self.args):
            return None
        try:
            value = float(self.reference(*(np.float64(float(a)) for a in self.args)))
        except (TypeError, ValueError):
            return None
        return sympy.Float(value, prec) if np.isfinite(value) else sympy.sympify(value)

    def _ccode(self, printer):
        raise NotImplementedError

    _cxxcode = _ccode
    _cudacode = _ccode


def _args(printer, expr) -> list[str]:
    return [printer._print(a) for a in expr.args]


def _refuse(printer, expr, what: str):
    # The ops' dtype rules refuse these operands while the graph is built (symgrad/ir/ops_integer.py):
    # reaching here is a bug. A ValueError, as the C printer's own refusals are.
    raise ValueError(f"cannot print {expr.func.__name__} in {printer.dtype} arithmetic: {what}")


class _Division(_Function):
    """A two-operand division or remainder: an integer helper, or float code of its own.

    A quotient's derivative is 0 almost everywhere (a step function); a remainder a - b * q(a, b)
    has derivative 1 in a and -q(a, b) in b, `quotient` naming its q."""

    nargs = 2
    int_helper = ""
    float_code = ""      # C for float operands: {f} the float suffix ("f" or ""), {a} and {b} the operands
    quotient = None      # a remainder's quotient function; None for a quotient

    def fdiff(self, argindex=1):
        if self.quotient is None:
            return sympy.S.Zero
        return sympy.S.One if argindex == 1 else -self.quotient(*self.args)

    def _ccode(self, printer):
        a, b = _args(printer, self)
        if printer.dtype in ("int32", "int64"):
            return f"{self.int_helper}({a}, {b})"
        if printer.dtype == "bool":
            _refuse(printer, self, "bool operands have no division (as torch)")
        return self.float_code.format(f="f" if printer.dtype == "float32" else "", a=a, b=b)


class floor_divide(_Division):  # noqa: N801  (the name printed in graphs and reports)
    """The quotient rounded toward -inf, as torch.floor_divide and Python's //."""

    int_helper = "sg_div_floor_i64"
    float_code = "sg_div_floor{f}({a}, {b})"
    reference = staticmethod(floor_divide_reference)


class trunc_divide(_Division):  # noqa: N801
    """The quotient rounded toward zero, as torch.div(rounding_mode="trunc") and C's integer `/`."""

    int_helper = "sg_div_trunc_i64"
    float_code = "trunc{f}(({a}) / ({b}))"
    reference = staticmethod(trunc_divide_reference)


class remainder(_Division):  # noqa: N801
    """a - b * floor_divide(a, b), the divisor's sign, as torch.remainder and Python's %."""

    int_helper = "sg_remainder_i64"
    float_code = "sg_remainder{f}({a}, {b})"
    quotient = floor_divide
    reference = staticmethod(remainder_reference)


class fmod(_Division):  # noqa: N801
    """a - b * trunc_divide(a, b), the dividend's sign, as torch.fmod and C's fmod."""

    int_helper = "sg_fmod_i64"
    float_code = "fmod{f}({a}, {b})"
    quotient = trunc_divide
    reference = staticmethod(fmod_reference)


class _Bitwise(_Function):
    """An op on the bits of integers (on truth values for bool): no derivative, no float form."""

    def fdiff(self, argindex=1):
        return sympy.S.Zero

    def _eval_evalf(self, prec):
        return None  # no float meaning: never folded through sympy (fold reads integers with NumPy)

    def _ccode(self, printer):
        if printer.dtype not in ("int32", "int64", "bool"):
            _refuse(printer, self, "bitwise ops take integers or bools")
        return self._code(printer, *_args(printer, self))


class _BitwiseOperator(_Bitwise):
    nargs = 2
    c_operator = ""

    def _code(self, printer, a, b):
        return f"(({a}) {self.c_operator} ({b}))"


class bitwise_and(_BitwiseOperator):  # noqa: N801
    """a & b: bits of integers, logical and of bools."""

    c_operator = "&"
    reference = staticmethod(np.bitwise_and)


class bitwise_or(_BitwiseOperator):  # noqa: N801
    """a | b: bits of integers, logical or of bools."""

    c_operator = "|"
    reference = staticmethod(np.bitwise_or)


class bitwise_xor(_BitwiseOperator):  # noqa: N801
    """a ^ b: bits of integers, logical xor of bools."""

    c_operator = "^"
    reference = staticmethod(np.bitwise_xor)


class bitwise_not(_Bitwise):  # noqa: N801
    """~a: every bit flipped (-a - 1 in two's complement); logical not of a bool."""

    nargs = 1
    reference = staticmethod(np.invert)

    def _code(self, printer, a):
        # A bool is a uint8 0 or 1 in C: ~1 would be 0xFE, a true value still.
        return f"(!({a}))" if printer.dtype == "bool" else f"(~({a}))"


class _Shift(_Bitwise):
    nargs = 2
    helper = ""

    def _code(self, printer, a, b):
        if printer.dtype == "bool":
            _refuse(printer, self, "bools have no shifts (as torch)")
        return f"{self.helper}({a}, {b})"


class left_shift(_Shift):  # noqa: N801
    """a << b; 0 where b < 0 or b >= the width (torch's CPU kernel)."""

    helper = "sg_shl_i64"
    reference = staticmethod(left_shift_reference)


class right_shift(_Shift):  # noqa: N801
    """a >> b, arithmetic; the sign (0 or -1) where b < 0 or b >= the width (torch's CPU kernel)."""

    helper = "sg_shr_i64"
    reference = staticmethod(right_shift_reference)
