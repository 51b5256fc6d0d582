"""Row-group decisions of the lowering (mixed into `_Lowerer`, beside FusionDecisions).

Softmax, log-softmax and cross-entropy are several row reductions (max, then
sum(exp(z - m)), ...) and elementwise maps over the same rows of one
(rows, C) shape. Lowered one node at a time, each is a pass over memory of its
own. A row group is the set of such nodes that one row kernel computes: per
row, passes over the row's C elements (each folding one or more reductions
and storing any (rows, C) maps whose per-row inputs are ready), with the
per-row scalars in registers between them. A full sum over (rows, C) read by
the group (the mean loss) is split into per-row partial sums stored by the
row kernel plus a tiny cross-row sum.

The decisions read only the graph; symgrad.backends.lowering carries them out.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import sympy

from ..ir import dtypes as D
from ..ir.registry import ELEMENTWISE, MOVEMENT, REDUCE
from ..ir.value import Value
from .fusion import _rowwise

# Elements per row above which no row kernel is formed: its passes re-read the row, which must
# stay in L1/L2 between them (4096 floats: 16 KiB per (rows, C) array read).
ROW_MAX = 4096


@dataclass(eq=False)
class RowGroup:
    """The nodes one row kernel computes, over rows of shape `rows` with `size` elements each."""

    rows: tuple
    size: int
    members: list              # row reductions and elementwise maps, in graph order
    partials: list             # full sums split into per-row partials and a cross-row sum
    aliases: list              # reshapes / expands of members (views of them), in graph order
    leaves: list = field(default_factory=list)  # what it reads that other kernels compute, or sources


class RowDecisions:
    """Expects FusionDecisions' attributes (`graph`, `uses`, `fused`, `fuse_reduce`, `epilogue_of`,
    `epilogued`, `_leaves`, `_materializes`) on the instance; sets `row_of` and `row_partial`."""

    def _choose_row_groups(self) -> None:
        """Group row reductions with the elementwise maps over the same rows into row kernels.

        A group must be worth a kernel (at least two of its reductions, maps and partial sums),
        and convex: nothing it reads may depend on what it computes (it runs as one kernel); nor
        may groups wait for each other.
        Reductions in a group lose the epilogue `_choose_epilogues` gave them: the row kernel
        computes per-row maps itself.
        """
        self.row_of: dict[int, RowGroup] = {}       # id(member or alias) -> its group
        self.row_partial: dict[int, RowGroup] = {}  # id(split full sum) -> its group
        if not self.fuse_reduce:
            return
        graph = self.graph
        key: dict[int, tuple] = {}
        for n in graph.nodes:
            k = _row_key(n)
            if k is not None:
                key[id(n)] = k
        if not key:
            return
        raw = {id(n): self._leaves(n) for n in graph.nodes
               if n.op.kind == REDUCE or (n.op.kind == ELEMENTWISE and self._materializes(n))}
        # Grow from the reductions through elementwise neighbours of a fitting shape.
        changed = True
        while changed:
            changed = False
            alias_of = self._row_aliases(key)
            leaves = {i: [alias_of.get(id(l), l) for l in ls] for i, ls in raw.items()}
            readers: dict[int, list] = {}
            for n in graph.nodes:
                for l in leaves.get(id(n), ()):
                    readers.setdefault(id(l), []).append(n)
            for n in graph.nodes:
                if id(n) in key or id(n) not in leaves or n.op.kind != ELEMENTWISE:
                    continue
                r = self.epilogue_of.get(id(n))
                if r is not None and id(r) not in key:
                    continue  # the epilogue of a reduction no group holds
                near = [l for l in leaves[id(n)] if id(l) in key]
                near += [u for u in readers.get(id(n), ()) if id(u) in key]
                for other in near:
                    k = key[id(other)]
                    if self._row_fits(n, k, key, leaves[id(n)]):
                        key[id(n)] = k
                        changed = True
                        break
        partial = {}
        for n in graph.nodes:
            k = self._partial_key(n, key, leaves)
            if k is not None:
                partial[id(n)] = k
        candidates = [g for g in self._row_components(key, partial, leaves, alias_of)
                      if self._worth_a_row_kernel(g, leaves, raw)]
        accepted = self._convex(candidates)
        for g in accepted:
            for n in [*g.members, *g.aliases]:
                self.row_of[id(n)] = g
            for p in g.partials:
                self.row_partial[id(p)] = g
        while True:  # groups convex alone may still wait for each other: drop one until none does
            g = self._row_group_in_a_cycle(accepted)
            if g is None:
                break
            accepted = [a for a in accepted if a is not g]
            for n in [*g.members, *g.aliases]:
                del self.row_of[id(n)]
            for p in g.partials:
                del self.row_partial[id(p)]
        # The row kernels compute their reductions' per-row maps: the epilogues chosen before go.
        inside = {id(n) for g in accepted for n in [*g.members, *g.aliases]}
        for root, r in list(self.epilogue_of.items()):
            if id(r) in inside:
                del self.epilogue_of[root]
                self.epilogued.discard(id(r))

    def _row_aliases(self, key: dict) -> dict:
        """id(movement node) -> the member it only reshapes (per row) or expands (per row to full)."""
        alias_of: dict[int, Value] = {}
        for n in self.graph.nodes:
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

    def _row_fits(self, n: Value, k: tuple, key: dict, leaves: list) -> bool:
        """Whether the elementwise `n` can join a group keyed `k`: a map over its full rows, or a
        per-row map reading a per-row value of the group (and nothing of the group's full shape)."""
        rows, size = k
        if tuple(n.shape) == (*rows, size):
            return True
        if not _per_row(n, rows, size):
            return False
        mine = [l for l in leaves if key.get(id(l)) == k]
        return bool(mine) and all(l.op.kind == REDUCE or _per_row(l, rows, size) for l in mine)

    def _partial_key(self, n: Value, key: dict, leaves: dict):
        """The group key of a float sum over every axis of (rows, C) values a group computes."""
        if n.op.name != "sum" or not D.is_float(n.dtype) or not _rowwise(n):
            return None
        x = n.inputs[0]
        if x.ndim < 2 or tuple(n.attrs["axes"]) != tuple(range(x.ndim)):
            return None
        if id(x) not in self.fused and id(x) not in key:
            return None
        for l in leaves[id(n)]:
            k = key.get(id(l))
            if k is not None and tuple(x.shape) == (*k[0], k[1]):
                return k
        return None

    def _row_components(self, key: dict, partial: dict, leaves: dict, alias_of: dict) -> list:
        """Connected groups (members joined by reading each other), with their aliases."""
        parent = {i: i for i in [*key, *partial]}

        def find(i):
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i
        for n in self.graph.nodes:
            if id(n) in parent:
                for l in leaves[id(n)]:
                    if id(l) in key and (key.get(id(n)) or partial.get(id(n))) == key[id(l)]:
                        parent[find(id(n))] = find(id(l))
        groups: dict[int, RowGroup] = {}
        for n in self.graph.nodes:
            if id(n) in parent:
                rows, size = key.get(id(n)) or partial[id(n)]
                g = groups.setdefault(find(id(n)), RowGroup(tuple(rows), size, [], [], [], []))
                (g.partials if id(n) in partial else g.members).append(n)
        by_member = {id(m): g for g in groups.values() for m in g.members}
        for n in self.graph.nodes:
            if id(n) in alias_of and id(alias_of[id(n)]) in by_member:
                by_member[id(alias_of[id(n)])].aliases.append(n)
        return list(groups.values())

    def _worth_a_row_kernel(self, g: RowGroup, leaves: dict, raw: dict) -> bool:
        """Whether `g` can and should be one kernel (convexity aside); sets its partials and leaves."""
        inside = {id(n) for n in [*g.members, *g.aliases]}
        if g.rows and any(id(l) in inside and tuple(l.shape) == g.rows for n in [*g.members, *g.partials]
                          if n.op.kind == REDUCE or tuple(n.shape) == (*g.rows, g.size) for l in raw[id(n)]):
            return False  # a full-row map reads a per-row value without its kept axis: NumPy aligns it with C
        read_by_members = {id(l) for m in g.members for l in leaves[id(m)]}
        g.partials = [p for p in g.partials if id(p) not in read_by_members]  # a member reads it: not split
        reductions = [m for m in g.members if m.op.kind == REDUCE]
        maps = [m for m in g.members if m.op.kind == ELEMENTWISE and tuple(m.shape) == (*g.rows, g.size)]
        if not reductions or len(reductions) + len(maps) + len(g.partials) < 2:
            return False
        external, seen = [], set()
        for n in [*g.members, *g.partials]:
            for l in leaves[id(n)]:
                if id(l) not in inside and id(l) not in seen:
                    seen.add(id(l))
                    external.append(l)
        g.leaves = external
        return True

    def _convex(self, groups: list) -> list:
        """The groups nothing they read is computed from (each runs as one kernel, after all it reads).

        One sweep in graph order gives every node the set of groups it comes after (a bit per
        group, in a Python int): a walk down from each group would cost time quadratic in the
        graph's size."""
        bit = {id(m): 1 << k for k, g in enumerate(groups) for m in g.members}
        after: dict[int, int] = {}  # id(node) -> bits of the groups with a member it depends on
        for n in self.graph.nodes:
            mask = 0
            for i in n.inputs:
                mask |= after[id(i)] | bit.get(id(i), 0)
            after[id(n)] = mask
        return [g for k, g in enumerate(groups) if not any(after[id(l)] >> k & 1 for l in g.leaves)]

    def _row_group_in_a_cycle(self, groups: list):
        """A group (the last of `groups` that is) on a cycle of waits, or None.

        Each group runs as one kernel, after everything any of its members reads: two groups,
        each convex, can still each read what the other computes (the gradient of
        sum(rowsum(exp(x)) * m) * sum(m)). A topological sort with every member waiting for all
        its group reads finds what never gets ready; peeling off what only follows a cycle leaves
        the cycles' nodes."""
        nodes = self.graph.nodes
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

    def _row_deps(self) -> dict:
        """id(member) -> ids of every value its group reads: the schedule runs a group's kernel at
        its first member, so each member waits for all of them."""
        deps = {}
        groups = {id(g): g for g in self.row_of.values()}  # row_of holds each group once per member
        for g in groups.values():
            leaves = {id(l) for l in g.leaves}
            for m in g.members:
                deps[id(m)] = leaves  # shared: the callers copy before they add to it
        return deps

    def _graph_order(self) -> list:
        """The graph's own order, except that each group's members wait for all the group reads (the
        order of an unscheduled lowering: a group's kernel is emitted at its first member)."""
        nodes = self.graph.nodes
        extra = self._row_deps()
        if not extra:
            return list(nodes)
        index = {id(n): k for k, n in enumerate(nodes)}
        waiting = {id(n): len({id(i) for i in n.inputs} | extra.get(id(n), set())) for n in nodes}
        users: dict[int, list] = {id(n): [] for n in nodes}
        for n in nodes:
            for d in {id(i) for i in n.inputs} | extra.get(id(n), set()):
                users[d].append(index[id(n)])
        ready = [k for k, n in enumerate(nodes) if waiting[id(n)] == 0]
        heapq.heapify(ready)
        order = []
        while ready:
            n = nodes[heapq.heappop(ready)]
            order.append(n)
            for k in users[id(n)]:
                waiting[id(nodes[k])] -= 1
                if waiting[id(nodes[k])] == 0:
                    heapq.heappush(ready, k)
        return order


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
