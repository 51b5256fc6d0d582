"""The order of a graph's nodes: each after its inputs. Below symgrad.ir.graph, which orders its
nodes so, and symgrad.ir.printing, which prints a Graph and walks bare values."""

from __future__ import annotations

from typing import Iterable

from .value import Value


def toposort(roots: Iterable[Value]) -> list[Value]:
    """All nodes reachable from `roots`, each after its inputs (iterative DFS)."""
    order: list[Value] = []
    done: set[int] = set()
    for root in roots:
        if id(root) in done:
            continue
        stack = [(root, iter(root.inputs))]
        on_stack = {id(root)}
        while stack:
            node, children = stack[-1]
            for child in children:
                key = id(child)
                if key not in done and key not in on_stack:
                    stack.append((child, iter(child.inputs)))
                    on_stack.add(key)
                    break
            else:
                stack.pop()
                key = id(node)
                on_stack.discard(key)
                done.add(key)
                order.append(node)
    return order
