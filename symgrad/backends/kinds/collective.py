"""The collective kind: all_reduce as a copy and one `CollectiveKernel`, its lowering and render
(templates/collective/collective.c.j2).

The value of this process is copied into a contiguous buffer of its own; the kernel then hands
that buffer to the caller's hook (sg_context.collective), which sums it over the processes in
place and returns a status, before any later kernel reads it. Without a hook the buffer keeps
this process's value: a program run alone computes what one process would.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ...ir import shapes as S
from ...ir.value import Value
from ..plan import Swap
from ..render.renderer import Renderer
from ..views import Buffer, View, broadcast_view, buffer_view

WORDS = (("collective", "collectives"),)  # the report's count line

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

    def swap(self, s: Swap) -> "CollectiveKernel":
        """This kernel with the buffers `s` maps swapped in."""
        return replace(self, buffer=s.buffer(self.buffer))

    def flops(self, n) -> int:
        """Arithmetic per call in this process: none (the hook sums)."""
        return 0

    report_kind = "collective"  # what `step.report()` counts it as

    def report_line(self) -> str:
        """What the kernel does, for the report's list of kernels."""
        return f"all_reduce of {self.numel} element(s), summed over the processes in place -> {self.buffer.name}"


def lower(ctx, node: Value) -> View:
    """The copy and the kernel computing an all_reduce node; returns the view of its value."""
    if node.dtype not in DTYPES:  # (all_reduce refuses other dtypes as it is built)
        raise TypeError(f"all_reduce: compiled collectives take {' or '.join(DTYPES)}, got {node.dtype}")
    (operand,) = node.inputs
    out = ctx.alloc(node)
    view = ctx.views[id(operand)]
    if view.shape != operand.shape:
        view = broadcast_view(view, operand.shape)
    ctx.copy(operand, view, out, "this process's value, to be summed over the processes in place")
    ctx.emit(CollectiveKernel(ctx.kernel_name(node), [ctx.line(node)], out, S.numel(node.shape)))
    return buffer_view(out, node.shape)


def refuse(node: Value, language) -> str | None:
    """Why `language` cannot build all_reduce `node`, or None."""
    if not language.collectives:
        return (f"the {language.name} backend has no collectives; sg.distributed runs them on the c and "
                f"numpy backends")
    return None


def render(r: Renderer, k: CollectiveKernel) -> dict:
    """all_reduce: the buffer handed to the caller's hook, which sums it over the processes
    (templates/collective/collective.c.j2); the entry point checks the status the hook returns."""
    params, args = r.params([], k.buffer, context=True)
    ctx = r.kernel(k, "collective", params=params, args=args, buffer=k.buffer.name,
                      numel=r.ex.size(k.numel), dtype=k.buffer.dtype, dtype_code=DTYPES.index(k.buffer.dtype))
    return dict(ctx, status=True)
