"""The kernel plan: what a lowering produces and every backend renders.

Frozen plain data. A `Plan` lists the buffers (inputs, variables, outputs,
one workspace of temporaries, constant arrays) and the kernels in the order
they run; each kernel reads values through `View`s (symgrad.backends.views)
and computes elementwise statements, one per graph node, each carrying the
IR line it computes. Lists inside are never changed once a kernel is built:
a later sweep (symgrad.backends.inplace) makes new kernels with
`dataclasses.replace` instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..ir import dtypes as D
from ..ir.elementwise import compute_dtype as elementwise_compute_dtype
from ..ir.graph import Graph
from ..ir.value import Value
from .views import Buffer, View, is_patches

class LoweringError(NotImplementedError):
    """A node the lowering has no rule for."""


REDUCED = "red"    # the local name of a reduced value inside a fused epilogue
PRODUCT = "prod"   # the local name of a matmul's element inside a fused epilogue


@dataclass(frozen=True, eq=False)
class Operand:
    """One value a loop kernel reads: local `name`, through `view` (at the kernel's loop shape)."""

    name: str
    view: View
    label: str


@dataclass(frozen=True, eq=False)
class Statement:
    """`name = expr(args)` for one node: args cast to `compute_dtype`, the result converted to `dtype`."""

    name: str
    node: Value
    expr: Any            # sympy expression over elementwise ARGS
    args: list[str]      # local names of the operands, in ARGS order
    arg_dtypes: list[str]
    compute_dtype: str
    dtype: str
    line: str            # the IR text line it computes


@dataclass(frozen=True, eq=False)
class LoopKernel:
    """Elementwise work: for every index of `shape`, run `statements`, store `result` to `out`."""

    name: str
    lines: list[str]
    shape: tuple          # the loop nest, after collapsing
    out: Buffer
    out_view: View        # at `shape`
    operands: list[Operand]
    statements: list[Statement]
    result: str
    numel: Any
    kind: str = "loop"

    @property
    def report_kind(self) -> str:
        """What `step.report()` counts it as: a copy (the lowering names those `k<n>_copy`) or a loop."""
        return "copy" if self.name.endswith("_copy") else "loop"

    def report_line(self) -> str:
        """What the kernel does, for the report's list of kernels."""
        return f"loop, {len(self.statements)} op(s) fused, {len(self.operands)} operand(s) -> {self.out.name}"


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

    @property
    def report_kind(self) -> str:
        """What `step.report()` counts it as: a reduction, or one with its prologue fused."""
        return "fused reduce" if self.operands else "reduce"

    def report_line(self) -> str:
        """What the kernel does, for the report's list of kernels."""
        fused = f" with {len(self.statements)} fused op(s)" if self.operands else ""
        return f"{self.op}{fused} -> {self.out.name}"


@dataclass(frozen=True, eq=False)
class MatmulKernel:
    """out[M,N] = a[M,K] @ b[K,N], both read through strides (a transpose costs no copy); with
    `batch`, one such product per index of the leading axes.

    A fused epilogue (`relu(a @ b + bias)`): each element of the product, the local PRODUCT,
    goes through `epilogue_statements` as it is stored; each epilogue operand's view is at
    [M, N] (read at the element's (row, col)), and `out` receives `epilogue_result`.
    """

    name: str
    lines: list[str]
    a: View
    b: View
    out: Buffer
    M: Any
    N: Any
    K: Any
    kind: str = "matmul"
    epilogue: list = field(default_factory=list)             # Operand
    epilogue_statements: list = field(default_factory=list)  # Statement
    epilogue_result: str = ""
    # A batched product: one GEMM per index of the leading axes, (size, a stride, b stride, out
    # stride) each, outer to inner (a stride of 0: that operand is broadcast over the axis).
    batch: tuple = ()

    @property
    def report_kind(self) -> str:
        """What `step.report()` counts it as: a matmul, or one with an epilogue fused."""
        return "fused matmul" if self.epilogue_statements else "matmul"

    def report_line(self) -> str:
        """What the kernel does, for the report's list of kernels."""
        fused = f" + {len(self.epilogue_statements)} fused op(s)" if self.epilogue_statements else ""
        batched = f", batched over {' x '.join(str(size) for size, *_ in self.batch)}" if self.batch else ""
        return f"matmul{fused}{batched} -> {self.out.name}"


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

    def report_line(self) -> str:
        """What the kernel does, for the report's list of kernels."""
        return f"{self.summary()} -> {', '.join(b.name for b in self.outs)}"


@dataclass(frozen=True, eq=False)
class Plan:
    """Everything a backend needs to emit one program."""

    graph: Graph
    dims: list                     # Dim symbols, in the order of the entry point's dims argument
    inputs: list[Buffer]
    variables: list[Buffer]
    outputs: list[Buffer]
    workspace: list[Buffer]
    consts: list[Buffer]
    kernels: list                  # compute kernels, then output copies, then update copies
    header: str                    # the graph's text form
    variable_nodes: list = field(default_factory=list)  # the variable node of each variables[k]
    choices: list = field(default_factory=list)         # save / recompute decisions, for the report
    in_place: list = field(default_factory=list)        # variables whose new value is written in place


def compute_dtype(node: Value) -> str:
    """The dtype a node's arithmetic runs in: its own, or its operands' common one for comparisons
    and for casts (a cast computes in the input's dtype and converts the result)."""
    if node.op.name == "cast":
        return D.compute_type(node.inputs[0].dtype)  # a 16-bit float is a float32 in a kernel
    return elementwise_compute_dtype(node)  # the NumPy reference's rule: torch's result type


# ---- what kernels read and write, and buffers swapped ----------------------------

def kernel_reads(kernel) -> list:
    """The buffers a kernel reads."""
    if hasattr(kernel, "reads"):  # a kernel kind that says it itself (symgrad.backends.gather)
        return kernel.reads()
    if isinstance(kernel, RowKernel):
        operands = [*kernel.operands, *(o for p in kernel.passes for o in p.operands)]
        return [o.view.buffer for o in operands if o.view.buffer is not None]
    if isinstance(kernel, LoopKernel):
        return [o.view.buffer for o in kernel.operands if o.view.buffer is not None]
    if isinstance(kernel, ReduceKernel):
        extra = [o.view.buffer for o in kernel.epilogue if o.view.buffer is not None]
        if kernel.operands:
            return [o.view.buffer for o in kernel.operands if o.view.buffer is not None] + extra
        return ([kernel.input.buffer] if kernel.input.buffer is not None else []) + extra
    patches = [v.literal.indices for v in (kernel.a, kernel.b) if is_patches(v)]  # a patch matrix's index map
    return [kernel.a.buffer, *patches, kernel.b.buffer] + [o.view.buffer for o in kernel.epilogue
                                                          if o.view.buffer is not None]


def kernel_writes(kernel) -> list:
    """The buffers a kernel writes."""
    if hasattr(kernel, "writes"):
        return kernel.writes()
    return kernel.outs if isinstance(kernel, RowKernel) else [kernel.out]


def swap_buffers(kernel, new: dict):
    """`kernel` reading and writing `new[id(b)]` wherever it used a buffer b that `new` maps; parts
    that use no mapped buffer stay the same objects (cheap), and so does a kernel using none."""
    def view(v: View) -> View:
        if is_patches(v) and id(v.literal.indices) in new:  # a patch matrix's index map is read too
            v = replace(v, literal=replace(v.literal, indices=new[id(v.literal.indices)]))
        return replace(v, buffer=new[id(v.buffer)]) if v.buffer is not None and id(v.buffer) in new else v

    def each(items: list) -> list:  # Operand or RowStore: both read through `.view`
        if not any(o.view.buffer is not None and id(o.view.buffer) in new for o in items):
            return items
        return [replace(o, view=view(o.view)) if o.view.buffer is not None and id(o.view.buffer) in new else o
                for o in items]

    def rebuilt(obj, **parts):  # `obj` itself when no part changed
        changed = {k: v for k, v in parts.items() if v is not getattr(obj, k)}
        return replace(obj, **changed) if changed else obj
    if hasattr(kernel, "swap"):  # a kernel kind that swaps its own views (symgrad.backends.gather)
        return kernel.swap(view, new)
    if isinstance(kernel, RowKernel):
        passes = [rebuilt(p, operands=each(p.operands), stores=each(p.stores), row_stores=each(p.row_stores))
                  for p in kernel.passes]
        if all(a is b for a, b in zip(passes, kernel.passes)):
            passes = kernel.passes
        return rebuilt(kernel, operands=each(kernel.operands), passes=passes)
    out = new.get(id(kernel.out), kernel.out)
    if isinstance(kernel, LoopKernel):
        return rebuilt(kernel, out=out, out_view=view(kernel.out_view), operands=each(kernel.operands))
    if isinstance(kernel, ReduceKernel):
        return rebuilt(kernel, out=out, input=view(kernel.input), operands=each(kernel.operands),
                       epilogue=each(kernel.epilogue))
    return rebuilt(kernel, out=out, a=view(kernel.a), b=view(kernel.b), epilogue=each(kernel.epilogue))


def gradients_final_after(plan: Plan) -> dict[int, list[int]]:
    """Kernel position -> the gradient buffers whose last access in the call is that kernel's.

    A gradient buffer is a variable of role "grad" that the program updates (`<param>.grad` of an
    accumulate program). After its last kernel no other kernel of the call reads or writes it, so a
    caller may start sending it to other processes (symgrad.distributed's buckets) while the rest
    of the backward runs. Buffers are given by their variable slot, ascending per kernel."""
    updated = {t.name for t, _ in plan.graph.updates}
    wanted = {slot for slot, v in enumerate(plan.variable_nodes) if v.attrs.get("role") == "grad" and v.name in updated}
    last: dict[int, int] = {}
    for position, kernel in enumerate(plan.kernels):
        for buffer in (*kernel_reads(kernel), *kernel_writes(kernel)):
            if buffer is not None and buffer.storage == "variable" and buffer.index in wanted:
                last[buffer.index] = position
    after: dict[int, list[int]] = {}
    for slot in sorted(last):
        after.setdefault(last[slot], []).append(slot)
    return after
