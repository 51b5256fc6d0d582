"""Lowering of the ops that read or write at positions of their own (kind gather): take,
scatter_add and embed.

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

from ..ir import shapes as S
from ..ir.elementwise import ARGS
from ..ir.value import Value
from .patches import patch_view
from .plan import LoweringError, Operand, Statement
from .views import Buffer, View, broadcast_view, buffer_view, is_contiguous, literal_view, slice_view


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

    def swap(self, view, new: dict) -> "GatherKernel":
        """This kernel with the buffers `new` maps swapped in (`view` swaps one view)."""
        return replace(self, src=view(self.src), indices=view(self.indices), out=new.get(id(self.out), self.out))


def contiguous_operand(lowerer, node: Value) -> View:
    """The view of `node`'s value, copied into a buffer of its own unless it is already contiguous."""
    view = lowerer.views[id(node)]
    if view.kind == "buffer" and is_contiguous(view):
        return view
    buf = lowerer.alloc(node)
    lowerer.copy(node, broadcast_view(view, node.shape) if view.shape != node.shape else view, buf,
                 f"make {node.op.name}'s operand contiguous")
    return buffer_view(buf, node.shape)


def lower_gather(lowerer, node: Value) -> View:
    """The kernels computing a gather-kind node; returns the view of its value."""
    name = node.op.name
    if name == "embed":
        return _embed(lowerer, node)
    source, indices = node.inputs
    axis = node.attrs["axis"]
    src, idx = contiguous_operand(lowerer, source), contiguous_operand(lowerer, indices)
    if id(node) in lowerer.decisions.patches:  # no kernel: its matmuls gather the patches themselves
        return patch_view(node, src, idx)
    k = indices.ndim
    if name == "take":
        P, rows, Q = S.numel(source.shape[:axis]), source.shape[axis], S.numel(source.shape[axis + 1:])
    elif name == "scatter_add":
        P, rows, Q = S.numel(source.shape[:axis]), node.shape[axis], S.numel(source.shape[axis + k:])
    else:
        raise LoweringError(f"no lowering for gather op {name!r}")
    out = lowerer.alloc(node)
    lowerer.kernels.append(GatherKernel(lowerer.kernel_name(node), [lowerer.line(node)], name, src, idx, out,
                                        P, S.numel(indices.shape), Q, rows, node.attrs.get("purpose", "")))
    return buffer_view(out, node.shape)


def _embed(lowerer, node: Value) -> View:
    """Zeros of the node's shape, then g stored into its window: two loop kernels on one buffer."""
    (g,) = node.inputs
    out = lowerer.alloc(node)
    zero = literal_view(0, node.shape, node.dtype)
    lowerer.copy(node, zero, out, "zero the array embed writes into")
    window = slice_view(buffer_view(out, node.shape), node.attrs["starts"], node.attrs["steps"], g.shape)
    source = broadcast_view(lowerer.views[id(g)], g.shape)
    statement = Statement("r", node, ARGS[0], ["v0"], [g.dtype], g.dtype, out.dtype, lowerer.line(node))
    kernel = lowerer._loop(lowerer.kernel_name(node), [lowerer.line(node)], g.shape, out,
                           [Operand("v0", source, lowerer.name(g))], [statement], "r", out_view=window)
    lowerer.kernels.append(kernel)
    return buffer_view(out, node.shape)
