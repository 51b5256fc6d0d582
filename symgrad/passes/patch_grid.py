"""The geometry of a stride-1 convolution's patch index map, read back from the map alone.

conv2d (symgrad.api.convolution) gathers its patches at a constant index map idx (position l, tap
t -> pixel idx[l, t] of the padded image, rows of Wp pixels). For a k x k kernel at stride 1 and
dilation 1, output (y, x) reads tap (ky, kx) at pixel origin + (y + ky) * Wp + x + kx: a grid of
output rows over a grid of pixel rows. The col2im pass (its input gradient as a convolution of
the padded output gradient) and the C backend's Winograd convolution both need that grid; this
finds it, or says there is none, from the map alone (the taps may come in any order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Grid:
    """Output (y, x), y < Ho, x < Wo, reads tap (ky, kx) (ky, kx < k) at pixel
    origin + (y + ky) * Wp + x + kx, which is column tap[k * ky + kx] of the index map."""

    k: int
    Ho: int
    Wo: int
    Wp: int
    origin: int
    tap: tuple        # k * k ints, row-major over (ky, kx)


def grid(indices: np.ndarray) -> Grid | None:
    """The Grid of an index map (L positions, k * k taps), or None when it is not a k x k stride-1
    convolution's with output rows narrower than the pixel rows (k > 1)."""
    if indices.ndim != 2 or indices.shape[0] == 0:
        return None
    k = math.isqrt(indices.shape[1])
    if k < 2 or k * k != indices.shape[1]:
        return None
    offsets = indices[0] - indices[0].min()
    ranked = np.sort(offsets)
    Wp = int(ranked[k])
    window = (np.arange(k)[:, None] * Wp + np.arange(k)[None, :]).reshape(-1)
    if Wp < k or not np.array_equal(ranked, window):
        return None
    base = indices[:, int(np.argmin(indices[0]))]      # each position's tap (0, 0)
    if not np.array_equal(indices - base[:, None], np.broadcast_to(offsets, indices.shape)):
        return None
    L = base.size
    breaks = np.flatnonzero(np.diff(base) != 1)
    Wo = int(breaks[0]) + 1 if breaks.size else L
    if L % Wo or Wo + k - 1 > Wp:
        return None
    Ho, origin = L // Wo, int(base[0])
    if not np.array_equal(base, (origin + np.arange(Ho)[:, None] * Wp + np.arange(Wo)[None, :]).reshape(-1)):
        return None
    column = {int(o): t for t, o in enumerate(offsets)}
    return Grid(k, Ho, Wo, Wp, origin, tuple(column[int(o)] for o in window))
