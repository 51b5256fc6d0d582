"""Pointwise functions beyond arithmetic: erf, log1p, softplus, GELU, sign, rounding, clip,
masked_fill.

Each is one elementwise op (symgrad/ir/ops.py), so its derivative comes from
sympy and it fuses into the kernels around it. Arguments and results follow
torch: `softplus(x, beta, threshold)`, `gelu(x, approximate=)`, `clip` as
`torch.clamp`; the rounding functions and sign have gradient 0.
"""

from __future__ import annotations

import numpy as np

from .functional import _lift, _unary, _value, apply_elementwise, constant, where
from ..ir import dtypes as D
from ..ir.value import Value

__all__ = ["erf", "log1p", "softplus", "gelu", "sign", "floor", "ceil", "round", "trunc", "clip", "masked_fill"]

erf, log1p, sign = (_unary(n) for n in ("erf", "log1p", "sign"))


def softplus(x, beta: float = 1.0, threshold: float = 20.0) -> Value:
    """log(1 + exp(beta * x)) / beta, and x where beta * x > threshold (torch's softplus):
    finite for every finite x, its gradient sigmoid(beta * x) never NaN."""
    x = _value(x, "softplus")
    if not beta > 0:
        raise ValueError(f"softplus: beta must be positive, got {beta!r}")
    x, beta_value = _lift(x, float(beta), "softplus")
    _, threshold_value = _lift(x, float(threshold), "softplus")
    return apply_elementwise("softplus", (x, beta_value, threshold_value))


def gelu(x, approximate: str = "none") -> Value:
    """x * Phi(x), Phi the standard normal CDF (approximate="none"), or its tanh approximation
    (approximate="tanh"), as torch.nn.functional.gelu."""
    x = _value(x, "gelu")
    ops = {"none": "gelu", "tanh": "gelu_tanh"}
    if approximate not in ops:
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return apply_elementwise(ops[approximate], (x,))


def _rounding(name: str):
    op = _unary(name)

    def fn(x) -> Value:
        x = _value(x, name)
        return x if not D.is_float(x.dtype) else op(x)  # integers are already whole, as in torch
    fn.__name__, fn.__doc__ = name, op.__doc__ + " Gradient 0; integers are returned as they are."
    return fn


floor, ceil, round, trunc = (_rounding(n) for n in ("floor", "ceil", "round", "trunc"))


def clip(x, min=None, max=None) -> Value:
    """x limited to [min, max], as torch.clamp: min and max are numbers or graph values (either
    may be None, not both); max wins where min > max; NaN stays NaN; the gradient is 1 on the
    closed interval and 0 outside."""
    x = _value(x, "clip")
    if min is None and max is None:
        raise ValueError("clip: give min, max or both")

    def bound(value, extreme: str) -> Value:
        if value is not None:
            return _lift(x, value, "clip")[1]
        if D.is_float(x.dtype):
            return constant(float(extreme + "inf"), x.dtype)
        info = np.iinfo(D.to_numpy(x.dtype))
        return constant(int(info.min if extreme == "-" else info.max), x.dtype)

    return apply_elementwise("clip", (x, bound(min, "-"), bound(max, "+")))


def masked_fill(x, mask, value) -> Value:
    """x with `value` where the bool `mask` (broadcast to x's shape) holds, as torch's masked_fill:
    a causal mask of -inf gives exact zeros after softmax. The gradient to x is 0 where filled."""
    x = _value(x, "masked_fill")
    mask = _value(mask, "masked_fill", "mask")
    if mask.dtype != "bool":
        raise TypeError(f"masked_fill: mask must be bool, got {mask.dtype} {mask.type_str}")
    filled = where(mask, value, x)
    if tuple(filled.shape) != tuple(x.shape):
        raise ValueError(f"masked_fill: mask {mask.type_str} must broadcast to the input {x.type_str}, "
                         f"not widen it to {list(filled.shape)}")
    return filled
