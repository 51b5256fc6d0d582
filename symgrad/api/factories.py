"""Values made from a size, in torch's spelling: ones, zeros, full, their `_like` forms, eye.

A constant filled with one number is a 0-d constant broadcast to the size (`expand`), so it
costs no memory in compiled code and its size may hold Dims (`sg.zeros(B, 10)`); eye compares
two element indices (the `iota` source), as tril does. Sizes are given as torch takes them:
`sg.ones(2, 3)` or `sg.ones((2, 3))`. `dtype=` takes a name, a NumPy or a torch dtype; the
default is torch's: float32, or for `full` the kind of the fill value (bool, int64, float32).
`device=` and `requires_grad=` are accepted and change nothing: the backend decides where a
graph runs, and sg.grad differentiates with respect to any value.
"""

from __future__ import annotations

import numbers

import numpy as np
import sympy

from . import functional as F
from ..ir import dtypes as D
from ..ir import shapes as S
from ..ir.registry import lookup
from ..ir.value import Value, make

__all__ = ["zeros", "ones", "full", "zeros_like", "ones_like", "full_like", "eye"]


def _size(op: str, sizes: tuple) -> tuple:
    """torch's size arguments (`2, 3` or `(2, 3)`) as a shape, each size checked."""
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
        sizes = tuple(sizes[0])
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, (numbers.Integral, sympy.Basic)):
            raise TypeError(f"{op}: sizes must be ints or Dims, got {size!r} in {list(sizes)}")
        if isinstance(size, numbers.Integral) and size < 0:
            raise ValueError(f"{op}: negative size {size} in {list(sizes)}")
    return S.as_shape(sizes)


def _filled(op: str, shape: tuple, fill_value, dtype) -> Value:
    if isinstance(fill_value, Value) or not isinstance(fill_value, (numbers.Number, np.generic)):
        raise TypeError(f"{op}: fill_value must be a number, got {type(fill_value).__name__}")
    if dtype is None:
        dtype = ("bool" if isinstance(fill_value, (bool, np.bool_)) else
                 "int64" if isinstance(fill_value, (numbers.Integral, np.integer)) else D.DEFAULT_FLOAT)
    dtype = F._dtype_name(dtype)
    value = np.asarray(fill_value).astype(D.to_numpy(dtype)).item()  # 2.7 as int64 is 2, as in torch
    return F.broadcast_to(F.constant(value, dtype), shape)


def full(size, fill_value, *, dtype=None, device=None, requires_grad: bool = False) -> Value:
    """A value of shape `size` holding `fill_value` (torch.full): of dtype `dtype`, or bool,
    int64 or float32 as the fill value is a bool, an int or a float."""
    return _filled("full", _size("full", (size,)), fill_value, dtype)


def zeros(*size, dtype=None, device=None, requires_grad: bool = False) -> Value:
    """Zeros of shape `size` (torch.zeros(2, 3) or torch.zeros((2, 3))), float32 unless `dtype`."""
    return _filled("zeros", _size("zeros", size), 0.0, dtype)


def ones(*size, dtype=None, device=None, requires_grad: bool = False) -> Value:
    """Ones of shape `size` (torch.ones(2, 3) or torch.ones((2, 3))), float32 unless `dtype`."""
    return _filled("ones", _size("ones", size), 1.0, dtype)


def _like(op: str, x, fill_value, dtype) -> Value:
    x = F._value(x, op, "input")
    return _filled(op, x.shape, fill_value, x.dtype if dtype is None else dtype)


def zeros_like(input, *, dtype=None, device=None, requires_grad: bool = False) -> Value:
    """Zeros of the shape of `input`, and its dtype unless `dtype` (torch.zeros_like)."""
    return _like("zeros_like", input, 0, dtype)


def ones_like(input, *, dtype=None, device=None, requires_grad: bool = False) -> Value:
    """Ones of the shape of `input`, and its dtype unless `dtype` (torch.ones_like)."""
    return _like("ones_like", input, 1, dtype)


def full_like(input, fill_value, *, dtype=None, device=None, requires_grad: bool = False) -> Value:
    """`fill_value` in the shape of `input`, and its dtype unless `dtype` (torch.full_like)."""
    return _like("full_like", input, fill_value, dtype)


def eye(n, m=None, *, dtype=None, device=None, requires_grad: bool = False) -> Value:
    """The n x m identity matrix (m defaults to n), float32 unless `dtype` (torch.eye)."""
    shape = _size("eye", (n,) if m is None else (n, m))
    if m is None:
        shape = (shape[0], shape[0])
    row = make(lookup("iota"), shape=shape, axis=0, dtype="int64")
    col = make(lookup("iota"), shape=shape, axis=1, dtype="int64")
    return F.cast(F.equal(row, col), F._dtype_name(D.DEFAULT_FLOAT if dtype is None else dtype))
