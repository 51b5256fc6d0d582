"""Fusion, save-or-recompute and scheduling decisions of the lowering (mixed into `_Lowerer`).

Which elementwise nodes are computed inside another kernel's loop instead of
getting one of their own (chains, reduction prologues and epilogues, matmul
epilogues, cheap values recomputed by each reader), which forward values are
kept for the backward and why, and the kernel order that keeps few bytes live.
The decisions read only the graph; `symgrad.backends.lowering` carries them out.
"""

from __future__ import annotations

import heapq

import numpy as np
import sympy

from ..ir import dtypes as D
from ..ir import shapes as S
from ..ir.elementwise import ARGS
from ..ir.graph import Graph
from ..ir.registry import CUSTOM, ELEMENTWISE, MATMUL, MOVEMENT, REDUCE, SOURCE
from ..ir.value import Value


class FusionDecisions:
    """The decisions; expects `graph`, `uses`, `fused`, `fuse_reduce`, `choices`, `epilogue_of`
    (id(elementwise root) -> the reduction or matmul it finishes), `epilogued` and `name` (a Namer)
    on the instance."""

    def _fusable(self, node: Value) -> bool:
        """Computed inside its one user's loop: an elementwise node read once, by an elementwise node
        of its own shape (or a single element, which costs nothing to recompute), or by a row-wise
        reduction (the prologue `exp(x - m)` of a row sum runs inside the sum's loop)."""
        if node.op.kind != ELEMENTWISE or self.uses[id(node)] != 1:
            return False
        users = self.graph.users[id(node)]
        return len(users) == 1 and self._accepts(users[0], node)

    def _accepts(self, user: Value, node: Value) -> bool:
        """Whether `user`'s kernel can compute the elementwise `node` itself, element by element."""
        if user.op.kind == ELEMENTWISE:
            return user.shape == node.shape or all(isinstance(s, int) and s == 1 for s in node.shape)
        if user.op.kind == REDUCE and self.fuse_reduce:
            return _rowwise(user)
        return False

    def _group_cost(self, node: Value) -> int:
        """Arithmetic cost of computing `node` with everything fused into it, per element."""
        cost, stack, seen = 0, [node], set()
        while stack:
            n = stack.pop()
            if id(n) in seen:
                continue
            seen.add(id(n))
            cost += _expr_cost(n.op.expr)
            stack.extend(i for i in n.inputs if id(i) in self.fused)
        return cost

    def _choose_recompute(self) -> None:
        """Save or recompute: a cheap elementwise value read by several kernels is recomputed inside
        each of them from the values it reads (which those kernels' neighbours keep anyway) instead
        of being stored and read back; everything else that is read later is kept. Each decision
        about a forward value that the backward reads is recorded with its reason."""
        graph = self.graph
        forward = _forward_ids(graph)
        for n in graph.nodes:
            if n.op.kind != ELEMENTWISE or id(n) in self.fused or n.op.expr is None:
                continue
            users = graph.users[id(n)]
            if self.uses[id(n)] != len(users) or len(users) < 2:
                continue  # an output or an update's value is stored anyway
            if n.op.name in NONDETERMINISTIC or not all(self._accepts(u, n) for u in users):
                continue
            cost = self._group_cost(n)
            if cost > RECOMPUTE_MAX_COST:
                continue
            self.fused.add(id(n))
            self.choices.append(dict(
                value=self.name(n), op=n.op.name, decision="recompute",
                bytes=_nbytes(n.shape, n.dtype),
                reason=f"cheap elementwise (cost {cost}) read by {len(users)} kernels: computed inside each "
                       f"from its inputs instead of stored"))
        for n in graph.nodes:
            if id(n) not in forward or id(n) in self.fused or n.op.kind in (SOURCE, MOVEMENT, CUSTOM):
                continue
            backward_users = [u for u in graph.users[id(n)] if id(u) not in forward]
            if not backward_users:
                continue
            forward_users = [u for u in graph.users[id(n)] if id(u) in forward]
            readers = sorted({u.op.name for u in forward_users if not self._accepts(u, n)})
            if readers:
                why = f"stored anyway: the forward's {', '.join(readers)} reads it from memory"
            elif n.op.kind == ELEMENTWISE and _expr_cost(n.op.expr) > RECOMPUTE_MAX_COST:
                why = f"{n.op.name} is costly to recompute (cost {self._group_cost(n)})"
            elif n.op.kind in (MATMUL, REDUCE):
                why = f"a {n.op.kind} result: recomputing it would repeat the whole {n.op.kind}"
            else:
                why = "read by kernels that cannot compute it themselves (another shape or a column sum)"
            if _only_sign_tests(n, backward_users):
                why += ("; the backward only tests its sign, but a 1-byte mask would add bytes to a value "
                        "stored anyway" if readers else "; the backward only tests its sign: a 1-byte mask "
                        "would do")
            self.choices.append(dict(value=self.name(n), op=n.op.name, decision="keep",
                                     bytes=_nbytes(n.shape, n.dtype), reason=why))

    def _materializes(self, node: Value) -> bool:
        """Whether `node` gets a kernel and a buffer of its own."""
        kind = node.op.kind
        if id(node) in self.epilogued:
            return False
        return kind in (REDUCE, MATMUL) or (kind == ELEMENTWISE and id(node) not in self.fused)

    def _choose_epilogues(self) -> None:
        """A row-wise reduction read only by one elementwise node of its own shape hands its value to
        that node inside the reduction kernel (the epilogue), when everything else the node's fused
        group reads is a constant or a value of that same shape and layout."""
        graph = self.graph
        updated = {id(new) for _, new in graph.updates}
        for r in graph.nodes:
            if r.op.kind != REDUCE or not _rowwise(r) or self.uses[id(r)] != 1:
                continue
            users = graph.users[id(r)]
            if len(users) != 1:
                continue
            u = users[0]
            while id(u) in self.fused and len(graph.users[id(u)]) == 1:  # up to the fused chain's root
                u = graph.users[id(u)][0]
            if u.op.kind != ELEMENTWISE or id(u) in self.fused or id(u) in updated or u.shape != r.shape \
                    or id(u) in self.epilogue_of:
                continue
            if all(self._epilogue_leaf(leaf, r) for leaf in self._leaves(u) if leaf is not r):
                self.epilogue_of[id(u)] = r
                self.epilogued.add(id(r))

    def _choose_matmul_epilogues(self) -> None:
        """A matmul read only by a chain of elementwise nodes of its own (M, N) shape and dtype hands
        its product to that chain inside the matmul kernel: the GEMM applies the chain to each element
        as it stores it (`relu(x @ W + b)`, relu's backward mask `dy @ W * (h > 0)`), so the bare
        product is never written out and read back. The chain's other operands are read at the same
        (row, col) through their views (a bias row broadcast over the rows, a saved activation).

        Not for a chain feeding a reduction or fused into several readers (a recompute choice stands),
        not for a chain that is already a reduction's epilogue, and not for a variable's new value:
        a loop kernel can write that straight into the variable, which the GEMM cannot (it stores
        partial sums into its output before the last K chunk)."""
        graph = self.graph
        updated = {id(new) for _, new in graph.updates}
        row_of = getattr(self, "row_of", {})  # row groups are chosen first
        for m in graph.nodes:
            if m.op.kind != MATMUL or self.uses[id(m)] != 1 or len(graph.users[id(m)]) != 1:
                continue
            u = graph.users[id(m)][0]
            chain = [u]
            while id(u) in self.fused and len(graph.users[id(u)]) == 1:  # up to the fused chain's root
                u = graph.users[id(u)][0]
                chain.append(u)
            if u.op.kind != ELEMENTWISE or id(u) in self.fused or id(u) in updated or id(u) in self.epilogue_of \
                    or u.shape != m.shape or u.dtype != m.dtype:
                continue
            if any(id(n) in row_of for n in chain):  # a row kernel computes it (and reads the product)
                continue
            self.epilogue_of[id(u)] = m
            self.epilogued.add(id(m))

    def _leaves(self, root: Value) -> list:
        """The values `root`'s fused group reads (its non-fused inputs, recursively)."""
        out, stack, seen = [], [root], set()
        while stack:
            n = stack.pop()
            for i in n.inputs:
                if id(i) in seen:
                    continue
                seen.add(id(i))
                if id(i) in self.fused:
                    stack.append(i)
                else:
                    out.append(i)
        return out

    def _epilogue_leaf(self, leaf: Value, r: Value) -> bool:
        if leaf.op.name == "const":
            value = leaf.attrs["value"]
            return not isinstance(value, np.ndarray) or value.size <= 1
        return leaf.shape == r.shape and (leaf.op.kind in (ELEMENTWISE, REDUCE, MATMUL)
                                          or leaf.op.name in ("input", "variable"))

    def _schedule(self) -> list:
        """A topological order of the nodes that keeps few bytes live at once (greedy list scheduling).

        Views (movement, sources, fused nodes) are placed as soon as they are ready. Among the
        ready kernels the one that frees the most bytes net of what it allocates runs first, ties
        going to the graph's own order: a layer's weight gradient and update run as soon as their
        inputs exist, before the backward moves on, so activations and gradients die early. The
        kernel computing a variable's new value waits for every other kernel reading the variable,
        so it can write the variable in place.
        """
        graph = self.graph
        nodes = graph.nodes
        index = {id(n): k for k, n in enumerate(nodes)}
        mat = {id(n): self._materializes(n) for n in nodes}
        # id(kernel node) -> ids of the buffers (materialized nodes, variables) its kernel reads, through
        # the views and fused nodes it computes itself. Only kernels: the running sets of every node
        # of a long fused chain would cost time quadratic in its length.
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
        deps = {id(n): {id(i) for i in n.inputs} for n in nodes}
        for member, leaves in self._row_deps().items():  # a row group runs as one kernel
            deps[member] |= leaves
        for target, new in graph.updates:
            if not mat.get(id(new)) or new.op.kind != ELEMENTWISE:
                continue
            ancestors = _ancestors(new)
            for n in nodes:
                if n is not new and mat[id(n)] and id(target) in reads[id(n)] and id(n) not in ancestors \
                        and id(new) not in _ancestors(n):
                    deps[id(new)].add(id(n))
        dims = {d: DEFAULT_DIM for d in graph.dims}
        size = {id(n): _concrete_bytes(n, dims) for n in nodes if mat[id(n)]}
        pinned = {id(v) for v in graph.outputs} | {id(new) for _, new in graph.updates}
        readers: dict[int, int] = {}
        for n in nodes:
            if mat[id(n)]:
                for b in reads[id(n)]:
                    readers[b] = readers.get(b, 0) + 1
        users: dict[int, list] = {id(n): [] for n in nodes}
        for n in nodes:
            for d in deps[id(n)]:
                users[d].append(n)
        waiting = {id(n): len(deps[id(n)]) for n in nodes}
        # Ready views wait in a heap by graph position (thousands of constants are ready at once);
        # ready kernels, few at a time, are compared by what running them frees.
        ready_views: list[int] = []
        ready_kernels: list = []

        def make_ready(n):
            if mat[id(n)]:
                ready_kernels.append(n)
            else:
                heapq.heappush(ready_views, index[id(n)])

        def gain(n):
            freed = sum(size.get(b, 0) for b in reads[id(n)]
                        if readers.get(b) == 1 and b not in pinned and b in size)
            return (size[id(n)] - freed, index[id(n)])
        for n in nodes:
            if waiting[id(n)] == 0:
                make_ready(n)
        order = []
        while ready_views or ready_kernels:
            if ready_views:
                pick = nodes[heapq.heappop(ready_views)]
            else:
                pick = min(ready_kernels, key=gain)
                ready_kernels = [n for n in ready_kernels if n is not pick]  # by identity: Value.__eq__ builds a node
                for b in reads[id(pick)]:
                    readers[b] -= 1
            order.append(pick)
            for u in users[id(pick)]:
                waiting[id(u)] -= 1
                if waiting[id(u)] == 0:
                    make_ready(u)
        if len(order) != len(nodes):  # a dependency cycle would be a bug here: keep the graph's order
            return list(nodes)
        return order


def _rowwise(node: Value) -> bool:
    """A reduction over the trailing axes of its input (softmax's row max and sum, a full sum)."""
    axes, ndim = tuple(node.attrs["axes"]), node.inputs[0].ndim
    return node.op.name in ("sum", "max", "argmax") and axes == tuple(range(ndim - len(axes), ndim))


# Per-element cost above which a value read by several kernels is stored rather than recomputed;
# a transcendental function (exp, log, tanh, ...) alone costs more.
RECOMPUTE_MAX_COST = 3
FUNCTION_COST = 8
NONDETERMINISTIC = frozenset({"random_bits"})


def _expr_cost(expr) -> int:
    """Operations per element of an elementwise expression; transcendental functions weigh FUNCTION_COST."""
    if expr is None:
        return FUNCTION_COST
    cost = 0
    for sub in sympy.preorder_traversal(sympy.sympify(expr)):
        if isinstance(sub, sympy.Function) and not isinstance(sub, (sympy.Piecewise, sympy.Max, sympy.Min,
                                                                     sympy.Abs, sympy.sign, sympy.Heaviside)):
            cost += FUNCTION_COST
        elif isinstance(sub, sympy.Pow) and not (sub.exp.is_Integer and abs(int(sub.exp)) <= 2):
            cost += FUNCTION_COST
        elif isinstance(sub, (sympy.Add, sympy.Mul)):
            cost += len(sub.args) - 1
        elif isinstance(sub, (sympy.Pow, sympy.Piecewise, sympy.Max, sympy.Min, sympy.Abs,
                              sympy.core.relational.Relational)):
            cost += 1
    return cost


DEFAULT_DIM = 64  # the value a Dim takes where a size must be a number before any call


def _concrete_bytes(node: Value, dims: dict) -> int:
    """Bytes of `node` with every Dim at the value `dims` gives it."""
    numel = S.evaluate(S.numel(node.shape), dims) if node.shape else 1
    return int(numel) * D.to_numpy(node.dtype).itemsize


def _reachable(roots) -> set:
    """ids of every node the roots depend on, the roots included."""
    seen, stack = set(), list(roots)
    while stack:
        n = stack.pop()
        if id(n) not in seen:
            seen.add(id(n))
            stack.extend(n.inputs)
    return seen


def _ancestors(node: Value) -> set:
    """ids of every node `node` depends on, itself included."""
    return _reachable([node])


def _forward_ids(graph: Graph) -> set:
    """The nodes the graph's outputs depend on (the forward pass of a training step)."""
    return _reachable(graph.outputs)


def _only_sign_tests(node: Value, users: list) -> bool:
    """Whether each user reads `node` only through a comparison with 0 (relu's derivative)."""
    for u in users:
        expr = u.op.expr
        if expr is None:
            return False
        for k, i in enumerate(u.inputs):
            if i is node:
                sym = ARGS[k]
                uses = [a for a in sympy.preorder_traversal(expr) if a == sym]
                tests = [r for r in sympy.preorder_traversal(expr)
                         if isinstance(r, sympy.core.relational.Relational) and sym in r.free_symbols]
                if not tests or len(uses) != len(tests):
                    return False
    return True


def _nbytes(shape, dtype):
    return S.numel(shape) * D.to_numpy(dtype).itemsize
