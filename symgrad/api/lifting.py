"""Python values as graph values: constants, an operand lifted beside its partner, argument checks.

The first step of every function on graph values (symgrad.api.functional and the modules beside it): a
Python scalar becomes a 0-d constant of the dtype torch gives the pair, an array a constant of its
own; what cannot be a graph value is refused, naming the op and the argument.
"""

from __future__ import annotations

import numbers
from typing import Sequence

import numpy as np
import sympy

from ..ir import dtypes as D
from ..ir import shapes as S
from ..ir.registry import lookup
from ..ir.value import Value, make

__all__ = ["constant", "apply_elementwise"]


def constant(value, dtype: str | None = None) -> Value:
    """A constant node: a Python number, a NumPy array or a sympy expression of Dims."""
    if isinstance(value, Value):
        return value
    if isinstance(value, sympy.Basic):
        return make(lookup("const"), value=value, shape=(), dtype=dtype or D.DEFAULT_FLOAT)
    if isinstance(value, np.ndarray):
        dt = D.canonical(dtype or (D.DEFAULT_FLOAT if value.dtype.kind == "f" else value.dtype))
        array = np.array(value, dtype=D.to_numpy(dt))
        array.flags.writeable = False
        return make(lookup("const"), value=array, shape=array.shape, dtype=dt)
    if isinstance(value, (numbers.Number, np.generic)):
        if dtype is None:
            dtype = ("bool" if isinstance(value, (bool, np.bool_)) else
                     "int64" if isinstance(value, (int, np.integer)) else D.DEFAULT_FLOAT)
        return make(lookup("const"), value=value.item() if isinstance(value, np.generic) else value,
                    shape=(), dtype=D.canonical(dtype))
    raise TypeError(f"cannot use {type(value).__name__} {value!r} as a graph value")


def _lift(a, b, op: str):
    """Both operands as Values. A Python scalar becomes a 0-d constant of the dtype torch gives
    the pair (`D.result_type`): beside the other operand the op's own rule then keeps it, since a
    0-d value only counts where it raises the category (`int_tensor * 0.5` is float32)."""
    if isinstance(a, Value) and isinstance(b, Value):
        return a, b
    if isinstance(a, Value):
        return a, _lift_one(b, a, op)
    if isinstance(b, Value):
        return _lift_one(a, b, op), b
    raise TypeError(f"{op}: at least one operand must be a graph value")


def _lift_one(x, partner: Value, op: str) -> Value:
    """`x` (a Python scalar, a sympy expression of Dims or an array) as a constant beside `partner`."""
    if isinstance(x, (numbers.Number, np.generic)) and not isinstance(x, np.ndarray):
        return constant(x, D.result_type(partner, x))
    if isinstance(x, sympy.Basic):  # an expression of Dims: a Python int where it is whole (B, B - 1)
        return constant(x, D.result_type(partner, 1 if x.is_integer else 0.5))
    if isinstance(x, np.ndarray):
        # An array is a tensor of its own dtype, but a float array (NumPy's float64 by default)
        # takes a float partner's precision, and the default float beside anything else.
        return constant(x, (partner.dtype if D.is_float(partner.dtype) else None) if x.dtype.kind == "f" else None)
    raise TypeError(f"{op}: unsupported operand of type {type(x).__name__}")


def _value(x, op: str, arg: str = "x") -> Value:
    """`x` itself where it is a graph value; else a TypeError naming the op and the argument."""
    if not isinstance(x, Value):
        raise TypeError(f"{op}: argument {arg} must be a graph value, got {type(x).__name__}")
    return x


def apply_elementwise(op, operands: Sequence[Value]) -> Value:
    """A node of elementwise `op` (an OpDef or a registered name) over `operands`."""
    op = lookup(op) if isinstance(op, str) else op
    return make(op, tuple(operands))


def _operand_text(x) -> str:
    """An operand as an error message names it: `bool [3]` for a value, the scalar itself."""
    return f"{x.dtype} {S.format_shape(x.shape)}" if isinstance(x, Value) else repr(x)


def _is_bool(x) -> bool:
    """Whether x is a bool operand: a bool value or array, or a Python bool."""
    return isinstance(x, (bool, np.bool_)) or (isinstance(x, (Value, np.ndarray)) and x.dtype == "bool")
