"""Fused attention: `attention` and its gradient `attention_grad` (kind attention).

    attention(q, k, v; causal, scale)       softmax(q @ k^T * scale [causal mask]) @ v
    attention_grad(q, k, v, out, g; ...)    [dq, dk, dv] stacked on a new first axis

q, k and v share one shape (*batch, T, D): the self-attention of a transformer
block, which is what torch's scaled_dot_product_attention computes for it. The
T x T matrix of probabilities is never a value of the graph: compiled code
computes it a tile of query rows against a block of keys at a time (flash
attention's online softmax) and recomputes it in the backward from q and k, so
the memory plan holds q, k, v, the output and k (and v) transposed per head. The backward's row sums
D_i = sum_d g[i, d] * out[i, d] come from the forward's output, as flash
attention's do; `out` is an input of the gradient for that reason.

Shapes that differ (cross-attention, another value width), a mask given as a
tensor and dropout stay composite (symgrad.nn.functional writes them as graph
code). The gradient has no VJP rule of its own: a second derivative goes through
its decomposition into matmuls and a softmax (`OpDef.decompose`), as torch's math
backend computes one, so only that derivative holds T x T matrices.
"""

from __future__ import annotations

import numpy as np

from . import dtypes as D
from . import shapes as S
from .registry import ATTENTION, OpDef, lookup, register
from .value import functions as _F  # symgrad.api.functional, for the decomposition written as graph code
from .value import make


MAX_HEAD = 512  # the largest head dimension (last axis) the fused kernels take


def refusal(op: str, named: list) -> str | None:
    """Why fused attention cannot take these (name, value) operands, or None when it can: every
    operand a float value of one dtype and one shape (*batch, T, E), E fixed and at most MAX_HEAD."""
    (first_name, first), *rest = named
    if first.ndim < 2 or not D.is_float(first.dtype):
        return f"{op}: {first_name} must be a float value of >= 2 axes (*batch, T, D), got {first.type_str}"
    if not isinstance(first.shape[-1], int) or not 0 < first.shape[-1] <= MAX_HEAD:
        return (f"{op}: the head dimension of {first_name} {first.type_str} must be a fixed size in "
                f"1..{MAX_HEAD} (the kernels hold rows of it on the stack)")
    for name, v in rest:
        if v.dtype != first.dtype or not S.same_shape(v.shape, first.shape):
            return (f"{op}: {name} {v.type_str} differs from {first_name} {first.type_str}; fused "
                    f"attention takes one shape and dtype for all of them")
    return None


def _check_operands(op: str, names: tuple, inputs) -> None:
    """Raise the refusal, if any, as the op's shape rule."""
    why = refusal(op, list(zip(names, inputs)))
    if why:
        raise ValueError(why)


def _attention_infer(inputs, attrs):
    _check_operands("attention", ("query", "key", "value"), inputs)
    return inputs[0].shape, inputs[0].dtype


def _attention_grad_infer(inputs, attrs):
    _check_operands("attention_grad", ("query", "key", "value", "output", "cotangent"), inputs)
    return (3, *inputs[0].shape), inputs[0].dtype


def probabilities(q: np.ndarray, k: np.ndarray, causal: bool, scale: float) -> np.ndarray:
    """softmax(q @ k^T * scale) over the keys, key j hidden from query i when causal and j > i."""
    scores = np.matmul(q, np.swapaxes(k, -1, -2)) * q.dtype.type(scale)
    if causal:
        rows, cols = scores.shape[-2:]
        scores = np.where(np.tril(np.ones((rows, cols), bool)), scores, -np.inf)
    shifted = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def _attention_numpy(args, node, env):
    q, k, v = args
    return np.matmul(probabilities(q, k, node.attrs["causal"], node.attrs["scale"]), v).astype(q.dtype)


# D_i = g_i . out_i stands for sum_j p_ij dp_ij, which it equals while both are finite. Where a
# cotangent row holds an infinity they part: torch's sum_j p_ij dp_ij is then +-inf or NaN and
# p_ij (dp_ij - D_i), infinite minus infinite, is NaN throughout the row, while g_i . out_i may be
# an infinity of the other sign, which leaves infinities instead. So a D that is not finite is NaN
# (here, in the decomposition below and in the C and CUDA kernels): the row's ds are NaN,
# as torch's.


def _attention_grad_numpy(args, node, env):
    q, k, v, out, g = args
    scale = q.dtype.type(node.attrs["scale"])
    p = probabilities(q, k, node.attrs["causal"], node.attrs["scale"])
    dv = np.matmul(np.swapaxes(p, -1, -2), g)
    dp = np.matmul(g, np.swapaxes(v, -1, -2))
    rows = (g * out).sum(axis=-1, keepdims=True)  # D_i = sum_j p_ij dp_ij, from the output
    rows = np.where(np.isfinite(rows), rows, np.nan)  # a D that is not finite is NaN (above)
    ds = p * (dp - rows) * scale
    dq = np.matmul(ds, k)
    dk = np.matmul(np.swapaxes(ds, -1, -2), q)
    return np.stack([dq, dk, dv]).astype(q.dtype)


def _attention_vjp(node, g, wants):
    q, k, v = node.inputs
    grads = attention_grad(q, k, v, node, g, node.attrs["causal"], node.attrs["scale"])
    return [grads[n] if wants[n] else None for n in range(3)]


def _swap(x):
    """x with its last two axes swapped."""
    return _F().transpose(x, tuple(range(x.ndim - 2)) + (x.ndim - 1, x.ndim - 2))


def _attention_grad_decomposed(node):
    """attention_grad as graph code of matmuls, a softmax and a stack: what autodiff differentiates
    for a second derivative (the T x T matrices exist here, as in torch's math backend)."""
    F = _F()
    q, k, v, out, g = node.inputs
    scale = F.constant(node.attrs["scale"], q.dtype)
    scores = F.matmul(q, _swap(k)) * scale
    if node.attrs["causal"]:
        rows = scores.shape[-2:]
        row, col = (make(lookup("iota"), shape=rows, axis=axis, dtype="int64") for axis in (0, 1))
        scores = F.where(F.less_equal(col, row), scores, float("-inf"))
    p = F.softmax(scores, axis=-1)
    rows = F.sum(g * out, axis=-1, keepdims=True)
    rows = F.where(F.less(F.abs(rows), float("inf")), rows, float("nan"))  # not finite: NaN (as the op)
    ds = p * (F.matmul(g, _swap(v)) - rows) * scale
    parts = (F.matmul(ds, k), F.matmul(_swap(ds), q), F.matmul(_swap(p), g))
    stacked = None  # [dq, dk, dv]: each embedded at its index of the new first axis, the three added
    for n, part in enumerate(parts):
        placed = F.embed(F.expand_dims(part, 0), node.shape, (n,) + (0,) * part.ndim, (1,) * node.ndim)
        stacked = placed if stacked is None else stacked + placed
    return stacked


def attention(q, k, v, causal: bool, scale: float):
    """The fused attention node of q, k, v (one shape (*batch, T, D)): out[i] = sum_j p_ij v[j]."""
    return make(ATTENTION_OP, (q, k, v), causal=bool(causal), scale=float(scale))


def attention_grad(q, k, v, out, g, causal: bool, scale: float):
    """[dq, dk, dv] of fused attention, stacked on a new first axis, from its output and cotangent."""
    return make(ATTENTION_GRAD_OP, (q, k, v, out, g), causal=bool(causal), scale=float(scale))


ATTENTION_OP = register(OpDef("attention", ATTENTION, _attention_infer, _attention_numpy, _attention_vjp,
                              doc="softmax(q @ k^T * scale, causal mask) @ v, never holding the T x T matrix"))
ATTENTION_GRAD_OP = register(OpDef("attention_grad", ATTENTION, _attention_grad_infer, _attention_grad_numpy,
                                   doc="dq, dk, dv of attention (stacked), the probabilities recomputed",
                                   decompose=_attention_grad_decomposed))
