"""The op registry: one entry per op, holding everything the compiler knows of it.

Each `OpDef` carries the op's shape/dtype rule, its NumPy reference
implementation, its VJP rule and its lowering kind. Passes and backends match
on `kind` (a named group, as in tinygrad's op sets), never on long if-chains
of op names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

# Lowering kinds: the named groups that passes and backends dispatch on.
SOURCE = "source"            # no inputs: input, variable, const, iota
ELEMENTWISE = "elementwise"  # a sympy expression over broadcast inputs
REDUCE = "reduce"            # sum / max / argmax over some axes
MOVEMENT = "movement"        # reshape, transpose, expand: index remapping only
MATMUL = "matmul"            # matrix product, batched over leading axes
GATHER = "gather"            # take, scatter_add, embed: elements at positions of their own
CUSTOM = "custom"            # a user's op with a hand-written backward
ATTENTION = "attention"      # fused attention and its gradient: softmax(q k^T) v without the T x T matrix
COLLECTIVE = "collective"    # all_reduce: a value summed over the processes of a data-parallel step
KINDS = (SOURCE, ELEMENTWISE, REDUCE, MOVEMENT, MATMUL, GATHER, CUSTOM, ATTENTION, COLLECTIVE)


@dataclass(eq=False)
class OpDef:
    """Everything about one op.

    infer(inputs, attrs) -> (shape, dtype): the shape rule; raises ValueError or
        TypeError naming the op and the shapes while the graph is built.
    numpy(args, node, env) -> ndarray: the reference implementation.
    vjp(node, cotangent, wants) -> tuple: one cotangent Value (or None) per
        input, at the shape of the node's output for elementwise inputs (the
        autodiff driver reduces broadcasts); `wants[i]` says whether input i
        needs one at all. None when the op has no derivative, or when it has a
        decomposition to differentiate through instead.
    decompose(node) -> Value: the node's value as graph code of other ops over
        node.inputs; autodiff differentiates through it when there is no VJP
        rule (a fused op's gradient, whose own derivative is rarely asked for:
        computing it pays the composite's cost, not the fused kernel's).
    """

    name: str
    kind: str
    infer: Callable
    numpy: Callable
    vjp: Optional[Callable] = None
    doc: str = ""
    decompose: Optional[Callable] = None
    # Elementwise ops only: the defining sympy expression over x0..x{arity-1}.
    expr: Any = None
    arity: Optional[int] = None
    extra: dict = field(default_factory=dict)
    # One of symgrad's own ops (seal_builtins): its definition is symgrad's code, which every
    # cache key holds, so a graph's fingerprint names it instead of printing its formula.
    builtin: bool = False

    def __repr__(self) -> str:
        return f"<op {self.name} ({self.kind})>"


REGISTRY: dict[str, OpDef] = {}


def register(opdef: OpDef) -> OpDef:
    """Add an op; redefining a name is an error, so two ops never share one."""
    if opdef.kind not in KINDS:
        raise ValueError(f"op {opdef.name!r}: unknown kind {opdef.kind!r}")
    if opdef.name in REGISTRY:
        raise ValueError(f"an op named {opdef.name!r} is already registered")
    REGISTRY[opdef.name] = opdef
    return opdef


def lookup(name: str) -> OpDef:
    """The op named `name`; a KeyError that names it otherwise."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"no op named {name!r} is registered") from None


_SEALED = False


def seal_builtins() -> None:
    """Mark every op registered so far as symgrad's own (`import symgrad` calls this once its
    modules have registered theirs); an op registered later (`sg.elementwise`) is a user's, also
    when symgrad is imported again (importlib.reload): only the first call marks any."""
    global _SEALED
    if _SEALED:
        return
    _SEALED = True
    for op in REGISTRY.values():
        op.builtin = True


def ops_of_kind(kind: str) -> list[OpDef]:
    """All registered ops of one lowering kind."""
    return [op for op in REGISTRY.values() if op.kind == kind]
