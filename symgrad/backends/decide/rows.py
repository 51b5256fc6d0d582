"""Row-group decisions: which row reductions and maps one row kernel computes.

Softmax, log-softmax and cross-entropy are several row reductions (max, then
sum(exp(z - m)), ...) and elementwise maps over the same rows of one
(rows, C) shape. Lowered one node at a time, each is a pass over memory of its
own. A row group is the set of such nodes that one row kernel computes: per
row, passes over the row's C elements (each folding one or more reductions
and storing any (rows, C) maps whose per-row inputs are ready), with the
per-row scalars in registers between them. A full sum over (rows, C) read by
the group (the mean loss) is split into per-row partial sums stored by the
row kernel plus a tiny cross-row sum.

Pure functions of the graph and the fusion decisions; symgrad.backends.decide.decisions
puts them together and symgrad.backends.kinds.row carries them out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import sympy

from ...ir import dtypes as D
from ...ir.graph import Graph
from ...ir.registry import ELEMENTWISE, MOVEMENT, REDUCE
from ...ir.value import Value
from .fusion import leaves as leaves_of, materializes, rowwise

# Elements per row above which no row kernel is formed: its passes re-read the row, which must
# stay in L1/L2 between them (4096 floats: 16 KiB per (rows, C) array read).
ROW_MAX = 4096


@dataclass(frozen=True, eq=False)
class RowGroup:
    """The nodes one row kernel computes, over rows of shape `rows` with `size` elements each."""

    rows: tuple
    size: int
    members: tuple             # row reductions and elementwise maps, in graph order
    partials: tuple            # full sums split into per-row partials and a cross-row sum
    aliases: tuple             # reshapes / expands of members (views of them), in graph order
    leaves: tuple = ()         # what it reads that other kernels compute, or sources

    def ids(self) -> tuple:
        """The group by its nodes' identities (two decisions over one graph compare equal by these)."""
        return (tuple(self.rows), self.size, *(tuple(map(id, part)) for part in
                                               (self.members, self.partials, self.aliases, self.leaves)))


def choose_row_groups(graph: Graph, fused, epilogue_of: dict) -> tuple:
    """Group row reductions with the elementwise maps over the same rows into row kernels.

    A group must be worth a kernel (at least two of its reductions, maps and partial sums),
    and convex: nothing it reads may depend on what it computes (it runs as one kernel); nor
    may groups wait for each other. `fused`: ids of the nodes computed inside their readers;
    `epilogue_of`: the reductions' epilogues chosen so far (a reduction in a group loses its
    epilogue: the row kernel computes per-row maps itself; `decide` drops those entries).
    """
    key: dict[int, tuple] = {}
    for n in graph.nodes:
        k = _row_key(n)
        if k is not None:
            key[id(n)] = k
    if not key:
        return ()
    epilogued = {id(r) for r in epilogue_of.values()}
    raw = {id(n): leaves_of(n, fused) for n in graph.nodes
           if n.op.kind == REDUCE or (n.op.kind == ELEMENTWISE and materializes(n, fused, epilogued))}
    # Grow from the reductions through elementwise neighbours of a fitting shape.
    changed = True
    while changed:
        changed = False
        alias_of = _row_aliases(graph, key)
        leaves = {i: [alias_of.get(id(l), l) for l in ls] for i, ls in raw.items()}
        readers: dict[int, list] = {}
        for n in graph.nodes:
            for l in leaves.get(id(n), ()):
                readers.setdefault(id(l), []).append(n)
        for n in graph.nodes:
            if id(n) in key or id(n) not in leaves or n.op.kind != ELEMENTWISE:
                continue
            r = epilogue_of.get(id(n))
            if r is not None and id(r) not in key:
                continue  # the epilogue of a reduction no group holds
            near = [l for l in leaves[id(n)] if id(l) in key]
            near += [u for u in readers.get(id(n), ()) if id(u) in key]
            for other in near:
                k = key[id(other)]
                if _row_fits(n, k, key, leaves[id(n)]):
                    key[id(n)] = k
                    changed = True
                    break
    partial = {}
    for n in graph.nodes:
        k = _partial_key(n, key, leaves, fused)
        if k is not None:
            partial[id(n)] = k
    candidates = [g for g in (_worth_a_row_kernel(g, leaves, raw)
                              for g in _row_components(graph, key, partial, leaves, alias_of)) if g is not None]
    accepted = _convex(graph, candidates)
    while True:  # groups convex alone may still wait for each other: drop one until none does
        g = _row_group_in_a_cycle(graph, accepted)
        if g is None:
            break
        accepted = [a for a in accepted if a is not g]
    return tuple(accepted)


def _row_aliases(graph: Graph, key: dict) -> dict:
    """id(movement node) -> the member it only reshapes (per row) or expands (per row to full)."""
    alias_of: dict[int, Value] = {}
    for n in graph.nodes:
        if n.op.kind != MOVEMENT or n.op.name not in ("reshape", "expand"):
            continue
        src = alias_of.get(id(n.inputs[0]), n.inputs[0])
        if id(src) not in key:
            continue
        rows, size = key[id(src)]
        if _per_row(src, rows, size) and (_per_row(n, rows, size) or
                                         (n.op.name == "expand" and tuple(n.shape) == (*rows, size))):
            alias_of[id(n)] = src
    return alias_of


def _row_fits(n: Value, k: tuple, key: dict, leaves: list) -> bool:
    """Whether the elementwise `n` can join a group keyed `k`: a map over its full rows, or a
    per-row map reading a per-row value of the group (and nothing of the group's full shape)."""
    rows, size = k
    if tuple(n.shape) == (*rows, size):
        return True
    if not _per_row(n, rows, size):
        return False
    mine = [l for l in leaves if key.get(id(l)) == k]
    return bool(mine) and all(l.op.kind == REDUCE or _per_row(l, rows, size) for l in mine)


def _partial_key(n: Value, key: dict, leaves: dict, fused):
    """The group key of a float sum over every axis of (rows, C) values a group computes."""
    if n.op.name != "sum" or not D.is_float(n.dtype) or not rowwise(n):
        return None
    x = n.inputs[0]
    if x.ndim < 2 or tuple(n.attrs["axes"]) != tuple(range(x.ndim)):
        return None
    if id(x) not in fused and id(x) not in key:
        return None
    for l in leaves[id(n)]:
        k = key.get(id(l))
        if k is not None and tuple(x.shape) == (*k[0], k[1]):
            return k
    return None


def _row_components(graph: Graph, key: dict, partial: dict, leaves: dict, alias_of: dict) -> list:
    """Connected groups (members joined by reading each other), with their aliases."""
    parent = {i: i for i in [*key, *partial]}

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i
    for n in graph.nodes:
        if id(n) in parent:
            for l in leaves[id(n)]:
                if id(l) in key and (key.get(id(n)) or partial.get(id(n))) == key[id(l)]:
                    parent[find(id(n))] = find(id(l))
    groups: dict[int, tuple] = {}  # root -> (rows, size, members, partials, aliases), filled in graph order
    for n in graph.nodes:
        if id(n) in parent:
            rows, size = key.get(id(n)) or partial[id(n)]
            g = groups.setdefault(find(id(n)), (tuple(rows), size, [], [], []))
            (g[3] if id(n) in partial else g[2]).append(n)
    by_member = {id(m): g for g in groups.values() for m in g[2]}
    for n in graph.nodes:
        if id(n) in alias_of and id(alias_of[id(n)]) in by_member:
            by_member[id(alias_of[id(n)])][4].append(n)
    return [RowGroup(rows, size, tuple(members), tuple(partials), tuple(aliases))
            for rows, size, members, partials, aliases in groups.values()]


def _worth_a_row_kernel(g: RowGroup, leaves: dict, raw: dict) -> RowGroup | None:
    """`g` with its partials and leaves when it can and should be one kernel (convexity aside), else None."""
    inside = {id(n) for n in [*g.members, *g.aliases]}
    if g.rows and any(id(l) in inside and tuple(l.shape) == g.rows for n in [*g.members, *g.partials]
                      if n.op.kind == REDUCE or tuple(n.shape) == (*g.rows, g.size) for l in raw[id(n)]):
        return None  # a full-row map reads a per-row value without its kept axis: NumPy aligns it with C
    read_by_members = {id(l) for m in g.members for l in leaves[id(m)]}
    partials = tuple(p for p in g.partials if id(p) not in read_by_members)  # a member reads it: not split
    reductions = [m for m in g.members if m.op.kind == REDUCE]
    maps = [m for m in g.members if m.op.kind == ELEMENTWISE and tuple(m.shape) == (*g.rows, g.size)]
    if not reductions or len(reductions) + len(maps) + len(partials) < 2:
        return None
    external, seen = [], set()
    for n in [*g.members, *partials]:
        for l in leaves[id(n)]:
            if id(l) not in inside and id(l) not in seen:
                seen.add(id(l))
                external.append(l)
    return replace(g, partials=partials, leaves=tuple(external))


def _convex(graph: Graph, groups: list) -> list:
    """The groups nothing they read is computed from (each runs as one kernel, after all it reads).

    One sweep in graph order gives every node the set of groups it comes after (a bit per
    group, in a Python int): a walk down from each group would cost time quadratic in the
    graph's size."""
    bit = {id(m): 1 << k for k, g in enumerate(groups) for m in g.members}
    after: dict[int, int] = {}  # id(node) -> bits of the groups with a member it depends on
    for n in graph.nodes:
        mask = 0
        for i in n.inputs:
            mask |= after[id(i)] | bit.get(id(i), 0)
        after[id(n)] = mask
    return [g for k, g in enumerate(groups) if not any(after[id(l)] >> k & 1 for l in g.leaves)]


def _row_group_in_a_cycle(graph: Graph, groups: list):
    """A group (the last of `groups` that is) on a cycle of waits, or None.

    Each group runs as one kernel, after everything any of its members reads: two groups,
    each convex, can still each read what the other computes (the gradient of
    sum(rowsum(exp(x)) * m) * sum(m)). A topological sort with every member waiting for all
    its group reads finds what never gets ready; peeling off what only follows a cycle leaves
    the cycles' nodes."""
    nodes = graph.nodes
    deps = {id(n): {id(i) for i in n.inputs} for n in nodes}
    for g in groups:
        leaves = {id(l) for l in g.leaves}
        for m in g.members:
            deps[id(m)] |= leaves
    users: dict[int, list] = {id(n): [] for n in nodes}
    for k, ds in deps.items():
        for d in ds:
            users[d].append(k)
    waiting = {k: len(ds) for k, ds in deps.items()}
    stack = [k for k, w in waiting.items() if w == 0]
    while stack:
        for u in users[stack.pop()]:
            waiting[u] -= 1
            if waiting[u] == 0:
                stack.append(u)
    stuck = {k for k, w in waiting.items() if w > 0}
    if not stuck:
        return None
    onward = {k: sum(u in stuck for u in users[k]) for k in stuck}  # stuck nodes waiting for k
    stack = [k for k, c in onward.items() if c == 0]
    while stack:
        k = stack.pop()
        stuck.discard(k)
        for d in deps[k]:
            if d in stuck:
                onward[d] -= 1
                if onward[d] == 0:
                    stack.append(d)
    return next((g for g in reversed(groups) if any(id(m) in stuck for m in g.members)), None)


def _row_key(n: Value):
    """(rows, C) of a float sum or max over the last axis of a (rows, C) value with C small."""
    if n.op.kind != REDUCE or n.op.name not in ("sum", "max") or not D.is_float(n.dtype):
        return None
    x = n.inputs[0]
    if x.ndim < 1 or tuple(n.attrs["axes"]) != (x.ndim - 1,):
        return None
    size = x.shape[-1]
    if isinstance(size, sympy.Basic):
        if not size.is_Integer:
            return None
        size = int(size)
    # C = 1 is no row reduction, and per-row values (rows, 1) would have the full shape (rows, C):
    # the group could not tell them apart (a KeyError in the lowering). Such nodes lower one by one.
    if not 2 <= size <= ROW_MAX:
        return None
    return tuple(x.shape[:-1]), size


def _per_row(n: Value, rows: tuple, size: int) -> bool:
    """Whether `n` holds one value per row: shape rows + (1,), or rows (and not the full shape)."""
    shape = tuple(n.shape)
    return shape in ((*rows, 1), tuple(rows)) and shape != (*rows, size)
