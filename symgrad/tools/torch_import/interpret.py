"""Build symgrad graph code from an exported forward: one pass over its FX nodes through the table.

`build(exported, leaf, inputs)` gives every placeholder its value (a module leaf by torch name, a
constant, or the caller's input), calls the table's entry for each ATen node, and returns the
user outputs with the buffer updates attached (symgrad/api/effects.py), so a train step built from
any of them updates the running statistics inside the step. The buffer updates are the export's
(a functionalised graph's mutation outputs) or, in a graph read as exported, its in-place writes
(in_place.py): a written value's names are bound to the new value from the writing node on. An
entry that refuses its arguments is reported with the node's ATen op, torch module and source line.
"""

from __future__ import annotations

from ...api import effects
from ...api import functional as F
from ...ir.value import Value
from .aten_table import TABLE, functional
from .exporting import Exported, UnsupportedTorchOp, display_name, location, op_name, python_operators


def _mapped(arg, env: dict):
    """An FX argument with its nodes replaced by their values (lists and tuples element-wise);
    anything else (numbers, torch dtypes, which the table reads with dtype_name) as it is."""
    if hasattr(arg, "op") and hasattr(arg, "name") and hasattr(arg, "meta"):  # an fx.Node
        return env[arg.name]
    if isinstance(arg, (list, tuple)):
        return type(arg)(_mapped(a, env) for a in arg)
    return arg


def _write(env: dict, groups, value) -> None:
    """Bind the names of each value a node wrote to the new value: the one the node's result
    carries for it as an effect (batch_norm's running statistics), else the result itself (an
    in-place op), in the written value's dtype as torch's in-place ops keep it."""
    for names in groups:
        old = env[names[0]]
        new = next((n for target, n in getattr(value, "effects", ()) if target is old), value)
        if isinstance(new, Value) and new.dtype != old.dtype:
            new = F.cast(new, old.dtype)
        for name in names:
            env[name] = new


def _buffer_updates(exported: Exported, leaf, env: dict, results: list) -> list:
    """(buffer, new value) for every buffer the forward writes: a functionalised graph's mutation
    outputs, or the values a graph read as exported left bound to its written buffers."""
    news = [(name, results[position]) for position, name in exported.mutations]
    written = {exported.placeholders[names[0]][1]: env[names[0]] for groups in exported.writes.values()
               for names in groups if exported.placeholders.get(names[0], ("",))[0] == "buffer"}
    updates = []
    for name, new in news + list(written.items()):
        target = leaf(name)
        if isinstance(new, Value) and new.dtype != target.dtype:
            new = F.cast(new, target.dtype)
        updates.append((target, new))
    return updates


def build(exported: Exported, leaf, inputs: list) -> list:
    """The user outputs of `exported` computed from `inputs` (flat, in the export's order), the
    module's parameters and buffers read through `leaf(torch_name)`, with every buffer update
    attached to every output value."""
    operators = python_operators()
    env: dict = {}
    for node in exported.graph.nodes:
        if node.op == "placeholder":
            kind, key = exported.placeholders[node.name]
            if kind == "input":
                env[node.name] = inputs[key]
            elif kind == "constant":
                env[node.name] = F.constant(exported.constants[key], dtype=str(exported.constants[key].dtype))
            else:
                env[node.name] = leaf(key)
        elif node.op == "call_function":
            args, kwargs = _mapped(node.args, env), {k: _mapped(v, env) for k, v in node.kwargs.items()}
            name = op_name(node.target)
            fn = operators.get(node.target) or TABLE.get(functional(name) if node.name in exported.writes else name)
            if fn is None:
                raise UnsupportedTorchOp(f"sg.from_torch: {display_name(node.target)} in {location(node)} has no "
                                         f"symgrad counterpart")
            try:
                env[node.name] = fn(*args, **kwargs)
            except (TypeError, ValueError, NotImplementedError, KeyError, IndexError) as error:
                raise UnsupportedTorchOp(f"sg.from_torch: {display_name(node.target)} in {location(node)}: "
                                         f"{error}") from error
            _write(env, exported.writes.get(node.name, ()), env[node.name])
        elif node.op == "output":
            results = list(_mapped(node.args[0], env))
        else:
            raise UnsupportedTorchOp(f"sg.from_torch: an FX {node.op} node ({node.name}) in the exported graph")
    updates = _buffer_updates(exported, leaf, env, results)
    outputs = [results[p] for p in exported.user_outputs]
    if updates:
        outputs = [effects.attach(v, updates) if isinstance(v, Value) else v for v in outputs]
    return outputs


__all__ = ["build"]
