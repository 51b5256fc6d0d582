"""A tiny rewrite engine: graph copies and local rules run to a fixed point.

A *rule* is a function `rule(node) -> Value | None` whose docstring states
its identity (`neg(neg(x)) -> x`). It sees a node whose inputs have already
been rewritten and returns a replacement of the same shape and dtype, or
None when it does not apply. `apply_rules` sweeps the graph bottom-up,
applying rules at each node until none fires, and repeats whole sweeps
until a sweep changes nothing (as PyTensor's EquilibriumGraphRewriter).

Values are immutable, so nothing is ever modified: a node whose inputs
changed is rebuilt, a node whose inputs did not is shared with the input
graph, and the result is a new `Graph`.
"""

from __future__ import annotations

import operator
from typing import Callable, Iterable, Optional

import numpy as np
import sympy

from ..ir.graph import Graph
from ..ir.value import Value, make

Rule = Callable[[Value], Optional[Value]]

# Ops whose every evaluation may differ (random numbers): never merged by CSE,
# never folded. An op may also declare itself so with extra["nondeterministic"].
NONDETERMINISTIC = frozenset({"random", "rand", "randn", "random_uniform", "random_normal",
                              "bernoulli", "dropout", "dropout_mask"})

# Leaves that stand for runtime data: never folded, never merged.
DATA_LEAVES = ("input", "variable")


def is_nondeterministic(node: Value) -> bool:
    """Whether `node`'s op draws random numbers (so two equal-looking nodes differ)."""
    return node.op.name in NONDETERMINISTIC or bool(node.op.extra.get("nondeterministic"))


def with_inputs(node: Value, inputs: tuple) -> Value:
    """`node` over new inputs of the same types: the same node when nothing changed."""
    if len(inputs) == len(node.inputs) and all(a is b for a, b in zip(inputs, node.inputs)):
        return node
    return node.over(tuple(inputs))


def rebuild(graph: Graph, rewrite: Callable[[Value], Value]) -> Graph:
    """A copy of `graph` in which each node, over its rebuilt inputs, is passed through `rewrite`.

    `rewrite(node)` returns the node or its replacement; it is called once per
    node, in topological order, so every input it sees is already final. Where
    every output and update comes out the same object, `graph` itself is returned.
    """
    # Keyed by the nodes themselves (Values hash by identity): no id() per lookup, in a loop that
    # a GPT step's passes run over its whole graph at every sweep.
    mapping: dict[Value, Value] = {}
    mapped = mapping.__getitem__
    for node in graph.nodes:
        old = node.inputs
        if old:  # with_inputs, inlined: a sweep asks it of every node of the graph
            inputs = tuple(map(mapped, old))
            if not all(map(operator.is_, inputs, old)):
                mapping[node] = rewrite(node.over(inputs))
                continue
        mapping[node] = rewrite(node)
    outputs = [mapping[v] for v in graph.outputs]
    updates = [(mapping[t], mapping[n]) for t, n in graph.updates]
    if all(map(operator.is_, outputs, graph.outputs)) and \
            all(t is t0 and n is n0 for (t, n), (t0, n0) in zip(updates, graph.updates)):
        # The same roots are the same graph (values are immutable): keep it, and the order and
        # users it has computed already, rather than sort a copy of it again.
        return graph
    return Graph(graph.inputs, outputs, updates)


def matches(*names: str, kind: str | None = None) -> Callable[[Rule], Rule]:
    """Declare the nodes a rule can fire at: ops of these names, or of this kind. `apply_rules`
    hands a node only to the rules that can fire at it (a sweep of a GPT step asks tens of
    thousands of nodes); a rule without the declaration is handed every node."""
    if not names and kind is None:
        raise TypeError("matches: name the ops a rule fires at, or their kind")

    def declare(rule: Rule) -> Rule:
        rule.op_names, rule.op_kind = frozenset(names), kind
        return rule
    return declare


def _rules_for(rules: tuple, name: str, kind: str) -> tuple:
    """The rules that can fire at an op of this name and kind (see `matches`)."""
    return tuple(rule for rule in rules if not hasattr(rule, "op_names")
                 or name in rule.op_names or kind == rule.op_kind)


class RuleError(RuntimeError):
    """A rule returned a value whose type differs from the node it replaces (a bug in the rule)."""


def _check(rule: Rule, node: Value, new: Value) -> None:
    if not isinstance(new, Value) or new.shape != node.shape or new.dtype != node.dtype:
        got = new.type_str if isinstance(new, Value) else type(new).__name__
        raise RuleError(f"rewrite rule {rule.__name__} replaced {node.op.name} {node.type_str} "
                        f"by {got}")


def apply_rules(graph: Graph, rules: Iterable[Rule], max_sweeps: int = 50,
                counts: dict | None = None, settled: set | None = None) -> Graph:
    """Rewrite `graph` with `rules` until no rule fires anywhere (or `max_sweeps` sweeps).

    `counts`, when given, receives how many times each rule fired, by name.
    Nodes of random ops are never handed to a rule: moving a broadcast past
    one, say, would turn independent draws into repeated ones.

    A rule sees only its node and what lies below it, so a node no rule rewrote is one no rule
    rewrites: such nodes are *settled* (a set of the nodes themselves, which keeps them alive) and
    not handed to the rules again, in a later sweep (where every node not rewritten below is
    the same object again) nor, when the caller passes its own `settled` set, in a later call
    with the same rules. A sweep then costs the rules only where the last one changed something,
    not the whole graph again.
    """
    rules = tuple(rules)
    by_op: dict = {}  # op -> the rules that can fire at its nodes (none at a random op's)
    original = graph
    settled = set() if settled is None else settled
    for sweep in range(max_sweeps):
        fired = False

        def at_node(node: Value) -> Value:
            nonlocal fired
            if node in settled:
                return node
            for _ in range(100):  # a node rewritten 100 times over means rules that cycle
                applicable = by_op.get(node.op)
                if applicable is None:  # a random op is left exactly as written (see NONDETERMINISTIC)
                    applicable = by_op[node.op] = () if is_nondeterministic(node) else \
                        _rules_for(rules, node.op.name, node.op.kind)
                for rule in applicable:
                    new = rule(node)
                    if new is not None and new is not node:
                        _check(rule, node, new)
                        if counts is not None:
                            counts[rule.__name__] = counts.get(rule.__name__, 0) + 1
                        fired, node = True, new
                        break
                else:
                    settled.add(node)
                    return node
                if node in settled:
                    return node  # rewritten into a node no rule rewrites
            raise RuleError(f"rewrite rules do not terminate at {node!r}")

        rebuilt = rebuild(graph, at_node)
        if not fired:
            return original if sweep == 0 else graph  # unchanged: the caller can tell by identity
        graph = rebuilt
    return graph


# ---- helpers the rules share -------------------------------------------------

def same_type(node: Value, new: Value | None) -> Value | None:
    """`new` when it has `node`'s shape and dtype, else None (the rule does not apply)."""
    if new is not None and new.shape == node.shape and new.dtype == node.dtype:
        return new
    return None


def scalar_constant(v: Value):
    """The one value every element of `v` holds, when `v` is a constant that says so; else None.

    Sees through expand and reshape (which copy elements), so a broadcast
    constant counts. Returns a Python number or a sympy expression of Dims.
    """
    while v.op.name in ("expand", "reshape"):
        v = v.inputs[0]
    if v.op.name != "const":
        return None
    value = v.attrs["value"]
    if isinstance(value, np.ndarray):
        if value.size == 0:
            return None
        first = value.flat[0]
        if not np.all(value == first) or (value.dtype.kind == "f" and np.isnan(first)):
            return None
        return first.item()
    return value


def is_value(v: Value, number) -> bool:
    """Whether every element of `v` is the constant `number` (0 and -0.0 both count as 0)."""
    c = scalar_constant(v)
    if c is None:
        return False
    if isinstance(c, sympy.Basic):
        return bool(c == number)
    return c == number


def const_like(value, dtype: str) -> Value:
    """A 0-d const node holding `value` (a Python number or a sympy expression of Dims)."""
    from ..ir.registry import lookup
    return make(lookup("const"), value=value, shape=(), dtype=dtype)


def short_rational(value):
    """A Python number as an exact sympy Rational when it has a short form (3, -0.125); else None.

    Every finite float is a dyadic rational; only small ones (numerator below
    2**24, denominator at most 2**10) are worth writing into an expression.
    0.1 is not: its exact value has a 55-bit denominator.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not np.isfinite(value):
        return None
    r = sympy.Rational(value)
    if abs(r.p) >= 2 ** 24 or r.q > 2 ** 10:
        return None
    return r
