"""Transposes sunk below the elementwise work that reads them: computing in the source's layout.

A convolution's GEMM produces its output channels last, (N, H, W, C), and conv2d hands it back
channels first, transpose(y, (0, 3, 1, 2)) as torch lays it out; BatchNorm and ReLU then read it
across the grain, and the next convolution transposes it back to channels last (a copy, to
reshape it into patch rows). The backward does the same in mirror. This pass moves each
transpose below the nodes that read it, so they compute in the layout of what was transposed:

    op(transpose(x, p), b)           ->  transpose(op(x, b'), p)          (elementwise; b small or
                                                                           transposed by the same p)
    reduce(transpose(x, p), axes)    ->  reduce(x, p[axes]), transposed when its kept axes move
    embed / slice(transpose(x, p))   ->  transpose(embed / slice(x), p)    (padding and its gradient)
    transpose(transpose(x, p), q)    ->  transpose(x, p[q]), or x          (simplify's rule)
    transpose(a @ b)                 ->  b^T @ a^T                          (the product read only so)

Transposes are free views in the lowering, but the kernels that read through one walk memory
across the grain; once sunk, a chain of them meets the next transpose and cancels, and the
channels-last values are read and written in order. The small operands (a BatchNorm scale of
shape (C, 1, 1)) are reshaped and transposed to match, a few elements each.

Where a region of such nodes is left through anything else (a pooling window's take, a flatten,
a product), sinking would only move the transposed read into a contiguous copy before that
reader: `worth_sinking` decides per connected region, before any rewrite. The residual network's
step: 228-233 -> 177-181 ms (AVX-512, 2 threads); LeNet's graph is left as it was.

A product read only through the transpose of its last two axes is computed transposed instead
(`product_transposed`): a Linear layer's weight gradient, x^T dy handed back as (out, in), then
reaches AdamW's update in order rather than with a stride of a row per element.
"""

from __future__ import annotations

from ..ir import shapes as S
from ..ir.graph import Graph
from ..ir.registry import ELEMENTWISE, GATHER, MOVEMENT, REDUCE, lookup
from ..ir.value import Value, make
from .rewrite import is_nondeterministic, rebuild
from .simplify import transpose_transpose

SMALL = 8   # an operand at most 1/SMALL of the node's elements is transposed to match (a broadcast one)


def _inverse(perm: tuple) -> tuple:
    inverse = [0] * len(perm)
    for k, p in enumerate(perm):
        inverse[p] = k
    return tuple(inverse)


def _transpose(x: Value, perm: tuple) -> Value:
    return x if perm == tuple(range(len(perm))) else make(lookup("transpose"), (x,), perm=perm)


def _transposed(node: Value) -> tuple | None:
    """(x, perm) when `node` is transpose(x, perm) of a value of 3 or more axes, else None."""
    if node.op.name == "transpose" and node.ndim >= 3:
        return node.inputs[0], node.attrs["perm"]
    return None


def _small(operand: Value, node: Value) -> bool:
    """Whether `operand` (of known size) has at most 1/SMALL of `node`'s elements, counting only the
    node's known sizes (a Dim batch counts as 1: a lower bound)."""
    n = S.numel(operand.shape)
    known = 1
    for size in node.shape:
        known *= size if isinstance(size, int) else 1
    return isinstance(n, int) and n * SMALL <= known


def _operands_in(node: Value, perm: tuple):
    """`node`'s inputs in the layout a transpose by `perm` came from: a transpose by perm gives its
    source, a scalar stays, a small operand is padded to the node's rank and transposed by perm's
    inverse; None when an input is full-size in the other layout (it would be transposed whole)."""
    inverse, inputs = _inverse(perm), []
    for operand in node.inputs:
        t = _transposed(operand)
        if t is not None and t[1] == perm and operand.ndim == node.ndim:
            inputs.append(t[0])
        elif operand.ndim == 0:
            inputs.append(operand)
        elif operand.ndim <= node.ndim and _small(operand, node):
            padded = (1,) * (node.ndim - operand.ndim) + tuple(operand.shape)
            reshaped = operand if operand.ndim == node.ndim else make(lookup("reshape"), (operand,),
                                                                      shape=S.as_shape(padded))
            inputs.append(_transpose(reshaped, inverse))
        else:
            return None
    return inputs


def _perm_of(node: Value, sunk: set) -> tuple | None:
    """The perm of the first input of `node` that is a transpose chosen to sink (in `sunk`), else None."""
    for operand in node.inputs:
        t = _transposed(operand)
        if t is not None and id(operand) in sunk and operand.shape == node.shape:
            return t[1]
    return None


def sink_through_elementwise(node: Value, sunk: set) -> Value | None:
    """op(transpose(x, p), b, ...) -> transpose(op(x, b', ...), p), for a transpose in `sunk` of the
    node's full shape; the other inputs as _operands_in gives them."""
    perm = _perm_of(node, sunk) if node.op.kind == ELEMENTWISE and node.ndim >= 3 else None
    inputs = None if perm is None else _operands_in(node, perm)
    return None if inputs is None else _transpose(make(node.op, tuple(inputs), **node.attrs), perm)


def sink_through_reduce(node: Value, sunk: set) -> Value | None:
    """reduce(transpose(x, p), axes) -> reduce(x, p[axes]), then transposed back when keepdims, or
    when the kept axes come out of x in another order. (argmax over one axis only: its index is
    along that axis, which the permutation does not change.)"""
    if node.op.kind != REDUCE or len(node.inputs) != 1 or id(node.inputs[0]) not in sunk:
        return None
    t = _transposed(node.inputs[0])
    if t is None or (node.op.name == "argmax" and len(node.attrs["axes"]) != 1):
        return None
    x, perm = t
    axes = tuple(sorted(perm[a] for a in node.attrs["axes"]))
    reduced = make(node.op, (x,), **{**node.attrs, "axes": axes})
    if node.attrs["keepdims"]:
        return _transpose(reduced, perm)
    kept_x = [j for j in range(x.ndim) if j not in axes]                       # reduced's axes, in order
    kept = [perm[k] for k in range(node.inputs[0].ndim) if k not in node.attrs["axes"]]  # node's, as x's axes
    return _transpose(reduced, tuple(kept_x.index(j) for j in kept))


def sink_through_window(node: Value, sunk: set) -> Value | None:
    """embed(transpose(x, p)) / slice(transpose(x, p)) -> transpose(embed / slice(x), p): each per-axis
    attribute (starts, stops, steps, the embedded shape) moved to x's axes."""
    if node.op.name not in ("embed", "slice") or id(node.inputs[0]) not in sunk:
        return None
    t = _transposed(node.inputs[0])
    if t is None:
        return None
    x, perm = t
    inverse = _inverse(perm)
    attrs = dict(node.attrs)
    for name in ("starts", "stops", "steps", "shape"):
        if name in attrs:
            attrs[name] = tuple(attrs[name][inverse[j]] for j in range(x.ndim))
    return _transpose(make(node.op, (x,), **attrs), perm)


def _gathered(x: Value) -> bool:
    """Whether `x` is a gathered value (a take: a convolution's patches) under movement ops."""
    while x.op.kind == MOVEMENT:
        x = x.inputs[0]
    return x.op.kind == GATHER


def product_transposed(node: Value, uses: dict) -> Value | None:
    """transpose(a @ b) -> b^T @ a^T, the transpose swapping the last two axes of a product that
    nothing else reads: the GEMM stores the product in the layout its readers want (its operands'
    transposes are only strides), so a weight gradient, computed as x^T dy and handed back
    transposed, reaches the optimizer's update in order instead of across the grain. Casts between
    the transpose and the product, each read once, are applied again to the new product: under
    autocast a float32 weight's gradient is transpose(cast(a @ b)), its bfloat16 product's. Not
    for a gathered operand (a convolution's patches, which the GEMM reads as they lie only as its
    first)."""
    if node.op.name != "transpose":
        return None
    casts, product = [], node.inputs[0]
    while product.op.name == "cast" and uses.get(id(product)) == 1:
        casts.append(product)
        product = product.inputs[0]
    if product.op.name != "matmul" or uses.get(id(product)) != 1:
        return None
    n = node.ndim
    swap = tuple(range(n - 2)) + (n - 1, n - 2)
    a, b = product.inputs
    if node.attrs["perm"] != swap or a.ndim != n or b.ndim != n or _gathered(a) or _gathered(b):
        return None

    def transposed(x: Value) -> Value:
        t = _transpose(x, swap)
        cancelled = transpose_transpose(t)
        return t if cancelled is None else cancelled

    new = make(product.op, (transposed(b), transposed(a)), **product.attrs)
    for cast in reversed(casts):  # innermost first
        new = make(cast.op, (new,), **cast.attrs)
    return new


RULES = (sink_through_elementwise, sink_through_reduce, sink_through_window)
MAX_SWEEPS = 50


def _cancels(p: tuple, q: tuple) -> bool:
    return tuple(p[j] for j in q) == tuple(range(len(p)))


def worth_sinking(graph: Graph, users: dict) -> set:
    """ids of the transposes worth sinking: those whose region ends well.

    The transposes of one perm sink together (a forward value and the gradient it meets in the
    backward, say relu's output and its gradient in relu's backward, each transposed the same
    way): the region is every elementwise node (of the full shape), embed and slice reached from
    them through readers, split into its connected parts. A part is sunk when it is left only
    through a transpose that cancels it or a reduction, and each of its elementwise nodes reads
    only the part, scalars, small operands and transposes of the same perm. Any other reader (a
    gather, a product, a reshape) wants the original layout: sinking would add a contiguous copy
    before it (a pooling window's take, a flatten) where now one kernel reads across the grain."""
    chosen: set = set()
    perms = {n.attrs["perm"] for n in graph.nodes if _transposed(n)}
    for perm in perms:
        seeds = [n for n in graph.nodes if _transposed(n) and n.attrs["perm"] == perm]
        region = {id(n): n for n in seeds}
        todo = list(seeds)
        while todo:
            value = todo.pop()
            for reader in users[id(value)]:
                if id(reader) not in region and (
                        (reader.op.kind == ELEMENTWISE and reader.shape == value.shape and reader.ndim >= 3)
                        or (reader.op.name in ("embed", "slice") and reader.inputs[0] is value)):
                    region[id(reader)] = reader
                    todo.append(reader)
        parent = {k: k for k in region}

        def find(k):
            while parent[k] != k:
                parent[k] = parent[parent[k]]
                k = parent[k]
            return k
        for node in region.values():
            for i in node.inputs:
                if id(i) in region and node.op.name != "transpose":
                    parent[find(id(i))] = find(id(node))
        bad = set()
        for node in region.values():
            if node.op.kind == ELEMENTWISE and not all(
                    id(i) in region or i.ndim == 0 or _small(i, node) for i in node.inputs):
                bad.add(find(id(node)))
            for reader in users[id(node)]:
                if reader.op.name == "transpose":
                    ok = reader.inputs[0] is node and _cancels(perm, reader.attrs["perm"])
                else:
                    ok = id(reader) in region or (reader.op.kind == REDUCE and len(reader.inputs) == 1 and (
                        reader.op.name != "argmax" or len(reader.attrs["axes"]) == 1))
                if not ok:
                    bad.add(find(id(node)))
        chosen |= {id(n) for n in seeds if find(id(n)) not in bad}
    return chosen


def layout(graph: Graph, counts: dict | None = None) -> Graph:
    """The graph with transposes sunk below the elementwise nodes, reductions and windows that read
    them (see the module doc), cancelling where they meet their inverse.

    Only a transpose `worth_sinking` is sunk, and the transposes that sinking it leaves below each
    node, which carry the same decision down the region. Sweeps until nothing fires."""
    for _ in range(MAX_SWEEPS):
        # (again each sweep: a region whose other readers were sunk by the last one may end well now)
        fired, sunk, uses = False, worth_sinking(graph, graph.users), graph.use_counts()

        def at_node(node: Value) -> Value:
            nonlocal fired
            if is_nondeterministic(node):
                return node
            while True:
                new, name = transpose_transpose(node), "transpose_transpose"
                if new is None:
                    new, name = product_transposed(node, uses), "product_transposed"
                for rule in RULES if new is None else ():
                    new, name = rule(node, sunk), rule.__name__
                    if new is not None:
                        break
                if new is None:
                    return node
                if new.op.name == "transpose" and name != "transpose_transpose":
                    sunk.add(id(new))          # the same decision, one node further down
                if counts is not None:
                    counts[name] = counts.get(name, 0) + 1
                fired, node = True, new

        rebuilt = rebuild(graph, at_node)
        if not fired:
            return graph
        graph = rebuilt
    return graph
