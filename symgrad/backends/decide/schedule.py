"""The kernel order: a topological order of the graph's nodes, each row group run as one kernel.

`schedule` orders the kernels to keep few bytes live; `graph_order` keeps the
graph's own order (the order of an unscheduled lowering). Both make every
member of a row group wait for all that its group reads, since the group's
kernel runs at its first member.
"""

from __future__ import annotations

import heapq

from ...ir import dtypes as D
from ...ir import shapes as S
from ...ir.graph import Graph, ancestors
from ...ir.registry import ELEMENTWISE
from ...ir.value import Value
from .fusion import DEFAULT_DIM, materializes


def schedule(graph: Graph, fused, epilogued, groups, stores=None) -> list | None:
    """A topological order of the nodes that keeps few bytes live at once (greedy list scheduling).

    Views (movement, sources, fused nodes) are placed as soon as they are ready. Among the
    ready kernels the one that frees the most bytes net of what it allocates runs first, ties
    going to the graph's own order: a layer's weight gradient and update run as soon as their
    inputs exist, before the backward moves on, so activations and gradients die early. The
    kernel computing a variable's new value waits for every other kernel reading the variable,
    so it can write the variable in place. (`fused`, `epilogued`: ids of the nodes that get no kernel
    of their own; `groups`: the row groups, each one kernel; `stores`: id(loop root) -> the new
    values its loop stores besides its own, whose variables it waits for likewise.)

    None when those waits close a cycle (a variable's update waiting for a reader of another's old
    value, which waits for the first: no order writes every variable in place); the caller then
    asks for less, or takes `graph_order`.
    """
    nodes = graph.nodes
    index = {id(n): k for k, n in enumerate(nodes)}
    mat = {id(n): materializes(n, fused, epilogued) for n in nodes}
    reads = _kernel_reads(nodes, mat)
    by_id = {id(n): n for n in nodes}
    stored_by = {id(v): by_id[root] for root, values in (stores or {}).items() for v in values}
    deps = _dependencies(graph, index, mat, reads, groups, stored_by)
    dims = {d: DEFAULT_DIM for d in graph.dims}
    size = {id(n): _concrete_bytes(n, dims) for n in nodes if mat[id(n)]}
    pinned = {id(v) for v in graph.outputs} | {id(new) for _, new in graph.updates}
    deferred = _deferred(graph, mat, reads)
    order = _list_schedule(nodes, index, mat, reads, deps, size, pinned, deferred)
    return order if len(order) == len(nodes) else None


def _deferred(graph: Graph, mat: dict, reads: dict) -> set:
    """ids of the backward's elementwise kernels that read forward values only (or other such
    kernels): a value recomputed for the backward (symgrad.passes.remat) is one. They could run at
    any time, and each runs as late as it can, once a kernel reading it could otherwise run: run
    early, its result would be held through the rest of the forward, which its recomputation was
    to spare."""
    forward = ancestors(graph.outputs)
    deferred: set = set()
    for n in graph.nodes:  # in topological order: what a kernel reads is classified before it
        if (mat[id(n)] and n.op.kind == ELEMENTWISE and id(n) not in forward and reads[id(n)]
                and all(b in forward or b in deferred for b in reads[id(n)])):
            deferred.add(id(n))
    return deferred


def _kernel_reads(nodes: list, mat: dict) -> dict[int, set]:
    """id(kernel node) -> ids of the buffers (materialized nodes, variables) its kernel reads, through
    the views and fused nodes it computes itself. Only kernels: the running sets of every node of a
    long fused chain would cost time quadratic in its length."""
    reads: dict[int, set] = {}
    for n in nodes:
        if not mat[id(n)]:
            continue
        got: set = set()
        stack, seen = list(n.inputs), set()
        while stack:
            i = stack.pop()
            if id(i) in seen:
                continue
            seen.add(id(i))
            if mat[id(i)] or i.op.name == "variable":
                got.add(id(i))
            else:
                stack.extend(i.inputs)
        reads[id(n)] = got
    return reads


def _dependencies(graph: Graph, index: dict, mat: dict, reads: dict, groups, stored_by=None) -> dict[int, set]:
    """id(node) -> ids of the nodes it waits for: its inputs; for a row group's member, all that its
    group reads; for a kernel computing a variable's new value, every other kernel reading it."""
    stored_by = stored_by or {}
    nodes = graph.nodes
    deps = {id(n): {id(i) for i in n.inputs} for n in nodes}
    for member, leaves in row_deps(groups).items():  # a row group runs as one kernel
        deps[member] |= leaves
    # The kernels reading each variable, in graph order.
    variable_readers: dict[int, list] = {}
    for n in nodes:
        if mat[id(n)]:
            for b in reads[id(n)]:
                variable_readers.setdefault(b, []).append(n)
    for target, new in graph.updates:
        new = stored_by.get(id(new), new)  # a new value another loop stores: that loop waits
        if not mat.get(id(new)) or new.op.kind != ELEMENTWISE:
            continue
        for n in variable_readers.get(id(target), ()):
            # A reader before `new` in the graph's (topological) order cannot depend on it, and one
            # that is already among its ancestors gains nothing from the edge but loses nothing
            # either; a later one may depend on it, and then must not wait for it (a cycle).
            if n is not new and (index[id(n)] < index[id(new)] or id(new) not in ancestors([n])):
                deps[id(new)].add(id(n))
    return deps


def _list_schedule(nodes: list, index: dict, mat: dict, reads: dict, deps: dict, size: dict, pinned: set,
                   deferred: set = frozenset()) -> list:
    """The greedy list schedule: ready views first, in graph order; else the ready kernel whose run
    frees the most bytes net of what it allocates (`size`; `pinned` buffers are never freed). A ready
    `deferred` kernel waits until a kernel that reads it (through views) waits for nothing else.
    Shorter than `nodes` only if `deps` has a cycle.

    The ready kernels wait in a heap by that gain. A kernel's gain changes only when it becomes
    the last kernel left to read one of its buffers, and is then pushed again: a deep model holds
    hundreds of ready kernels (its weight gradients wait for their inputs' last readers), and
    comparing them all at every pick made the schedule quadratic in depth."""
    readers: dict[int, int] = {}   # buffer -> the kernels not yet run that read it: how many
    reading: dict[int, list] = {}  # buffer -> the kernels that read it
    for n in nodes:
        if mat[id(n)]:
            for b in reads[id(n)]:
                readers[b] = readers.get(b, 0) + 1
                reading.setdefault(b, []).append(n)
    users: dict[int, list] = {id(n): [] for n in nodes}
    for n in nodes:
        for d in deps[id(n)]:
            users[d].append(n)
    waiting = {id(n): len(deps[id(n)]) for n in nodes}
    # Ready views wait in a heap by graph position (thousands of constants are ready at once);
    # ready kernels in a heap by gain, an entry whose gain has changed since left where it is
    # and passed over (`current` holds each ready kernel's gain).
    ready_views: list[int] = []
    ready_kernels: list = []
    current: dict[int, tuple] = {}
    done: set = set()
    parking = _Parking(deps, mat, users, {id(n): n for n in nodes}, done)

    def gain(n):
        freed = sum(size.get(b, 0) for b in reads[id(n)]
                    if readers.get(b) == 1 and b not in pinned and b in size)
        return (size[id(n)] - freed, index[id(n)])

    def push_kernel(n):
        current[id(n)] = key = gain(n)
        heapq.heappush(ready_kernels, (key, id(n)))

    def make_ready(n):
        if id(n) in deferred:
            parking.park(n)
        elif mat[id(n)]:
            push_kernel(n)
        else:
            heapq.heappush(ready_views, index[id(n)])

    for n in nodes:
        if waiting[id(n)] == 0:
            make_ready(n)
    order = []
    while ready_views or current or parking.parked:
        if ready_views:
            pick = nodes[heapq.heappop(ready_views)]
        else:
            for n in parking.release(bool(current)):
                push_kernel(n)
            while True:
                key, node_id = heapq.heappop(ready_kernels)
                if current.get(node_id) == key:
                    break
            del current[node_id]
            pick = nodes[key[1]]
            for b in reads[id(pick)]:
                readers[b] -= 1
                if readers[b] == 1:  # its last reader now frees it: that reader's gain changes
                    last = next(r for r in reading[b] if id(r) not in done and r is not pick)
                    if id(last) in current:
                        push_kernel(last)
        order.append(pick)
        done.add(id(pick))
        parking.ran(pick)
        for u in users[id(pick)]:
            waiting[id(u)] -= 1
            if waiting[id(u)] == 0:
                make_ready(u)
    return order


class _Parking:
    """The ready deferred kernels of a list schedule (`parked`: `park` adds one), each released to
    the ready kernels once a kernel reading it (through views) waits for nothing else; all of them
    when no other kernel is ready (nothing else could run: the schedule must not stop).

    A deep model parks its layers' recomputations through the whole forward, so a release does not
    look at every parked kernel's readers again: a reader is looked at when a kernel it reads is
    parked, and after that only once the kernel that last kept it waiting (its blocker) has run
    (`ran`) or been parked, the only changes that can end its wait. A look that finds no blocker
    (its wait ends in a view reached twice) is repeated at every release. Looked at afresh, every
    pick cost a walk over all of them: a schedule quadratic in depth."""

    def __init__(self, deps: dict, mat: dict, users: dict, by_id: dict, done: set):
        self.deps, self.mat, self.users, self.by_id, self.done = deps, mat, users, by_id, done
        self.parked: list = []
        self._parked_ids: set = set()
        self._readers: dict[int, list] = {}   # id(parked kernel) -> the kernels reading it
        self._parked_read: dict[int, list] = {}  # id(reader) -> the kernels parked that it reads
        self._blocker: dict[int, int] = {}    # id(reader) -> a kernel it waited for at the last look
        self._watching: dict[int, list] = {}  # id(blocker) -> the readers it kept waiting
        self._to_look: dict[int, Value] = {}  # the readers to look at in the next release
        self._every_time: dict[int, Value] = {}  # readers waiting with no blocker found

    def park(self, n: Value) -> None:
        """Park ready kernel `n`: its readers, and those it kept waiting, may now wait only for parked ones."""
        self.parked.append(n)
        self._parked_ids.add(id(n))
        for c in self._reading(n):
            self._to_look[id(c)] = c
            self._parked_read.setdefault(id(c), []).append(n)
        self.ran(n)

    def ran(self, n: Value) -> None:
        """Kernel `n` ran (or was parked): the readers it kept waiting are looked at again."""
        self._to_look.update((id(c), c) for c in self._watching.pop(id(n), ()))

    def release(self, others_ready: bool) -> list:
        """The parked kernels some waiting kernel needs now (all of them when no other kernel is
        ready: `others_ready` False), taken out of `parked`."""
        if not self.parked:
            return []
        parked_ids = self._parked_ids
        looking, self._to_look = {**self._to_look, **self._every_time}, {}
        released: set = set()
        for key, c in looking.items():
            self._every_time.pop(key, None)
            if self._needs_only_parked(c, parked_ids):
                released.update(id(p) for p in self._parked_read.get(key, ()) if id(p) in parked_ids)
                continue
            blocker = self._blocker.get(key)   # what this look found in its way, if anything
            if blocker is None or blocker in self.done or blocker in parked_ids:
                self._every_time[key] = c   # no kernel found in its way: look again each time
            else:
                self._watching.setdefault(blocker, []).append(c)
        if not released and not others_ready:
            released = set(parked_ids)
        if not released:
            return []
        out = [p for p in self.parked if id(p) in released]
        self.parked = [p for p in self.parked if id(p) not in released]  # by identity: Value.__eq__ builds a node
        parked_ids -= released
        return out

    def _needs_only_parked(self, c: Value, parked_ids: set) -> bool:
        """Whether kernel `c` waits only for parked kernels (_waits_only_for), remembering the
        kernel that keeps it waiting where one does."""
        blocker = self._blocker.get(id(c))
        if blocker is not None and blocker not in self.done and blocker not in parked_ids:
            return False
        found: list = []
        free = self._waits_only_for(c, parked_ids, set(), found)
        if found:
            self._blocker[id(c)] = found[0]
        return free

    def _waits_only_for(self, n: Value, parked_ids: set, seen: set, found: list) -> bool:
        """Whether every dependency of `n` not yet run is parked, or a view waiting only for such;
        `found` gets the kernel that keeps it waiting, if one does."""
        for d in self.deps[id(n)]:
            if d in self.done or d in parked_ids:
                continue
            if self.mat[d]:
                found.append(d)
                return False
            if d in seen:
                return False
            seen.add(d)
            if not self._waits_only_for(self.by_id[d], parked_ids, seen, found):
                return False
        return True

    def _reading(self, n: Value) -> list:
        """The kernels that read `n`, directly or through views."""
        found = self._readers.get(id(n))
        if found is None:
            found, stack = [], list(self.users[id(n)])
            while stack:
                u = stack.pop()
                if self.mat[id(u)]:
                    found.append(u)
                else:
                    stack.extend(self.users[id(u)])
            self._readers[id(n)] = found
        return found


def row_deps(groups) -> dict:
    """id(member) -> ids of every value its row group reads: the schedule runs a group's kernel at
    its first member, so each member waits for all of them."""
    deps = {}
    for g in groups:
        leaves = {id(l) for l in g.leaves}
        for m in g.members:
            deps[id(m)] = leaves  # shared: the callers copy before they add to it
    return deps


def graph_order(graph: Graph, groups) -> list:
    """The graph's own order, except that each group's members wait for all the group reads (the
    order of an unscheduled lowering: a group's kernel is emitted at its first member)."""
    nodes = graph.nodes
    extra = row_deps(groups)
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


def _concrete_bytes(node: Value, dims: dict) -> int:
    """Bytes of `node` with every Dim at the value `dims` gives it."""
    numel = S.evaluate(S.numel(node.shape), dims) if node.shape else 1
    return int(numel) * D.to_numpy(node.dtype).itemsize
