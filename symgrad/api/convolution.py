"""Convolution and padding in torch's terms: conv1d, conv2d, pad, written as graph code.

A 2-D convolution is im2col and a matrix product: the padded input is gathered
(`take`) at a fixed index map into patches. Without groups the input is read
channels last, so the patches of the whole batch are the rows of one matrix
(N*H_out*W_out, KH*KW*C), multiplied once by the weight as (KH*KW*C, O); with
groups, each image's patches (C, KH*KW, H_out*W_out) meet the weight in a
batched product, groups as a batch axis. The gather's gradient is one
scatter_add (col2im), so backward is as short as forward. The C backend
stores no patch matrix its GEMM reads (the forward product's and the
weight gradient's): the GEMM gathers each block from the image as it packs
it (symgrad.backends.decide.patches, implicit GEMM).
Padding is a primitive too: zeros are `embed` (the input written into a
larger zero array), reflect and replicate are `take` with a fixed index map.
"""

from __future__ import annotations

import numbers

import numpy as np

from . import functional as F
from ..ir import shapes as S
from ..ir.value import Value
from ..narrow_limit import NARROW_N

__all__ = ["conv1d", "conv2d", "pad", "output_size"]

SHORT_PATCH = 64      # patch lengths (C*KH*KW) below which those dot products are mostly overhead


def _pair(value, name: str, op: str) -> tuple[int, int]:
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value), int(value)
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, numbers.Integral) for v in value):
        return int(value[0]), int(value[1])
    raise ValueError(f"{op}: {name} must be an int or a pair of ints, got {value!r}")


def output_size(size: int, kernel: int, stride: int, padding: int, dilation: int, ceil_mode: bool = False) -> int:
    """torch's output length of a window op: floor (or ceil) of the span over the stride, plus one;
    in ceil mode the last window must start inside the input or its left padding."""
    span = size + 2 * padding - dilation * (kernel - 1) - 1
    if span < 0:
        return 0
    out = (-(-span // stride) if ceil_mode else span // stride) + 1
    if ceil_mode and (out - 1) * stride >= size + padding:
        out -= 1
    return out


def pad(x, padding, mode: str = "constant", value: float = 0.0) -> Value:
    """torch.nn.functional.pad: `padding` pairs (left, right) from the last axis backwards;
    mode "constant" (with `value`), "reflect" or "replicate"."""
    x = F._value(x, "pad")
    padding = tuple(padding)
    if len(padding) % 2 or len(padding) // 2 > x.ndim or not all(isinstance(p, numbers.Integral) and p >= 0
                                                                  for p in padding):
        raise ValueError(f"pad: padding must be non-negative int pairs for at most {x.ndim} axes of "
                         f"{x.type_str}, got {padding}")
    if mode not in ("constant", "reflect", "replicate"):
        raise ValueError(f"pad: mode must be 'constant', 'reflect' or 'replicate', got {mode!r}")
    pairs = [(0, 0)] * x.ndim
    for k in range(len(padding) // 2):
        pairs[x.ndim - 1 - k] = (padding[2 * k], padding[2 * k + 1])
    if mode == "constant":
        shape = tuple(S.as_size(s + lo + hi) for s, (lo, hi) in zip(x.shape, pairs))
        out = F.embed(x, shape, [lo for lo, _ in pairs], [1] * x.ndim)
        if value != 0:
            inside = F.embed(F.broadcast_to(F.constant(True), x.shape), shape, [lo for lo, _ in pairs], [1] * x.ndim)
            out = F.where(inside, out, F.constant(value, x.dtype))
        return out
    for axis, (lo, hi) in enumerate(pairs):
        if lo == hi == 0:
            continue
        size = x.shape[axis]
        if not isinstance(size, int):
            raise ValueError(f"pad: {mode} padding of the symbolic axis {axis} of {x.type_str}")
        if mode == "reflect" and (lo >= size or hi >= size):
            raise ValueError(f"pad: reflect padding ({lo}, {hi}) must be below the size {size} of axis {axis}")
        positions = np.arange(-lo, size + hi)
        if mode == "reflect":
            positions = np.abs(positions)
            positions = np.where(positions >= size, 2 * (size - 1) - positions, positions)
        else:
            positions = np.clip(positions, 0, size - 1)
        x = F.take(x, F.constant(positions.astype(np.int64)), axis=axis, checked=True)
    return x


def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups: int = 1) -> Value:
    """torch.nn.functional.conv2d: input (N, C, H, W), weight (O, C/groups, KH, KW), bias (O,);
    padding an int, a pair, "valid" or "same" (stride 1)."""
    x, w = F._value(input, "conv2d", "input"), F._value(weight, "conv2d", "weight")
    if x.ndim != 4 or w.ndim != 4:
        raise ValueError(f"conv2d: expects input (N, C, H, W) and weight (O, C/groups, KH, KW), got "
                         f"{x.type_str} and {w.type_str}")
    N, C, H, W = x.shape
    O, Cg, KH, KW = w.shape
    if not isinstance(groups, numbers.Integral) or groups < 1 or C % groups or O % groups or Cg != C // groups:
        raise ValueError(f"conv2d: input {x.type_str} and weight {w.type_str} do not fit groups={groups} "
                         f"(weight's axis 1 must be C/groups, O a multiple of groups)")
    (sh, sw), (dh, dw) = _pair(stride, "stride", "conv2d"), _pair(dilation, "dilation", "conv2d")
    if isinstance(padding, str):
        if padding == "valid":
            pads = ((0, 0), (0, 0))
        elif padding == "same":
            if (sh, sw) != (1, 1):
                raise ValueError("conv2d: padding='same' needs stride 1 (as torch)")
            total = (dh * (KH - 1), dw * (KW - 1))
            pads = tuple((t // 2, t - t // 2) for t in total)   # torch puts the odd one on the right
        else:
            raise ValueError(f"conv2d: padding must be an int, a pair, 'valid' or 'same', got {padding!r}")
    else:
        ph, pw = _pair(padding, "padding", "conv2d")
        pads = ((ph, ph), (pw, pw))
    if any(p for pair in pads for p in pair):
        x = pad(x, (pads[1][0], pads[1][1], pads[0][0], pads[0][1]))
    Hp, Wp = x.shape[2], x.shape[3]
    Ho = output_size(Hp, KH, sh, 0, dh)
    Wo = output_size(Wp, KW, sw, 0, dw)
    if Ho < 1 or Wo < 1:
        raise ValueError(f"conv2d: the kernel {KH}x{KW} (dilation {dh}, {dw}) is larger than the padded "
                         f"input {Hp}x{Wp}")
    # im2col as one gather: patch element (i, j) of output position (ho, wo) is pixel
    # (ho*sh + i*dh) * Wp + wo*sw + j*dw of the flattened padded image. Its gradient is one
    # scatter_add (col2im), the sums of overlapping windows added in a fixed order.
    K2, L = KH * KW, Ho * Wo
    taps = (np.arange(KH)[:, None] * dh * Wp + np.arange(KW)[None, :] * dw).reshape(K2)
    starts = (np.arange(Ho)[:, None] * sh * Wp + np.arange(Wo)[None, :] * sw).reshape(L)
    if groups == 1 and not (O <= NARROW_N and C * K2 < SHORT_PATCH):
        # Channels last: the image as (N, Hp*Wp, C) pixel rows, gathered into (N, L, K2, C), which
        # is (N*L, K2*C) patch rows: ONE product for the whole batch, (N*L, K2*C) @ (K2*C, O), and
        # the backward's two are single products too (the weight's gradient over all N*L
        # positions), large enough for the GEMM's tiles and threads. (A few output channels
        # over short patches, a first layer's, take the per-image products below.)
        pixels = F.reshape(F.transpose(x, (0, 2, 3, 1)), (N, Hp * Wp, C))
        patches = F.take(pixels, F.constant((starts[:, None] + taps[None, :]).astype(np.int64)), axis=1,
                         checked=True, purpose=f"conv2d {KH}x{KW} im2col, channels last: "
                                               f"{S.format_size(N * L)} x {K2 * C} patch rows, one GEMM")
        kernel = F.reshape(F.transpose(w, (2, 3, 1, 0)), (K2 * C, O))
        product = F.matmul(F.reshape(patches, (N * L, K2 * C)), kernel)                  # (N*L, O)
        out = F.transpose(F.reshape(product, (N, Ho, Wo, O)), (0, 3, 1, 2))
    else:
        # One product per image and group: (O/g, C/g * K2) @ (C/g * K2, L), the weight broadcast
        # over N. Also without groups when O is narrow and the patches short: as one product, each
        # output would be a dot product along C*K2 (the narrow kernels'), mostly a partial vector
        # and a horizontal sum when C*K2 is short (LeNet's first layer: 25); per image, the
        # products run along the L output positions. LeNet's step: 4.15 -> 3.27 ms (AVX-512, 2 threads).
        flat = F.reshape(x, (N, C, Hp * Wp))
        patches = F.take(flat, F.constant((taps[:, None] + starts[None, :]).astype(np.int64)), axis=2,
                         checked=True, purpose=f"conv2d {KH}x{KW} im2col, groups={groups}: {Cg * K2} x {L} "
                                               "patches per image and group")  # (N, C, K2, L)
        cols = F.reshape(patches, (N, groups, Cg * K2, L))
        kernel = F.reshape(w, (groups, O // groups, Cg * K2))
        out = F.reshape(F.matmul(kernel, cols), (N, O, Ho, Wo))                           # (N, g, O/g, L)
    if bias is not None:
        b = F._value(bias, "conv2d", "bias")
        if b.shape != (O,):
            raise ValueError(f"conv2d: bias must be [{O}], got {b.type_str}")
        out = out + F.reshape(b, (O, 1, 1))
    return out


def conv1d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups: int = 1) -> Value:
    """torch.nn.functional.conv1d: input (N, C, L), weight (O, C/groups, K): conv2d over a height of 1."""
    x, w = F._value(input, "conv1d", "input"), F._value(weight, "conv1d", "weight")
    if x.ndim != 3 or w.ndim != 3:
        raise ValueError(f"conv1d: expects input (N, C, L) and weight (O, C/groups, K), got {x.type_str} and {w.type_str}")
    one = lambda v: v if isinstance(v, str) else (0 if v is None else (v if isinstance(v, numbers.Integral) else v[0]))  # noqa: E731
    out = conv2d(F.expand_dims(x, 2), F.expand_dims(w, 2), bias, (1, one(stride)),
                 padding if isinstance(padding, str) else (0, one(padding)), (1, one(dilation)), groups)
    return F.squeeze(out, 2)
