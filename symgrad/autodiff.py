"""Reverse mode: the backward graph, built from each op's VJP rule.

`grad` walks the graph from `y` back to the values asked for, once, in
reverse topological order (what PyTorch's engine does on every
`loss.backward()`, done here while the graph is built). Cotangents from
several uses of a value are summed; a cotangent at a broadcast shape is
summed back to the input's shape. The result is graph code, so it can be
differentiated again.
"""

from __future__ import annotations

from typing import Sequence

from .api import functional as F
from .ir import autocast
from .ir import dtypes as D
from .ir import shapes as S
from .ir.graph import toposort
from .ir.value import Value


def unbroadcast(g: Value, shape: tuple) -> Value:
    """Sum `g` over the axes along which a value of `shape` was broadcast to g's shape."""
    if g.shape == shape:
        return g
    full = S.broadcast_shapes(g.shape, shape, op="grad")
    if full != g.shape:
        # A cotangent smaller than its value (a custom backward's scalar): spread it first.
        g = F.broadcast_to(g, full)
        if g.shape == shape:
            return g
    lead = g.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, s in enumerate(shape)
                                      if isinstance(s, int) and s == 1 and g.shape[lead + i] != 1)
    if axes:
        g = F.sum(g, axis=axes, keepdims=True)
    return F.reshape(g, shape)


def _zeros(v: Value) -> Value:
    return F.broadcast_to(F.constant(0, v.dtype), v.shape)


def _holds_nothing(v: Value) -> bool:
    """Whether v has no elements (a fixed axis of size 0): nothing after it depends on its inputs,
    so no cotangent passes through it. Chaining its (empty) cotangent back instead would multiply a
    zero by each op's local derivative on the way, and 0 * inf is NaN where the gradient is 0."""
    return any(isinstance(s, int) and s == 0 for s in v.shape)


def _vjp_through_decomposition(node: Value, g: Value, wants: tuple) -> list:
    """The cotangents of an op without a VJP rule, from its decomposition (OpDef.decompose):
    partial derivatives, each input a leaf (an input that is itself computed from another, as
    attention_grad's `out` from q, k and v, passes its share on through the outer walk), and an
    input given at several positions receives its cotangent once."""
    first: dict[int, int] = {}
    for n, (inp, want) in enumerate(zip(node.inputs, wants)):
        if want:
            first.setdefault(id(inp), n)
    positions = sorted(first.values())
    grads = _grad(node.op.decompose(node), [node.inputs[n] for n in positions], g, leaves=True)
    result: list = [None] * len(node.inputs)
    for n, ct in zip(positions, grads):
        result[n] = ct
    return result


def grad(y: Value, wrt, grad_output=None):
    """Gradients of `y` with respect to `wrt` (a value or a list of them), as graph values.

    y must be a scalar unless `grad_output` (the cotangent of y, its shape)
    is given, as with torch.autograd.grad's grad_outputs. A value that y
    does not depend on gets zeros; an integer or bool value gets None.
    """
    if not isinstance(y, Value):
        raise TypeError(f"grad: y must be a graph value, got {type(y).__name__}")
    single = isinstance(wrt, Value)
    targets: Sequence[Value] = [wrt] if single else list(wrt)
    for k, w in enumerate(targets):
        if not isinstance(w, Value):
            raise TypeError(f"grad: wrt[{k}] must be a graph value, got {type(w).__name__}")
    if not D.is_float(y.dtype):
        raise TypeError(f"grad: y must be a float value, got {y.dtype} {S.format_shape(y.shape)}")
    if grad_output is None:
        if y.shape != ():
            raise ValueError(f"grad: y has shape {S.format_shape(y.shape)}; grad of a non-scalar needs "
                             f"grad_output= of that shape (as torch.autograd.grad's grad_outputs)")
        seed = F.constant(1.0, y.dtype)
    else:
        seed = grad_output if isinstance(grad_output, Value) else F.constant(grad_output, y.dtype)
        if seed.shape != y.shape:
            raise ValueError(f"grad: grad_output has shape {S.format_shape(seed.shape)}, "
                             f"y has shape {S.format_shape(y.shape)}")
        seed = F.cast(seed, y.dtype)
    with autocast.disabled():  # a backward follows its forward's dtypes, as torch's autograd
        results = _grad(y, targets, seed)
    return results[0] if single else results


def _grad(y: Value, targets: Sequence[Value], seed: Value, leaves: bool = False) -> list:
    """The cotangents of `targets` from `seed` at y (checked by `grad`); with `leaves`, the walk
    stops at the targets: partial derivatives, as if each were an input of its own."""
    nodes = toposort([y])
    wanted = {id(w) for w in targets}
    # Only values downstream of something in `wrt` need a cotangent.
    depends: set[int] = set()
    for n in nodes:
        if id(n) in wanted or any(id(i) in depends for i in n.inputs):
            depends.add(id(n))

    cotangents: dict[int, Value] = {id(y): seed}
    for node in reversed(nodes):
        g = cotangents.get(id(node))
        if g is None or not node.inputs or (leaves and id(node) in wanted) or _holds_nothing(node):
            continue
        wants = tuple(id(i) in depends and D.is_float(i.dtype) for i in node.inputs)
        if not any(wants):
            continue
        if node.op.vjp is not None:
            contributions = node.op.vjp(node, g, wants)
        elif node.op.decompose is not None:
            contributions = _vjp_through_decomposition(node, g, wants)
        else:
            raise NotImplementedError(f"grad: op {node.op.name!r} has no VJP rule "
                                      f"(needed to differentiate {node.type_str} = {node.op.name}(...))")
        if len(contributions) != len(node.inputs):
            raise RuntimeError(f"grad: VJP of {node.op.name!r} returned {len(contributions)} "
                               f"cotangents for {len(node.inputs)} inputs")
        for inp, ct, want in zip(node.inputs, contributions, wants):
            if ct is None or not want:
                continue
            ct = F.cast(unbroadcast(ct, inp.shape), inp.dtype)
            previous = cotangents.get(id(inp))
            cotangents[id(inp)] = ct if previous is None else F.add(previous, ct)

    results = []
    for w in targets:
        if not D.is_float(w.dtype):
            results.append(None)
        else:
            g = cotangents.get(id(w))
            results.append(_zeros(w) if g is None else g)
    return results
