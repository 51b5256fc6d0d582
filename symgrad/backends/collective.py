"""Lowering of collectives (kind collective): all_reduce as a copy and one `CollectiveKernel`.

The value of this process is copied into a contiguous buffer of its own; the kernel then hands
that buffer to the caller's hook (sg_context.collective), which sums it over the processes in
place and returns a status, before any later kernel reads it. Without a hook the buffer keeps
this process's value: a program run alone computes what one process would.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..ir import shapes as S
from ..ir.value import Value
from .views import Buffer, View, broadcast_view, buffer_view

#: The dtype codes the hook receives (its `dtype` argument), in this order.
DTYPES = ("float32", "float64")


@dataclass(frozen=True, eq=False)
class CollectiveKernel:
    """all_reduce over `buffer` in place: `numel` elements of this process's value on entry, their
    sum over the processes on return."""

    name: str
    lines: list[str]
    buffer: Buffer
    numel: Any
    kind: str = "collective"

    def reads(self) -> list:
        return [self.buffer]

    def writes(self) -> list:
        return [self.buffer]

    def swap(self, view, new: dict) -> "CollectiveKernel":
        """This kernel with the buffers `new` maps swapped in."""
        return replace(self, buffer=new.get(id(self.buffer), self.buffer))

    report_kind = "collective"  # what `step.report()` counts it as

    def report_line(self) -> str:
        """What the kernel does, for the report's list of kernels."""
        return f"all_reduce of {self.numel} element(s), summed over the processes in place -> {self.buffer.name}"


def lower_collective(lowerer, node: Value) -> View:
    """The copy and the kernel computing an all_reduce node; returns the view of its value."""
    if node.dtype not in DTYPES:
        raise TypeError(f"all_reduce: compiled collectives take {' or '.join(DTYPES)}, got {node.dtype}")
    (operand,) = node.inputs
    out = lowerer.alloc(node)
    view = lowerer.views[id(operand)]
    if view.shape != operand.shape:
        view = broadcast_view(view, operand.shape)
    lowerer.copy(operand, view, out, "this process's value, to be summed over the processes in place")
    lowerer.kernels.append(CollectiveKernel(lowerer.kernel_name(node), [lowerer.line(node)], out, S.numel(node.shape)))
    return buffer_view(out, node.shape)

