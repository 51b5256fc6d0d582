"""A graph: the values a compiled function takes, returns and updates.

`Graph` is immutable: passes build new graphs. Its nodes are everything
reachable from its outputs and update values, in a topological order that
is deterministic (inputs before users, first use first).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence

from . import shapes as S
from .order import toposort  # the graph's order (callers import it from here too)
from .value import Value


@dataclass(frozen=True, eq=False)
class Graph:
    """inputs: runtime arguments in call order; outputs: returned values;
    updates: (variable, new value) pairs written after every output is computed.
    """

    inputs: tuple
    outputs: tuple
    updates: tuple = field(default=())

    def __post_init__(self):
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        object.__setattr__(self, "updates", tuple((v, n) for v, n in self.updates))
        position: dict[int, int] = {}
        for k, v in enumerate(self.inputs):
            if v.op.name != "input":
                raise TypeError(f"graph inputs must be sg.input values, got {v!r}")
            if id(v) in position:  # one runtime argument per input: two would leave one unread
                raise ValueError(f"graph inputs: input {v.name!r} {v.type_str} is given twice "
                                 f"(positions {position[id(v)]} and {k}); list each input once")
            position[id(v)] = k
        for target, new in self.updates:
            if target.op.name != "variable":
                raise TypeError(f"only variables can be updated, got {target!r}")
            if target.shape != new.shape or target.dtype != new.dtype:
                raise ValueError(f"update of {target.name!r}: new value is {new.type_str}, "
                                 f"variable is {target.type_str}")

    @cached_property
    def nodes(self) -> list[Value]:
        """Every node, inputs first, in a topological order."""
        return toposort([*self.inputs, *self.outputs, *(n for _, n in self.updates),
                         *(t for t, _ in self.updates)])

    @cached_property
    def variables(self) -> list[Value]:
        """The variable nodes (parameters, optimizer state) the graph reads or writes."""
        return [n for n in self.nodes if n.op.name == "variable"]

    @cached_property
    def users(self) -> dict[int, list[Value]]:
        """id(node) -> the nodes that take it as an input."""
        users: dict[int, list[Value]] = {id(n): [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                users[id(i)].append(n)
        return users

    def use_counts(self) -> dict[int, int]:
        """id(node) -> how many times it is read: by other nodes, as an output, as an update's new value."""
        uses = {id(n): len(self.users[id(n)]) for n in self.nodes}
        for v in [*self.outputs, *(new for _, new in self.updates)]:
            uses[id(v)] += 1
        return uses

    @cached_property
    def dims(self) -> list:
        """The Dim symbols of the graph, bound from the inputs' shapes at call time."""
        return S.dims_of(v.shape for v in self.inputs)

    def __str__(self) -> str:
        from .printing import graph_text
        return graph_text(self)

    __repr__ = __str__

    def to_dot(self) -> str:
        """Graphviz DOT text of the graph."""
        from .printing import graph_dot
        return graph_dot(self)

    def with_(self, inputs: Sequence[Value] | None = None, outputs: Sequence[Value] | None = None,
              updates: Sequence | None = None) -> "Graph":
        """A copy with some parts replaced."""
        return Graph(self.inputs if inputs is None else inputs,
                     self.outputs if outputs is None else outputs,
                     self.updates if updates is None else updates)


def same_named_leaves(graph: "Graph") -> tuple | None:
    """The first two different leaves (inputs, variables) that share a name, or None: names are
    how callers and checkpoints address leaves, so each must be one leaf's."""
    seen: dict[str, Value] = {}
    for leaf in [*graph.inputs, *graph.variables]:
        other = seen.setdefault(leaf.name, leaf)
        if other is not leaf:
            return other, leaf
    return None


def ancestors(roots) -> set:
    """ids of every node the `roots` depend on, the roots included."""
    seen, stack = set(), list(roots)
    while stack:
        n = stack.pop()
        if id(n) not in seen:
            seen.add(id(n))
            stack.extend(n.inputs)
    return seen
