"""Values built from element indices: arange, tril, triu, and axis permutations in torch's names.

All of them read the `iota` source (each element's index along one axis), so
they cost no memory in compiled code: a causal mask is a comparison of two
indices inside the kernel that uses it.
"""

from __future__ import annotations

import math
import numbers

import sympy

from . import functional as F
from ..ir import dtypes as D
from ..ir import shapes as S
from ..ir.registry import lookup
from ..ir.value import Value, make

__all__ = ["arange", "tril", "triu", "permute", "swapaxes"]


def _is_integer(value) -> bool:
    return isinstance(value, (numbers.Integral, S.Dim)) or (isinstance(value, sympy.Basic) and value.is_integer)


def arange(start=None, stop=None, step=1, dtype=None, *, end=None, device=None, requires_grad: bool = False) -> Value:
    """start, start + step, ... below stop (torch.arange; torch's `end=` is `stop`): int64 when
    start, stop and step are integers, else float32, unless `dtype` (a name, a NumPy or a torch
    dtype). The length may be a Dim expression (`sg.arange(T)` for a symbolic T). `device=` and
    `requires_grad=` change nothing (the backend decides where a graph runs)."""
    if end is not None:
        if stop is not None:
            raise TypeError("arange: got both stop and end= (NumPy's and torch's names of one argument)")
        stop = end
    if start is None and stop is None:
        raise TypeError("arange: give an end")
    if stop is None:
        start, stop = 0, start
    elif start is None:
        start = 0
    if step == 0:
        raise ValueError("arange: step must not be zero")
    span = sympy.sympify(stop) - start
    if span.is_number and span * step < 0:
        raise ValueError(f"arange: stop {stop} is not reached from start {start} by step {step} (as torch refuses)")
    integral = all(_is_integer(v) for v in (start, stop, step))
    dtype = F._dtype_name(dtype or ("int64" if integral else D.DEFAULT_FLOAT))
    if integral:
        length = sympy.sympify((sympy.sympify(stop) - start + step - (1 if step > 0 else -1)) // step)
        if length.is_number:
            length = max(int(length), 0)
        elif length.has(sympy.floor):
            raise TypeError(f"arange: a length of Dims must divide exactly; ({start}, {stop}, {step}) "
                            f"gives {length} (use step 1 or -1)")
    else:
        if any(isinstance(v, sympy.Basic) and not v.is_number for v in (start, stop, step)):
            raise TypeError("arange: symbolic bounds must be integers")
        length = max(0, math.ceil((float(stop) - float(start)) / float(step)))
    index = make(lookup("iota"), shape=(length,), axis=0, dtype="int64" if integral else dtype)
    index = F.cast(index, dtype)
    if step != 1:
        index = index * F.constant(step, dtype)
    if start != 0:
        index = index + F.constant(start, dtype)
    return index


def _diagonal_mask(x: Value, diagonal: int, keep_lower: bool, op: str) -> Value:
    x = F._value(x, op)
    if x.ndim < 2:
        raise ValueError(f"{op}: the input needs at least 2 axes, got {x.type_str}")
    if not isinstance(diagonal, numbers.Integral):
        raise TypeError(f"{op}: diagonal must be an int, got {diagonal!r}")
    plane = tuple(x.shape[-2:])
    row = make(lookup("iota"), shape=plane, axis=0, dtype="int64")
    col = make(lookup("iota"), shape=plane, axis=1, dtype="int64")
    offset = col - row
    keep = F.less_equal(offset, diagonal) if keep_lower else F.greater_equal(offset, diagonal)
    return F.where(keep, x, F.constant(0, x.dtype))


def tril(x, diagonal: int = 0) -> Value:
    """x with the elements above the `diagonal`-th diagonal of its last two axes zeroed (torch.tril)."""
    return _diagonal_mask(x, diagonal, True, "tril")


def triu(x, diagonal: int = 0) -> Value:
    """x with the elements below the `diagonal`-th diagonal of its last two axes zeroed (torch.triu)."""
    return _diagonal_mask(x, diagonal, False, "triu")


def permute(x, dims) -> Value:
    """x with its axes in the order `dims` (torch.permute; numpy.transpose with axes)."""
    return F.transpose(x, tuple(dims))


def swapaxes(x, axis0: int, axis1: int) -> Value:
    """x with two axes exchanged (torch.swapaxes / torch.transpose(x, a, b))."""
    x = F._value(x, "swapaxes")
    order = list(range(x.ndim))
    a, b = (S.normalize_axes(axis, x.ndim, "swapaxes")[0] for axis in (axis0, axis1))
    order[a], order[b] = order[b], order[a]
    return F.transpose(x, order)
