"""Pooling and resizing in torch's terms: max_pool2d, avg_pool2d, adaptive_avg_pool2d, interpolate.

A window op over (N, C, H, W) sees its windows as (N, C, H_out, W_out, kh*kw): windows that tile the
input (stride = kernel, no padding, no dilation: LeNet's pools and most CNNs') are its view
(N, C, Ho, kh, Wo, kw) with the axes moved, copied once; other windows are gathered by one `take` of
the flattened image at a fixed index map. The tiles' copy costs a quarter of the gather, and its
gradient is the copy back, where the gather's is a scatter-add. Average
pooling sums the last axis; max pooling keeps its first maximum (argmax), so a tie sends the whole
gradient to the first element of the window in row-major order, as torch's
max_pool2d does, and a NaN in a window wins, as in torch.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from . import functional as F
from .convolution import _pair, output_size, pad
from .indexing import stack
from ..ir import shapes as S
from ..ir.value import Value

__all__ = ["max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "interpolate", "flatten"]


def _windows(x: Value, kernel, stride, padding, dilation, ceil_mode: bool, fill: float, op: str):
    """The windows of the input padded with `fill` (and on the right as far as ceil mode reaches):
    (N, C, Ho, Wo, kh*kw), each window's elements in row-major order; a copy of the input's tiles
    where the windows tile it, else gathered by one `take` of the flattened image at a fixed index map."""
    if x.ndim != 4:
        raise ValueError(f"{op}: expects an (N, C, H, W) input, got {x.type_str}")
    (kh, kw) = _pair(kernel, "kernel_size", op)
    (sh, sw) = _pair(kernel if stride is None or stride == [] else stride, "stride", op)
    (ph, pw), (dh, dw) = _pair(padding, "padding", op), _pair(dilation, "dilation", op)
    if ph > kh // 2 or pw > kw // 2:
        raise ValueError(f"{op}: padding ({ph}, {pw}) must be at most half the kernel ({kh}, {kw}), as torch requires")
    H, W = x.shape[2], x.shape[3]
    if not isinstance(H, int) or not isinstance(W, int):
        raise ValueError(f"{op}: the spatial axes of {x.type_str} must be fixed sizes")
    Ho, Wo = output_size(H, kh, sh, ph, dh, ceil_mode), output_size(W, kw, sw, pw, dw, ceil_mode)
    if Ho < 1 or Wo < 1:
        raise ValueError(f"{op}: the window {kh}x{kw} does not fit the input {H}x{W} with padding ({ph}, {pw})")
    geometry = (kh, kw, sh, sw, ph, pw, H, W, Ho, Wo)
    if (sh, sw) == (kh, kw) and (ph, pw, dh, dw) == (0, 0, 1, 1) and Ho * kh <= H and Wo * kw <= W:
        # Tiles: the rows and columns the windows cover (floor mode drops the rest), split into
        # (Ho, kh) and (Wo, kw), a view; each window's kh x kw elements then made one axis.
        N, C = x.shape[0], x.shape[1]
        tiles = F.reshape(x[:, :, :Ho * kh, :Wo * kw], (N, C, Ho, kh, Wo, kw))
        return F.reshape(F.transpose(tiles, (0, 1, 2, 4, 3, 5)), (N, C, Ho, Wo, kh * kw)), geometry
    # Right padding: what the last window reaches beyond the input (ceil mode reads past it).
    right_h = max(0, (Ho - 1) * sh + dh * (kh - 1) + 1 - H - ph)
    right_w = max(0, (Wo - 1) * sw + dw * (kw - 1) + 1 - W - pw)
    if ph or pw or right_h or right_w:
        x = pad(x, (pw, right_w, ph, right_h), value=fill)
    N, C, Hp, Wp = x.shape
    taps = (np.arange(kh)[:, None] * dh * Wp + np.arange(kw)[None, :] * dw).reshape(1, 1, kh * kw)
    starts = (np.arange(Ho)[:, None, None] * sh * Wp + np.arange(Wo)[None, :, None] * sw)
    slices = F.take(F.reshape(x, (N, C, Hp * Wp)), F.constant((starts + taps).astype(np.int64)), axis=2,
                    checked=True)
    return slices, geometry


def max_pool2d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False,
               return_indices: bool = False) -> Value:
    """torch.nn.functional.max_pool2d: the maximum of each window (-inf where it reaches padding)."""
    if return_indices:
        raise NotImplementedError("max_pool2d: return_indices is not supported")
    x = F._value(input, "max_pool2d")
    stacked, (kh, kw, sh, sw, ph, pw, H, W, Ho, Wo) = _windows(x, kernel_size, stride, padding, dilation,
                                                               ceil_mode, float("-inf"), "max_pool2d")
    count = stacked.shape[-1]
    if count == 1:
        return F.squeeze(stacked, -1)
    # torch's scan keeps the first maximum and lets every NaN replace it: the last NaN wins, inf too.
    # It scans the window's elements inside the input only: where they are all -inf, the first of
    # them is the maximum (and gets the gradient), not the -inf padding before it.
    offsets = F.reshape(_offsets(count), (1, 1, 1, 1, count))
    nan = F.not_equal(stacked, stacked)
    key = F.where(nan, F.constant(float("-inf"), x.dtype), stacked)
    (dh, dw) = _pair(dilation, "dilation", "max_pool2d")
    rows = np.arange(Ho)[:, None, None, None] * sh + np.arange(kh)[None, None, :, None] * dh - ph
    cols = np.arange(Wo)[None, :, None, None] * sw + np.arange(kw)[None, None, None, :] * dw - pw
    inside = F.constant(((rows >= 0) & (rows < H) & (cols >= 0) & (cols < W)).reshape(1, 1, Ho, Wo, count))
    tops = F.where(inside, F.equal(key, F.max(key, axis=-1, keepdims=True)), F.constant(False, "bool"))
    # One argmax finds that element: a NaN at offset k scores 2 count + k (the last NaN scores
    # highest, above every other element), a maximum inside the input count - k (the first scores
    # highest), the rest 0; every nonzero score is unique. Three reductions of the window (the
    # maximum, this argmax, the sum below), not five.
    score = F.where(nan, offsets + 2 * count,
                    F.where(tops, F.constant(count, "int64") - offsets, F.constant(0, "int64")))
    first = F.argmax(score, axis=-1)
    chosen = F.equal(F.expand_dims(first, -1), offsets)
    return F.sum(F.where(chosen, stacked, F.constant(0, x.dtype)), axis=-1)


def _offsets(count: int) -> Value:
    return F.constant(np.arange(count, dtype=np.int64))


def avg_pool2d(input, kernel_size, stride=None, padding=0, ceil_mode: bool = False,
               count_include_pad: bool = True, divisor_override: int | None = None) -> Value:
    """torch.nn.functional.avg_pool2d: each window's mean, over its kernel size or (with
    count_include_pad=False) over the elements inside the input."""
    x = F._value(input, "avg_pool2d")
    windows, (kh, kw, sh, sw, ph, pw, H, W, Ho, Wo) = _windows(x, kernel_size, stride, padding, 1, ceil_mode, 0.0,
                                                               "avg_pool2d")
    total = F.sum(windows, axis=-1)
    if divisor_override is not None:
        return total / float(divisor_override)
    # torch divides by the window clipped to the padded input (ceil mode's overhang excluded), or by
    # the part inside the input without padding: fixed numbers per output position.
    rows = [(min(i * sh - ph + kh, H + ph) - (i * sh - ph), min(i * sh - ph + kh, H) - max(i * sh - ph, 0))
            for i in range(Ho)]
    cols = [(min(j * sw - pw + kw, W + pw) - (j * sw - pw), min(j * sw - pw + kw, W) - max(j * sw - pw, 0))
            for j in range(Wo)]
    k = 0 if count_include_pad else 1
    counts = np.outer([r[k] for r in rows], [c[k] for c in cols]).astype(np.float64)
    return total / F.constant(counts, x.dtype)


def adaptive_avg_pool2d(input, output_size) -> Value:
    """torch.nn.functional.adaptive_avg_pool2d: output cell (i, j) averages rows
    floor(i*H/Ho) .. ceil((i+1)*H/Ho) and the same for columns."""
    x = F._value(input, "adaptive_avg_pool2d")
    if x.ndim != 4:
        raise ValueError(f"adaptive_avg_pool2d: expects an (N, C, H, W) input, got {x.type_str}")
    Ho, Wo = _pair(output_size, "output_size", "adaptive_avg_pool2d")
    H, W = x.shape[2], x.shape[3]
    rows = []
    for i in range(Ho):
        r0, r1 = (i * H) // Ho, -(-(i + 1) * H // Ho)
        cols = []
        for j in range(Wo):
            c0, c1 = (j * W) // Wo, -(-(j + 1) * W // Wo)
            cols.append(F.mean(x[:, :, r0:r1, c0:c1], axis=(2, 3)))
        rows.append(stack(cols, axis=-1))
    return stack(rows, axis=-2)


def interpolate(input, size=None, scale_factor=None, mode: str = "nearest") -> Value:
    """torch.nn.functional.interpolate with mode="nearest" on (N, C, L) or (N, C, H, W): output
    index o reads input index floor(o * in / out)."""
    x = F._value(input, "interpolate")
    if mode != "nearest":
        raise NotImplementedError(f"interpolate: mode {mode!r} is not supported (only 'nearest')")
    spatial = x.shape[2:]
    if not spatial:
        raise ValueError(f"interpolate: expects (N, C, ...) with spatial axes, got {x.type_str}")
    if (size is None) == (scale_factor is None):
        raise ValueError("interpolate: give exactly one of size and scale_factor")
    if size is not None:
        out = [size] * len(spatial) if isinstance(size, numbers.Integral) else list(size)
        scales = [s / o for s, o in zip(spatial, out)]
    else:
        factors = [scale_factor] * len(spatial) if isinstance(scale_factor, numbers.Number) else list(scale_factor)
        out = [int(math.floor(s * f)) for s, f in zip(spatial, factors)]
        scales = [1.0 / f for f in factors]
    for axis, (n_in, n_out, scale) in enumerate(zip(spatial, out, scales)):
        index = np.minimum(np.floor(np.arange(n_out) * scale).astype(np.int64), n_in - 1)
        x = F.take(x, F.constant(index), axis=2 + axis, checked=True)
    return x


def flatten(input, start_dim: int = 0, end_dim: int = -1) -> Value:
    """torch.flatten: axes start_dim..end_dim merged into one."""
    x = F._value(input, "flatten")
    if x.ndim == 0:
        return F.reshape(x, (1,))
    start, end = (S.normalize_axes(d, x.ndim, "flatten")[0] for d in (start_dim, end_dim))
    if start > end:
        raise ValueError(f"flatten: start_dim {start_dim} comes after end_dim {end_dim} for {x.type_str}")
    return F.reshape(x, (*x.shape[:start], S.numel(x.shape[start:end + 1]), *x.shape[end + 1:]))
