"""The gather kind: `GatherKernel`, the ops that read or write at positions of their own (take,
scatter_add and embed), with their lowering and render (templates <language>/gather).

take(table, idx, axis) and scatter_add(src, idx, axis, size) become one `GatherKernel` each,
over three loops: P (the axes before `axis`), I (the indices) and Q (the axes after it):

    take:         out[p, i, q]  = table[p, idx[i], q]
    scatter_add:  out[p, r, q]  = 0;  out[p, idx[i], q] += src[p, i, q]   (i in order)

Every operand is read contiguously (a strided view is copied first), so the kernel's
indices are plain products. scatter_add adds the indices in order, as np.add.at does,
so the sums are the NumPy reference's bit for bit; its threads split P and Q, never I,
so no two threads add into one element.

embed(g, shape, starts, steps) needs no kernel kind of its own: a loop zeroes the output,
a second one stores g into the window of it (a strided view of the output buffer).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import sympy

from ...ir import dtypes as D
from ...ir import shapes as S
from ...ir.elementwise import ARGS
from ...ir.value import Value
from ..decide.patches import patch_view
from ..plan import LoweringError, Operand, Statement, Swap
from ..render.renderer import Renderer, small
from ..views import Buffer, View, broadcast_view, buffer_view, is_contiguous, literal_view, slice_view

WORDS = (("gather", "gathers"),)  # the report's count line


@dataclass(frozen=True, eq=False)
class GatherKernel:
    """take (`op` "take": out[p, i, q] = src[p, indices[i], q]) or scatter_add (`op`
    "scatter_add": out zeroed, then out[p, indices[i], q] += src[p, i, q]); `rows` is the
    size of the indexed axis of the table (take) or of the output (scatter_add)."""

    name: str
    lines: list[str]
    op: str
    src: View            # contiguous
    indices: View        # contiguous, integers
    out: Buffer
    P: Any
    I: Any
    Q: Any
    rows: Any
    purpose: str = ""    # what the gather is for (a convolution's im2col), from the node, for the report
    kind: str = "gather"

    def reads(self) -> list:
        return [self.src.buffer, self.indices.buffer]

    def writes(self) -> list:
        return [self.out]

    def swap(self, s: Swap) -> "GatherKernel":
        """This kernel with the buffers `s` maps swapped in."""
        return replace(self, src=s.view(self.src), indices=s.view(self.indices), out=s.buffer(self.out))

    report_kind = "gather"  # what `step.report()` counts it as

    def report_line(self) -> str:
        """What the kernel does, for the report's list of kernels."""
        return f"{self.op} of {self.I} index(es) -> {self.out.name}"

    def flops(self, n) -> int:
        """Arithmetic per call (`n` evaluates a size): none for take (it moves elements), one add
        per element for scatter_add."""
        return n(self.P * self.I * self.Q) if self.op == "scatter_add" else 0

    def purpose_line(self, size) -> str | None:
        """What a composite op asked this gather for (a convolution's im2col) and the bytes it
        stores (`size(view)`: a view's), for the report's gathers by purpose; None without one."""
        stored = buffer_view(self.out, (self.out.numel,))
        return f"{self.purpose} -> {self.out.name}, {size(stored)}" if self.purpose else None


def _borders(node: Value) -> list | None:
    """The (starts, shape) boxes that cover embed's output outside its window of steps 1, disjoint:
    for each axis d, the rows before and after the window along d, inside the window on the axes
    before d and whole on those after. None when a box's size is not a known number."""
    (g,) = node.inputs
    starts, size = node.attrs["starts"], node.shape
    boxes = []
    for d in range(node.ndim):
        stop = S.as_size(starts[d] + g.shape[d])
        for lo, hi in ((0, starts[d]), (stop, size[d])):
            length = S.as_size(hi - lo)
            if not isinstance(length, int):
                return None         # (a window along a Dim axis that does not cover it: zero it all)
            if length == 0:
                continue
            box_starts = tuple(starts[:d]) + (lo,) + (0,) * (node.ndim - d - 1)
            box_shape = tuple(g.shape[:d]) + (length,) + tuple(size[d + 1:])
            boxes.append((box_starts, box_shape))
    return boxes


def contiguous_operand(ctx, node: Value) -> View:
    """The view of `node`'s value, copied into a buffer of its own unless it is already contiguous."""
    view = ctx.views[id(node)]
    if view.kind == "buffer" and is_contiguous(view):
        return view
    buf = ctx.alloc(node)
    ctx.copy(node, broadcast_view(view, node.shape) if view.shape != node.shape else view, buf,
                 f"make {node.op.name}'s operand contiguous")
    return buffer_view(buf, node.shape)


def lower(ctx, node: Value) -> View:
    """The kernels computing a gather-kind node; returns the view of its value."""
    name = node.op.name
    if name == "embed":
        return _embed(ctx, node)
    source, indices = node.inputs
    axis = node.attrs["axis"]
    src, idx = contiguous_operand(ctx, source), contiguous_operand(ctx, indices)
    if id(node) in ctx.decisions.patches:  # no kernel: its matmuls gather the patches themselves
        return patch_view(node, src, idx)
    k = indices.ndim
    if name == "take":
        P, rows, Q = S.numel(source.shape[:axis]), source.shape[axis], S.numel(source.shape[axis + 1:])
    elif name == "scatter_add":
        P, rows, Q = S.numel(source.shape[:axis]), node.shape[axis], S.numel(source.shape[axis + k:])
    else:
        raise LoweringError(f"no lowering for gather op {name!r}")
    out = ctx.alloc(node)
    ctx.emit(GatherKernel(ctx.kernel_name(node), [ctx.line(node)], name, src, idx, out,
                                        P, S.numel(indices.shape), Q, rows, node.attrs.get("purpose", "")))
    return buffer_view(out, node.shape)


def _embed(ctx, node: Value) -> View:
    """Zeros around g's window (or, for a strided window, everywhere), then g stored into its
    window: loop kernels on one buffer."""
    (g,) = node.inputs
    out = ctx.alloc(node)
    borders = _borders(node) if all(step == 1 for step in node.attrs["steps"]) else None
    if borders is None:
        ctx.copy(node, literal_view(0, node.shape, node.dtype), out, "zero the array embed writes into")
    for starts, shape in borders or ():
        # A padded image's border, not the whole array, which the window then overwrites (a
        # convolution's padding: 4 thin slabs of 34 x 34, not 34 x 34 zeros and the image again).
        slab = slice_view(buffer_view(out, node.shape), starts, (1,) * node.ndim, shape)
        ctx.copy(node, literal_view(0, shape, node.dtype), out, "zero embed's border outside its window",
                     out_view=slab)
    window = slice_view(buffer_view(out, node.shape), node.attrs["starts"], node.attrs["steps"], g.shape)
    source = broadcast_view(ctx.views[id(g)], g.shape)
    statement = Statement("r", node, ARGS[0], ["v0"], [g.dtype], g.dtype, out.dtype, ctx.line(node))
    kernel = ctx.loop(ctx.kernel_name(node), [ctx.line(node)], g.shape, out,
                           [Operand("v0", source, ctx.name(g))], [statement], "r", out_view=window)
    ctx.emit(kernel)
    return buffer_view(out, node.shape)


def render(r: Renderer, k: GatherKernel) -> dict:
    """take or scatter_add over (P, I, Q) loops (templates <language>/gather)."""
    params, args = r.params([k.src.buffer, k.indices.buffer], k.out)
    sizes = {name: r.ex.paren(getattr(k, name)) for name in ("P", "I", "Q", "rows")}
    threads = f"{sizes['P']} * {sizes['I']} * {sizes['Q']}" if k.op == "take" else f"{sizes['P']} * {sizes['Q']}"
    return r.kernel(k, "gather", params=params, args=args, op=k.op, ctype=D.C_TYPES[k.out.dtype],
                       itype=D.C_TYPES[k.indices.dtype], src=r.ex.pointer(k.src),
                       idx=r.ex.pointer(k.indices), out=k.out.name, threads=threads,
                       parallel=not small(_numel(k)), **sizes)


def _numel(k: GatherKernel):
    """Elements a gather kernel moves: P * I * Q."""
    return sympy.sympify(k.P) * sympy.sympify(k.I) * sympy.sympify(k.Q)
