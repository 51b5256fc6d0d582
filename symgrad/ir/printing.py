"""Ways to look at a graph: let-binding text, the backward chain, and DOT.

The text form reads like a small program (as a jaxpr does): one line per
node, `name: type = op[attrs](operands)`, scalar constants inlined. Names
are given only when printing, from user names where there are some.
"""

from __future__ import annotations

import functools
import re

import numpy as np
import sympy

from .elementwise import ARGS
from .value import Value

# Attributes that are part of the node's type and would only repeat it.
_HIDDEN_ATTRS = {"name", "shape", "dtype", "init", "role", "function", "serial", "cell"}


def _format_attr(v) -> str:
    if isinstance(v, tuple):
        return "(" + ",".join(_format_attr(x) for x in v) + (",)" if len(v) == 1 else ")")
    if isinstance(v, sympy.Basic):
        return str(v).replace(" ", "")
    return repr(v)


def _is_inline(node: Value) -> bool:
    return node.op.name == "const" and node.shape == () and not isinstance(node.attrs["value"], np.ndarray)


class Namer:
    """Short names for nodes: user names for leaves, t0, t1, ... for the rest."""

    def __init__(self):
        self.names: dict[int, str] = {}
        self.taken: set[str] = set()
        self.counter = 0

    def copy(self) -> "Namer":
        """A namer that has named what this one has, and goes on from there on its own."""
        other = Namer()
        other.names, other.taken, other.counter = dict(self.names), set(self.taken), self.counter
        return other

    def __call__(self, node: Value) -> str:
        known = self.names.get(id(node))
        if known is not None:
            return known
        if _is_inline(node):
            value = node.attrs["value"]
            return str(value).replace(" ", "") if isinstance(value, sympy.Basic) else repr(value)
        base = node.name
        # Dotted module paths ("0.weight", from sg.nn) are names too.
        if base is None or not ("v" + base.replace(".", "_")).isidentifier() or base in self.taken:
            base = None
        while base is None or base in self.taken:
            base, self.counter = f"t{self.counter}", self.counter + 1
        self.taken.add(base)
        self.names[id(node)] = base
        return base


def formula(node: Value, name) -> str:
    """A derived op's expression (a derivative, a simplified chain) over its operands' names:
    `t21 - t12*t22/t13`; an operand that prints as a number or an expression is parenthesized."""
    def operand(value: Value) -> str:
        text = name(value)
        return text if text.replace(".", "_").isidentifier() else f"({text})"
    operands = tuple(operand(i) for i in node.inputs)
    distinct = sorted(set(operands))
    template = _formula_template(node.op.expr, tuple(distinct.index(text) for text in operands))
    return _PLACEHOLDER.sub(lambda match: distinct[int(match.group(1))], template)


# A formula's operands while it is printed: names that sort as the operands' own names do.
_PLACEHOLDER = re.compile("\x01([0-9]{4})\x01")


@functools.lru_cache(maxsize=4096)
def _formula_template(expr: sympy.Expr, ranks: tuple) -> str:
    """`expr` printed over placeholder names, operand k's standing for the `ranks[k]`-th of the
    operands' names in sorted order. sympy orders a sum's terms and a product's factors by their
    symbols' names, so placeholders that sort as the names do print the order the names would;
    every layer's same formula, over other names, is then printed once (sympy's printing costs
    about half a millisecond a formula: a 12-layer GPT's kernels' comments, 60 ms)."""
    return str(expr.xreplace({ARGS[k]: sympy.Symbol(f"\x01{rank:04d}\x01") for k, rank in enumerate(ranks)}))


def node_line(node: Value, name) -> str:
    """One let-binding: `t3: f32[B,10] = add(t2, b)`, or `t9: f32[B,10] = t3*(1 - t8)` for an op
    derived by sympy (it has no registered name; its formula is what it computes)."""
    if node.op.extra.get("derived"):
        return f"{name(node)}: {node.type_str} = {formula(node, name)}"
    attrs = ", ".join(f"{k}={_format_attr(v)}" for k, v in node.attrs.items() if k not in _HIDDEN_ATTRS)
    if node.op.name == "const" and isinstance(node.attrs["value"], np.ndarray):
        attrs = "array"
    if node.op.name == "custom":
        attrs = node.attrs["function"].name
    head = node.op.name + (f"[{attrs}]" if attrs else "")
    return f"{name(node)}: {node.type_str} = {head}({', '.join(name(i) for i in node.inputs)})"


HEADER_WIDTH = 100  # a graph's header longer than this wraps, one line per group of declarations


def _header(graph, name) -> list[str]:
    """`graph(x: f32[B,4]) vars(W: f32[4,3], b: f32[3]) {` on one line where it fits in
    HEADER_WIDTH columns; else wrapped, the inputs and then the variables packed into indented
    lines of at most that width (a 2-layer GPT's 70 variables made a 3,942-character line)."""
    ins = [f"{name(v)}: {v.type_str}" for v in graph.inputs]
    variables = [f"{name(v)}: {v.type_str}" for v in graph.variables]
    line = f"graph({', '.join(ins)})" + (f" vars({', '.join(variables)})" if variables else "") + " {"
    if len(line) <= HEADER_WIDTH:
        return [line]

    def packed(opening: str, items: list[str], closing: str) -> list[str]:
        out, current = [], opening
        for k, item in enumerate(items):
            piece = item + (", " if k < len(items) - 1 else "")
            if len(current) + len(piece.rstrip()) > HEADER_WIDTH and current.strip() != opening.strip():
                out.append(current.rstrip())
                current = " " * len(opening)
            current += piece
        return out + [current.rstrip() + closing]
    return packed("graph(", ins, ")" if variables else ") {") + (packed("  vars(", variables, ") {") if variables else [])


def graph_text(graph, max_lines: int | None = None) -> str | None:
    """The whole graph as let-bindings with shapes; None when that takes more than `max_lines`
    lines (counted before any node is printed: a program's source header, which a model's
    thousands of nodes would not fit, asks)."""
    name = Namer()
    lines = _header(graph, name)
    printed = [node for node in graph.nodes if node.op.name not in ("input", "variable") and not _is_inline(node)]
    if max_lines is not None and len(lines) + len(printed) + 2 + len(graph.updates) > max_lines:
        return None
    for node in printed:
        lines.append("  " + node_line(node, name))
    lines.append(f"  return ({', '.join(name(v) for v in graph.outputs)}{',' if len(graph.outputs) == 1 else ''})")
    for target, new in graph.updates:
        lines.append(f"  update {name(target)} <- {name(new)}")
    lines.append("}")
    return "\n".join(lines)


def _backward_name(node: Value) -> str:
    if node.op.name in ("input", "variable"):
        return f"AccumulateGrad({node.name})"
    label = "".join(part.capitalize() for part in node.op.name.split("_"))
    return f"{label}Backward"


# Deeper lines of a backward chain are indented this far and carry their depth as a number: a
# chain of thousands of nodes would otherwise print a quadratic number of spaces.
MAX_INDENT = 64


def backward_chain(root: Value) -> str:
    """The chain autograd would record for `root`, as grad_fn.next_functions prints.

    Each line is a node that passes gradient on; leaves that take gradients
    (float inputs and variables) end in AccumulateGrad. Constants and
    integer values, which take no gradient, are left out. A node reached
    again is printed once more, marked "(shown above)", without its inputs.
    Lines deeper than MAX_INDENT levels start with their depth: `[70] MulBackward`.
    """
    from .dtypes import is_float
    from .order import toposort

    # Whether each node depends on a float input or variable, in one sweep (inputs first).
    reaches_leaf: dict[int, bool] = {}
    for n in toposort([root]):
        reaches_leaf[id(n)] = ((n.op.name in ("input", "variable") and n.dtype.startswith("float"))
                               or any(reaches_leaf[id(i)] for i in n.inputs))

    def differentiable(v: Value) -> bool:
        return is_float(v.dtype) and v.op.name not in ("const", "iota") and reaches_leaf[id(v)]

    lines: list[str] = []
    seen: set[int] = set()
    stack = [(root, 0)]  # depth first, inputs in order: an explicit stack, so any depth prints
    while stack:
        node, depth = stack.pop()
        repeat = id(node) in seen
        indent = "  " * depth if depth <= MAX_INDENT else "  " * MAX_INDENT + f"[{depth}] "
        lines.append(indent + _backward_name(node) + (" (shown above)" if repeat and node.inputs else ""))
        if repeat:
            continue
        seen.add(id(node))
        if node.op.vjp is None and node.inputs:
            continue
        children = [child for i, child in enumerate(node.inputs)
                    if not (node.op.name == "custom" and i == 0)
                    and differentiable(child) and child.op.name != "stop_gradient"]
        stack.extend((child, depth + 1) for child in reversed(children))
    return "\n".join(lines)


def graph_dot(graph) -> str:
    """Graphviz DOT text: one box per node, labelled with its text-form line."""
    name = Namer()
    out = ["digraph symgrad {", "  rankdir=TB;", '  node [shape=box, fontname="monospace"];']
    ids: dict[int, str] = {}
    for k, node in enumerate(graph.nodes):
        if _is_inline(node):
            continue
        ids[id(node)] = f"n{k}"
        label = f"{name(node)}: {node.type_str}" if node.op.name in ("input", "variable") else node_line(node, name)
        shape = ', shape=ellipse' if node.op.name in ("input", "variable") else ""
        label = label.replace("\\", "\\\\").replace('"', '\\"')
        out.append(f'  n{k} [label="{label}"{shape}];')
    for node in graph.nodes:
        for child in node.inputs:
            if id(child) in ids and id(node) in ids:
                out.append(f"  {ids[id(child)]} -> {ids[id(node)]};")
    for k, v in enumerate(graph.outputs):
        if id(v) in ids:
            out.append(f'  out{k} [label="output {k}", shape=plaintext];')
            out.append(f"  {ids[id(v)]} -> out{k};")
    out.append("}")
    return "\n".join(out)


def print_graph(value: Value, file=None) -> None:
    """Print the backward chain of `value` (see `backward_chain`)."""
    print(backward_chain(value), file=file)
