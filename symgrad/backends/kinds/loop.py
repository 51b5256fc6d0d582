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
    """Elementwise work: for every index of `shape`, run `statements`, store `result` to `out`
    (and each of `also`'s locals to its buffer: the values the loop computes for its own result and
    stores too, fusion.choose_stores_in_reader)."""

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
    also: tuple = ()      # (buffer, view at `shape`, local) per value stored besides `result`

    def reads(self) -> list:
        return [o.view.buffer for o in self.operands if o.view.buffer is not None]

    def writes(self) -> list:
        return [self.out, *(buffer for buffer, _, _ in self.also)]

    def stores(self) -> list:
        """(buffer, view, local) of every value the loop stores: its result first."""
        return [(self.out, self.out_view, self.result), *self.also]

    def swap(self, s: Swap) -> "LoopKernel":
        """This kernel with the buffers `s` maps swapped in."""
        also = tuple((s.buffer(b), s.view(v), local) for b, v, local in self.also)
        unchanged = all(new[0] is old[0] and new[1] is old[1] for new, old in zip(also, self.also))
        return s.rebuilt(self, out=s.buffer(self.out), out_view=s.view(self.out_view), operands=s.each(self.operands),
                         also=self.also if unchanged else also)

    @property
    def report_kind(self) -> str:
        """What `step.report()` counts it as: a copy (the lowering names those `k<n>_copy`) or a loop."""
        return "copy" if self.name.endswith("_copy") else "loop"

    def report_line(self) -> str:
        """What the kernel does, for the report's list of kernels."""
        stored = ", ".join(b.name for b, _, _ in self.stores())
        return f"loop, {len(self.statements)} op(s) fused, {len(self.operands)} operand(s) -> {stored}"

    def flops(self, n) -> int:
        """Arithmetic per call (`n` evaluates a size): one per fused op per element."""
        return n(self.numel) * len(self.statements)


def lower(ctx, root) -> View:
    """The loop kernel of elementwise node `root` and the nodes fused into it; the view of its value.
    The values the decisions have it store besides (`Decisions.stores`) get their buffers here."""
    operands, statements, result = ctx.fused_body(root, root.shape)
    out = ctx.alloc(root)
    also = []
    for value in ctx.decisions.stores.get(id(root), ()):
        buffer = ctx.alloc(value)
        also.append((buffer, buffer_view(buffer, root.shape), ctx.name(value)))
        ctx.views[id(value)] = buffer_view(buffer, value.shape)
    ctx.emit(ctx.loop(ctx.kernel_name(root), [s.line for s in statements], root.shape, out, operands, statements,
                      result, also=also))
    return buffer_view(out, root.shape)


def render(r: Renderer, k: LoopKernel) -> dict:
    """A fused elementwise loop over `k.shape`."""
    loops = r.loops(k.shape, "i", numel=k.numel)
    loop_vars = [l["var"] for l in loops]
    body = r.element(k.operands, k.statements, loop_vars)
    # out_view's offset: 0 but for embed, which stores into a window of its buffer.
    body += [Store(buffer.name, r.ex.index(view.offset, loop_vars, view.strides), local)
             for buffer, view, local in k.stores()]
    params, args = r.params([op.view.buffer for op in k.operands if op.view.buffer is not None],
                            [buffer for buffer, _, _ in k.stores()])
    used = used_axes([op.view for op in k.operands] + [view for _, view, _ in k.stores()], len(k.shape))
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
