"""Buffers and views: how a kernel plan stores values and reads them.

A `Buffer` is storage for one value; a `View` says how a kernel reads a value
(a buffer through per-axis strides and an offset, a literal, or an index).
Movement ops are view algebra and cost nothing: transpose, expand, slice and
a reshape of a contiguous value only change the strides a reader uses. The
axis merge that turns several loops stepping as one into one longer loop is
written once here (`merge_axes`); the lowering's loop, reduction and row
kernels all use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sympy

from ..ir import shapes as S


def replace(obj, **changes):
    """`dataclasses.replace` for the plan's frozen dataclasses (views, operands, kernels: none has a
    __post_init__ or a field outside __init__): the instance's fields copied, `changes` over them.
    A lowering makes tens of thousands of views (a 12-layer GPT's, 17,000), and the generic
    dataclasses.replace, which calls __init__ with every field, took three times as long."""
    fields = type(obj).__dataclass_fields__
    unknown = [name for name in changes if name not in fields]
    if unknown:
        raise TypeError(f"replace: {type(obj).__name__} has no field(s) {unknown}")
    new = object.__new__(type(obj))
    state = new.__dict__
    state.update(obj.__dict__)
    state.update(changes)
    return new


@dataclass(frozen=True, eq=False)
class Buffer:
    """Storage for one value. `name` is index-based (in0, var2, out0, ws3, c1): never a user's name."""

    name: str
    storage: str        # "input" | "variable" | "output" | "workspace" | "const"
    index: int          # position among its storage's buffers
    dtype: str
    numel: Any          # int or sympy expression of Dims
    label: str = ""     # what it holds, for comments only (may contain user text)
    value: Any = None   # the array of a "const" buffer


@dataclass(frozen=True, eq=False)
class View:
    """How a kernel reads a value of `shape`.

    Element (i0, ..., in) is `offset + sum(ik * strides[k])`, which is an
    index into `buffer` (kind "buffer") or the value itself (kind "index":
    iota). Kind "literal" is `literal` everywhere (a number, or a sympy
    expression of Dims such as 1/B).
    """

    kind: str
    shape: tuple
    dtype: str
    strides: tuple
    offset: Any = 0
    buffer: Buffer | None = None
    literal: Any = None


# The kind of a patch matrix read in place (symgrad.backends.decide.patches makes such views): named here,
# below the plan's kernels, which read its index map too.
PATCHES = "patches"


def is_patches(view: View) -> bool:
    """Whether `view` is a patch matrix read in place (patch rows or patch columns)."""
    return view.kind == PATCHES


def contiguous_strides(shape) -> tuple:
    """Row-major strides, in elements."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step = _mul(step, size)
    return tuple(reversed(strides))


def _mul(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return a * b
    return S.as_size(sympy.expand(sympy.sympify(a) * sympy.sympify(b))) if a != 0 and b != 0 else 0


def _same(a, b) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return sympy.expand(sympy.sympify(a) - sympy.sympify(b)) == 0


def _is_one(size) -> bool:
    return isinstance(size, int) and size == 1


def _numel(shape):
    return S.numel(shape)


def buffer_view(buffer: Buffer, shape) -> View:
    """A contiguous view of a whole buffer."""
    return View("buffer", tuple(shape), buffer.dtype, contiguous_strides(shape), 0, buffer)


def literal_view(value, shape, dtype) -> View:
    """A value equal to `value` everywhere (every stride 0)."""
    return View("literal", tuple(shape), dtype, (0,) * len(shape), 0, None, value)


def is_contiguous(view: View) -> bool:
    """Whether the view reads its elements in row-major order with no gaps (size-1 axes ignored)."""
    expected = contiguous_strides(view.shape)
    return view.kind == "buffer" and all(_is_one(s) or _same(a, b)
                                          for s, a, b in zip(view.shape, view.strides, expected))


def broadcast_view(view: View, shape) -> View:
    """The view read at the broadcast `shape` (NumPy rules: new axes and size-1 axes get stride 0)."""
    shape = tuple(shape)
    if view.shape == shape:
        return view
    lead = len(shape) - len(view.shape)
    strides = [0] * lead
    for size, stride, target in zip(view.shape, view.strides, shape[lead:]):
        strides.append(0 if _is_one(size) and not _is_one(target) else stride)
    return replace(view, shape=shape, strides=tuple(strides))


def transpose_view(view: View, perm) -> View:
    """The view with its axes permuted: only the strides move."""
    return replace(view, shape=tuple(view.shape[p] for p in perm),
                   strides=tuple(view.strides[p] for p in perm))


def slice_view(view: View, starts, steps, shape) -> View:
    """The window of the view from `starts` by `steps` on each axis: its offset moves to the first
    element, its strides scale by the steps."""
    offset = view.offset
    for start, stride in zip(starts, view.strides):
        offset = offset + _mul(start, stride) if not (isinstance(start, int) and start == 0) else offset
    return replace(view, shape=tuple(shape), offset=S.as_size(offset) if not isinstance(offset, int) else offset,
                   strides=tuple(_mul(stride, step) for stride, step in zip(view.strides, steps)))


def reshape_view(view: View, shape) -> View | None:
    """The view as `shape` without moving data, or None when that needs a copy."""
    shape = tuple(shape)
    if view.kind == "literal":
        return replace(view, shape=shape, strides=(0,) * len(shape))
    if is_contiguous(view):
        return replace(view, shape=shape, strides=contiguous_strides(shape))
    old = [(s, st) for s, st in zip(view.shape, view.strides) if not _is_one(s)]
    new = [s for s in shape if not _is_one(s)]
    strides = _regrouped_strides(old, new)
    if strides is None:
        return None
    it = iter(strides)
    return replace(view, shape=shape, strides=tuple(0 if _is_one(s) else next(it) for s in shape))


def _regrouped_strides(old: list, new: list) -> list | None:
    """The strides of the sizes `new` over the axes `old` ((size, stride) pairs, no size 1) when
    they are a regrouping of them, as NumPy's no-copy reshape finds it: runs of old axes with equal
    products of sizes to runs of new ones, each old run one that walks memory as a single axis
    (stride[a] = stride[a + 1] * size[a + 1]): a slice's last axis split into heads, (B, T, 3C)[..., :C]
    as (B, T, H, D). None when some run is not one axis in memory (a copy is needed), or when
    sizes that are not numbers would have to be multiplied to match."""
    strides: list = []
    i = j = 0
    while i < len(old) and j < len(new):
        if _same(old[i][0], new[j]):
            strides.append(old[i][1])
            i, j = i + 1, j + 1
            continue
        ni, nj, have, want = i + 1, j + 1, old[i][0], new[j]
        while have != want:
            if not (isinstance(have, int) and isinstance(want, int)):
                return None
            if want < have:
                if nj == len(new) or not isinstance(new[nj], int):
                    return None
                want, nj = want * new[nj], nj + 1
            else:
                if ni == len(old) or not isinstance(old[ni][0], int):
                    return None
                have, ni = have * old[ni][0], ni + 1
        if not all(_same(old[a][1], _mul(old[a + 1][1], old[a + 1][0])) for a in range(i, ni - 1)):
            return None
        run, stride = [], old[ni - 1][1]
        for size in reversed(new[j:nj]):
            run.append(stride)
            stride = _mul(stride, size)
        strides.extend(reversed(run))
        i, j = ni, nj
    return strides if i == len(old) and j == len(new) else None


def merge_axes(sizes, stride_lists) -> tuple[tuple, list[tuple]]:
    """Drop size-1 axes, then merge adjacent axes that every operand steps through as one.

    `stride_lists` holds one stride per axis for each operand. Axes a, a+1
    merge when, for every operand, stride[a] == stride[a+1] * size[a+1]; the
    merged axis has size size[a] * size[a+1] and stride stride[a+1]. Returns
    the sizes and each operand's strides, fewer and longer loops.
    """
    keep = [a for a, s in enumerate(sizes) if not _is_one(s)]
    sizes = [sizes[a] for a in keep]
    strides = [[st[a] for a in keep] for st in stride_lists]
    a = len(sizes) - 2
    while a >= 0:
        if all(_same(st[a], _mul(st[a + 1], sizes[a + 1])) for st in strides):
            sizes[a:a + 2] = [_mul(sizes[a], sizes[a + 1])]
            for st in strides:
                st[a:a + 2] = [st[a + 1]]
        a -= 1
    return tuple(sizes), [tuple(st) for st in strides]


def collapse(shape, stride_lists: list[tuple]) -> tuple[tuple, list[tuple]]:
    """A loop nest of `shape` read by operands of `stride_lists`, with as few axes as possible."""
    return merge_axes(shape, stride_lists)


def merge_loop_axes(axes: list[tuple]) -> list[tuple]:
    """`merge_axes` over (size, strides) pairs, `strides` holding one stride per operand:
    the merged (size, strides) pairs."""
    sizes, per_operand = merge_axes([s for s, _ in axes], [list(col) for col in zip(*(st for _, st in axes))]
                                    if axes and axes[0][1] else [])
    return [(size, tuple(st[k] for st in per_operand)) for k, size in enumerate(sizes)]


def merge_strided_axes(axes: list[tuple]) -> list[tuple]:
    """`merge_axes` over (size, stride) pairs of one operand: the merged pairs."""
    return [(size, strides[0]) for size, strides in merge_loop_axes([(s, (st,)) for s, st in axes])]
