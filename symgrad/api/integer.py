"""Rounded division, remainders and bitwise ops on graph values, with torch's names and meanings.

    a // b, sg.floor_divide(a, b)     the quotient rounded toward -inf (ints and floats)
    sg.div(a, b, rounding_mode=)      None: true division; "trunc": toward zero; "floor": toward -inf
    a % b, sg.remainder(a, b)         the remainder with the divisor's sign (Python's %)
    sg.fmod(a, b)                     the remainder with the dividend's sign (C's fmod)
    a & b, a | b, a ^ b, ~a           bitwise on integers, logical on bools
    a << b, a >> b                    shifts of integers (arithmetic right shift)

Python scalars take the other operand's dtype, as for + and *; `int_value // 2.5` is float
division. Integer division by zero gives 0 (quotient and remainder: NumPy's choice, where torch
raises on the CPU); float division by zero gives inf or NaN, as torch. What else C leaves
undefined (INT_MIN / -1, shifts by a negative amount or past the width) is defined as in
symgrad/ir/integer.py, whose functions compute all of these on every backend.

Gradients are torch's: floor_divide has none (sg.grad refuses it, naming the op, as torch's
autograd does), div with a rounding mode has gradient 0, remainder and fmod pass the cotangent
to a and -cotangent * quotient to b; the bitwise ops take no floats at all.
"""

from __future__ import annotations

from .functional import _lift, _value, apply_elementwise
from .functional import div as _true_div
from ..ir.value import Value

__all__ = ["floor_divide", "div", "remainder", "fmod", "bitwise_and", "bitwise_or", "bitwise_xor",
           "bitwise_not", "bitwise_left_shift", "bitwise_right_shift"]


def _binary(op: str, a, b) -> Value:
    a, b = _lift(a, b, op)
    return apply_elementwise(op, (a, b))


def floor_divide(a, b) -> Value:
    """a // b elementwise, rounded toward -inf (torch.floor_divide), with broadcasting: -7 // 2 = -4.
    Integers and floats; integer division by zero gives 0. Not differentiable (as in torch); use
    div(a, b, rounding_mode="floor") for the same value with gradient 0."""
    return _binary("floor_divide", a, b)


_ROUNDING = {"trunc": "div_trunc", "floor": "div_floor"}


def div(a, b, rounding_mode: str | None = None) -> Value:
    """a / b elementwise (torch.div): true division (a float result) when rounding_mode is None;
    "trunc" rounds the quotient toward zero (C's integer division), "floor" toward -inf, both in
    the operands' dtype, with gradient 0. Integer division by zero gives 0."""
    if rounding_mode is None:
        return _true_div(a, b)
    if rounding_mode not in _ROUNDING:
        raise ValueError(f"div: rounding_mode must be None, 'trunc' or 'floor', got {rounding_mode!r}")
    return _binary(_ROUNDING[rounding_mode], a, b)


def remainder(a, b) -> Value:
    """a % b elementwise with the sign of b (torch.remainder, Python's %): -7 % 2 = 1, 7 % -2 = -1.
    Integer division by zero gives 0, float gives NaN. Gradient 1 to a, -floor_divide(a, b) to b."""
    return _binary("remainder", a, b)


def fmod(a, b) -> Value:
    """C's remainder of a / b elementwise, with the sign of a (torch.fmod): fmod(-7, 2) = -1.
    Integer division by zero gives 0, float gives NaN. Gradient 1 to a, -div(a, b, "trunc") to b."""
    return _binary("fmod", a, b)


def bitwise_and(a, b) -> Value:
    """a & b elementwise on integers (bits) or bools (logical and); floats are refused."""
    return _binary("bitwise_and", a, b)


def bitwise_or(a, b) -> Value:
    """a | b elementwise on integers (bits) or bools (logical or); floats are refused."""
    return _binary("bitwise_or", a, b)


def bitwise_xor(a, b) -> Value:
    """a ^ b elementwise on integers (bits) or bools (logical xor); floats are refused."""
    return _binary("bitwise_xor", a, b)


def bitwise_not(x) -> Value:
    """~x elementwise: every bit of an integer flipped (-x - 1), a bool negated; floats are refused."""
    return apply_elementwise("bitwise_not", (_value(x, "bitwise_not"),))


def bitwise_left_shift(a, b) -> Value:
    """a << b elementwise on integers: 0 where b < 0 or b is at least the bit width (torch's CPU
    kernel; undefined in C). Bools and floats are refused."""
    return _binary("bitwise_left_shift", a, b)


def bitwise_right_shift(a, b) -> Value:
    """a >> b elementwise on integers, arithmetic (the sign fills in): the sign, 0 or -1, where
    b < 0 or b is at least the bit width (torch's CPU kernel). Bools and floats are refused."""
    return _binary("bitwise_right_shift", a, b)
