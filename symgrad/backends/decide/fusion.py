"""Fusion and save-or-recompute decisions: which elementwise nodes get no kernel of their own.

Which elementwise nodes are computed inside another kernel's loop instead of
getting one of their own (chains, reduction prologues and epilogues, matmul
epilogues, cheap values recomputed by each reader) and which forward values
are kept for the backward and why. Pure functions of the graph and of the
decisions made before them; symgrad.backends.decide.decisions puts them together.
"""

from __future__ import annotations

import numpy as np
import sympy

from ...ir import dtypes as D
from ...ir import shapes as S
from ...ir.elementwise import ARGS, expr_cost
from ...ir.graph import Graph, ancestors
from ...ir.registry import ATTENTION, CUSTOM, ELEMENTWISE, MATMUL, MOVEMENT, REDUCE, SOURCE
from ...ir.value import Value


def use_counts(graph: Graph) -> dict:
    """id(node) -> how many times it is read: by other nodes, as an output, as an update's new value."""
    return graph.use_counts()


def fused_chains(graph: Graph, uses: dict, fuse_reduce: bool) -> set:
    """ids of the nodes computed inside their one user's loop: an elementwise node read once, by an
    elementwise node of its own shape (or a single element, which costs nothing to recompute), or by
    a row-wise reduction (the prologue `exp(x - m)` of a row sum runs inside the sum's loop)."""
    fused = set()
    for node in graph.nodes:
        if node.op.kind != ELEMENTWISE or uses[id(node)] != 1:
            continue
        users = graph.users[id(node)]
        if len(users) == 1 and accepts(users[0], node, fuse_reduce):
            fused.add(id(node))
    return fused


def accepts(user: Value, node: Value, fuse_reduce: bool) -> bool:
    """Whether `user`'s kernel can compute the elementwise `node` itself, element by element."""
    if user.op.kind == ELEMENTWISE:
        return user.shape == node.shape or all(isinstance(s, int) and s == 1 for s in node.shape)
    if user.op.kind == REDUCE and fuse_reduce:
        return rowwise(user)
    return False


def group_cost(node: Value, fused) -> int:
    """Arithmetic cost of computing `node` with everything fused into it, per element."""
    cost, stack, seen = 0, [node], set()
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        cost += expr_cost(n.op.expr)
        stack.extend(i for i in n.inputs if id(i) in fused)
    return cost


def choose_recompute(graph: Graph, uses: dict, fused: set, fuse_reduce: bool, name) -> tuple[set, list]:
    """Save or recompute: a cheap elementwise value read by several kernels is recomputed inside
    each of them from the values it reads (which those kernels' neighbours keep anyway) instead
    of being stored and read back; everything else that is read later is kept. Returns the fused
    set with the recomputed values added, and each decision about a forward value that the
    backward reads, with its reason (`name`: a Namer, for the values' names)."""
    fused, choices = set(fused), []
    forward = _forward_ids(graph)
    for n in graph.nodes:
        if n.op.kind != ELEMENTWISE or id(n) in fused or n.op.expr is None:
            continue
        users = graph.users[id(n)]
        if uses[id(n)] != len(users) or len(users) < 2:
            continue  # an output or an update's value is stored anyway
        if n.op.name in NONDETERMINISTIC or not all(accepts(u, n, fuse_reduce) for u in users):
            continue
        cost = group_cost(n, fused)
        if cost > RECOMPUTE_MAX_COST:
            continue
        fused.add(id(n))
        choices.append(dict(
            value=name(n), op=n.op.name, decision="recompute",
            bytes=_nbytes(n.shape, n.dtype),
            reason=f"cheap elementwise (cost {cost}) read by {len(users)} kernels: computed inside each "
                   f"from its inputs instead of stored"))
    for n in graph.nodes:
        if id(n) not in forward or id(n) in fused or n.op.kind in (SOURCE, MOVEMENT, CUSTOM):
            continue
        backward_users = [u for u in graph.users[id(n)] if id(u) not in forward]
        if not backward_users:
            continue
        forward_users = [u for u in graph.users[id(n)] if id(u) in forward]
        readers = sorted({u.op.name for u in forward_users if not accepts(u, n, fuse_reduce)})
        if readers:
            why = f"stored anyway: the forward's {', '.join(readers)} reads it from memory"
        elif n.op.kind == ELEMENTWISE and expr_cost(n.op.expr) > RECOMPUTE_MAX_COST:
            why = f"{n.op.name} is costly to recompute (cost {group_cost(n, fused)})"
        elif n.op.kind in (MATMUL, REDUCE, ATTENTION):
            why = f"a {n.op.kind} result: recomputing it would repeat the whole {n.op.kind}"
        else:
            why = "read by kernels that cannot compute it themselves (another shape or a column sum)"
        if _only_sign_tests(n, backward_users):
            why += ("; the backward only tests its sign, but a 1-byte mask would add bytes to a value "
                    "stored anyway" if readers else "; the backward only tests its sign: a 1-byte mask "
                    "would do")
        choices.append(dict(value=name(n), op=n.op.name, decision="keep",
                            bytes=_nbytes(n.shape, n.dtype), reason=why))
    choices += _backward_copies(graph, forward, name)
    return fused, choices


def _backward_copies(graph: Graph, forward: set, name) -> list:
    """The report's records of the backward's own copies of forward values (symgrad.passes.remat):
    an elementwise node outside the forward computing what a forward node computes."""
    originals = {(n.op.name, tuple(id(i) for i in n.inputs), repr(n.attrs)): n for n in graph.nodes
                 if id(n) in forward and n.op.kind == ELEMENTWISE}
    records = []
    for n in graph.nodes:
        if id(n) in forward or n.op.kind != ELEMENTWISE:
            continue
        original = originals.get((n.op.name, tuple(id(i) for i in n.inputs), repr(n.attrs)))
        if original is not None:
            records.append(dict(value=name(n), op=n.op.name, decision="recompute", bytes=_nbytes(n.shape, n.dtype),
                                reason=f"computed again for the backward from values it holds anyway; the "
                                       f"forward's {name(original)} dies with the forward (passes/remat)"))
    return records


def materializes(node: Value, fused, epilogued) -> bool:
    """Whether `node` gets a kernel and a buffer of its own."""
    kind = node.op.kind
    if id(node) in epilogued:
        return False
    return kind in (REDUCE, MATMUL) or (kind == ELEMENTWISE and id(node) not in fused)


def choose_epilogues(graph: Graph, uses: dict, fused) -> dict:
    """id(elementwise root) -> the row-wise reduction whose kernel computes the root's fused group as
    it stores each reduced value (the epilogue). A reduction read only by one elementwise node of its
    own shape gets one, when everything else the node's fused group reads is a constant or a value of
    that same shape and layout."""
    epilogue_of: dict = {}
    updated = {id(new) for _, new in graph.updates}
    for r in graph.nodes:
        if r.op.kind != REDUCE or not rowwise(r) or uses[id(r)] != 1:
            continue
        users = graph.users[id(r)]
        if len(users) != 1:
            continue
        u = users[0]
        while id(u) in fused and len(graph.users[id(u)]) == 1:  # up to the fused chain's root
            u = graph.users[id(u)][0]
        if u.op.kind != ELEMENTWISE or id(u) in fused or id(u) in updated or u.shape != r.shape \
                or id(u) in epilogue_of:
            continue
        if all(_epilogue_leaf(leaf, r) for leaf in leaves(u, fused) if leaf is not r):
            epilogue_of[id(u)] = r
    return epilogue_of


def choose_matmul_epilogues(graph: Graph, uses: dict, fused, epilogue_of: dict, row_of: dict) -> dict:
    """id(elementwise root) -> the matmul whose kernel computes the root's chain as it stores each
    element (new entries beside the reductions' `epilogue_of`).

    A matmul read only by a chain of elementwise nodes of its own (M, N) shape and dtype hands
    its product to that chain inside the matmul kernel: the GEMM applies the chain to each element
    as it stores it (`relu(x @ W + b)`, relu's backward mask `dy @ W * (h > 0)`), so the bare
    product is never written out and read back. The chain's other operands are read at the same
    (row, col) through their views (a bias row broadcast over the rows, a saved activation).

    Not for a chain feeding a reduction or fused into several readers (a recompute choice stands),
    not for a chain that is already a reduction's epilogue or computed by a row kernel (`row_of`),
    and not for a variable's new value: a loop kernel can write that straight into the variable,
    which the GEMM cannot (it stores partial sums into its output before the last K chunk)."""
    chosen: dict = {}
    updated = {id(new) for _, new in graph.updates}
    for m in graph.nodes:
        if m.op.kind != MATMUL or m.ndim != 2 or uses[id(m)] != 1 or len(graph.users[id(m)]) != 1:
            continue  # (a batched product's GEMMs store each matrix apart: no epilogue there yet)
        u = graph.users[id(m)][0]
        chain = [u]
        while id(u) in fused and len(graph.users[id(u)]) == 1:  # up to the fused chain's root
            u = graph.users[id(u)][0]
            chain.append(u)
        if u.op.kind != ELEMENTWISE or id(u) in fused or id(u) in updated or id(u) in epilogue_of \
                or id(u) in chosen or u.shape != m.shape or u.dtype != m.dtype:
            continue
        if any(id(n) in row_of for n in chain):  # a row kernel computes it (and reads the product)
            continue
        chosen[id(u)] = m
    return chosen


def choose_stores_in_reader(graph: Graph, uses: dict, fused, taken) -> dict:
    """id(root) -> the values (graph order) its loop computes and also stores: a variable's new value
    read only by one elementwise loop of its own shape, which computes it in its own walk instead of
    reading it back. AdamW's moments are the case: the parameter's update reads m' and v', so one
    loop per parameter reads the gradient and the old state once and writes m, v and the
    parameter, where three loops read the gradient twice and the new moments back.

    `taken`: ids of the nodes other decisions give a kernel of their own kind (epilogue roots,
    row-group members, sums stored in place). Not for an output (its buffer is the caller's), nor
    for a value read by a reduction, another shape, or loops of two kernels."""
    updated: dict[int, int] = {}
    for _, new in graph.updates:
        updated[id(new)] = updated.get(id(new), 0) + 1
    outputs = {id(v) for v in graph.outputs}
    reader: dict[int, Value] = {}  # id(stored value) -> the loop root reading it
    for n in reversed(graph.nodes):  # readers first: a value read by a value stored in turn sees where that goes
        if n.op.kind != ELEMENTWISE or n.op.expr is None or id(n) in fused or id(n) in taken \
                or id(n) in outputs or updated.get(id(n)) != 1 or n.op.name in NONDETERMINISTIC:
            continue
        users = graph.users[id(n)]
        if not users or uses[id(n)] != len(users) + 1:
            continue
        roots = [_final(reader, _loop_root(graph, u, n.shape, fused, taken)) for u in users]
        if all(r is not None and r is roots[0] for r in roots):
            reader[id(n)] = roots[0]
    stores: dict[int, list] = {}
    for n in graph.nodes:
        root = reader.get(id(n))
        if root is not None:
            stores.setdefault(id(root), []).append(n)
    return {root: tuple(values) for root, values in stores.items()}


def _final(reader: dict, root: Value | None) -> Value | None:
    """The loop that computes `root`: itself, or where a value stored in turn is stored."""
    while root is not None and id(root) in reader:
        root = reader[id(root)]
    return root


def _loop_root(graph: Graph, user: Value, shape, fused, taken) -> Value | None:
    """The loop kernel's root that computes `user` (itself, or the end of the fused chain it is in),
    when every node on the way is elementwise of `shape`; else None."""
    while True:
        if user.op.kind != ELEMENTWISE or user.shape != shape or id(user) in taken:
            return None
        if id(user) not in fused:
            return user
        readers = graph.users[id(user)]
        if len(readers) != 1:
            return None  # recomputed by several kernels
        user = readers[0]


def leaves(root: Value, fused) -> list:
    """The values `root`'s fused group reads (its non-fused inputs, recursively)."""
    out, stack, seen = [], [root], set()
    while stack:
        n = stack.pop()
        for i in n.inputs:
            if id(i) in seen:
                continue
            seen.add(id(i))
            if id(i) in fused:
                stack.append(i)
            else:
                out.append(i)
    return out


def _epilogue_leaf(leaf: Value, r: Value) -> bool:
    if leaf.op.name == "const":
        value = leaf.attrs["value"]
        return not isinstance(value, np.ndarray) or value.size <= 1
    return leaf.shape == r.shape and (leaf.op.kind in (ELEMENTWISE, REDUCE, MATMUL)
                                      or leaf.op.name in ("input", "variable"))


def rowwise(node: Value) -> bool:
    """A reduction over the trailing axes of its input (softmax's row max and sum, a full sum)."""
    axes, ndim = tuple(node.attrs["axes"]), node.inputs[0].ndim
    return node.op.name in ("sum", "max", "argmax") and axes == tuple(range(ndim - len(axes), ndim))


# Per-element cost above which a value read by several kernels is stored rather than recomputed;
# a transcendental function (exp, log, tanh, ...) alone costs more.
RECOMPUTE_MAX_COST = 3
NONDETERMINISTIC = frozenset({"random_bits"})


DEFAULT_DIM = 64  # the value a Dim takes where a size must be a number before any call


def _forward_ids(graph: Graph) -> set:
    """The nodes the graph's outputs depend on (the forward pass of a training step)."""
    return ancestors(graph.outputs)


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
