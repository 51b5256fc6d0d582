"""Rounded division, remainders and bitwise ops: elementwise ops with torch's meanings.

    floor_divide(a, b)         a // b, rounded toward -inf; no derivative (torch: "not implemented")
    div_floor(a, b)            the same value, gradient 0 (torch.div(rounding_mode="floor"))
    div_trunc(a, b)            a / b rounded toward zero, gradient 0 (torch.div(rounding_mode="trunc"))
    remainder(a, b)            a % b with b's sign; d/da = 1, d/db = -floor_divide(a, b)
    fmod(a, b)                 C's remainder, with a's sign; d/da = 1, d/db = -div_trunc(a, b)
    bitwise_and/or/xor(a, b)   on integers and bools; no derivative
    bitwise_not(a)             ~a; logical not of a bool
    bitwise_left_shift(a, b)   a << b, on integers; no derivative
    bitwise_right_shift(a, b)  a >> b (arithmetic), on integers; no derivative

Each is one sympy expression over the functions of symgrad/ir/integer.py, which hold the
NumPy reference, the C/CUDA text and the derivatives, and say what is defined where C's
operators are not (division by zero, INT_MIN / -1, shifts past the width). Output dtypes
follow the elementwise "promote" rule; an operand dtype torch refuses is refused here, while
the graph is built, naming the op and the operands: bools have no division or shift, floats
no bitwise op.
"""

from __future__ import annotations

from . import dtypes as D
from .elementwise import ARGS, define
from .integer import (bitwise_and, bitwise_not, bitwise_or, bitwise_xor, floor_divide, fmod, left_shift,
                      remainder, right_shift, trunc_divide)
from .ops import _zero_vjp

x0, x1 = ARGS[:2]


def _refusing(op, refuse_float: bool, refuse_bool: bool, why: str):
    """`op` with a dtype rule that refuses the result dtypes torch has no kernel for."""
    infer = op.infer

    def checked(inputs, attrs):
        shape, dtype = infer(inputs, attrs)
        if (refuse_float and D.is_float(dtype)) or (refuse_bool and dtype == "bool"):
            operands = ", ".join(v.type_str for v in inputs)
            raise TypeError(f"{op.name}: got {' and '.join(v.dtype for v in inputs)} ({operands}); {why}")
        return shape, dtype
    op.infer = checked
    return op


_NO_BOOL = "it takes integers or floats, as torch: cast bools to an integer dtype first"
_NO_FLOAT = "it takes integers or bools, as torch: a float has no bits to combine"
_INTEGERS = "it takes integers only, as torch: floats and bools have no shift"

# The quotient as `//` and torch.floor_divide give it: torch refuses to differentiate it, and so
# does sg.grad (an error naming the op). torch.div(rounding_mode=...) has gradient zero instead.
_refusing(define("floor_divide", floor_divide(x0, x1), 2, differentiable=False,
                 doc="x // y: the quotient rounded toward -inf (torch.floor_divide)"), False, True, _NO_BOOL)
_refusing(define("div_floor", floor_divide(x0, x1), 2, vjp=_zero_vjp,
                 doc="x / y rounded toward -inf (torch.div(rounding_mode='floor'))"), False, True, _NO_BOOL)
_refusing(define("div_trunc", trunc_divide(x0, x1), 2, vjp=_zero_vjp,
                 doc="x / y rounded toward zero (torch.div(rounding_mode='trunc'))"), False, True, _NO_BOOL)
_refusing(define("remainder", remainder(x0, x1), 2, doc="x % y, with the sign of y (torch.remainder)"),
          False, True, _NO_BOOL)
_refusing(define("fmod", fmod(x0, x1), 2, doc="C's remainder of x / y, with the sign of x (torch.fmod)"),
          False, True, _NO_BOOL)

for _name, _fn, _doc in (("bitwise_and", bitwise_and, "x & y"), ("bitwise_or", bitwise_or, "x | y"),
                         ("bitwise_xor", bitwise_xor, "x ^ y")):
    _refusing(define(_name, _fn(x0, x1), 2, differentiable=False, doc=f"{_doc}: bits of integers, logic of bools"),
              True, False, _NO_FLOAT)
_refusing(define("bitwise_not", bitwise_not(x0), 1, differentiable=False,
                 doc="~x: every bit flipped; logical not of a bool"), True, False, _NO_FLOAT)
_refusing(define("bitwise_left_shift", left_shift(x0, x1), 2, differentiable=False,
                 doc="x << y; 0 where y < 0 or y >= the bit width"), True, True, _INTEGERS)
_refusing(define("bitwise_right_shift", right_shift(x0, x1), 2, differentiable=False,
                 doc="x >> y, arithmetic; the sign (0 or -1) where y < 0 or y >= the bit width"), True, True, _INTEGERS)
