"""Build symgrad graph code from an exported forward: one pass over its FX nodes through the table.

`build(exported, leaf, inputs)` gives every placeholder its value (a module leaf by torch name, a
constant, or the caller's input), calls the table's entry for each ATen node, and returns the
user outputs with the buffer updates attached (symgrad/api/effects.py), so a train step built from
any of them updates the running statistics inside the step. An entry that refuses its
arguments is reported with the node's ATen op, torch module and source line.
"""

from __future__ import annotations

from ...api import effects
from ...api import functional as F
from ...ir.value import Value
from .aten_table import TABLE
from .exporting import Exported, UnsupportedTorchOp, display_name, location, op_name, python_operators


def _mapped(arg, env: dict):
    """An FX argument with its nodes replaced by their values (lists and tuples element-wise);
    anything else (numbers, torch dtypes, which the table reads with dtype_name) as it is."""
    if hasattr(arg, "op") and hasattr(arg, "name") and hasattr(arg, "meta"):  # an fx.Node
        return env[arg.name]
    if isinstance(arg, (list, tuple)):
        return type(arg)(_mapped(a, env) for a in arg)
    return arg


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
            fn = operators.get(node.target) or TABLE.get(op_name(node.target))
            if fn is None:
                raise UnsupportedTorchOp(f"sg.from_torch: {display_name(node.target)} in {location(node)} has no "
                                         f"symgrad counterpart")
            try:
                env[node.name] = fn(*args, **kwargs)
            except (TypeError, ValueError, NotImplementedError, KeyError, IndexError) as error:
                raise UnsupportedTorchOp(f"sg.from_torch: {display_name(node.target)} in {location(node)}: "
                                         f"{error}") from error
        elif node.op == "output":
            results = list(_mapped(node.args[0], env))
        else:
            raise UnsupportedTorchOp(f"sg.from_torch: an FX {node.op} node ({node.name}) in the exported graph")
    updates = []
    for position, name in exported.mutations:
        target, new = leaf(name), results[position]
        if isinstance(new, Value) and new.dtype != target.dtype:
            new = F.cast(new, target.dtype)
        updates.append((target, new))
    outputs = [results[p] for p in exported.user_outputs]
    if updates:
        outputs = [effects.attach(v, updates) if isinstance(v, Value) else v for v in outputs]
    return outputs


__all__ = ["build"]
