"""Sums of embeds into disjoint windows, stored in place: a concatenation's parts in one buffer.

`sg.cat` is a sum of its parts each embedded into zeros at its offset, and so is the gradient of
a split (a transformer's q, k and v sliced from one product: the gradient of that product is
embed(dq) + embed(dk) + embed(dv)). Lowered node by node, each embed is a buffer of its own,
zeroed outside its window, and the sum reads them all back: three full-size buffers, their
borders zeroed, and two adds, for what is one buffer with three windows.

When the embeds' windows do not overlap, the sum's value in each window is that window's part,
and zero outside them all. So each embed stores its part straight into the window of the sum's
buffer (a loop kernel), the uncovered rest is zeroed first (nothing, for a concatenation), and
the sum itself computes nothing:

    t9 = add(add(embed(a, starts=(0, 0)), embed(b, starts=(0, 4))), embed(c, starts=(0, 8)))
      ->  t9[:, 0:4] = a;  t9[:, 4:8] = b;  t9[:, 8:12] = c

`parts_in_place` decides which sums (a pure function of the graph and the fusion decisions);
`store_part` lowers each part; the sum then has its buffer and no kernel.
"""

from __future__ import annotations

import sympy

from ...ir import shapes as S
from ...ir.elementwise import ARGS
from ...ir.registry import ELEMENTWISE
from ...ir.value import Value
from ..plan import Operand, Statement
from ..views import broadcast_view, buffer_view, literal_view, slice_view


def _leaves(root: Value, uses: dict, fused) -> list | None:
    """The embeds `root`'s tree of adds sums, when every add in it below the root is read only by
    the tree (fused into the root's loop) and every leaf is an embed of the root's shape and dtype
    read only by the tree, with windows of step 1; else None."""
    leaves, stack = [], list(root.inputs)
    while stack:
        x = stack.pop()
        if uses[id(x)] != 1 or x.shape != root.shape or x.dtype != root.dtype:
            return None
        if x.op.name == "add":
            if id(x) not in fused:
                return None
            stack.extend(x.inputs)
        elif x.op.name == "embed" and all(step == 1 for step in x.attrs["steps"]):
            leaves.append(x)
        else:
            return None
    return leaves


def _apart(a: Value, b: Value) -> bool:
    """Whether the windows of embeds `a` and `b` provably share no element: along some axis, one
    ends where the other starts or before."""
    for sa, na, sb, nb in zip(a.attrs["starts"], a.inputs[0].shape, b.attrs["starts"], b.inputs[0].shape):
        if sympy.sympify(sa + na - sb) <= 0 or sympy.sympify(sb + nb - sa) <= 0:
            return True
    return False


def covers(root: Value, leaves: list) -> bool:
    """Whether the disjoint windows of `leaves` cover all of `root` (then nothing is zeroed)."""
    volume = sum((sympy.sympify(S.numel(leaf.inputs[0].shape)) for leaf in leaves), sympy.S.Zero)
    return sympy.simplify(volume - S.numel(root.shape)) == 0


def parts_in_place(graph, uses: dict, fused, elsewhere) -> dict:
    """id(embed) -> the sum whose buffer it stores its part into, for every sum of embeds into
    pairwise disjoint windows that gets a loop kernel of its own (an elementwise add, not fused into
    its reader, nor in `elsewhere`: the ids computed by another kernel, an epilogue or a row group)."""
    parts = {}
    for node in graph.nodes:
        if node.op.kind != ELEMENTWISE or node.op.name != "add" or id(node) in fused or id(node) in elsewhere:
            continue
        leaves = _leaves(node, uses, fused)
        if not leaves or len(leaves) < 2:
            continue
        try:
            if not all(_apart(a, b) for k, a in enumerate(leaves) for b in leaves[k + 1:]):
                continue
        except TypeError:  # a comparison of Dims sympy cannot decide
            continue
        parts.update((id(leaf), node) for leaf in leaves)
    return parts


def store_part(ctx, node: Value, root: Value) -> None:
    """Embed `node`'s part stored into its window of `root`'s buffer (the buffer made, and zeroed
    where no window covers it, at the first part)."""
    if id(root) not in ctx.views:
        out = ctx.alloc(root)
        if not covers(root, ctx.decisions.parts_of(root)):
            ctx.copy(root, literal_view(0, root.shape, root.dtype), out,
                         "zero what no part of the sum covers")
        ctx.views[id(root)] = buffer_view(out, root.shape)
    out = ctx.views[id(root)].buffer
    (g,) = node.inputs
    window = slice_view(buffer_view(out, root.shape), node.attrs["starts"], node.attrs["steps"], g.shape)
    statement = Statement("r", node, ARGS[0], ["v0"], [g.dtype], g.dtype, out.dtype,
                          f"{ctx.line(node)}, stored in place into {ctx.name(root)}")
    ctx.emit(ctx.loop(ctx.kernel_name(node), [statement.line], g.shape, out,
                              [Operand("v0", broadcast_view(ctx.views[id(g)], g.shape), ctx.name(g))],
                              [statement], "r", out_view=window))
