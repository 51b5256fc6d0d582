"""Lowering: a graph becomes a kernel plan, the same for every compiled backend.

The plan says which buffers exist (inputs, variables, outputs, one workspace
of temporaries, constant arrays), how every value is read (a `View`: a
buffer with per-axis strides, a literal, or an index), and which kernels run
in which order. Movement ops cost nothing: reshape of a contiguous value,
transpose and expand only change the strides a consumer reads through;
matmul reads transposed operands through their strides. Chains of
elementwise nodes whose value has one elementwise user are fused into that
user's loop, one statement per node; an elementwise prologue read by a
row-wise reduction runs inside the reduction's loop, and an elementwise
epilogue of a row-wise reduction runs as each reduced value is stored; with
`matmul_epilogues`, an elementwise chain reading a matmul's product (bias add
and activation, relu's backward mask) runs as the GEMM stores each element; a
cheap elementwise value read by several kernels is recomputed in each. The
kernels run in an order that keeps few bytes live (symgrad.backends.fusion
decides all that; symgrad.backends.memory plans the workspace arena).

Updates are functional: kernels write new variable values into
temporaries, and copies into the variables run after every other kernel.

The C backend renders the plan (symgrad/backends/c.py); a CUDA backend can
render the same plan.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import sympy

from ..ir import dtypes as D
from ..ir import shapes as S
from ..ir.elementwise import ARGS
from ..ir.graph import Graph
from ..ir.printing import Namer, node_line
from ..ir.registry import CUSTOM, ELEMENTWISE, MATMUL, MOVEMENT, REDUCE, SOURCE
from ..ir.value import Value
from .fusion import DEFAULT_DIM, FusionDecisions  # noqa: F401 -- DEFAULT_DIM: re-exported for the backends
from .rows import RowDecisions
from .plan import (PRODUCT, REDUCED, LoopKernel, MatmulKernel, Operand, Plan, ReduceKernel, RowKernel,  # noqa: F401
                   RowPass, RowReduction, RowStore, Statement, kernel_reads, kernel_writes, swap_buffers)
from .views import (Buffer, View, broadcast_view, buffer_view, collapse, contiguous_strides,  # noqa: F401
                    is_contiguous, literal_view, merge_loop_axes, merge_strided_axes, reshape_view, slice_view,
                    transpose_view, _numel, _same)

# What other modules have imported from here (the plan types and view algebra live in plan.py and views.py).
_reads, _writes = kernel_reads, kernel_writes


# ---- the lowering itself ----------------------------------------------------------


class LoweringError(NotImplementedError):
    """A node the lowering has no rule for."""


def _c_ident(text: str) -> str:
    """`text` reduced to [A-Za-z0-9_] (op names of user-defined ops may be any identifier)."""
    out = "".join(c if (c.isascii() and (c.isalnum() or c == "_")) else "_" for c in text)
    return out or "_"


class _RowContext:
    """Where `_RowLowering._row_value` puts what it computes: one pass (element level) or the row level."""

    def __init__(self, local: dict, row_level: bool, compute: set, shape=None):
        self.local = local          # key -> local name (key: id(node), or ("row", id(node)) per row)
        self.row_level = row_level
        self.compute = compute      # ids of non-fused nodes computed here (this pass's maps)
        self.shape = shape          # per row: the shape the leaves broadcast to (the member's)
        self.operands: list = []
        self.statements: list = []

    def key(self, node: Value):
        return ("row", id(node)) if self.row_level else id(node)


class _RowLowering:
    """Carries out RowDecisions (mixed into `_Lowerer`): one RowKernel per row group."""

    def row_group(self, node: Value) -> None:
        """Emit the kernel of `node`'s row group, once: at its first member in the schedule (the
        schedule makes every member wait for all that the group reads)."""
        g = self.row_of[id(node)]
        if id(g) in self.rows_done:
            return
        self.rows_done.add(id(g))
        rows, full = tuple(g.rows), (*g.rows, g.size)
        inside = {id(n) for n in [*g.members, *g.partials]}
        members = {id(n) for n in g.members}
        alias: dict[int, Value] = {}
        for a in g.aliases:
            alias[id(a)] = alias.get(id(a.inputs[0]), a.inputs[0])
        leaves = {id(n): [alias.get(id(l), l) for l in self._leaves(n)] for n in [*g.members, *g.partials]}

        def per_row(n):
            return n.op.kind == REDUCE or tuple(n.shape) != full
        # Which pass computes each map and reduction; after which pass each per-row value is ready.
        pass_of, ready = {}, {}
        work = sorted([*g.members, *g.partials], key=lambda n: self.order[id(n)])
        for n in work:
            k = max([ready[id(l)] if per_row(l) else pass_of[id(l)] for l in leaves[id(n)] if id(l) in members],
                    default=0)
            if n.op.kind == REDUCE:
                pass_of[id(n)] = k
                ready[id(n)] = k + 1
            elif per_row(n):
                ready[id(n)] = k
            else:
                pass_of[id(n)] = k
        outside = {id(v) for v in self.graph.outputs} | {id(new) for _, new in self.graph.updates}

        escaping: dict[int, bool] = {}  # id(node) -> escapes(node), for the members and what they reach

        def escapes(n) -> bool:
            """Whether a kernel other than this one reads n (so it is stored): a graph end, or a
            reader outside the group, directly or through fused nodes and aliases (which other
            kernels compute or view themselves). A post-order walk on an explicit stack, each
            node's answer kept: members share long fused chains."""
            stack = [(n, False)]
            while stack:
                v, readers_done = stack.pop()
                if id(v) in escaping:
                    continue
                through = [u for u in self.graph.users[id(v)] if id(u) not in inside
                           and (id(u) in self.fused or id(u) in alias)]
                if readers_done:
                    escaping[id(v)] = any(escaping[id(u)] for u in through)
                elif id(v) in outside or any(id(u) not in inside and id(u) not in self.fused
                                             and id(u) not in alias for u in self.graph.users[id(v)]):
                    escaping[id(v)] = True
                else:
                    stack.append((v, True))
                    stack.extend((u, False) for u in through)
            return escaping[id(n)]
        later = {id(l) for n in work for l in leaves[id(n)] if id(l) in members and not per_row(l)
                 and pass_of[id(l)] < pass_of[id(n)]}
        row_local: dict = {}
        row_ops: list[Operand] = []
        passes, lines = [], []
        self._row_state = (rows, full, alias, row_local, row_ops)
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
                    value = self._row_value(n.inputs[0], ctx)
                    split = id(n) in self.row_partial
                    acc = "float64" if n.op.name == "sum" and n.dtype == "float32" else n.dtype
                    index = nreductions + len(reductions)
                    name = f"p{index}"
                    reductions.append(RowReduction(name, f"a{index}", n.op.name, value, acc,
                                                   acc if split else n.dtype,
                                                   self.line(n) + (" (this row's part)" if split else "")))
                    if split:  # a full sum: this row's part, in the accumulator's precision
                        buf = self.alloc(n, shape=rows, dtype=acc)
                        self.row_partials[id(n)] = buffer_view(buf, rows)
                        row_stores.append(RowStore(name, self._per_row_view(buffer_view(buf, rows)),
                                                   f"{self.name(n)}, per row"))
                    else:
                        self._row_define(n, name)
                        if escapes(n):
                            row_stores.append(self._row_store(n, name))
                else:
                    value = self._row_value(n, ctx)
                    if escapes(n) or id(n) in later:
                        buf = self.alloc(n)
                        self.views[id(n)] = buffer_view(buf, n.shape)
                        stores.append(RowStore(value, broadcast_view(self.views[id(n)], full), self.name(n)))
            after = []
            for n in ready_after[k]:
                rctx = _RowContext(row_local, True, {id(n)}, tuple(n.shape))
                value = self._row_value(n, rctx)
                after.extend(rctx.statements)
                self._row_define(n, value)
                if escapes(n):
                    row_stores.append(self._row_store(n, value))
            passes.append(RowPass(ctx.operands, ctx.statements, reductions, stores, after, row_stores))
            nreductions += len(reductions)
            lines += [st.line for st in ctx.statements] + [r.line for r in reductions] + [st.line for st in after]
        for a in g.aliases:  # reshapes and expands of stored members read by other kernels
            if id(a.inputs[0]) in self.views:
                self.views[id(a)] = self.movement(a)
        self.kernels.append(self._row_kernel(g, list(dict.fromkeys(lines)), row_ops, passes))

    def _row_define(self, n: Value, name: str) -> None:
        """Record the per-row local of member `n`: read per row always, and by full-row maps when
        broadcasting it along the row is NumPy's reading (its shape ends in 1, or there are no row axes)."""
        rows, full, _, row_local, _ = self._row_state
        row_local[("row", id(n))] = name
        if tuple(n.shape) != rows or not rows:
            row_local[id(n)] = name

    def _per_row_view(self, view: View) -> View:
        """A per-row view (shape rows or rows + (1,)) read at the full shape: stride 0 along the row."""
        rows, full = self._row_state[:2]
        if tuple(view.shape) != (*rows, 1):
            view = reshape_view(view, (*rows, 1))
            if view is None:
                raise LoweringError("a per-row value that cannot be viewed with a trailing axis")
        return broadcast_view(replace(view, strides=view.strides[:-1] + (0,)), full)

    def _row_store(self, n: Value, name: str) -> RowStore:
        """A per-row member stored for other kernels (its own buffer, laid out as its shape)."""
        buf = self.alloc(n)
        self.views[id(n)] = buffer_view(buf, n.shape)
        return RowStore(name, self._per_row_view(self.views[id(n)]), self.name(n))

    def _row_value(self, n: Value, ctx: _RowContext) -> str:
        """The local holding `n` where `ctx` runs: computed there (fused nodes and the maps of this
        pass, one statement per node), taken from an earlier pass, or loaded.

        A post-order walk on an explicit stack (a fused chain may be thousands of nodes long),
        inputs left to right: statements and operands are numbered in the order they are first
        needed."""
        rows, full, alias, row_local, row_ops = self._row_state
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
                                                _compute_dtype(v), v.dtype, self.line(v)))
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

    def _row_kernel(self, g, lines: list, row_ops: list, passes: list) -> "RowKernel":
        """The RowKernel, its views' row axes merged where every view steps through them as one."""
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
        return RowKernel(f"k{len(self.kernels)}_rows_{label}", lines, [size for size, _ in merged], g.size,
                         row_ops, passes, _numel((*g.rows, g.size)))

    def cross_row_sum(self, node: Value, epilogue=None) -> View:
        """The sum over rows of a split full sum's per-row parts (stored by its row kernel)."""
        part = self.row_partials[id(node)]
        rows = part.shape
        return self._emit_reduce(node, [f"{self.line(node)} (the sum of the per-row parts)"], "sum", part, [],
                                 merge_strided_axes([(s, st) for s, st in zip(rows, part.strides)]), part.dtype, epilogue)


class _Lowerer(FusionDecisions, RowDecisions, _RowLowering):
    """One lowering: walks the graph in order, records a view per value and appends kernels."""

    def __init__(self, graph: Graph, variables=None, fuse_reduce: bool = True, recompute: bool = True,
                 schedule: bool = True, matmul_epilogues: bool = False):
        self.graph = graph
        # The variable buffers: the caller's list (those of the unoptimized graph, so that no
        # variable disappears from the program's arguments when passes drop its last use).
        self.variable_nodes = list(graph.variables if variables is None else variables)
        missing = [v.name for v in graph.variables if all(v is not w for w in self.variable_nodes)]
        if missing:
            raise ValueError(f"lower: the graph reads variables {missing} that are not in `variables`")
        self.fuse_reduce = fuse_reduce
        self.name = Namer()
        for v in [*graph.inputs, *self.variable_nodes, *graph.nodes]:
            self.name(v)
        self.order = {id(n): k for k, n in enumerate(graph.nodes)}
        self.uses = {id(n): len(graph.users[id(n)]) for n in graph.nodes}
        for v in graph.outputs:
            self.uses[id(v)] += 1
        for _, new in graph.updates:
            self.uses[id(new)] += 1
        self.dims = list(graph.dims)
        # Positions by identity: Value.__eq__ builds a graph node, so list.index cannot be used.
        self.input_pos = {id(v): k for k, v in enumerate(graph.inputs)}
        self.var_pos = {id(v): k for k, v in enumerate(self.variable_nodes)}
        self.inputs = [Buffer(f"in{k}", "input", k, v.dtype, _numel(v.shape), v.name)
                       for k, v in enumerate(graph.inputs)]
        self.variables = [Buffer(f"var{k}", "variable", k, v.dtype, _numel(v.shape), v.name)
                          for k, v in enumerate(self.variable_nodes)]
        self.outputs = [Buffer(f"out{k}", "output", k, v.dtype, _numel(v.shape), f"output {k}")
                        for k, v in enumerate(graph.outputs)]
        self.workspace: list[Buffer] = []
        self.consts: list[Buffer] = []
        self.kernels: list = []
        self.views: dict[int, View] = {}
        self.out_claimed: set[int] = set()
        self.output_positions: dict[int, list[int]] = {}  # id(node) -> where it is among the outputs
        for k, v in enumerate(graph.outputs):
            self.output_positions.setdefault(id(v), []).append(k)
        self.fused = {id(n) for n in graph.nodes if self._fusable(n)}
        self.choices: list[dict] = []
        if recompute:
            self._choose_recompute()
        self.epilogue_of: dict[int, Value] = {}   # id(elementwise root) -> the reduction or matmul it finishes
        self.epilogued: set[int] = set()          # ids of reductions and matmuls whose kernel its epilogue emits
        if fuse_reduce:
            self._choose_epilogues()
        self._choose_row_groups()
        self.rows_done: set[int] = set()       # ids of the row groups whose kernel is emitted
        self.row_partials: dict[int, View] = {}  # id(split full sum) -> its per-row parts
        if matmul_epilogues:
            self._choose_matmul_epilogues()
        self.schedule = self._schedule() if schedule else self._graph_order()
        self.order = {id(n): k for k, n in enumerate(self.schedule)}

    # ---- decisions ------------------------------------------------------
    def kernel_name(self, node: Value) -> str:
        label = self.name(node)
        label = label if label.startswith("t") and label[1:].isdigit() else f"n{self.order[id(node)]}"
        return f"k{len(self.kernels)}_{_c_ident(node.op.name)}_{label}"

    def line(self, node: Value) -> str:
        return node_line(node, self.name)

    def alloc(self, node: Value, shape=None, dtype=None) -> Buffer:
        """The buffer a kernel computing `node` writes: its output buffer when it is one, else workspace."""
        shape = node.shape if shape is None else shape
        dtype = node.dtype if dtype is None else dtype
        if dtype == node.dtype and shape == node.shape:
            for k in self.output_positions.get(id(node), ()):
                if k not in self.out_claimed:
                    self.out_claimed.add(k)
                    return self.outputs[k]
        buf = Buffer(f"ws{len(self.workspace)}", "workspace", len(self.workspace), dtype, _numel(shape),
                     self.name(node))
        self.workspace.append(buf)
        return buf

    # ---- per kind -------------------------------------------------------
    def lower(self) -> Plan:
        for node in self.schedule:
            kind = node.op.kind
            if id(node) in self.row_of:
                self.row_group(node)
            elif kind == SOURCE:
                self.views[id(node)] = self.source(node)
            elif kind == MOVEMENT:
                self.views[id(node)] = self.movement(node)
            elif kind == CUSTOM:
                self.views[id(node)] = self.views[id(node.inputs[0])]
            elif kind == ELEMENTWISE:
                finished = self.epilogue_of.get(id(node))
                if finished is not None and finished.op.kind == MATMUL:
                    self.views[id(node)] = self.matmul(finished, epilogue_root=node)
                elif finished is not None:
                    self.views[id(node)] = self.reduce_with_epilogue(node)
                elif id(node) not in self.fused:
                    self.views[id(node)] = self.elementwise(node)
            elif kind == REDUCE:
                if id(node) not in self.epilogued:  # else emitted with its epilogue
                    self.views[id(node)] = self.reduce(node)
            elif kind == MATMUL:
                if id(node) not in self.epilogued:  # else emitted with its epilogue
                    self.views[id(node)] = self.matmul(node)
            else:
                raise LoweringError(f"no lowering for op {node.op.name!r} of kind {kind!r}")
        # Outputs not written in place by their kernel are copied into their buffers.
        for k, node in enumerate(self.graph.outputs):
            if k not in self.out_claimed and not self.alias_output(k, node):
                self.copy(node, self.views[id(node)], self.outputs[k], f"output {k}")
        # Updates: new values that live in a variable must be saved before any variable is written.
        finals = []
        for target, new in self.graph.updates:
            view = self.views[id(new)]
            if view.kind == "buffer" and view.buffer.storage == "variable":
                buf = self.alloc(new, dtype=new.dtype)
                self.copy(new, view, buf, f"save the new value of variable {target.name}")
                view = buffer_view(buf, new.shape)
            finals.append((target, new, view))
        direct = self.write_in_place(finals)
        for target, new, view in finals:
            if id(target) in direct:
                continue
            k = self.var_pos[id(target)]
            self.copy(new, view, self.variables[k], f"update {self.name(target)} <- {self.name(new)}")
        renumbered = {id(b): replace(b, index=k, name=f"ws{k}")  # close the gaps left by retargeted temporaries
                      for k, b in enumerate(self.workspace) if b.index != k}
        if renumbered:
            self.kernels = [swap_buffers(k, renumbered) for k in self.kernels]
            self.workspace = [renumbered.get(id(b), b) for b in self.workspace]
        header = str(self.graph)
        return Plan(self.graph, self.dims, self.inputs, self.variables, self.outputs, self.workspace,
                    self.consts, self.kernels, header, self.variable_nodes, self.choices,
                    [self.name(t) for t, _, _ in finals if id(t) in direct])

    def alias_output(self, k: int, node: Value) -> bool:
        """An output that is a reshape of a temporary: the kernel writes the output buffer instead.

        Applies when the output reads the whole temporary contiguously from its start (a
        reshape, an added or removed size-1 axis); transposes and broadcasts still need a copy.
        """
        view = self.views[id(node)]
        out = self.outputs[k]
        if view.kind != "buffer" or view.buffer.storage != "workspace" or view.buffer.dtype != out.dtype \
                or not is_contiguous(view) or not (isinstance(view.offset, int) and view.offset == 0) \
                or not _same(view.buffer.numel, out.numel):
            return False
        self.retarget(view.buffer, out)
        self.out_claimed.add(k)
        return True

    def retarget(self, old: Buffer, new: Buffer) -> None:
        """Every kernel and view that used the temporary `old` uses `new` instead."""
        self.kernels = [swap_buffers(k, {id(old): new})
                        if any(b is old for b in [*kernel_reads(k), *kernel_writes(k)]) else k for k in self.kernels]
        for key, view in self.views.items():
            if view.buffer is old:
                self.views[key] = replace(view, buffer=new)
        self.workspace.remove(old)

    def write_in_place(self, finals: list) -> set:
        """Let the loop computing a variable's new value store it into the variable directly.

        Safe when the loop reads the variable only at the element it writes (same strides), no
        later kernel reads the variable's old value, and the new value is a temporary of its own
        (not an output, not another update's value). Returns the ids of the targets so written.
        """
        counts: dict[int, int] = {}
        for _, new, _ in finals:
            counts[id(new)] = counts.get(id(new), 0) + 1
        direct: set[int] = set()
        for target, new, view in finals:
            var = self.variables[self.var_pos[id(target)]]
            buf = view.buffer
            if view.kind != "buffer" or buf.storage != "workspace" or counts[id(new)] != 1 \
                    or view != self.views.get(id(new)) or not is_contiguous(view) \
                    or not (isinstance(view.offset, int) and view.offset == 0):
                continue
            if any(other is not view and other.buffer is buf for _, _, other in finals):
                continue  # another update reads this temporary too
            producer = next((i for i, k in enumerate(self.kernels) if any(b is buf for b in kernel_writes(k))), None)
            if producer is None or not isinstance(self.kernels[producer], LoopKernel):
                continue
            kernel = self.kernels[producer]
            if any(any(b is var for b in kernel_reads(k)) for k in self.kernels[producer + 1:]):
                continue
            aligned = all(o.view.buffer is not var or (
                all(_same(a, b) for a, b in zip(o.view.strides, kernel.out_view.strides))
                and isinstance(o.view.offset, int) and o.view.offset == 0) for o in kernel.operands)
            if not aligned:
                continue
            self.retarget(buf, var)
            direct.add(id(target))
        return direct

    def source(self, node: Value) -> View:
        name = node.op.name
        if name == "input":
            k = self.input_pos[id(node)]
            return buffer_view(self.inputs[k], node.shape)
        if name == "variable":
            k = self.var_pos[id(node)]
            return buffer_view(self.variables[k], node.shape)
        if name == "const":
            value = node.attrs["value"]
            if isinstance(value, np.ndarray) and value.ndim > 0:
                if value.size == 1 or (value.size and (value == value.flat[0]).all()):
                    return literal_view(value.flat[0].item(), node.shape, node.dtype)
                buf = Buffer(f"c{len(self.consts)}", "const", len(self.consts), node.dtype, value.size,
                             self.name(node), np.ascontiguousarray(value, dtype=D.to_numpy(node.dtype)))
                self.consts.append(buf)
                return buffer_view(buf, node.shape)
            if isinstance(value, np.ndarray):
                value = value.item()
            return literal_view(value, node.shape, node.dtype)
        if name == "iota":
            axis = node.attrs["axis"]
            strides = tuple(1 if a == axis else 0 for a in range(node.ndim))
            return View("index", node.shape, node.dtype, strides)
        raise LoweringError(f"no lowering for source op {name!r}")

    def movement(self, node: Value) -> View:
        src = self.views[id(node.inputs[0])]
        name = node.op.name
        if name == "transpose":
            return transpose_view(src, node.attrs["perm"])
        if name == "expand":
            return broadcast_view(src, node.shape)
        if name == "slice":
            return slice_view(src, node.attrs["starts"], node.attrs["steps"], node.shape)
        if name == "reshape":
            view = reshape_view(src, node.shape)
            if view is None:
                buf = self.alloc(node.inputs[0])
                self.copy(node.inputs[0], src, buf, "make contiguous for a reshape")
                view = reshape_view(buffer_view(buf, node.inputs[0].shape), node.shape)
            return view
        raise LoweringError(f"no lowering for movement op {name!r}")

    def copy(self, node: Value, view: View, out: Buffer, why: str) -> None:
        """A loop kernel storing `view` into `out` (converted to out's dtype)."""
        shape = view.shape
        operand = Operand("v0", view, why)
        stmt = Statement("r", node, ARGS[0], ["v0"], [view.dtype], view.dtype, out.dtype,
                         f"{why}: {self.line(node) if node.inputs else self.name(node)}")
        self.kernels.append(self._loop(f"k{len(self.kernels)}_copy", [stmt.line], shape, out,
                                       [operand], [stmt], "r"))

    def _loop(self, name, lines, shape, out, operands, statements, result) -> LoopKernel:
        out_view = buffer_view(out, shape)
        loop_shape, strides = collapse(shape, [out_view.strides, *(o.view.strides for o in operands)])
        out_view = replace(out_view, shape=loop_shape, strides=strides[0])
        operands = [replace(o, view=replace(o.view, shape=loop_shape, strides=st))
                    for o, st in zip(operands, strides[1:])]
        return LoopKernel(name, lines, loop_shape, out, out_view, operands, statements, result,
                          _numel(shape))

    def elementwise(self, root: Value) -> View:
        # The fused group: root and, recursively, its fused inputs, in graph order.
        operands, statements, result = self._fused_body(root, root.shape)
        out = self.alloc(root)
        kernel = self._loop(self.kernel_name(root), [s.line for s in statements], root.shape, out,
                            operands, statements, result)
        self.kernels.append(kernel)
        return buffer_view(out, root.shape)

    def _fused_body(self, root: Value, shape, preset: dict | None = None,
                    operand_prefix: str = "v") -> tuple[list, list, str]:
        """The operands (read at `shape`) and statements computing `root` with every node fused into it
        (`preset`: id(node) -> a local name the kernel already holds, such as a reduced value;
        `operand_prefix`: of the operands' local names, v0, v1 by default). A statement's local is
        named as its value is in the printed graph and the report (t12), so the C reads as the graph."""
        group, stack, seen = [], [root], set()
        while stack:
            n = stack.pop()
            if id(n) in seen:
                continue
            seen.add(id(n))
            group.append(n)
            stack.extend(i for i in n.inputs if id(i) in self.fused)
        group.sort(key=lambda n: self.order[id(n)])
        local: dict[int, str] = dict(preset or {})
        operands: list[Operand] = []
        statements: list[Statement] = []
        for n in group:
            for i in n.inputs:
                if id(i) not in local:
                    name = f"{operand_prefix}{len(operands)}"
                    local[id(i)] = name
                    operands.append(Operand(name, broadcast_view(self.views[id(i)], shape), self.name(i)))
            name = self.name(n)  # the value's own name, as the graph prints it and the report says
            arg_dtypes = [i.dtype for i in n.inputs]
            statements.append(Statement(name, n, n.op.expr, [local[id(i)] for i in n.inputs], arg_dtypes,
                                        _compute_dtype(n), n.dtype, self.line(n)))
            local[id(n)] = name
        return operands, statements, local[id(root)]

    def reduce_with_epilogue(self, root: Value) -> View:
        """The reduction feeding `root`, with `root`'s fused group computed as it stores each value."""
        r = self.epilogue_of[id(root)]
        # The epilogue's locals are named apart from a fused prologue's: where no reduced loop is left
        # (a 0-d input, reduced axes of size 1) both are declared in the same C scope.
        operands, statements, result = self._fused_body(root, root.shape, {id(r): REDUCED}, "ev")
        if not all(o.view.kind == "literal" or (o.view.kind == "buffer" and is_contiguous(o.view)
                                                 and isinstance(o.view.offset, int) and o.view.offset == 0)
                   for o in operands):  # a strided operand: no epilogue after all
            self.views[id(r)] = self.reduce(r)
            return self.elementwise(root)
        return self.reduce(r, epilogue=(root, operands, statements, result))

    def reduce(self, node: Value, epilogue=None) -> View:
        (x,) = node.inputs
        if id(node) in self.row_partials:
            return self.cross_row_sum(node, epilogue)
        if id(x) in self.fused:
            return self.fused_reduce(node, epilogue)
        src = self.views[id(x)]
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
        return self._emit_reduce(node, [self.line(node)], op, src, kept, reduced, acc, epilogue)

    def _emit_reduce(self, node, lines, op, src, kept, reduced, acc, epilogue, **prologue) -> View:
        """Append the ReduceKernel of `node` (with its epilogue, if any); the view of what it stores."""
        (x,) = node.inputs
        root = node if epilogue is None else epilogue[0]
        out = self.alloc(root)
        if epilogue is not None:
            _, operands, statements, result = epilogue
            lines = lines + [st.line for st in statements]
            prologue.update(epilogue=operands, epilogue_statements=statements, epilogue_result=result,
                            reduced_dtype=node.dtype)
        self.kernels.append(ReduceKernel(self.kernel_name(root), lines, op, src, kept, reduced, out, acc,
                                         _numel(x.shape), **prologue))
        return buffer_view(out, root.shape)

    def fused_reduce(self, node: Value, epilogue=None) -> View:
        """A row-wise reduction whose elementwise input is computed inside the reduction loop."""
        (x,) = node.inputs
        axes = node.attrs["axes"]
        operands, statements, result = self._fused_body(x, x.shape)
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
        lines = [st.line for st in statements] + [self.line(node)]
        return self._emit_reduce(node, lines, op, placeholder, [(s, 0) for s, _ in kept],
                                 [(s, 0) for s, _ in reduced], acc, epilogue, operands=operands,
                                 statements=statements, result=result)

    def matmul(self, node: Value, epilogue_root: Value | None = None) -> View:
        """The MatmulKernel of `node`; with `epilogue_root`, the kernel also computes the elementwise
        chain from the product up to that root as it stores each element, and stores the root."""
        a, b = node.inputs
        if node.ndim != 2:
            raise LoweringError(f"matmul with batch dimensions ({a.type_str} @ {b.type_str}) has no C lowering yet")
        views = []
        for v in (a, b):
            view = self.views[id(v)]
            if view.kind != "buffer":
                buf = self.alloc(v)
                self.copy(v, view, buf, "materialize a matmul operand")
                view = buffer_view(buf, v.shape)
            views.append(view)
        root = node if epilogue_root is None else epilogue_root
        out = self.alloc(root)
        name, lines, epilogue = self.kernel_name(root), [self.line(node)], {}
        if epilogue_root is not None:
            operands, statements, result = self._fused_body(root, root.shape, {id(node): PRODUCT})
            lines += [st.line for st in statements]
            epilogue = dict(epilogue=operands, epilogue_statements=statements, epilogue_result=result)
        self.kernels.append(MatmulKernel(name, lines, views[0], views[1], out, node.shape[0], node.shape[1],
                                         a.shape[1], **epilogue))
        return buffer_view(out, root.shape)


def _compute_dtype(node: Value) -> str:
    """The dtype a node's arithmetic runs in: its own, or its operands' common one for comparisons
    and for casts (a cast computes in the input's dtype and converts the result)."""
    if node.op.name == "cast":
        return node.inputs[0].dtype
    if node.dtype == "bool":
        return D.promote(*(i.dtype for i in node.inputs)) if node.inputs else "bool"
    return node.dtype




def lower(graph: Graph, variables=None, fuse_reduce: bool = True, recompute: bool = True,
          schedule: bool = True, matmul_epilogues: bool = False) -> Plan:
    """The kernel plan of `graph`.

    variables: the variable nodes to give buffers, in order (default the graph's own); pass
        the unoptimized graph's list so every variable keeps its slot after passes.
    fuse_reduce: compute elementwise prologues inside row-wise reductions.
    recompute: recompute cheap elementwise values in each reader instead of storing them.
    schedule: order the kernels to keep few bytes live (else the graph's own order, each row group
        waiting for all it reads).
    matmul_epilogues: compute an elementwise chain that reads a matmul's product (bias add,
        activation, relu's backward mask) inside the matmul kernel, as each element is stored; only
        for backends whose matmul renders MatmulKernel.epilogue (C; not CUDA yet).
    """
    for node in graph.nodes:
        stray = set()
        for size in node.shape:
            if isinstance(size, sympy.Basic):
                stray |= size.free_symbols - set(graph.dims)
        value = node.attrs.get("value") if node.op.name == "const" else None
        if isinstance(value, sympy.Basic):
            stray |= value.free_symbols - set(graph.dims)
        if stray:
            raise ValueError(f"{node.op.name} {node.type_str}: sizes use Dims {sorted(map(str, stray))} "
                             f"that no input's shape determines")
    return _Lowerer(graph, variables, fuse_reduce=fuse_reduce, recompute=recompute,
                    schedule=schedule, matmul_epilogues=matmul_epilogues).lower()

