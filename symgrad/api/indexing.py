"""Indexing in torch's terms: `x[...]`, narrow, cat, stack, split, chunk, and take by index arrays.

All of it is built on four primitives (symgrad.ir.ops_indexing): a basic index
`x[1:3, None, ::2]` is one `slice` and a reshape; `cat` is a sum of `embed`s
(each part written into zeros at its offset), so its gradient is a slice per
part; an integer array index is `take`, whose gradient is `scatter_add`.
"""

from __future__ import annotations

import numbers
from typing import Sequence

import numpy as np
import sympy

from . import functional as F
from ..ir import dtypes as D
from ..ir import shapes as S
from ..ir.ops_indexing import slice_length
from ..ir.value import Value
from .spellings import torch_dims

__all__ = ["getitem", "narrow", "cat", "concat", "concatenate", "stack", "split", "chunk", "take", "embedding"]

take = F.take


def embedding(weight, ids) -> Value:
    """weight's rows at the integer `ids` (sg.take on axis 0; torch.nn.functional.embedding(ids, weight))."""
    return F.take(weight, ids, axis=0)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _known(size) -> bool:
    return isinstance(size, int)


def _normalize_slice(s: slice, size, axis: int, x: Value) -> tuple:
    """(start, stop, step) of `s` on an axis of `size`, as Python clamps them (steps >= 1)."""
    step = 1 if s.step is None else s.step
    if not _is_int(step) or step < 1:
        raise ValueError(f"x[...]: step {s.step!r} on axis {axis} of {S.format_shape(x.shape)}: "
                         f"only positive integer steps (torch refuses negative ones too)")
    if _known(size):
        start, stop, _ = s.indices(size)
        return start, max(start, stop), step
    # A symbolic axis: None means its end; negative bounds count from it; no clamping is possible.
    def bound(b, default):
        if b is None:
            return default
        if _is_int(b) and b < 0:
            return S.as_size(size + b)
        return b
    return bound(s.start, 0), bound(s.stop, size), step


def _index_key(key, ndim: int) -> list:
    """`key` as a list with the Ellipsis expanded into full slices."""
    key = list(key) if isinstance(key, tuple) else [key]
    used = sum(1 for k in key if k is not None and k is not Ellipsis)
    if sum(1 for k in key if k is Ellipsis) > 1:
        raise IndexError("x[...]: an index can only have a single ellipsis")
    if used > ndim:
        raise IndexError(f"x[...]: too many indices ({used}) for a value of {ndim} axes")
    if any(k is Ellipsis for k in key):  # `in` would compare a Value index with ==
        at = next(i for i, k in enumerate(key) if k is Ellipsis)
        key[at:at + 1] = [slice(None)] * (ndim - used)
        return key
    return key + [slice(None)] * (ndim - used)


def getitem(x: Value, key) -> Value:
    """x[key] for ints, slices (positive steps), None, Ellipsis, and one integer array or Value
    (gathered with `take`), as torch indexes a tensor."""
    key = _index_key(key, x.ndim)
    arrays = [k for k in key if isinstance(k, (Value, np.ndarray, list))]
    if len(arrays) > 1 or (arrays and any(_is_int(k) for k in key)):
        # torch broadcasts several array (and int) indices together and may move their axes first;
        # one array among slices keeps its place, which is what a model needs (x[:, idx]).
        raise IndexError("x[...]: one integer array index, among slices only (use take for more)")
    starts, stops, steps, shape = [], [], [], []   # shape: the result's axes after the slice
    axis = 0
    gathered = None                                # (position in `shape`, indices)
    for k in key:
        if k is None:
            shape.append(1)
            continue
        size = x.shape[axis]
        if _is_int(k):
            if _known(size) and not -size <= k < size:
                raise IndexError(f"x[...]: index {k} is out of range for axis {axis} of {S.format_shape(x.shape)}")
            k = k % size if _known(size) else (S.as_size(size + k) if k < 0 else k)
            starts.append(k), stops.append(S.as_size(sympy.sympify(k) + 1)), steps.append(1)
        elif isinstance(k, slice):
            start, stop, step = _normalize_slice(k, size, axis, x)
            starts.append(start), stops.append(stop), steps.append(step)
            shape.append(slice_length(start, stop, step))
        elif isinstance(k, (Value, np.ndarray, list)):
            starts.append(0), stops.append(size), steps.append(1)
            gathered = (len(shape), axis, k)
            shape.append(size)
        else:
            raise IndexError(f"x[...]: unsupported index {k!r} (ints, slices, None, ..., or an integer array)")
        axis += 1
    out = F.make_slice(x, starts, stops, steps)
    if gathered is None:
        return F.reshape(out, tuple(shape))
    # Drop the int-indexed axes first (keeping the gathered one), then gather along it.
    position, source_axis, indices = gathered
    kept = [out.shape[a] for a, k in enumerate(k for k in key if k is not None) if not _is_int(k)]
    out = F.reshape(out, tuple(kept))
    at = sum(1 for a, k in enumerate(k for k in key if k is not None) if a < source_axis and not _is_int(k))
    if not isinstance(indices, Value):
        indices = F.constant(np.asarray(indices, dtype=np.int64))
    out = F.take(out, indices, axis=at)
    # Re-insert the None axes around the result (they do not move the gathered axes).
    full, it = [], iter(out.shape)
    taken = indices.ndim
    for k in key:
        if k is None:
            full.append(1)
        elif isinstance(k, (Value, np.ndarray, list)):
            full.extend(next(it) for _ in range(taken))
        elif not _is_int(k):
            full.append(next(it))
    return F.reshape(out, tuple(full))


def narrow(x, dim: int, start, length) -> Value:
    """x[..., start:start + length, ...] on axis `dim` (torch.narrow)."""
    x = F._value(x, "narrow")
    dim = S.normalize_axes(dim, x.ndim, "narrow")[0]
    stop = S.as_size(sympy.sympify(start) + length)
    starts = [start if a == dim else 0 for a in range(x.ndim)]
    stops = [stop if a == dim else x.shape[a] for a in range(x.ndim)]
    return F.make_slice(x, starts, stops, [1] * x.ndim)


@torch_dims
def cat(values: Sequence, axis: int = 0) -> Value:
    """The values joined along `axis` (torch.cat): a sum of each written into zeros at its offset,
    so the gradient of each part is a slice; compiled code stores each part straight into its
    window of one buffer (symgrad.backends.lower.concat)."""
    values = [F._value(v, "cat", f"values[{k}]") for k, v in enumerate(values)]
    if not values:
        raise ValueError("cat: expects at least one value")
    # torch.cat promotes its tensors' dtypes, as an elementwise op over them would (int64 and float64: float64)
    dtype = D.result_type(*values)
    values = [v if v.dtype == dtype else F.cast(v, dtype) for v in values]
    first = values[0]
    axis = S.normalize_axes(axis, first.ndim, "cat")[0]
    for k, v in enumerate(values):
        if v.ndim != first.ndim or any(
                a != axis and not S.same_size(s, t) for a, (s, t) in enumerate(zip(v.shape, first.shape))):
            raise ValueError(f"cat: values[{k}] is {v.dtype} {S.format_shape(v.shape)}, values[0] is "
                             f"{first.dtype} {S.format_shape(first.shape)}: all must agree except on axis {axis}")
    if len(values) == 1:
        return first
    total = S.as_size(sum((sympy.sympify(v.shape[axis]) for v in values), sympy.S.Zero))
    shape = first.shape[:axis] + (total,) + first.shape[axis + 1:]
    offset, parts = 0, []
    for v in values:
        starts = [offset if a == axis else 0 for a in range(v.ndim)]
        parts.append(F.embed(v, shape, starts, [1] * v.ndim))
        offset = S.as_size(sympy.sympify(offset) + v.shape[axis])
    out = parts[0]
    for p in parts[1:]:
        out = out + p
    return out


concat = concatenate = cat


@torch_dims
def stack(values: Sequence, axis: int = 0) -> Value:
    """The values joined along a new axis (torch.stack)."""
    values = [F._value(v, "stack", f"values[{k}]") for k, v in enumerate(values)]
    if not values:
        raise ValueError("stack: expects at least one value")
    axis = S.normalize_axes(axis, values[0].ndim + 1, "stack")[0]
    return cat([F.expand_dims(v, axis) for v in values], axis)


def split(x, split_size_or_sections, dim: int = 0) -> tuple:
    """x cut along `dim` into pieces of one size (the last may be smaller) or of the listed sizes
    (torch.split)."""
    x = F._value(x, "split")
    dim = S.normalize_axes(dim, x.ndim, "split")[0]
    size = x.shape[dim]
    if _is_int(split_size_or_sections):
        step = split_size_or_sections
        if step < 1:
            raise ValueError(f"split: split_size must be positive, got {step}")
        if not _known(size):
            raise ValueError(f"split: axis {dim} of {S.format_shape(x.shape)} is symbolic; give the sizes")
        sizes = [min(step, size - k) for k in range(0, size, step)] or [0]
    else:
        sizes = list(split_size_or_sections)
        if not S.same_size(S.as_size(sum(sympy.sympify(s) for s in sizes)), size):
            raise ValueError(f"split: sizes {sizes} do not add up to {size}, axis {dim} of {S.format_shape(x.shape)}")
    pieces, start = [], 0
    for n in sizes:
        pieces.append(narrow(x, dim, start, n))
        start = S.as_size(sympy.sympify(start) + n)
    return tuple(pieces)


def chunk(x, chunks: int, dim: int = 0) -> tuple:
    """x cut into `chunks` pieces of ceil(size / chunks) along `dim` (torch.chunk; fewer when
    they run out)."""
    x = F._value(x, "chunk")
    dim = S.normalize_axes(dim, x.ndim, "chunk")[0]
    size = x.shape[dim]
    if not _is_int(chunks) or chunks < 1:
        raise ValueError(f"chunk: chunks must be a positive integer, got {chunks!r}")
    if not _known(size):
        raise ValueError(f"chunk: axis {dim} of {S.format_shape(x.shape)} is symbolic")
    return split(x, max(1, -(-size // chunks)), dim)
