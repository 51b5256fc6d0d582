"""The reduce kind: `ReduceKernel`, a sum, max or argmax over some axes, with its fused prologue and
epilogue.

Its lowering (`lower`: a reduction read from a view, computed from its fused elementwise input, or
summing a row kernel's per-row parts; `lower_with_epilogue`: with the elementwise group it
finishes) and its render (templates <language>/reduce, and <language>/reduce_columns for a sum over
leading axes into a contiguous axis) are here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ...ir import dtypes as D
from ...ir.value import Value
from ..render.expressions import comment, contiguous, convert, lowest
from ..render.languages import COLUMN_TILE
from ..plan import REDUCED, Swap
from ..render.renderer import Accumulator, Fold, Let, Renderer, Store, small, used_axes
from ..views import Buffer, View, _numel, buffer_view, is_contiguous, merge_loop_axes, merge_strided_axes
from . import loop

WORDS = (("reduce", "reductions"), ("fused reduce", "fused reductions"))  # the report's count line


@dataclass(frozen=True, eq=False)
class ReduceKernel:
    """`op` (sum, max, argmax) of `input` over `reduced` axes, for every index of `kept` axes.

    A fused reduction (an elementwise prologue such as `exp(x - m)` computed
    inside the reduction loop) has `operands` and `statements`: each operand's
    view is at the loop shape [*kept sizes, *reduced sizes], and the reduced
    element is the local `result`; `input` is then a placeholder of kind
    "fused" (no buffer) and the strides in `kept` / `reduced` are unused.
    """

    name: str
    lines: list[str]
    op: str
    input: View
    kept: list[tuple]     # (size, input stride), outer to inner; the output is contiguous over them
    reduced: list[tuple]  # (size, input stride)
    out: Buffer
    acc_dtype: str
    numel: Any            # elements read
    kind: str = "reduce"
    operands: list = field(default_factory=list)     # Operand, for a fused prologue
    statements: list = field(default_factory=list)   # Statement, for a fused prologue
    result: str = ""
    # A fused epilogue (`log(sum)`, `loss * -1/B`): after the reduction, the reduced value (local
    # REDUCED, of dtype `reduced_dtype`) goes through `epilogue_statements`; each epilogue operand
    # is a literal or a buffer laid out as the output (read at the output's own index); `out`
    # receives `epilogue_result`.
    epilogue: list = field(default_factory=list)
    epilogue_statements: list = field(default_factory=list)
    epilogue_result: str = ""
    reduced_dtype: str = ""

    def reads(self) -> list:
        extra = [o.view.buffer for o in self.epilogue if o.view.buffer is not None]
        if self.operands:
            return [o.view.buffer for o in self.operands if o.view.buffer is not None] + extra
        return ([self.input.buffer] if self.input.buffer is not None else []) + extra

    def writes(self) -> list:
        return [self.out]

    def swap(self, s: Swap) -> "ReduceKernel":
        """This kernel with the buffers `s` maps swapped in."""
        return s.rebuilt(self, out=s.buffer(self.out), input=s.view(self.input), operands=s.each(self.operands),
                         epilogue=s.each(self.epilogue))

    def flops(self, n) -> int:
        """Arithmetic per call (`n` evaluates a size): a fold and the prologue's ops per element read,
        the epilogue's per element stored."""
        kept = int(np.prod([n(size) for size, _ in self.kept], dtype=np.int64))
        return n(self.numel) * (1 + len(self.statements)) + len(self.epilogue_statements) * kept

    @property
    def report_kind(self) -> str:
        """What `step.report()` counts it as: a reduction, or one with its prologue fused."""
        return "fused reduce" if self.operands else "reduce"

    def report_line(self) -> str:
        """What the kernel does, for the report's list of kernels."""
        fused = f" with {len(self.statements)} fused op(s)" if self.operands else ""
        return f"{self.op}{fused} -> {self.out.name}"


def lower_with_epilogue(ctx, root: Value) -> View:
    """The reduction feeding `root`, with `root`'s fused group computed as it stores each value."""
    r = ctx.decisions.epilogue_of[id(root)]
    # The epilogue's locals are named apart from a fused prologue's: where no reduced loop is left
    # (a 0-d input, reduced axes of size 1) both are declared in the same C scope.
    operands, statements, result = ctx.fused_body(root, root.shape, {id(r): REDUCED}, "ev")
    if not all(o.view.kind == "literal" or (o.view.kind == "buffer" and is_contiguous(o.view)
                                             and isinstance(o.view.offset, int) and o.view.offset == 0)
               for o in operands):  # a strided operand: no epilogue after all
        ctx.views[id(r)] = lower(ctx, r)
        return loop.lower(ctx, root)
    return lower(ctx, r, epilogue=(root, operands, statements, result))


def lower(ctx, node: Value, epilogue=None) -> View:
    """The ReduceKernel of reduction `node` (with `epilogue`: (root, operands, statements, result)
    of the group it finishes); the view of what it stores."""
    (x,) = node.inputs
    if id(node) in ctx.row_partials:
        return _cross_row_sum(ctx, node, epilogue)
    if id(x) in ctx.decisions.fused:
        return _fused(ctx, node, epilogue)
    src = ctx.views[id(x)]
    axes = node.attrs["axes"]
    kept = [(s, st) for a, (s, st) in enumerate(zip(src.shape, src.strides)) if a not in axes]
    reduced = [(s, st) for a, (s, st) in enumerate(zip(src.shape, src.strides)) if a in axes]
    kept, reduced = merge_strided_axes(kept), merge_strided_axes(reduced)
    op = node.op.name
    acc = node.dtype
    if op == "sum" and node.dtype == "float32":
        acc = "float64"  # float32 sums accumulate in double: NumPy's pairwise sum is that accurate
    elif op == "argmax":
        acc = x.dtype
    return _emit(ctx, node, [ctx.line(node)], op, src, kept, reduced, acc, epilogue)


def _cross_row_sum(ctx, node: Value, epilogue=None) -> View:
    """The sum over rows of a split full sum's per-row parts (stored by its row kernel)."""
    part = ctx.row_partials[id(node)]
    rows = part.shape
    reduced = merge_strided_axes([(s, st) for s, st in zip(rows, part.strides)])
    return _emit(ctx, node, [f"{ctx.line(node)} (the sum of the per-row parts)"], "sum", part, [],
                             reduced, part.dtype, epilogue)


def _emit(ctx, node, lines, op, src, kept, reduced, acc, epilogue, **prologue) -> View:
    """Append the ReduceKernel of `node` (with its epilogue, if any); the view of what it stores."""
    (x,) = node.inputs
    root = node if epilogue is None else epilogue[0]
    out = ctx.alloc(root)
    if epilogue is not None:
        _, operands, statements, result = epilogue
        lines = lines + [st.line for st in statements]
        prologue.update(epilogue=operands, epilogue_statements=statements, epilogue_result=result,
                        reduced_dtype=node.dtype)
    ctx.emit(ReduceKernel(ctx.kernel_name(root), lines, op, src, kept, reduced, out, acc,
                                     _numel(x.shape), **prologue))
    return buffer_view(out, root.shape)


def _fused(ctx, node: Value, epilogue=None) -> View:
    """A row-wise reduction whose elementwise input is computed inside the reduction loop."""
    (x,) = node.inputs
    axes = node.attrs["axes"]
    operands, statements, result = ctx.fused_body(x, x.shape)
    order = [a for a in range(x.ndim) if a not in axes] + list(axes)
    per_axis = [(x.shape[a], tuple(o.view.strides[a] for o in operands)) for a in order]
    kept = merge_loop_axes(per_axis[:x.ndim - len(axes)])
    reduced = merge_loop_axes(per_axis[x.ndim - len(axes):])
    loop_shape = tuple(s for s, _ in [*kept, *reduced])
    operands = [replace(o, view=replace(o.view, shape=loop_shape,
                                        strides=tuple(st[k] for _, st in [*kept, *reduced])))
                for k, o in enumerate(operands)]
    op = node.op.name
    acc = "float64" if op == "sum" and node.dtype == "float32" else (x.dtype if op == "argmax" else node.dtype)
    placeholder = View("fused", tuple(x.shape), x.dtype, ())
    lines = [st.line for st in statements] + [ctx.line(node)]
    return _emit(ctx, node, lines, op, placeholder, [(s, 0) for s, _ in kept],
                             [(s, 0) for s, _ in reduced], acc, epilogue, operands=operands,
                             statements=statements, result=result)


def render(r: Renderer, k: ReduceKernel) -> dict:
    """A sum, max or argmax over `k.reduced` for each index of `k.kept`, with its fused prologue
    and epilogue: each thread folds into an accumulator, `language.combine` combines them."""
    if r.lang.column_sums and k.op == "sum" and len(k.kept) == 1 and k.kept[0][1] == 1 and k.reduced \
            and k.input.kind == "buffer" and not k.epilogue_statements:
        return _column_sum(r, k)
    kept, reduced = [s for s, _ in k.kept], [s for s, _ in k.reduced]
    outer = r.loops(kept, "o", numel=k.numel)
    inner = r.loops(reduced, "r", depth0=1 + len(outer), parallel=False)
    outer_vars, inner_vars = [l["var"] for l in outer], [l["var"] for l in inner]
    acc_t = D.C_TYPES[k.acc_dtype]
    view = View(k.input.kind, (), k.input.dtype, tuple(st for _, st in [*k.kept, *k.reduced]),
                k.input.offset, k.input.buffer, k.input.literal)
    views = [op.view for op in k.operands] if k.operands else [view]
    if k.operands:  # a fused elementwise prologue: the reduced element is computed in the loop
        body, value = r.element(k.operands, k.statements, outer_vars + inner_vars), k.result
    else:
        body, value = [], r.ex.load(view, outer_vars + inner_vars)
    if k.op != "sum":
        body.append(Let(D.C_TYPES[k.input.dtype], "v", value))
        value = "v"
    nan_flag = "acc_nan" if k.op == "max" and r.lang.max_fold == "flag" and D.is_float(k.acc_dtype) else ""
    # argmax's index: the flat index over the reduced axes (a flat loop strides over it as r)
    index = "r" if r.flat else r.ex.index(0, inner_vars, contiguous(reduced))
    acc = Accumulator(k.op, "acc", acc_t, value, fold=r.lang.max_fold, lowest=lowest(k.acc_dtype),
                      index=index, nan_flag=nan_flag)
    if k.op == "argmax":
        r.features.add("argmax")
    body.append(Fold(acc))
    total, best = r.lang.reduced_at  # the accumulators once the threads' parts are combined
    if nan_flag:
        total = f"({nan_flag} ? NAN : {total})"
    out_index = "o" if r.flat else r.ex.index(0, outer_vars, contiguous(kept))
    if k.op == "argmax":
        result = f"{best} < 0 ? 0 : {best}"
        finish = [Store(k.out.name, out_index, result)]
        result = f"({result})"
    else:
        finish = [Store(k.out.name, out_index, convert(total, k.acc_dtype, k.out.dtype))]
        result = convert(total, k.acc_dtype, k.reduced_dtype or k.acc_dtype)
    if k.epilogue_statements:  # the reduced value goes through the fused epilogue before it is stored
        finish = [Let(D.C_TYPES[k.reduced_dtype], REDUCED, result), *_epilogue(r, k, out_index)]
    for l in inner:
        # lanes combine by OpenMP's simd reduction; argmax's first-maximum search is no OpenMP reduction
        l["simd"] = r.lang.combine == "simd" and l is inner[-1] and k.op != "argmax"
    buffers = [k.input.buffer] if k.input.buffer is not None else []
    buffers += [op.view.buffer for op in [*k.operands, *k.epilogue] if op.view.buffer is not None]
    params, args = r.params(buffers, k.out)
    return r.kernel(k, "reduce", params=params, args=args, op=k.op, acc_t=acc_t, outer=outer, inner=inner,
                       accumulators=[acc], body=body, finish=finish, indent="    " * (len(outer) + 1),
                       inner_indent="    " * (len(outer) + len(inner) + 1), numel=r.ex.paren(k.numel),
                       n_out=r.ex.numel(kept), n_red=r.ex.numel(reduced),
                       split_out=r.split(kept, "o", used_axes(views, len(kept))),
                       split_red=r.split(reduced, "r", used_axes(views, len(reduced), len(kept))))


def _epilogue(r: Renderer, k: ReduceKernel, out_index: str) -> list:
    """A fused epilogue: operands read at the output's index, one local per node, the store."""
    body = [Let(D.C_TYPES[op.view.dtype], op.name,
                r.ex.literal(op.view.literal, op.view.dtype) if op.view.kind == "literal"
                else f"{op.view.buffer.name}[{out_index}]", comment(op.label)) for op in k.epilogue]
    return body + r.nodes(k.epilogue_statements) + [Store(k.out.name, out_index, k.epilogue_result)]


def _column_sum(r: Renderer, k: ReduceKernel) -> dict:
    """A sum over leading axes into a contiguous kept axis: rows added into a tile (bias gradients)."""
    inner = r.loops([s for s, _ in k.reduced], "r", depth0=2, parallel=False)
    row_offset = r.ex.index(k.input.offset, [l["var"] for l in inner], [st for _, st in k.reduced])
    params, args = r.params([k.input.buffer], k.out)
    return r.kernel(k, "reduce_columns", params=params, args=args, inner=inner, size=r.ex.paren(k.kept[0][0]),
                       tile=COLUMN_TILE, acc_t=D.C_TYPES[k.acc_dtype], in_t=D.C_TYPES[k.input.dtype],
                       row=f"{k.input.buffer.name} + {row_offset}" if row_offset != "0" else k.input.buffer.name,
                       out=k.out.name, store=convert("acc[j]", k.acc_dtype, k.out.dtype),
                       inner_indent="    " * (len(inner) + 2), numel=r.ex.paren(k.numel),
                       parallel=not small(k.numel))


def refuse(node: Value, language) -> str | None:
    """Why `language` cannot build the reduction `node`, or None."""
    if node.op.name not in language.reductions:
        return f"no {language.name} lowering for reduction {node.op.name!r}"
    return None
