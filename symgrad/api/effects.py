"""Variable updates that ride along with a value: running statistics, random-stream counters.

A BatchNorm layer in training mode updates its running mean and variance
every time it runs; a dropout mask advances its random stream. In a static
graph those are (variable, new value) pairs that belong in the compiled
step's updates exactly when the value that carries them is computed. A
layer attaches the pairs to its output with `attach`, which returns the
output as a new value that carries them (values are immutable: the pairs are
part of the node, not of a table beside it); `train_step` (and the
accumulate and predict programs) gather the pairs of every value they
compute with `collect`.
"""

from __future__ import annotations

from typing import Iterable

from ..ir.graph import toposort
from ..ir.value import Value


def attach(value: Value, updates: Iterable[tuple[Value, Value]]) -> Value:
    """`value`, as a new node that also performs `updates` when computed: use the returned value."""
    pairs = tuple(updates)
    for target, new in pairs:
        if not isinstance(target, Value) or target.op.name != "variable":
            raise TypeError(f"attach: only variables can be updated, got {target!r}")
        if target.shape != new.shape or target.dtype != new.dtype:
            raise ValueError(f"attach: update of {target.name!r} is {new.type_str}, variable is {target.type_str}")
    return Value(value.op, value.inputs, value.attrs, value.shape, value.dtype, value.effects + pairs)


def collect(roots: Iterable[Value]) -> list[tuple[Value, Value]]:
    """Every update pair attached to a value that computing `roots` computes, in graph order.

    The same pair reached twice (a shared random-stream counter) counts once;
    two different new values for one variable (a BatchNorm layer run twice
    in one training step) is an error, since one step writes a variable once.
    """
    pairs: list[tuple[Value, Value]] = []
    for node in toposort(list(roots)):
        pairs.extend(node.effects)
    return merge(pairs)


def merge(*groups: Iterable[tuple[Value, Value]]) -> list[tuple[Value, Value]]:
    """Concatenate update lists, dropping exact repeats; a variable given two new values is an error."""
    out: list[tuple[Value, Value]] = []
    seen: dict[str, tuple[Value, Value]] = {}
    for group in groups:
        for target, new in group:
            previous = seen.get(target.name)
            if previous is None:
                seen[target.name] = (target, new)
                out.append((target, new))
            elif previous[1] is not new:
                raise ValueError(f"variable {target.name!r} would be updated twice in one step (a stateful layer, "
                                 f"such as BatchNorm in training mode, used twice in one graph?)")
    return out
