"""The kernel plan: what a lowering produces and every backend renders.

Frozen plain data. A `Plan` lists the buffers (inputs, variables, outputs,
one workspace of temporaries, constant arrays) and the kernels in the order
they run (each of a kind of symgrad.backends.kinds, which say what they read,
write and swap); a kernel reads values through `View`s (symgrad.backends.views)
and computes elementwise statements (`Statement`), one per graph node, each
carrying the IR line it computes. Lists inside are never changed once a kernel is built:
a later sweep (symgrad.backends.lower.inplace) makes new kernels with
`replace` (symgrad.backends.views) instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..ir import dtypes as D
from ..ir.elementwise import compute_dtype as elementwise_compute_dtype
from ..ir.graph import Graph
from ..ir.value import Value
from .views import Buffer, View, replace

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
    variable_nodes: list = field(default_factory=list)  # the variable node of each variables[k]
    choices: list = field(default_factory=list)         # save / recompute decisions, for the report
    in_place: list = field(default_factory=list)        # variables whose new value is written in place
    decisions: str = ""  # what decide chose for this plan, printed (symgrad.backends.decide.decisions.Decisions)


def compute_dtype(node: Value) -> str:
    """The dtype a node's arithmetic runs in: its own, or its operands' common one for comparisons
    and for casts (a cast computes in the input's dtype and converts the result)."""
    if node.op.name == "cast":
        return D.compute_type(node.inputs[0].dtype)  # a 16-bit float is a float32 in a kernel
    return elementwise_compute_dtype(node)  # the NumPy reference's rule: torch's result type


# ---- what kernels read and write, and buffers swapped: each kernel kind says it itself ----
# (the protocol of symgrad.backends.kinds: reads(), writes(), swap(Swap))

def kernel_reads(kernel) -> list:
    """The buffers a kernel reads."""
    return kernel.reads()


def kernel_writes(kernel) -> list:
    """The buffers a kernel writes."""
    return kernel.writes()


class Swap:
    """Buffers swapped in a kernel's parts: `new` maps id(old buffer) -> the buffer used instead.
    Parts that use no mapped buffer stay the same objects (cheap), and so does a kernel using none."""

    def __init__(self, new: dict):
        self.new = new

    def buffer(self, b):
        """`b`, or the buffer swapped in for it."""
        return b if b is None else self.new.get(id(b), b)

    def view(self, v: View) -> View:
        """`v` reading the swapped-in buffer (a patch matrix's index map is read too)."""
        new = self.new
        literal = v.literal
        if getattr(literal, "indices", None) is not None and isinstance(literal.indices, Buffer) \
                and id(literal.indices) in new:
            v = replace(v, literal=replace(literal, indices=new[id(literal.indices)]))
        return replace(v, buffer=new[id(v.buffer)]) if v.buffer is not None and id(v.buffer) in new else v

    def each(self, items: list) -> list:
        """Operands or row stores (both read through `.view`), swapped."""
        new = self.new
        if not any(o.view.buffer is not None and id(o.view.buffer) in new for o in items):
            return items
        return [replace(o, view=self.view(o.view)) if o.view.buffer is not None and id(o.view.buffer) in new else o
                for o in items]

    @staticmethod
    def rebuilt(obj, **parts):
        """`obj` with `parts` replaced; `obj` itself when no part changed."""
        changed = {k: v for k, v in parts.items() if v is not getattr(obj, k)}
        return replace(obj, **changed) if changed else obj


def swap_buffers(kernel, new: dict):
    """`kernel` reading and writing `new[id(b)]` wherever it used a buffer b that `new` maps."""
    return kernel.swap(Swap(new))


def gradients_final_after(plan: Plan) -> dict[int, list[int]]:
    """Kernel position -> the gradient buffers whose last access in the call is that kernel's.

    A gradient buffer is a variable of role "grad" that the program updates (`<param>.grad` of an
    accumulate program). After its last kernel no other kernel of the call reads or writes it, so a
    caller may start sending it to other processes (symgrad.tools.distributed's buckets) while the rest
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
