"""The movement functions on graph values: reshape, transpose, broadcast_to, expand, expand_dims, squeeze.

They change how a value's elements are arranged or repeated, never the elements themselves (no
kernel in compiled code where a view does); torch's names and meanings, with NumPy's spellings beside.
"""

from __future__ import annotations

import builtins

import sympy

from ..ir import shapes as S
from ..ir.registry import lookup
from ..ir.value import Value, make
from .lifting import _value
from .spellings import torch_dims

builtins_max = builtins.max

__all__ = ["reshape", "transpose", "broadcast_to", "expand", "expand_dims", "unsqueeze", "squeeze"]


def reshape(x, shape) -> Value:
    """x with a new shape of as many elements; one size may be -1."""
    x = _value(x, "reshape")
    shape = (shape,) if isinstance(shape, (int, sympy.Basic)) else tuple(shape)
    wildcards = [i for i, s in enumerate(shape) if isinstance(s, int) and s == -1]
    if len(wildcards) > 1:
        raise ValueError(f"reshape: only one size may be -1, got {shape}")
    if wildcards:
        known = S.numel([s for i, s in enumerate(shape) if i != wildcards[0]])
        rest = S.simplify(sympy.sympify(S.numel(x.shape)) / sympy.sympify(known))
        if rest.is_Rational and not rest.is_Integer:
            raise ValueError(f"reshape: cannot reshape {S.format_shape(x.shape)} to {shape}")
        shape = tuple(rest if i == wildcards[0] else s for i, s in enumerate(shape))
    shape = S.as_shape(shape)
    if shape == x.shape:
        return x
    return make(lookup("reshape"), (x,), shape=shape)


def transpose(x, *dims, axes=None) -> Value:
    """torch.transpose(x, dim0, dim1): x with two axes exchanged. Otherwise numpy.transpose:
    `transpose(x)` reverses the axes, `transpose(x, perm)` or `axes=perm` permutes them (as does
    `transpose(x, *perm)` with other than two axes)."""
    x = _value(x, "transpose")
    if dims and axes is not None:
        raise TypeError(f"transpose: got both axes= and dims {dims}; give one")
    if len(dims) == 2 and all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        return _swap(x, dims[0], dims[1])
    if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
        dims = tuple(dims[0])  # one sequence: a permutation, whatever its length
    if dims:
        axes = dims
    if axes is not None:
        for a in axes:
            # Check before wrapping: a % ndim would turn axis 5 of a 2-D value into axis 1.
            if not isinstance(a, int) or isinstance(a, bool) or not -x.ndim <= a < x.ndim:
                raise ValueError(f"transpose: axes {tuple(axes)} are not a permutation of the {x.ndim} axes "
                                 f"of {S.format_shape(x.shape)}")
    perm = tuple(reversed(range(x.ndim))) if axes is None else tuple(a % x.ndim for a in axes)
    if sorted(perm) != list(range(x.ndim)):
        raise ValueError(f"transpose: axes {tuple(axes)} are not a permutation of the {x.ndim} axes "
                         f"of {S.format_shape(x.shape)}")
    if perm == tuple(range(x.ndim)):
        return x
    return make(lookup("transpose"), (x,), perm=perm)


def _swap(x: Value, dim0: int, dim1: int) -> Value:
    """x with axes dim0 and dim1 exchanged (torch.transpose; a 0-d or 1-d x stays as it is, as
    torch accepts dims 0 and -1 there)."""
    rank = builtins_max(x.ndim, 1)
    for d in (dim0, dim1):
        if not -rank <= d < rank:
            raise ValueError(f"transpose: dim {d} is out of range for {x.type_str} (dims {-rank}..{rank - 1})")
    order = list(range(x.ndim))
    if x.ndim >= 2:
        a, b = dim0 % x.ndim, dim1 % x.ndim
        order[a], order[b] = order[b], order[a]
    return transpose(x, axes=tuple(order))


def broadcast_to(x, shape) -> Value:
    """x broadcast to `shape` (NumPy rules), without copying in compiled code."""
    x = _value(x, "broadcast_to")
    shape = S.as_shape(shape)
    if shape == x.shape:
        return x
    return make(lookup("expand"), (x,), shape=shape)


def expand(x, *sizes) -> Value:
    """torch's x.expand(*sizes): x broadcast to `sizes` (varargs or one tuple), where -1 keeps an
    axis's size and new axes go in front; only axes of size 1 grow (torch refuses the rest)."""
    x = _value(x, "expand")
    if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)):
        sizes = tuple(sizes[0])
    if len(sizes) < x.ndim:
        raise ValueError(f"expand: {list(sizes)} has fewer axes than {x.type_str}")
    lead = len(sizes) - x.ndim
    shape = []
    for k, size in enumerate(sizes):
        old = x.shape[k - lead] if k >= lead else None
        if isinstance(size, int) and size == -1:
            if old is None:
                raise ValueError(f"expand: -1 is not allowed for the new leading axis {k} of {list(sizes)}")
            size = old
        elif old is not None and not S.same_size(old, size) and old != 1:
            raise ValueError(f"expand: axis {k} of {x.type_str} has size {old}, which cannot grow to {size} "
                             f"(only size-1 axes expand), target {list(sizes)}")
        shape.append(size)
    return broadcast_to(x, tuple(shape))


def expand_dims(x, axis: int) -> Value:
    """x with a new axis of size 1 at `axis` (numpy.expand_dims, torch.unsqueeze)."""
    x = _value(x, "expand_dims")
    if not isinstance(axis, int) or isinstance(axis, bool) or not -x.ndim - 1 <= axis <= x.ndim:
        raise ValueError(f"expand_dims: axis {axis!r} is out of range for {S.format_shape(x.shape)} "
                         f"(a new axis goes at -{x.ndim + 1}..{x.ndim})")
    axis = axis % (x.ndim + 1)
    return reshape(x, x.shape[:axis] + (1,) + x.shape[axis:])


def unsqueeze(x, dim: int) -> Value:
    """x with a new axis of size 1 at `dim` (torch.unsqueeze; -1 appends it)."""
    return expand_dims(x, dim)


@torch_dims
def squeeze(x, axis=None) -> Value:
    """x without axes of size 1: all of them, or those of `axis` / `dim` (an int or a tuple).
    As torch.squeeze, a given axis whose size is not 1 is kept (numpy.squeeze refuses it)."""
    x = _value(x, "squeeze")
    for a in (() if axis is None else (axis,) if isinstance(axis, int) else axis):
        if isinstance(a, int) and not -builtins_max(x.ndim, 1) <= a < builtins_max(x.ndim, 1):
            raise ValueError(f"squeeze: dim {a} is out of range for {x.type_str}")
    if x.ndim == 0:
        return x  # torch squeezes a 0-d tensor along dim 0 or -1 to itself
    axes = S.normalize_axes(axis, x.ndim, "squeeze") if axis is not None else ()
    axes = tuple(a for a in (axes if axis is not None else range(x.ndim)) if x.shape[a] == 1)
    return reshape(x, tuple(s for a, s in enumerate(x.shape) if a not in axes))
