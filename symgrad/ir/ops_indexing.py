"""The indexing primitives: `slice` and its transpose `embed`, `take` and its transpose `scatter_add`.

`slice` is a view (kind movement); the other three write elements at positions
of their own (kind gather), so compiled code gives them a buffer. Each pair is
the other's VJP, as in JAX (slice / pad, gather / scatter-add):

    slice(x, starts, stops, steps)   x[start:stop:step] on every axis (steps >= 1)
    embed(g, shape, starts, steps)   zeros of `shape` with g written at those positions
    take(table, indices, axis)       table's entries at `indices` along `axis` (np.take)
    scatter_add(g, indices, axis, size)
                                     zeros with `size` entries along `axis`, g's entries
                                     added at `indices` (np.add.at): repeated indices sum

Concatenation is a sum of embeds, and splitting a list of slices; both are
written in symgrad.api.indexing on top of these four. Indices that `take` reads are
checked against the table's size before the op runs (by the `class_labels`
check the functional layer puts in front of them), so a bad index is a Python
error naming the op, never a read outside the table.
"""

from __future__ import annotations

import numpy as np
import sympy

from . import dtypes as D
from . import shapes as S
from .registry import GATHER, MOVEMENT, OpDef, register
from .value import functions as _F  # symgrad.api.functional, for VJP rules written as graph code


def slice_length(start, stop, step: int):
    """The number of elements of start, start + step, ... below stop (0 when none)."""
    span = sympy.sympify(stop) - sympy.sympify(start)
    if span.is_number:
        return max(0, -(-int(span) // step))
    if step != 1:
        raise ValueError(f"slice: a symbolic range {start}:{stop} needs step 1, got {step}")
    return S.as_size(span)


def _python_slices(attrs: dict, bindings: dict) -> tuple:
    """The attrs as Python slices, their Dim expressions evaluated."""
    return tuple(slice(S.evaluate(a, bindings), S.evaluate(b, bindings), c)
                 for a, b, c in zip(attrs["starts"], attrs["stops"], attrs["steps"]))


# ---- slice and embed: strided windows, and their transpose ------------------------

def _slice_infer(inputs, attrs):
    (x,) = inputs
    starts, stops, steps = attrs["starts"], attrs["stops"], attrs["steps"]
    if not len(starts) == len(stops) == len(steps) == x.ndim:
        raise ValueError(f"slice: {len(starts)} ranges for the {x.ndim} axes of {S.format_shape(x.shape)}")
    shape = []
    for axis, (start, stop, step, size) in enumerate(zip(starts, stops, steps, x.shape)):
        if not isinstance(step, int) or step < 1:
            raise ValueError(f"slice: step {step!r} on axis {axis}: steps must be positive integers")
        below = [sympy.sympify(0) <= start, sympy.sympify(start) <= stop, sympy.sympify(stop) <= size]
        if any(c == sympy.false for c in below):
            raise ValueError(f"slice: range {start}:{stop} on axis {axis} is outside 0:{size} "
                             f"of {S.format_shape(x.shape)}")
        shape.append(slice_length(start, stop, step))
    return tuple(shape), x.dtype


def _slice_vjp(node, g, wants):
    x = node.inputs[0]
    return [_F().embed(g, x.shape, node.attrs["starts"], node.attrs["steps"])]


register(OpDef("slice", MOVEMENT, _slice_infer,
               lambda args, node, env: args[0][_python_slices(node.attrs, env.bindings)],
               _slice_vjp, doc="x[start:stop:step] on every axis"))


def _embed_stops(node) -> tuple:
    """The stop of each axis's range in embed's output: one past the last element written."""
    g = node.inputs[0]
    return tuple(S.as_size(sympy.sympify(start) + (n - 1) * step + 1) if n != 0 else start
                 for start, step, n in zip(node.attrs["starts"], node.attrs["steps"], g.shape))


def _embed_infer(inputs, attrs):
    (g,) = inputs
    shape = S.as_shape(attrs["shape"])
    starts, steps = attrs["starts"], attrs["steps"]
    if not len(shape) == len(starts) == len(steps) == g.ndim:
        raise ValueError(f"embed: {S.format_shape(g.shape)} into {S.format_shape(shape)} with {len(starts)} offsets")
    for axis, (start, step, n, size) in enumerate(zip(starts, steps, g.shape, shape)):
        last = sympy.sympify(start) + (sympy.sympify(n) - 1) * step
        empty = sympy.sympify(n) <= 0
        if (sympy.sympify(start) < 0) == sympy.true or (empty != sympy.true and (last >= size) == sympy.true):
            raise ValueError(f"embed: {n} elements from {start} by {step} on axis {axis} do not fit in "
                             f"{S.format_shape(shape)}")
    return shape, g.dtype


def _embed_numpy(args, node, env):
    out = np.zeros(env.shape(node), args[0].dtype)
    stops = tuple(S.evaluate(s, env.bindings) for s in _embed_stops(node))
    starts = tuple(S.evaluate(s, env.bindings) for s in node.attrs["starts"])
    out[tuple(slice(a, b, c) for a, b, c in zip(starts, stops, node.attrs["steps"]))] = args[0]
    return out


def _embed_vjp(node, g, wants):
    return [_F().make_slice(g, node.attrs["starts"], _embed_stops(node), node.attrs["steps"])]


register(OpDef("embed", GATHER, _embed_infer, _embed_numpy, _embed_vjp,
               doc="zeros of attrs['shape'] with the input written from starts by steps (slice's transpose)"))


# ---- take and scatter_add: reads and writes at computed indices --------------------

def _check_indices(indices, op: str) -> None:
    if indices.dtype not in D.INT_DTYPES:
        raise TypeError(f"{op}: indices must be integers, got {indices.dtype} {S.format_shape(indices.shape)}")


def _take_infer(inputs, attrs):
    table, indices = inputs
    _check_indices(indices, "take")
    axis = attrs["axis"]
    if not 0 <= axis < table.ndim:
        raise ValueError(f"take: axis {axis} is out of range for the table {S.format_shape(table.shape)}")
    return table.shape[:axis] + indices.shape + table.shape[axis + 1:], table.dtype


def _take_numpy(args, node, env):
    table, indices = args
    size = table.shape[node.attrs["axis"]]
    if indices.size and (indices.min() < 0 or indices.max() >= size):
        raise IndexError(f"take: an index lies outside [0, {size}) (the table has {size} entries on its axis)")
    return np.take(table, indices, axis=node.attrs["axis"])


def _take_vjp(node, g, wants):
    table, indices = node.inputs
    axis = node.attrs["axis"]
    purpose = node.attrs.get("purpose")
    return [_F().scatter_add(g, indices, axis, table.shape[axis], purpose=f"col2im, the gradient of {purpose}" if purpose
                             else "") if wants[0] else None, None]


register(OpDef("take", GATHER, _take_infer, _take_numpy, _take_vjp,
               doc="table's entries at integer indices along one axis (np.take; torch.embedding on axis 0)"))


def _scatter_add_infer(inputs, attrs):
    src, indices = inputs
    _check_indices(indices, "scatter_add")
    axis, k = attrs["axis"], indices.ndim
    if src.shape[axis:axis + k] != indices.shape:
        raise ValueError(f"scatter_add: the indices {S.format_shape(indices.shape)} are not axes {axis}.. "
                         f"of the source {S.format_shape(src.shape)}")
    return src.shape[:axis] + (S.as_size(attrs["size"]),) + src.shape[axis + k:], src.dtype


def _scatter_add_numpy(args, node, env):
    src, indices = args
    axis = node.attrs["axis"]
    out = np.zeros(env.shape(node), src.dtype)
    # np.add.at along `axis`: move it first, add rows at the flattened indices, move it back.
    moved = np.moveaxis(out, axis, 0)
    rows = np.moveaxis(src, tuple(range(axis, axis + indices.ndim)), tuple(range(indices.ndim)))
    # (the row count spelled out: -1 cannot be inferred when a row has no elements)
    np.add.at(moved, indices.reshape(-1), rows.reshape((indices.size,) + moved.shape[1:]))
    return out


def _scatter_add_vjp(node, g, wants):
    src, indices = node.inputs
    return [_F().take(g, indices, node.attrs["axis"], checked=True) if wants[0] else None, None]


register(OpDef("scatter_add", GATHER, _scatter_add_infer, _scatter_add_numpy, _scatter_add_vjp,
               doc="zeros with attrs['size'] entries on the axis, the source added at the indices (take's transpose)"))
