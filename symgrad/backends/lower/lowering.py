"""Lowering: a decided graph becomes a kernel plan, through the public `LoweringContext`.

`lower(graph)` takes the decisions of symgrad.backends.decide.decisions (what is
fused, which groups finish a reduction or a matmul in its kernel, the row
groups, the kernel order, each matmul's implementation) and builds the plan's
kernels from them, walking the nodes in that order: a view per value
(symgrad.backends.views: movement ops only change the strides a reader uses),
and for every other node its kernel kind's lowering (symgrad.backends.kinds,
dispatched by op kind): a loop kernel per fused elementwise group, a reduction
or a matmul kernel (with the epilogue decide gave it), a row kernel per row
group, a gather, fused attention, a collective. Outputs and updates are copied
into their buffers last, unless the memory sweeps of symgrad.backends.lower.inplace
let the kernels write them directly; symgrad.backends.lower.memory then plans the
workspace arena.

Updates are functional: kernels write new variable values into
temporaries, and copies into the variables run after every other kernel.
The plan types (symgrad.backends.plan), the kernel types of the kinds and the
view algebra are re-exported here for the modules that import them from the
lowering.
"""

from __future__ import annotations


import numpy as np
import sympy

from ...ir import dtypes as D
from ...ir.elementwise import ARGS
from ...ir.graph import Graph
from ...ir.printing import node_line
from ...ir.registry import CUSTOM, ELEMENTWISE, MATMUL, MOVEMENT, SOURCE
from ...ir.value import Value
from .concat import store_part
from ..decide.decisions import Decisions, decide
from ..decide.fusion import DEFAULT_DIM  # noqa: F401 -- re-exported for the backends
from ..render.languages import C_OPENMP, Language
from .inplace import aliases_output, apply_retargets, retarget_views, write_in_place
from ..kinds import BY_OP, matmul, reduce, row
from ..kinds.attention import AttentionKernel  # noqa: F401 -- the kernel types, re-exported
from ..kinds.collective import CollectiveKernel  # noqa: F401
from ..kinds.gather import GatherKernel  # noqa: F401
from ..kinds.loop import LoopKernel
from ..kinds.matmul import MatmulKernel  # noqa: F401
from ..kinds.reduce import ReduceKernel  # noqa: F401
from ..kinds.row import RowKernel, RowPass, RowReduction, RowStore  # noqa: F401
from ..decide.patches import moved
from ..views import is_patches, replace
from ..plan import (PRODUCT, REDUCED, LoweringError, Operand, Plan, Statement, compute_dtype,  # noqa: F401
                   kernel_reads, kernel_writes)
from ..views import (Buffer, View, broadcast_view, buffer_view, collapse, contiguous_strides, is_contiguous,
                     literal_view, merge_loop_axes, merge_strided_axes, reshape_view, slice_view, transpose_view,
                     _numel)  # noqa: F401

# What other modules have imported from here (the plan types and view algebra live in plan.py and views.py).
_reads, _writes = kernel_reads, kernel_writes


def _c_ident(text: str) -> str:
    """`text` reduced to [A-Za-z0-9_] (op names of user-defined ops may be any identifier)."""
    out = "".join(c if (c.isascii() and (c.isalnum() or c == "_")) else "_" for c in text)
    return out or "_"


class LoweringContext:
    """One lowering of a decided graph: walks the nodes in the decided order, records a view per value
    and appends kernels (this object's state lives for one `build_plan` call).

    The kernel kinds (symgrad.backends.kinds) lower their nodes through its public part: the
    `decisions` (and their `language`), `views` (id(node) -> View of its value), `name` / `line` / `kernel_name`,
    `alloc` / `scratch` (buffers), `copy`, `loop` (a LoopKernel), `fused_body` (a fused group's
    operands and statements), `emit` (append a kernel), `movement`, and `kept` / `row_partials`
    (buffers and views one kernel leaves for a later one, as the decisions pair them)."""

    def __init__(self, decisions: Decisions):
        self.decisions = decisions
        self.language = decisions.language
        self.graph = graph = decisions.graph
        self.variable_nodes = list(decisions.variables)
        self.name = decisions.namer()
        # What the decisions say, read in every kernel's walk.
        self.fused, self.epilogue_of, self.epilogued = decisions.fused, decisions.epilogue_of, decisions.epilogued
        self.row_of = decisions.row_of
        self.order = {id(n): k for k, n in enumerate(decisions.order)}
        self.kept: dict = {}  # (id(node), role) -> a buffer its kernel leaves for a later one (attention's stats)
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
        decisions = self.decisions
        for node in decisions.order:
            kind = node.op.kind
            if id(node) in self.row_of:
                row.lower_group(self, self.row_of[id(node)])
            elif kind == SOURCE:
                self.views[id(node)] = self.source(node)
            elif kind == MOVEMENT:
                self.views[id(node)] = self.movement(node)
            elif kind == CUSTOM:
                self.views[id(node)] = self.views[id(node.inputs[0])]
            elif id(node) in decisions.parts:
                store_part(self, node, decisions.parts[id(node)])
            elif kind == ELEMENTWISE and id(node) in self.epilogue_of:
                finished = self.epilogue_of[id(node)]
                self.views[id(node)] = (matmul.lower(self, finished, epilogue_root=node) if finished.op.kind == MATMUL
                                        else reduce.lower_with_epilogue(self, node))
            elif id(node) in self.epilogued or (kind == ELEMENTWISE and not decisions.materializes(node)):
                continue  # emitted with its epilogue; or fused, or a sum its parts store into
            elif kind in BY_OP:
                self.views[id(node)] = BY_OP[kind].lower(self, node)
            else:
                raise LoweringError(f"no lowering for op {node.op.name!r} of kind {kind!r}")
        return self.outputs_and_updates()

    def outputs_and_updates(self) -> Plan:
        """The plan, once the computing kernels are built: outputs and new variable values are copied
        into their buffers, unless the memory sweeps (symgrad.backends.lower.inplace) let their kernels
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
        return Plan(self.graph, self.dims, self.inputs, self.variables, self.outputs, self.workspace,
                    self.consts, self.kernels, self.variable_nodes, list(self.decisions.choices),
                    [self.name(t) for t, _, _ in finals if id(t) in direct], str(self.decisions))

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
        self.emit(self.loop(f"k{len(self.kernels)}_copy", [stmt.line], shape, out, [operand], [stmt], "r",
                            out_view=out_view))

    def emit(self, kernel) -> None:
        """Append `kernel` to the plan's kernels (they run in the order emitted)."""
        self.kernels.append(kernel)

    def loop(self, name, lines, shape, out, operands, statements, result, out_view=None, also=()) -> LoopKernel:
        """A loop over `shape` storing `result` into `out` (through `out_view`: by default the whole
        buffer, contiguously; embed passes a window of it), and each (buffer, view, local) of `also`."""
        out_view = buffer_view(out, shape) if out_view is None else out_view
        views = [out_view, *(view for _, view, _ in also)]
        loop_shape, strides = collapse(shape, [*(v.strides for v in views), *(o.view.strides for o in operands)])
        out_view, *also_views = [replace(v, shape=loop_shape, strides=st) for v, st in zip(views, strides)]
        operands = [replace(o, view=replace(o.view, shape=loop_shape, strides=st))
                    for o, st in zip(operands, strides[len(views):])]
        also = tuple((buffer, view, local) for (buffer, _, local), view in zip(also, also_views))
        return LoopKernel(name, lines, loop_shape, out, out_view, operands, statements, result,
                          _numel(shape), also=also)

    def fused_body(self, root: Value, shape, preset: dict | None = None,
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


def build_plan(decisions: Decisions) -> Plan:
    """The kernel plan that `decisions` describe (symgrad.backends.decide.decisions.decide)."""
    return LoweringContext(decisions).lower()


def lower(graph: Graph, variables=None, fuse_reduce: bool = True, recompute: bool = True,
          schedule: bool = True, matmul_epilogues: bool = False, implicit_gemm: bool = False,
          language: Language = C_OPENMP) -> Plan:
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
        take storing them (symgrad.backends.decide.patches); only for the runtime's GEMM (C).
    language: the language the plan is for (languages.Language): what it can build decides each
        matmul's implementation, and a node it cannot build is refused before any kernel is made.
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
    given = set(map(id, variables))  # by identity: Value.__eq__ builds a node
    missing = [v.name for v in graph.variables if id(v) not in given]
    if missing:
        raise ValueError(f"lower: the graph reads variables {missing} that are not in `variables`")
    return build_plan(decide(graph, variables, fuse_reduce=fuse_reduce, recompute=recompute, schedule=schedule,
                             matmul_epilogues=matmul_epilogues, implicit_gemm=implicit_gemm, language=language))
