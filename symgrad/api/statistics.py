"""Statistics along axes as torch computes them: var, std (with `correction=`), logsumexp and prod.

Composites of sum, max, slices and pointwise ops, so their gradients follow from their parts.
"""

from __future__ import annotations

import sympy

from . import functional as F
from . import indexing
from ..ir import shapes as S
from ..ir.value import Value
from .spellings import torch_dims

__all__ = ["var", "std", "logsumexp", "prod"]


@torch_dims
def var(x, axis=None, correction: int = 1, keepdims: bool = False, *, unbiased: bool | None = None) -> Value:
    """The variance over `axis` / `dim` (None: all), divided by N - correction (torch.var;
    correction=1, the unbiased estimate, is torch's default; torch's older `unbiased=False` is
    correction=0, and a bool in correction's place means what `unbiased` does).

    N - correction <= 0 (fixed sizes, or a Dim bound at run time) gives torch's values: the
    divisor is clamped at 0, so inf, or NaN where the squares sum to 0. The gradient there is
    torch's too: with axis=None, g * (NaN where x == mean, else inf); with an axis, 2 g (x - mean)
    divided by the clamped divisor: +-inf, NaN where x == mean. (Where N < correction torch's
    gradient with an axis divides by the negative N - correction, a finite gradient of an
    infinite value; symgrad divides by the 0 its value divides by, torch's gradient at
    correction = N.)
    """
    x = F._value(x, "var")
    correction = _correction("var", correction, unbiased)
    axes = S.normalize_axes(axis, x.ndim, "var")
    dof = S.numel([x.shape[a] for a in axes]) - correction
    if isinstance(dof, sympy.Basic) and not dof.is_number:
        # Known at run time only: the clamp and the choice below are computed there (B - 1 >= 0
        # for a Dim B, so sympy drops the Max of the default correction itself).
        divisor = sympy.Max(dof, 0)
        degenerate = F.less_equal(F.constant(divisor, x.dtype), 0)
    else:
        divisor = max(dof, 0)  # torch clamps the degrees of freedom at 0
        degenerate = divisor == 0
    mean = F.mean(x, axis=axes, keepdims=True)
    # Where the divisor is 0 the mean's path would add the gradient's mean, inf - inf = NaN in
    # every element; torch's backward leaves it out (it is 0: the centred values sum to 0).
    centred = x - _choose(degenerate, F.stop_gradient(mean), mean)
    squares = centred * centred
    if axis is None:
        # torch's dim=None backward at a divisor of 0 is g * inf whatever the sign of x - mean:
        # squares whose value is centred**2 and whose derivative is 2 |centred|.
        slope = F.stop_gradient(2 * F.abs(centred))
        unsigned = F.stop_gradient(squares) + (centred - F.stop_gradient(centred)) * slope
        squares = _choose(degenerate, unsigned, squares)
    total = F.sum(squares, axis=axes, keepdims=keepdims)
    return total * F.constant(F.ieee_ratio(1, divisor), total.dtype)


def _correction(op: str, correction, unbiased) -> int:
    """torch's `correction=`, or its older `unbiased=` (True: 1, False: 0); not both."""
    if unbiased is not None:
        if correction != 1:
            raise TypeError(f"{op}: got both unbiased= and correction=; give one")
        return int(bool(unbiased))
    return correction


def _choose(condition, if_true: Value, if_false: Value) -> Value:
    """if_true where `condition` holds: decided here for a Python bool, at run time for a graph
    value (a condition on a Dim)."""
    if isinstance(condition, Value):
        return F.where(condition, if_true, if_false)
    return if_true if condition else if_false


@torch_dims
def std(x, axis=None, correction: int = 1, keepdims: bool = False, *, unbiased: bool | None = None) -> Value:
    """sqrt(var(x, axis, correction)), as torch.std (`dim=`, `keepdim=`, `unbiased=` as var);
    its gradient is 0 where it is 0 (torch's std_backward masks sqrt's infinite derivative
    there: equal elements, one of them)."""
    variance = var(x, axis=axis, correction=_correction("std", correction, unbiased), keepdims=keepdims)
    # where() passes nothing to the branch not taken, so sqrt's inf at 0 never reaches var.
    return F.sqrt(F.where(F.equal(variance, 0), F.stop_gradient(variance), variance))


@torch_dims
def logsumexp(x, axis=None, keepdims: bool = False) -> Value:
    """log(sum(exp(x))) over `axis`, computed stably (torch.logsumexp): shifted by the max,
    which is taken as 0 where it is infinite, so a row of -inf gives -inf and one +inf gives inf."""
    x = F._value(x, "logsumexp")
    axes = S.normalize_axes(axis, x.ndim, "logsumexp")
    if any(x.shape[a] == 0 for a in axes):  # nothing to shift by: log(0) = -inf, as torch
        return F.log(F.sum(F.exp(x), axis=axes, keepdims=keepdims))
    peak = F.stop_gradient(F.max(x, axis=axes, keepdims=True))
    shift = F.where(F.equal(F.abs(peak), float("inf")), 0.0, peak)
    total = F.log(F.sum(F.exp(x - shift), axis=axes, keepdims=True)) + shift
    return total if keepdims else F.squeeze(total, axis=axes)


@torch_dims
def prod(x, axis=None, keepdims: bool = False) -> Value:
    """The product over `axis` (None: all), as torch.prod; the product of nothing is 1.

    The reduced axes are merged into one, which is multiplied as a balanced tree of halves (each
    half a slice, so a view): its gradient is then the product of the other elements, exact where
    some are zero and to any order, with no division (torch's backward special-cases zeros)."""
    x = F._value(x, "prod")
    axes = S.normalize_axes(axis, x.ndim, "prod")
    if not all(isinstance(x.shape[a], int) for a in axes):
        raise ValueError(f"prod: the reduced axes {list(axes)} of x {S.format_shape(x.shape)} "
                         "must have fixed sizes (a product tree is built over them)")
    kept = [a for a in range(x.ndim) if a not in axes]
    count = int(S.numel([x.shape[a] for a in axes]))
    rows = F.reshape(F.transpose(x, kept + list(axes)), [x.shape[a] for a in kept] + [count])
    if count == 0:
        product = F.sum(rows, axis=-1, keepdims=True) + 1   # (zero gradient, as the 1 has none)
    else:
        leftovers = []  # the last element of an odd-length level, multiplied in at the end
        while count > 1:
            if count % 2:
                leftovers.append(indexing.narrow(rows, -1, count - 1, 1))
                count -= 1
            rows = indexing.narrow(rows, -1, 0, count // 2) * indexing.narrow(rows, -1, count // 2, count // 2)
            count //= 2
        product = rows
        for leftover in reversed(leftovers):
            product = product * leftover
    product = F.squeeze(product, axis=-1)
    if keepdims:
        product = F.reshape(product, [1 if a in axes else x.shape[a] for a in range(x.ndim)])
    return product
