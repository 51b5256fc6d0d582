"""Lowering: a graph becomes a kernel plan, the same for every compiled backend.

`lower(graph)` takes the decisions of symgrad.backends.decisions (what is
fused, which groups finish a reduction or a matmul in its kernel, the row
groups, the kernel order) and builds the plan's kernels from them, walking
the nodes in that order: a view per value (symgrad.backends.views: movement
ops only change the strides a reader uses), a loop kernel per fused
elementwise group (one statement per node), a reduction kernel (with its
prologue and epilogue), a matmul kernel (with its epilogue), a row kernel
per row group (symgrad.backends.row_kernels). Outputs and updates are copied
into their buffers last, unless the memory sweeps of symgrad.backends.inplace
let the kernels write them directly; symgrad.backends.memory then plans the
workspace arena.

Updates are functional: kernels write new variable values into
temporaries, and copies into the variables run after every other kernel.
The plan types (symgrad.backends.plan) and the view algebra are re-exported
here for the modules that import them from the lowering.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import sympy

from ..ir import dtypes as D
from ..ir.elementwise import ARGS
from ..ir.graph import Graph
from ..ir.printing import node_line
from ..ir.registry import ATTENTION, COLLECTIVE, CUSTOM, ELEMENTWISE, GATHER, MATMUL, MOVEMENT, REDUCE, SOURCE
from ..ir.value import Value
from .concat import store_part
from .decisions import Decisions, decide, graph_namer
from .attention import lower_attention
from .collective import lower_collective
from .gather import lower_gather
from .fusion import DEFAULT_DIM  # noqa: F401 -- re-exported for the backends
from .patches import is_patches, moved
from .inplace import aliases_output, apply_retargets, retarget_views, write_in_place
from .plan import (PRODUCT, REDUCED, LoopKernel, LoweringError, MatmulKernel, Operand,  # noqa: F401
                   Plan, ReduceKernel, RowKernel, RowPass, RowReduction, RowStore, Statement, compute_dtype,
                   kernel_reads, kernel_writes)
from .row_kernels import lower_row_group
from .views import (Buffer, View, broadcast_view, buffer_view, collapse, contiguous_strides,  # noqa: F401
                    is_contiguous, literal_view, merge_loop_axes, merge_strided_axes, reshape_view, slice_view,
                    transpose_view, _numel)

# What other modules have imported from here (the plan types and view algebra live in plan.py and views.py).
_reads, _writes = kernel_reads, kernel_writes


def _c_ident(text: str) -> str:
    """`text` reduced to [A-Za-z0-9_] (op names of user-defined ops may be any identifier)."""
    out = "".join(c if (c.isascii() and (c.isalnum() or c == "_")) else "_" for c in text)
    return out or "_"


class _Lowerer:
    """One lowering of a decided graph: walks the nodes in the decided order, records a view per value
    and appends kernels (this object's state lives for one `build_plan` call)."""

    def __init__(self, decisions: Decisions):
        self.decisions = decisions
        self.graph = graph = decisions.graph
        self.variable_nodes = list(decisions.variables)
        self.name = graph_namer(graph, self.variable_nodes)
        # What the decisions say, read in every kernel's walk.
        self.fused, self.epilogue_of, self.epilogued = decisions.fused, decisions.epilogue_of, decisions.epilogued
        self.row_of = decisions.row_of
        self.order = {id(n): k for k, n in enumerate(decisions.order)}
        self.attention_stats: dict = {}  # id(attention node) -> the softmax statistics its gradient reads
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
        self.rows_done: set[int] = set()       # ids of the row groups whose kernel is emitted
        self.row_partials: dict[int, View] = {}  # id(split full sum) -> its per-row parts

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
        return self.scratch(node, shape, dtype)

    def scratch(self, node: Value, shape, dtype) -> Buffer:
        """A workspace buffer for a kernel computing `node` (never one of the outputs, whatever its
        shape: a kernel's own temporaries, such as fused attention's transposed keys)."""
        buf = Buffer(f"ws{len(self.workspace)}", "workspace", len(self.workspace), dtype, _numel(shape),
                     self.name(node))
        self.workspace.append(buf)
        return buf

    def lower(self) -> Plan:
        """The plan: every decided kernel, then copies into the outputs and the variables."""
        for node in self.decisions.order:
            kind = node.op.kind
            if id(node) in self.row_of:
                self.row_group(self.row_of[id(node)])
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
                elif self.decisions.materializes(node):  # not fused, nor a sum its parts store into
                    self.views[id(node)] = self.elementwise(node)
            elif kind == REDUCE:
                if id(node) not in self.epilogued:  # else emitted with its epilogue
                    self.views[id(node)] = self.reduce(node)
            elif kind == MATMUL:
                if id(node) not in self.epilogued:  # else emitted with its epilogue
                    self.views[id(node)] = self.matmul(node)
            elif id(node) in self.decisions.parts:
                store_part(self, node, self.decisions.parts[id(node)])
            elif kind == GATHER:
                self.views[id(node)] = lower_gather(self, node)
            elif kind == ATTENTION:
                self.views[id(node)] = lower_attention(self, node)
            elif kind == COLLECTIVE:
                self.views[id(node)] = lower_collective(self, node)
            else:
                raise LoweringError(f"no lowering for op {node.op.name!r} of kind {kind!r}")
        return self.outputs_and_updates()

    def outputs_and_updates(self) -> Plan:
        """The plan, once the computing kernels are built: outputs and new variable values are copied
        into their buffers, unless the memory sweeps (symgrad.backends.inplace) let their kernels
        write there directly."""
        # Outputs not written in place by their kernel are copied into their buffers.
        retargets: dict[int, tuple] = {}  # id(temporary) -> (temporary, the output or variable written instead)
        for k, node in enumerate(self.graph.outputs):
            if k in self.out_claimed:
                continue
            view = self.views[id(node)]
            if aliases_output(view, self.outputs[k]):
                retargets[id(view.buffer)] = (view.buffer, self.outputs[k])
                self.views = retarget_views(self.views, view.buffer, self.outputs[k])
                self.out_claimed.add(k)
            else:
                self.copy(node, view, self.outputs[k], f"output {k}")
        # Updates: new values that live in a variable must be saved before any variable is written.
        finals = []
        for target, new in self.graph.updates:
            view = self.views[id(new)]
            if view.kind == "buffer" and view.buffer.storage == "variable":
                buf = self.alloc(new, dtype=new.dtype)
                self.copy(new, view, buf, f"save the new value of variable {target.name}")
                view = buffer_view(buf, new.shape)
            finals.append((target, new, view))
        self.views, in_place, direct = write_in_place(
            self.kernels, self.views, finals, {id(t): self.variables[self.var_pos[id(t)]] for t, _, _ in finals})
        retargets.update(in_place)
        for target, new, view in finals:
            if id(target) in direct:
                continue
            k = self.var_pos[id(target)]
            self.copy(new, view, self.variables[k], f"update {self.name(target)} <- {self.name(new)}")
        self.kernels, self.workspace = apply_retargets(self.kernels, self.workspace, retargets)
        header = str(self.graph)
        return Plan(self.graph, self.dims, self.inputs, self.variables, self.outputs, self.workspace,
                    self.consts, self.kernels, header, self.variable_nodes, list(self.decisions.choices),
                    [self.name(t) for t, _, _ in finals if id(t) in direct])

    def row_group(self, g) -> None:
        """Emit the kernel of row group `g`, once: at its first member in the schedule (the schedule
        makes every member wait for all that the group reads)."""
        if id(g) in self.rows_done:
            return
        self.rows_done.add(id(g))
        done = lower_row_group(g, self.decisions, self.views, self.alloc, self.name, self.order, len(self.kernels))
        self.views.update(done.stored)
        self.row_partials.update(done.partials)
        for a in g.aliases:  # reshapes and expands of stored members read by other kernels
            if id(a.inputs[0]) in self.views:
                self.views[id(a)] = self.movement(a)
        self.kernels.append(done.kernel)

    def cross_row_sum(self, node: Value, epilogue=None) -> View:
        """The sum over rows of a split full sum's per-row parts (stored by its row kernel)."""
        part = self.row_partials[id(node)]
        rows = part.shape
        reduced = merge_strided_axes([(s, st) for s, st in zip(rows, part.strides)])
        return self._emit_reduce(node, [f"{self.line(node)} (the sum of the per-row parts)"], "sum", part, [],
                                 reduced, part.dtype, epilogue)

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
        if is_patches(src):  # a convolution's patch matrix, read by its matmuls in place (patches.py)
            return moved(src, node)
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

    def copy(self, node: Value, view: View, out: Buffer, why: str, out_view: View | None = None) -> None:
        """A loop kernel storing `view` into `out` (converted to out's dtype): the whole buffer, or
        the window `out_view` of it."""
        shape = view.shape
        operand = Operand("v0", view, why)
        stmt = Statement("r", node, ARGS[0], ["v0"], [view.dtype], view.dtype, out.dtype,
                         f"{why}: {self.line(node) if node.inputs else self.name(node)}")
        self.kernels.append(self._loop(f"k{len(self.kernels)}_copy", [stmt.line], shape, out,
                                       [operand], [stmt], "r", out_view=out_view))

    def _loop(self, name, lines, shape, out, operands, statements, result, out_view=None) -> LoopKernel:
        """A loop over `shape` storing `result` into `out` (through `out_view`: by default the whole
        buffer, contiguously; embed passes a window of it)."""
        out_view = buffer_view(out, shape) if out_view is None else out_view
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
                                        compute_dtype(n), n.dtype, self.line(n)))
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
        views = []
        for v in (a, b):
            view = self.views[id(v)]
            if view.kind != "buffer" and not is_patches(view):
                buf = self.alloc(v)
                self.copy(v, view, buf, "materialize a matmul operand")
                view = buffer_view(buf, v.shape)
            views.append(view)
        batch = ()
        if node.ndim > 2:  # torch.matmul's batch axes: each operand's view at the broadcast batch shape
            # (Each image's patch columns, read in place, are not strided: the direct convolution
            # walks their batch itself, so their batch strides are 0 here.)
            lead = node.shape[:-2]
            a_view, b_view = (vw if is_patches(vw) else broadcast_view(vw, lead + v.shape[-2:])
                              for vw, v in zip(views, (a, b)))
            out_strides = contiguous_strides(node.shape)
            batch = tuple(zip(lead, *((vw.strides[:-2] or (0,) * len(lead)) for vw in (a_view, b_view)),
                              out_strides[:-2]))
            views = [vw if is_patches(vw) else replace(vw, shape=v.shape[-2:], strides=vw.strides[-2:])
                     for vw, v in zip((a_view, b_view), (a, b))]
        root = node if epilogue_root is None else epilogue_root
        out = self.alloc(root)
        name, lines, epilogue = self.kernel_name(root), [self.line(node)], {}
        if epilogue_root is not None:
            operands, statements, result = self._fused_body(root, root.shape, {id(node): PRODUCT})
            lines += [st.line for st in statements]
            epilogue = dict(epilogue=operands, epilogue_statements=statements, epilogue_result=result)
        self.kernels.append(MatmulKernel(name, lines, views[0], views[1], out, node.shape[-2], node.shape[-1],
                                         a.shape[-1], batch=batch, **epilogue))
        return buffer_view(out, root.shape)


def build_plan(decisions: Decisions) -> Plan:
    """The kernel plan that `decisions` describe (symgrad.backends.decisions.decide)."""
    return _Lowerer(decisions).lower()


def lower(graph: Graph, variables=None, fuse_reduce: bool = True, recompute: bool = True,
          schedule: bool = True, matmul_epilogues: bool = False, implicit_gemm: bool = False) -> Plan:
    """The kernel plan of `graph`: `build_plan(decide(graph, ...))`.

    variables: the variable nodes to give buffers, in order (default the graph's own); pass
        the unoptimized graph's list so every variable keeps its slot after passes.
    fuse_reduce: compute elementwise prologues inside row-wise reductions.
    recompute: recompute cheap elementwise values in each reader instead of storing them.
    schedule: order the kernels to keep few bytes live (else the graph's own order, each row group
        waiting for all it reads).
    matmul_epilogues: compute an elementwise chain that reads a matmul's product (bias add,
        activation, relu's backward mask) inside the matmul kernel, as each element is stored; only
        for backends whose matmul renders MatmulKernel.epilogue (C; not CUDA yet).
    implicit_gemm: a convolution's matmuls gather its patches as they pack them, instead of a
        take storing them (symgrad.backends.patches); only for the runtime's GEMM (C).
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
    # The variable buffers: the caller's list (those of the unoptimized graph, so that no
    # variable disappears from the program's arguments when passes drop its last use).
    variables = list(graph.variables if variables is None else variables)
    missing = [v.name for v in graph.variables if all(v is not w for w in variables)]
    if missing:
        raise ValueError(f"lower: the graph reads variables {missing} that are not in `variables`")
    return build_plan(decide(graph, variables, fuse_reduce=fuse_reduce, recompute=recompute, schedule=schedule,
                             matmul_epilogues=matmul_epilogues, implicit_gemm=implicit_gemm))
