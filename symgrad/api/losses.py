"""The losses of torch.nn.functional, with torch's arguments and meanings: nll_loss and
cross_entropy (`weight=`, `ignore_index=`, `label_smoothing=`, probability targets, inputs of
[N, C], [C] or [N, C, d1, ...]), and mse_loss; each with `reduction=` "mean" | "sum" | "none".

Written as graph code on symgrad.api.functional, so their gradients follow from their parts. A
target equal to `ignore_index` contributes nothing, and "mean" divides by the count (or the
class weights) of the targets that are not ignored, counted at run time, as torch does: a batch
whose targets are all ignored has a NaN mean loss, as in torch.
"""

from __future__ import annotations

import numbers

import numpy as np

from . import functional as F
from ..ir import dtypes as D
from ..ir import shapes as S
from ..ir.value import Value

__all__ = ["nll_loss", "cross_entropy", "mse_loss"]

REDUCTIONS = ("mean", "sum", "none")


def _check_reduction(reduction, op: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def _reduce_loss(per_element: Value, reduction: str, op: str) -> Value:
    """torch's reductions of a loss per element, "mean" over every element."""
    _check_reduction(reduction, op)
    if reduction == "mean":
        return F.mean(per_element)
    return F.sum(per_element) if reduction == "sum" else per_element


def _rows(scores, target, op: str, arg: str):
    """`scores` [N, C] (or [C], or [N, C, d1, ...]) as rows [M, C] with the classes last, `target`
    [N] (or [], or [N, d1, ...]) as [M], and the target's shape (the shape of an unreduced loss)."""
    scores, target = F._value(scores, op, arg), F._value(target, op, "target")
    expected = () if scores.ndim == 1 else scores.shape[:1] + scores.shape[2:]
    if scores.ndim == 0 or target.ndim != len(expected) or \
            not all(S.same_size(a, b) for a, b in zip(target.shape, expected)):
        raise ValueError(f"{op}: expects {arg} [N,C] and target [N] (or [C] and [], or [N,C,d1,...] and "
                         f"[N,d1,...]), got {S.format_shape(scores.shape)} and {S.format_shape(target.shape)}")
    if scores.ndim == 2:
        return scores, target, target.shape
    if scores.ndim == 1:
        return F.reshape(scores, (1, scores.shape[0])), F.reshape(target, (1,)), ()
    classes_last = F.transpose(scores, axes=(0,) + tuple(range(2, scores.ndim)) + (1,))
    return F.reshape(classes_last, (-1, scores.shape[1])), F.reshape(target, (-1,)), target.shape


def _class_weight(weight, classes, dtype: str, op: str) -> Value | None:
    """torch's `weight=` (one number per class) as a graph value of the scores' dtype."""
    if weight is None:
        return None
    if not isinstance(weight, Value):
        weight = F.constant(np.asarray(weight), dtype)
    if weight.ndim != 1 or not S.same_size(weight.shape[0], classes):
        raise ValueError(f"{op}: weight must hold one number per class ([{classes}]), "
                         f"got {S.format_shape(weight.shape)}")
    return weight if weight.dtype == dtype else F.cast(weight, dtype)


def _nll_rows(log_probs: Value, target: Value, weight, ignore_index: int, reduction: str, op: str,
              label_smoothing: float = 0.0) -> tuple[Value, Value | None]:
    """The loss of each row [M] and, for "mean", the divisor: the count (or the class weights) of
    the rows whose target is not ignored. `label_smoothing` mixes in the uniform distribution."""
    classes = log_probs.shape[1]
    if not isinstance(ignore_index, numbers.Integral) or isinstance(ignore_index, bool):
        raise TypeError(f"{op}: ignore_index must be an int, got {ignore_index!r}")
    labels = F.class_labels(target, classes, op, "target", ignore_index=ignore_index)
    kept = F.not_equal(labels, F.constant(int(ignore_index), labels.dtype))
    mask = F._class_mask(labels, classes)
    zero = F.constant(0, log_probs.dtype)
    # Each row's target entry selected, not one_hot * log_probs: a masked class (log-probability
    # -inf) would give 0 * -inf = nan in the sum, where torch's gather gives the target's value.
    picked = F.sum(F.where(mask, log_probs, zero), axis=1)
    w = _class_weight(weight, classes, log_probs.dtype, op)
    if w is not None:
        row_weight = F.sum(F.where(mask, F.broadcast_to(w, log_probs.shape), zero), axis=1)
        picked = picked * row_weight
    loss = -picked
    # A label can only select a class where ignore_index is one (0 <= ignore_index < C): only
    # then do the ignored rows need zeroing; otherwise their mask is empty and their loss 0.
    selectable = ignore_index >= 0 and not (isinstance(classes, int) and ignore_index >= classes)
    if selectable:
        loss = F.where(kept, loss, zero)  # where, not a product: their entries may be infinite
    if label_smoothing:
        # torch: (1 - e) * nll + e / C * (-sum over classes of w_c * log p_c), per kept row;
        # label_smoothing / classes is a sympy expression where the classes are a Dim.
        spread = log_probs if w is None else log_probs * w
        smooth = F.where(kept, -F.sum(spread, axis=1), zero)
        loss = loss * (1.0 - label_smoothing) + smooth * F.constant(label_smoothing / classes, smooth.dtype)
    divisor = None
    if reduction == "mean":
        counted = F.cast(kept, log_probs.dtype) if w is None else \
            F.where(kept, row_weight, zero) if selectable else row_weight  # (0 where nothing is selected)
        divisor = F.sum(counted)
    return loss, divisor


def _finish(loss: Value, divisor: Value | None, reduction: str, shape: tuple) -> Value:
    if reduction == "mean":
        return F.sum(loss) / divisor
    if reduction == "sum":
        return F.sum(loss)
    return F.reshape(loss, shape)


def nll_loss(input, target, weight=None, ignore_index: int = -100, reduction: str = "mean") -> Value:
    """torch.nn.functional.nll_loss: the negative log-likelihood of integer `target` under rows
    of log-probabilities `input` ([N, C] with target [N]; [C] with []; [N, C, d1, ...] with
    [N, d1, ...]). `weight`: one weight per class. A target equal to `ignore_index` adds nothing
    and is not counted by "mean", which divides by the (weighted) count of the others."""
    _check_reduction(reduction, "nll_loss")
    rows, labels, shape = _rows(input, target, "nll_loss", "input")
    loss, divisor = _nll_rows(rows, labels, weight, ignore_index, reduction, "nll_loss")
    return _finish(loss, divisor, reduction, shape)


def cross_entropy(input, target, weight=None, ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0) -> Value:
    """torch.nn.functional.cross_entropy: log_softmax over the classes (axis 1, or 0 of a [C]
    input), then the negative log-likelihood of `target`.

    `target` holds class indices (integers, shaped as for nll_loss, with `ignore_index` as
    there), or class probabilities (floats, shaped as `input`). `label_smoothing` in [0, 1]
    mixes the target with the uniform distribution over the classes, as torch does. "mean" over
    class indices divides by the (weighted) count of the targets not ignored; over
    probabilities, by the number of rows.
    """
    op = "cross_entropy"
    _check_reduction(reduction, op)
    if not isinstance(label_smoothing, numbers.Real) or not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{op}: label_smoothing must lie in [0, 1], got {label_smoothing!r}")
    input, target = F._value(input, op, "input"), F._value(target, op, "target")
    if D.is_float(target.dtype):
        return _soft_cross_entropy(input, target, weight, reduction, float(label_smoothing))
    rows, labels, shape = _rows(input, target, op, "input")
    log_probs = F.log_softmax(rows, axis=1)
    loss, divisor = _nll_rows(log_probs, labels, weight, ignore_index, reduction, op, float(label_smoothing))
    return _finish(loss, divisor, reduction, shape)


def _soft_cross_entropy(input: Value, target: Value, weight, reduction: str, label_smoothing: float) -> Value:
    """cross_entropy against class probabilities: -sum_c w_c p_c log softmax(input)_c per row."""
    op = "cross_entropy"
    if input.shape != target.shape and not (len(input.shape) == len(target.shape) and all(
            S.same_size(a, b) for a, b in zip(input.shape, target.shape))):
        raise ValueError(f"{op}: class probabilities must have the input's shape, got input "
                         f"{S.format_shape(input.shape)} and target {S.format_shape(target.shape)}")
    axis = 0 if input.ndim == 1 else 1
    classes = input.shape[axis]
    if target.dtype != input.dtype:
        target = F.cast(target, D.result_type(input, target))
    if label_smoothing:
        target = target * (1.0 - label_smoothing) + label_smoothing / classes
    terms = F.log_softmax(input, axis=axis) * target
    w = _class_weight(weight, classes, terms.dtype, op)
    if w is not None:
        terms = terms * F.reshape(w, (classes,) + (1,) * (input.ndim - 1 - axis))
    loss = -F.sum(terms, axis=axis)
    if reduction == "mean":
        # torch divides by the number of rows (N * d1 * ...), not the weights.
        return F.mean(loss)
    return _reduce_loss(loss, reduction, op)


def mse_loss(input, target, reduction: str = "mean") -> Value:
    """Mean squared error (torch.nn.functional.mse_loss)."""
    input, target = F._lift(input, target, "mse_loss")
    if input.shape != target.shape:
        S.broadcast_shapes(input.shape, target.shape, op="mse_loss")
    diff = input - target
    return _reduce_loss(diff * diff, reduction, "mse_loss")
