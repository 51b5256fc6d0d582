"""The order of a graph's nodes: each after its inputs. Below symgrad.ir.graph, which orders its
nodes so, and symgrad.ir.printing, which prints a Graph and walks bare values."""

from __future__ import annotations

from typing import Iterable

from .value import Value


def toposort(roots: Iterable[Value]) -> list[Value]:
    """All nodes reachable from `roots`, each after its inputs (iterative DFS, post-order).

    The stack is the path from the root being walked: a node's input is never on it, since values
    are immutable and their graph has no cycle, so only finished nodes need remembering."""
    order: list[Value] = []
    # Values hash by identity (Value.__hash__ is object's), so the set holds the nodes themselves:
    # no id() call per visit, the walk's largest cost on a GPT's graphs.
    done: set[Value] = set()
    finish = done.add
    for root in roots:
        if root in done:
            continue
        stack = [(root, iter(root.inputs))]
        push, pop = stack.append, stack.pop
        while stack:
            node, children = stack[-1]
            for child in children:
                if child not in done:
                    push((child, iter(child.inputs)))
                    break
            else:
                pop()
                finish(node)
                order.append(node)
    return order
