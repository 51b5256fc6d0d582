"""Variable updates that ride along with a value: running statistics, random-stream counters.

A BatchNorm layer in training mode updates its running mean and variance
every time it runs; a dropout mask advances its random stream. In a static
graph those are (variable, new value) pairs that belong in the compiled
step's updates exactly when the value that carries them is computed. A
layer attaches the pairs to its output with `attach`; `train_step` (and the
accumulate and predict programs) gather the pairs of every value they
compute with `collect`. Graph values stay immutable: the pairs live in a
side table keyed by the value's identity and dropped when the value dies.
"""

from __future__ import annotations

import weakref
from typing import Iterable

from .ir.graph import toposort
from .ir.value import Value

# id(value) -> (weak reference to the value, its update pairs). Keyed by id,
# not by the value: Value.__eq__ builds a graph node, so values cannot be
# compared as dictionary keys (a WeakKeyDictionary would call it).
_EFFECTS: dict[int, tuple[weakref.ref, list]] = {}


def attach(value: Value, updates: Iterable[tuple[Value, Value]]) -> Value:
    """Record that computing `value` also performs `updates`; returns `value`."""
    pairs = list(updates)
    for target, new in pairs:
        if not isinstance(target, Value) or target.op.name != "variable":
            raise TypeError(f"attach: only variables can be updated, got {target!r}")
        if target.shape != new.shape or target.dtype != new.dtype:
            raise ValueError(f"attach: update of {target.name!r} is {new.type_str}, variable is {target.type_str}")
    key = id(value)
    entry = _EFFECTS.get(key)
    if entry is not None and entry[0]() is value:
        entry[1].extend(pairs)
    else:
        _EFFECTS[key] = (weakref.ref(value, lambda _ref, key=key: _EFFECTS.pop(key, None)), pairs)
    return value


def attached(value: Value) -> list[tuple[Value, Value]]:
    """The update pairs attached to `value` itself (not to its inputs)."""
    entry = _EFFECTS.get(id(value))
    return list(entry[1]) if entry is not None and entry[0]() is value else []


def collect(roots: Iterable[Value]) -> list[tuple[Value, Value]]:
    """Every update pair attached to a value that computing `roots` computes, in graph order.

    The same pair reached twice (a shared random-stream counter) counts once;
    two different new values for one variable (a BatchNorm layer run twice
    in one training step) is an error, since one step writes a variable once.
    """
    pairs: list[tuple[Value, Value]] = []
    for node in toposort(list(roots)):
        pairs.extend(attached(node))
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
