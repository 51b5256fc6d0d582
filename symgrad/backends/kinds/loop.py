"""The loop kind: `LoopKernel`, a fused elementwise group (or a copy) over one loop nest.

Its lowering (`lower`: an elementwise node and every node fused into it, one statement per node)
and its render (`render`: templates <language>/loop) are here; copies are loop kernels too, built by
the lowering context's `copy`, and so are embed's stores (symgrad.backends.kinds.gather).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..plan import Swap
from ..render.expressions import calls_math
from ..render.renderer import Renderer, Store, used_axes
from ..views import Buffer, View, buffer_view

WORDS = (("loop", "loops"), ("copy", "copies"))  # what the report's count line calls them


@dataclass(frozen=True, eq=False)
class LoopKernel:
    """Elementwise work: for every index of `shape`, run `statements`, store `result` to `out`."""

    name: str
    lines: list[str]
    shape: tuple          # the loop nest, after collapsing
    out: Buffer
    out_view: View        # at `shape`
    operands: list        # Operand
    statements: list      # Statement
    result: str
    numel: Any
    kind: str = "loop"

    def reads(self) -> list:
        return [o.view.buffer for o in self.operands if o.view.buffer is not None]

    def writes(self) -> list:
        return [self.out]

    def swap(self, s: Swap) -> "LoopKernel":
        """This kernel with the buffers `s` maps swapped in."""
        return s.rebuilt(self, out=s.buffer(self.out), out_view=s.view(self.out_view), operands=s.each(self.operands))

    @property
    def report_kind(self) -> str:
        """What `step.report()` counts it as: a copy (the lowering names those `k<n>_copy`) or a loop."""
        return "copy" if self.name.endswith("_copy") else "loop"

    def report_line(self) -> str:
        """What the kernel does, for the report's list of kernels."""
        return f"loop, {len(self.statements)} op(s) fused, {len(self.operands)} operand(s) -> {self.out.name}"

    def flops(self, n) -> int:
        """Arithmetic per call (`n` evaluates a size): one per fused op per element."""
        return n(self.numel) * len(self.statements)


def lower(ctx, root) -> View:
    """The loop kernel of elementwise node `root` and the nodes fused into it; the view of its value."""
    operands, statements, result = ctx.fused_body(root, root.shape)
    out = ctx.alloc(root)
    ctx.emit(ctx.loop(ctx.kernel_name(root), [s.line for s in statements], root.shape, out, operands, statements,
                      result))
    return buffer_view(out, root.shape)


def render(r: Renderer, k: LoopKernel) -> dict:
    """A fused elementwise loop over `k.shape`."""
    loops = r.loops(k.shape, "i", numel=k.numel)
    loop_vars = [l["var"] for l in loops]
    body = r.element(k.operands, k.statements, loop_vars)
    # out_view's offset: 0 but for embed, which stores into a window of its buffer.
    body.append(Store(k.out.name, r.ex.index(k.out_view.offset, loop_vars, k.out_view.strides), k.result))
    params, args = r.params([op.view.buffer for op in k.operands if op.view.buffer is not None], k.out)
    used = used_axes([op.view for op in k.operands] + [k.out_view], len(k.shape))
    # Calls of the program's exp, tanh, erf or erfc (templates/program/expf.h.j2): arithmetic-bound,
    # in the widest vectors that run at full rate (SG_MATH_LOOP).
    math = any(calls_math(line.value) for line in body)
    return r.kernel(k, "loop", params=params, args=args, loops=loops, body=body, math=math,
                    indent="    " * (len(loops) + 1), numel=r.ex.numel(k.shape),
                    split=r.split(k.shape, "i", used))


# The parameter a one-loop kernel's element count is passed in, where kernels share a function
# over different counts (render/program.py).
COUNT = "n"


def with_count_argument(context: dict) -> dict | None:
    """`context` (render's) with the element count passed by the caller as the last parameter,
    COUNT: a kernel of one loop over a constant count, else None. Kernels differing only in their
    count (every parameter's optimizer update: the same code over each parameter's size) then
    call one function; the program keeps the constant where no other kernel shares the code."""
    loops = context["loops"]
    if len(loops) != 1 or context.get("split") or not str(loops[0]["size"]).isdigit():
        return None
    count = dict(ctype="int64_t", name=COUNT, const=False, pointer=False, restrict=False)
    return dict(context, loops=[dict(loops[0], size=COUNT)], numel=COUNT, params=[*context["params"], count],
                args=[*context["args"], str(loops[0]["size"])], count=COUNT)
