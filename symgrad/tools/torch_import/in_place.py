"""Whether torch.export's graph can be read as it is exported, and which values its in-place ops write.

torch.export gives torch's training IR: ATen ops at the level the model called them (linear,
layer_norm, scaled_dot_product_attention, batch_norm), with in-place ops left in place (`x += y`
as aten.add_, nn.ReLU(inplace=True) as aten.relu_, BatchNorm's running statistics written by
aten.batch_norm itself). torch's `run_decompositions` functionalises that graph (and decomposes
it to core ATen): a second trace of the whole model, which costs about as much as the export.
When every op of the graph has an entry in the table and every write is one the interpreter
can replay (a buffer or a fresh intermediate value, written by an in-place op whose functional
twin is in the table or by batch_norm's running statistics, and no view of it read across a
write), the importer reads the exported graph directly: values are immutable in symgrad, so a
write is the written value's name bound to the new value from there on, and a written buffer
is an update of the step. Anything else goes through torch's functionalisation, as before.
"""

from __future__ import annotations

import operator

from .aten_table import HIDDEN_WRITES, TABLE, functional


def _schema(node):
    return getattr(node.target, "_schema", None) if node.op == "call_function" else None


def _aliases(node) -> bool:
    """Whether a node's result may share memory with an input (a view, an alias, an in-place
    op's self); a node torch gives no schema for counts as one."""
    schema = _schema(node)
    if schema is None:
        return node.op != "output"
    return any(ret.alias_info is not None for ret in schema.returns)


def _written(node, name: str) -> list | None:
    """The argument nodes `node` writes ([] for a pure op), or None for a node the interpreter
    cannot replay (no table entry, or a write other than an in-place op's self)."""
    schema = _schema(node)
    if name in HIDDEN_WRITES:  # batch_norm's schema does not say it writes the running statistics
        condition, names = HIDDEN_WRITES[name]
        bound = {**{a.name: v for a, v in zip(schema.arguments, node.args)}, **node.kwargs}
        if not bound.get(condition):
            return []
        return [bound[n] for n in names if hasattr(bound.get(n), "op")]
    if name in TABLE:
        return None if schema is not None and schema.is_mutable else []
    if schema is None or not schema.is_mutable or functional(name) not in TABLE:
        return None
    writes = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if writes != [schema.arguments[0].name] or not node.args or not hasattr(node.args[0], "op"):
        return None
    return [node.args[0]]


def _writable(root, buffers: set) -> bool:
    """A value a write may replace: a persistent buffer, or an intermediate value of its own
    memory (not a view of something else, which the write would change too)."""
    if root.op == "placeholder":
        return root.name in buffers
    return root.op == "call_function" and root.target is not operator.getitem and not _aliases(root)


def direct_writes(graph, buffers: set, operators) -> dict | None:
    """For a graph the interpreter can read as exported: node name -> one tuple per value the
    node writes, of the names bound to that value so far (the written value first, then the
    earlier in-place ops on it, then the node itself for an in-place op), which from this node
    on all mean the new value. None when the graph needs torch's functionalisation.
    `buffers`: the placeholder names of persistent buffers; `operators`: size arithmetic."""
    order = {node: k for k, node in enumerate(graph.nodes)}
    root_of, members, writers, last_write, writes = {}, {}, {}, {}, {}
    for node in graph.nodes:
        if node.op != "call_function" or node.target in operators:
            continue
        name = str(node.target)
        written = _written(node, name)
        if written is None:
            return None
        groups = []
        for arg in written:
            root = root_of.get(arg, arg)
            if not _writable(root, buffers):
                return None
            group = members.setdefault(root, [root])
            if name not in HIDDEN_WRITES:  # an in-place op: its result is the written value too
                group.append(node)
                root_of[node] = root
            writers.setdefault(root, set()).add(node)
            last_write[root] = order[node]
            groups.append(tuple(n.name for n in group))
        if groups:
            writes[node.name] = tuple(groups)
    for root, group in members.items():
        for member in group:
            # A view taken before a write would be read as the old value: torch's to handle.
            if any(user not in writers[root] and _aliases(user) and order[user] < last_write[root]
                   for user in member.users):
                return None
    return writes


__all__ = ["direct_writes"]
