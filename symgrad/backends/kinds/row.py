"""The row kind: `RowKernel`, the row reductions and maps of one row group in one kernel
(symgrad.backends.decide.rows decides the groups).

Per row, the group's passes over the row's elements: each loads its operands,
computes its maps (one statement per node), folds its reductions and stores
what other kernels read; after each pass, per-row maps (log(sum)) run on the
finished reductions. Values that are the same all along a row are loaded once
per row. `lower_row_group` builds one group's kernel from the views of what
it reads and hands back the views of what it stores; `lower_group` is the lowering
context's entry, `render` the kernel's template context (templates <language>/row).
"""

from __future__ import annotations

from collections import ChainMap
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ...ir import dtypes as D
from ...ir.printing import node_line
from ...ir.registry import REDUCE
from ...ir.value import Value
from ..render.expressions import comment, convert, lowest
from ..decide.fusion import leaves as leaves_of
from ..plan import LoweringError, Operand, Statement, Swap, compute_dtype
from ..render.renderer import Accumulator, Fold, Let, Renderer, Store, used_axes
from ..views import Buffer, View, _numel, broadcast_view, buffer_view, merge_loop_axes, reshape_view

if TYPE_CHECKING:  # (decide imports the kinds: the lowering hands this module its decisions)
    from ..decide.decisions import Decisions
    from ..decide.rows import RowGroup

WORDS = (("row", "row kernels"),)  # the report's count line


@dataclass(frozen=True, eq=False)
class RowReduction:
    """One accumulator of a row pass: `op` (sum, max) of the element local `value` into `acc`
    (of `acc_dtype`), finished per row as the local `name` of `dtype`."""

    name: str
    acc: str
    op: str
    value: str
    acc_dtype: str
    dtype: str
    line: str


@dataclass(frozen=True, eq=False)
class RowStore:
    """`view`'s buffer receives the local `value` at the view's index (at the kernel's loop shape)."""

    value: str
    view: View
    label: str


@dataclass(frozen=True, eq=False)
class RowPass:
    """One loop over a row's elements, then what follows it once per row.

    Per element: load `operands`, run `statements`, fold each of `reductions`,
    write `stores`. Then per row: finish the reductions into their locals, run
    `after` (per-row maps, such as log(sum)), write `row_stores`.
    """

    operands: list
    statements: list
    reductions: list
    stores: list
    after: list
    row_stores: list


@dataclass(frozen=True, eq=False)
class RowKernel:
    """Row reductions and maps over the same rows in one kernel: for every row (the `rows` loop
    axes, outer to inner), `operands` are loaded once, then `passes` run in order over the row's
    `size` elements, each reading the per-row values of the passes before it (softmax: max, then
    sum(exp(z - m)), then the outputs). Every view is at the loop shape [*rows, size]."""

    name: str
    lines: list[str]
    rows: list            # loop sizes of the row axes (merged where every view allows)
    size: Any             # elements per row
    operands: list        # Operand, read once per row (stride 0 along the row)
    passes: list          # RowPass
    numel: Any            # elements per (rows, size) array
    kind: str = "row"

    @property
    def outs(self) -> list:
        """The buffers the kernel writes, each once."""
        seen: dict[int, Buffer] = {}
        for p in self.passes:
            for st in [*p.stores, *p.row_stores]:
                seen.setdefault(id(st.view.buffer), st.view.buffer)
        return list(seen.values())

    def summary(self) -> str:
        """What the kernel does in words, for the report: "row kernel: max, sum (3 passes), 2 outputs"."""
        ops = [r.op for p in self.passes for r in p.reductions]
        return f"row kernel: {', '.join(ops)} ({len(self.passes)} passes), {len(self.outs)} outputs"

    report_kind = "row"  # what `step.report()` counts it as

    def reads(self) -> list:
        operands = [*self.operands, *(o for p in self.passes for o in p.operands)]
        return [o.view.buffer for o in operands if o.view.buffer is not None]

    def writes(self) -> list:
        return self.outs

    def swap(self, s: Swap) -> "RowKernel":
        """This kernel with the buffers `s` maps swapped in."""
        passes = [s.rebuilt(p, operands=s.each(p.operands), stores=s.each(p.stores), row_stores=s.each(p.row_stores))
                  for p in self.passes]
        if all(a is b for a, b in zip(passes, self.passes)):
            passes = self.passes
        return s.rebuilt(self, operands=s.each(self.operands), passes=passes)

    def flops(self, n) -> int:
        """Arithmetic per call (`n` evaluates a size): each pass's ops and folds per element, its
        per-row maps per row."""
        rows = int(np.prod([n(size) for size in self.rows], dtype=np.int64))
        return sum((len(p.statements) + len(p.reductions)) * n(self.numel) + len(p.after) * rows for p in self.passes)

    def report_line(self) -> str:
        """What the kernel does, for the report's list of kernels."""
        return f"{self.summary()} -> {', '.join(b.name for b in self.outs)}"


@dataclass(frozen=True, eq=False)
class LoweredRows:
    """A row group lowered: its kernel, the views of the members it stores for other kernels, and
    the per-row parts of its split full sums (id(node) -> view)."""

    kernel: RowKernel
    stored: dict
    partials: dict


def lower_row_group(g: RowGroup, decisions: Decisions, views, alloc, name, order: dict,
                    kernel_index: int) -> LoweredRows:
    """The RowKernel of row group `g`, named as kernel number `kernel_index`.

    views: id(node) -> View of what the group reads (read only); alloc(node, shape=, dtype=): a
    buffer for a value it stores; name: the Namer of the graph; order: id(node) -> position in
    the kernel order."""
    builder = _RowKernelBuilder(g, decisions, views, alloc, name, order, kernel_index)
    kernel = builder.build()
    return LoweredRows(kernel, builder.stored, builder.partials)


def _per_row_only(n: Value, full: tuple) -> bool:
    """Whether `n` holds one value per row (a reduction, or a map of the per-row shape)."""
    return n.op.kind == REDUCE or tuple(n.shape) != full


def _assign_passes(work: list, leaves: dict, members: set, full: tuple) -> tuple[dict, dict]:
    """Which pass computes each full-row map and reduction of `work` (in order), and after which
    pass each per-row value is ready: (pass_of, ready), by id. A reduction runs in the first pass
    after everything it reads is ready and its value is ready after that pass; a full-row map
    runs in the pass that makes its last input ready."""
    pass_of, ready = {}, {}
    for n in work:
        k = max([ready[id(l)] if _per_row_only(l, full) else pass_of[id(l)] for l in leaves[id(n)]
                 if id(l) in members], default=0)
        if n.op.kind == REDUCE:
            pass_of[id(n)] = k
            ready[id(n)] = k + 1
        elif _per_row_only(n, full):
            ready[id(n)] = k
        else:
            pass_of[id(n)] = k
    return pass_of, ready


class _RowContext:
    """Where `_RowKernelBuilder.value` puts what it computes: one pass (element level) or the row level."""

    def __init__(self, local: dict, row_level: bool, compute: set, shape=None):
        self.local = local          # key -> local name (key: id(node), or ("row", id(node)) per row)
        self.row_level = row_level
        self.compute = compute      # ids of non-fused nodes computed here (this pass's maps)
        self.shape = shape          # per row: the shape the leaves broadcast to (the member's)
        self.operands: list = []
        self.statements: list = []

    def key(self, node: Value):
        return ("row", id(node)) if self.row_level else id(node)


class _RowKernelBuilder:
    """Builds the RowKernel of one row group; what it stores and its split sums' parts are views it
    hands back. Reads the lowering's views of what the group reads; allocates through `alloc`."""

    def __init__(self, g: RowGroup, decisions: Decisions, views, alloc, name, order: dict, kernel_index: int):
        self.g, self.graph, self.fused = g, decisions.graph, decisions.fused
        self.row_partial = decisions.row_partial
        self.stored: dict[int, View] = {}                   # id(member) -> its buffer, for other kernels
        self.views = ChainMap(self.stored, views)           # what a member reads: earlier passes' stores too
        self.partials: dict[int, View] = {}                 # id(split full sum) -> its per-row parts
        self.alloc, self.name, self.order, self.kernel_index = alloc, name, order, kernel_index
        self.rows, self.full = tuple(g.rows), (*g.rows, g.size)
        self.alias: dict[int, Value] = {}  # id(alias) -> the member it views
        self.row_local: dict = {}          # key -> local name, per row (see _RowContext)
        self.row_ops: list[Operand] = []   # operands loaded once per row
        self.inside = {id(n) for n in [*g.members, *g.partials]}
        self.outside = {id(v) for v in self.graph.outputs} | {id(new) for _, new in self.graph.updates}
        self.escaping: dict[int, bool] = {}  # id(node) -> whether another kernel reads it (see _escapes)

    def line(self, node: Value) -> str:
        return node_line(node, self.name)

    def build(self) -> RowKernel:
        """The group's kernel (its stores and parts are in `stored` and `partials` once it is built)."""
        g = self.g
        rows, full, alias = self.rows, self.full, self.alias
        members = {id(n) for n in g.members}
        for a in g.aliases:
            alias[id(a)] = alias.get(id(a.inputs[0]), a.inputs[0])
        leaves = {id(n): [alias.get(id(l), l) for l in leaves_of(n, self.fused)] for n in [*g.members, *g.partials]}
        work = sorted([*g.members, *g.partials], key=lambda n: self.order[id(n)])
        pass_of, ready = _assign_passes(work, leaves, members, full)
        escapes = self._escapes
        # Full-row maps read by a later pass: stored by their pass, read back by the later one.
        later = {id(l) for n in work for l in leaves[id(n)] if id(l) in members and not _per_row_only(l, full)
                 and pass_of[id(l)] < pass_of[id(n)]}
        row_local = self.row_local
        passes, lines = [], []
        npasses = max(pass_of.values()) + 1
        computed_in = [[] for _ in range(npasses)]  # per pass: its maps and reductions, in work order
        ready_after = [[] for _ in range(npasses)]  # per pass: the per-row maps ready once it is done
        for n in work:
            if id(n) in pass_of:
                computed_in[pass_of[id(n)]].append(n)
            elif n.op.kind != REDUCE and 1 <= ready[id(n)] <= npasses:
                ready_after[ready[id(n)] - 1].append(n)
        nreductions = 0  # over the passes so far: the number of the next accumulator's name
        for k in range(npasses):
            here = computed_in[k]
            ctx = _RowContext(dict(row_local), False, {id(n) for n in here if n.op.kind != REDUCE})
            reductions, stores, row_stores = [], [], []
            for n in here:
                if n.op.kind == REDUCE:
                    value = self.value(n.inputs[0], ctx)
                    split = id(n) in self.row_partial
                    acc = "float64" if n.op.name == "sum" and n.dtype == "float32" else n.dtype
                    index = nreductions + len(reductions)
                    name = f"p{index}"
                    reductions.append(RowReduction(name, f"a{index}", n.op.name, value, acc,
                                                   acc if split else n.dtype,
                                                   self.line(n) + (" (this row's part)" if split else "")))
                    if split:  # a full sum: this row's part, in the accumulator's precision
                        buf = self.alloc(n, shape=rows, dtype=acc)
                        self.partials[id(n)] = buffer_view(buf, rows)
                        row_stores.append(RowStore(name, self._per_row_view(buffer_view(buf, rows)),
                                                   f"{self.name(n)}, per row"))
                    else:
                        self._row_define(n, name)
                        if escapes(n):
                            row_stores.append(self._row_store(n, name))
                else:
                    value = self.value(n, ctx)
                    if escapes(n) or id(n) in later:
                        buf = self.alloc(n)
                        self.stored[id(n)] = buffer_view(buf, n.shape)
                        stores.append(RowStore(value, broadcast_view(self.stored[id(n)], full), self.name(n)))
            after = []
            for n in ready_after[k]:
                rctx = _RowContext(row_local, True, {id(n)}, tuple(n.shape))
                value = self.value(n, rctx)
                after.extend(rctx.statements)
                self._row_define(n, value)
                if escapes(n):
                    row_stores.append(self._row_store(n, value))
            passes.append(RowPass(ctx.operands, ctx.statements, reductions, stores, after, row_stores))
            nreductions += len(reductions)
            lines += [st.line for st in ctx.statements] + [r.line for r in reductions] + [st.line for st in after]
        return self._row_kernel(list(dict.fromkeys(lines)), passes)

    def _escapes(self, n: Value) -> bool:
        """Whether a kernel other than this one reads member n (so it is stored): a graph end, or a
        reader outside the group, directly or through fused nodes and aliases (which other kernels
        compute or view themselves). A post-order walk on an explicit stack, each node's answer
        kept: members share long fused chains."""
        escaping, users, fused, alias = self.escaping, self.graph.users, self.fused, self.alias
        inside = self.inside
        stack = [(n, False)]
        while stack:
            v, readers_done = stack.pop()
            if id(v) in escaping:
                continue
            through = [u for u in users[id(v)] if id(u) not in inside and (id(u) in fused or id(u) in alias)]
            if readers_done:
                escaping[id(v)] = any(escaping[id(u)] for u in through)
            elif id(v) in self.outside or any(id(u) not in inside and id(u) not in fused and id(u) not in alias
                                              for u in users[id(v)]):
                escaping[id(v)] = True
            else:
                stack.append((v, True))
                stack.extend((u, False) for u in through)
        return escaping[id(n)]

    def _row_define(self, n: Value, name: str) -> None:
        """Record the per-row local of member `n`: read per row always, and by full-row maps when
        broadcasting it along the row is NumPy's reading (its shape ends in 1, or there are no row axes)."""
        self.row_local[("row", id(n))] = name
        if tuple(n.shape) != self.rows or not self.rows:
            self.row_local[id(n)] = name

    def _per_row_view(self, view: View) -> View:
        """A per-row view (shape rows or rows + (1,)) read at the full shape: stride 0 along the row."""
        rows, full = self.rows, self.full
        if tuple(view.shape) != (*rows, 1):
            view = reshape_view(view, (*rows, 1))
            if view is None:
                raise LoweringError("a per-row value that cannot be viewed with a trailing axis")
        return broadcast_view(replace(view, strides=view.strides[:-1] + (0,)), full)

    def _row_store(self, n: Value, name: str) -> RowStore:
        """A per-row member stored for other kernels (its own buffer, laid out as its shape)."""
        buf = self.alloc(n)
        self.stored[id(n)] = buffer_view(buf, n.shape)
        return RowStore(name, self._per_row_view(self.stored[id(n)]), self.name(n))

    def value(self, n: Value, ctx: _RowContext) -> str:
        """The local holding `n` where `ctx` runs: computed there (fused nodes and the maps of this
        pass, one statement per node), taken from an earlier pass, or loaded.

        A post-order walk on an explicit stack (a fused chain may be thousands of nodes long),
        inputs left to right: statements and operands are numbered in the order they are first
        needed."""
        full, alias, row_local, row_ops = self.full, self.alias, self.row_local, self.row_ops
        stack = [(n, False)]
        while stack:
            v, inputs_done = stack.pop()
            key = ctx.key(v)
            if key in ctx.local:
                continue
            if id(v) in alias:  # a reshape or expand of a member: its per-row value
                name = ctx.local[("row", id(alias[id(v)]))]
            elif id(v) in self.fused or id(v) in ctx.compute:
                if not inputs_done:
                    stack.append((v, True))
                    stack.extend((i, False) for i in reversed(v.inputs))
                    continue
                args = [ctx.local[ctx.key(i)] for i in v.inputs]
                name = self.name(v)
                ctx.statements.append(Statement(name, v, v.op.expr, args, [i.dtype for i in v.inputs],
                                                compute_dtype(v), v.dtype, self.line(v)))
            else:
                view = self.views[id(v)]
                if ctx.row_level:
                    view = self._per_row_view(broadcast_view(view, ctx.shape))
                else:
                    view = broadcast_view(view, full)
                if ctx.row_level or view.strides[-1] == 0:  # the same all along the row: loaded once per row
                    name = f"u{len(row_ops)}"
                    row_ops.append(Operand(name, view, self.name(v)))
                    row_local[key] = name
                else:
                    name = f"v{len(ctx.operands)}"
                    ctx.operands.append(Operand(name, view, self.name(v)))
            ctx.local[key] = name
        return ctx.local[ctx.key(n)]

    def _row_kernel(self, lines: list, passes: list) -> RowKernel:
        """The RowKernel, its views' row axes merged where every view steps through them as one."""
        g, row_ops = self.g, self.row_ops
        views = [o.view for o in row_ops]
        for p in passes:
            views += [o.view for o in p.operands] + [s.view for s in [*p.stores, *p.row_stores]]
        per_axis = [(size, tuple(v.strides[a] for v in views)) for a, size in enumerate(g.rows)]
        merged = merge_loop_axes(per_axis)
        shape = (*[size for size, _ in merged], g.size)

        def at_loop(view: View, k: int) -> View:
            return replace(view, shape=shape, strides=(*[st[k] for _, st in merged], view.strides[-1]))
        position = iter(range(len(views)))  # the views' order above: each one's column of `merged`

        def each(items: list) -> list:
            return [replace(o, view=at_loop(o.view, next(position))) for o in items]
        row_ops = each(row_ops)
        passes = [replace(p, operands=each(p.operands), stores=each(p.stores), row_stores=each(p.row_stores))
                  for p in passes]
        first = g.members[0]
        label = self.name(first)
        label = label if label.startswith("t") and label[1:].isdigit() else f"n{self.order[id(first)]}"
        return RowKernel(f"k{self.kernel_index}_rows_{label}", lines, [size for size, _ in merged], g.size,
                         row_ops, passes, _numel((*g.rows, g.size)))


def lower_group(ctx, g) -> None:
    """Emit the kernel of row group `g`, once: at its first member in the schedule (the schedule
    makes every member wait for all that the group reads)."""
    if id(g) in ctx.rows_done:
        return
    ctx.rows_done.add(id(g))
    done = lower_row_group(g, ctx.decisions, ctx.views, ctx.alloc, ctx.name, ctx.order, len(ctx.kernels))
    ctx.views.update(done.stored)
    ctx.row_partials.update(done.partials)
    for a in g.aliases:  # reshapes and expands of stored members read by other kernels
        if id(a.inputs[0]) in ctx.views:
            ctx.views[id(a)] = ctx.movement(a)
    ctx.emit(done.kernel)


def render(r: Renderer, k: RowKernel) -> dict:
    """A row kernel: per row, the per-row loads, then each pass's loop over the row's elements
    (its folds and stores) and what follows it (the reduced values, per-row maps and stores)."""
    outer = r.loops(k.rows, "o", numel=k.numel)
    loop_vars = [l["var"] for l in outer] + ["c"]
    passes, shared, views = [], [], [op.view for op in k.operands]
    for n, p in enumerate(k.passes):
        accumulators, finish = [], []
        for red in p.reductions:
            acc_t = D.C_TYPES[red.acc_dtype]
            nan_flag = f"{red.acc}_nan" if red.op == "max" and D.is_float(red.acc_dtype) else ""
            accumulators.append(Accumulator(red.op, red.acc, acc_t, red.value, lowest=lowest(red.acc_dtype),
                                            nan_flag=nan_flag, note=comment(red.line)))
            value = f"({nan_flag} ? NAN : {red.acc})" if nan_flag else red.acc  # this thread's part
            shared += [acc_t] if acc_t not in shared else []  # a block's scratch, by type
            value = r.lang.row_combine.format(op=red.op, ctype=acc_t, value=value)
            finish.append(Let(D.C_TYPES[red.dtype], red.name, convert(value, red.acc_dtype, red.dtype)))
        stores = [_store(r, st, loop_vars) for st in p.stores]
        what = [f"{red.op} {red.name}" for red in p.reductions] + [f"store {st.label}" for st in p.stores]
        passes.append(dict(title=f"pass {n + 1} of {len(k.passes)} over the row: {', '.join(what)}",
                           accumulators=accumulators, simd=r.lang.combine == "simd",
                           body=[*r.element(p.operands, p.statements, loop_vars),
                                 *(Fold(a) for a in accumulators), *stores],
                           finish=finish + r.nodes(p.after),
                           row_stores=[_store(r, st, loop_vars) for st in p.row_stores]))
        views += [op.view for op in p.operands] + [st.view for st in [*p.stores, *p.row_stores]]
    r.features.add("rows")
    reads = [o.view.buffer for o in [*k.operands, *(o for p in k.passes for o in p.operands)]
             if o.view.buffer is not None]
    params, args = r.params(reads, k.outs)
    return dict(r.kernel(k, "row", params=params, args=args, outer=outer, passes=passes, shared=shared,
                            row=r.element(k.operands, [], loop_vars), size=r.ex.size(k.size),
                            indent="    " * (len(outer) + 1), numel=r.ex.paren(k.numel),
                            n_rows=r.ex.numel(k.rows), split=r.split(k.rows, "o", used_axes(views, len(k.rows)))),
                comments=[comment(k.summary())] + [comment(line) for line in k.lines])


def _store(r: Renderer, st, loop_vars: list[str]) -> Store:
    """A row kernel's store (its view is at the kernel's loop shape)."""
    return Store(st.view.buffer.name, r.ex.index(st.view.offset, loop_vars, st.view.strides), st.value,
                 comment(st.label))
