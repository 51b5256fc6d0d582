"""The mixed-precision policy (symgrad.ir.autocast) applied to a graph already built:
`sg.train_step(..., autocast="bfloat16")`. Apart from the policy itself, which nodes are made
under, since a graph rewrite builds nodes (symgrad.ir.value) and the nodes read the policy."""

from __future__ import annotations

from .autocast import check_dtype
from .value import Value, policy_inputs


def autocast_graph(outputs, dtype="bfloat16") -> list:
    """`outputs` (graph values) rebuilt under the policy for `dtype`: every node whose inputs
    the policy casts, or whose inputs changed, is made again over its new inputs (type
    promotion decides the rest). Values built under `sg.autocast` come back unchanged."""
    dtype = check_dtype(dtype)
    mapping: dict[int, Value] = {}
    for node in _with_effects_first(list(outputs)):
        inputs = tuple(mapping[id(i)] for i in node.inputs)
        cast_inputs = policy_inputs(node.op, inputs, dtype)
        # A layer's updates (BatchNorm's running statistics) follow the rebuilt forward too.
        effects = tuple((target, mapping[id(new)]) for target, new in node.effects)
        if all(a is b for a, b in zip(cast_inputs, node.inputs)) and \
                all(a[1] is b[1] for a, b in zip(effects, node.effects)):
            mapping[id(node)] = node
        else:
            shape, d = node.op.infer(cast_inputs, node.attrs)
            mapping[id(node)] = Value(node.op, cast_inputs, node.attrs, shape, d, effects)
    return [mapping[id(v)] for v in outputs]


def _with_effects_first(roots: list) -> list:
    """The nodes `roots` compute, each after its inputs and after the new values of the updates
    attached to it (symgrad.api.effects), which a rebuilt node must carry rebuilt."""
    order, done, stack = [], set(), [(r, False) for r in reversed(roots)]
    while stack:
        node, expanded = stack.pop()
        if id(node) in done:
            continue
        if expanded:
            done.add(id(node))
            order.append(node)
            continue
        stack.append((node, True))
        for dep in (*node.inputs, *(new for _, new in node.effects)):
            if id(dep) not in done:
                stack.append((dep, False))
    return order
