"""Winograd convolution: a 3x3, stride-1 convolution's product in fewer multiplications.

A convolution's forward product (and its input gradient, which col2im turns into a convolution of
the padded output gradient with the flipped weight) multiplies each position's 3x3 patch of Q
channels by the (9Q x N) weight: 9QN multiply-adds per position, the GEMM micro-kernel's work.
Winograd's minimal filtering F(m x m, 3 x 3) computes an m x m tile of outputs from an
(m + 2) x (m + 2) tile of input pixels with (m + 2)^2 products instead of 9 m^2, each a
multiply-add over the Q channels (Lavin and Gray, "Fast Algorithms for Convolutional Neural
Networks", 2016):

    Y = A^T [ (G g G^T) . (B^T d B) ] A        per input channel, summed over the channels

d the input tile, g the 3x3 kernel, "." elementwise. Summed over channels, the elementwise
product becomes (m + 2)^2 independent GEMMs, tiles x Q by Q x N. F(4x4, 3x3), used here, does 36
where direct convolution does 144 (4 times fewer multiply-adds; F(2x2, 3x3) 2.25 times with
smaller rounding errors); the transforms are additions and a few multiplications by constants.
In float32 its results differ from a direct convolution's by about 1e-6 of their magnitude, as
cuDNN's and oneDNN's Winograd convolutions do.

The weight's gradient, X^T dY, is the same bilinear map differentiated: dW = G^T [sum over tiles
of (A e A^T) . (B^T d B)] G, e a tile of the output gradient: (m + 2)^2 GEMMs Q x tiles by
tiles x N, summed over the tiles.

`passes.patch_grid.grid(indices)` recognises the patch index map of such a convolution
(patches.Patches.grid); `chosen(spec, n)` decides a product: a 3x3 grid's patch matrix, with
enough channels each side for the GEMMs to pay for the transforms. The runtime computes it
(templates/matmul/winograd.c.j2, sg_conv_winograd and sg_conv_winograd_grad): the weight is
transformed once per call, the tiles in blocks that stay in cache: a block's input transform,
its (m + 2)^2 products on the GEMM micro-kernel, then its output transform into C (or, for the
gradient, the products summed into each thread's partials, transformed once at the end).

`transforms(ctype)` gives the template the three 1-D transforms as C expressions, generated
from the matrices here (zero coefficients left out, so the compiler has nothing to fold).
"""

from __future__ import annotations

from fractions import Fraction as F

import numpy as np

# F(m, 3) for each m: the input transform B^T (alpha x alpha, alpha = m + 2), the kernel transform
# G (alpha x 3) and the output transform A^T (m x alpha). F(2, 3): interpolation points 0, 1, -1
# and infinity; F(4, 3): 0, 1, -1, 2, -2 and infinity (Lavin and Gray's).
MATRICES = {
    2: dict(BT=((1, 0, -1, 0), (0, 1, 1, 0), (0, -1, 1, 0), (0, 1, 0, -1)),
            G=((1, 0, 0), (F(1, 2), F(1, 2), F(1, 2)), (F(1, 2), F(-1, 2), F(1, 2)), (0, 0, 1)),
            AT=((1, 1, 1, 0), (0, 1, -1, -1))),
    4: dict(BT=((4, 0, -5, 0, 1, 0), (0, -4, -4, 1, 1, 0), (0, 4, -4, -1, 1, 0), (0, -2, -1, 2, 1, 0),
                (0, 2, -1, -2, 1, 0), (0, 4, 0, -5, 0, 1)),
            G=((F(1, 4), 0, 0), (F(-1, 6), F(-1, 6), F(-1, 6)), (F(-1, 6), F(1, 6), F(-1, 6)),
               (F(1, 24), F(1, 12), F(1, 6)), (F(1, 24), F(-1, 12), F(1, 6)), (0, 0, 1)),
            AT=((1, 1, 1, 1, 1, 0), (0, 1, -1, 2, -2, 0), (0, 1, 1, 4, 4, 0), (0, 1, -1, 8, -8, 1))),
}
# Outputs per tile side. The residual network's step (AVX-512): 205 ms by the patch GEMM, 148-175 ms
# with F(2x2, 3x3), 135-138 ms with F(4x4, 3x3); AVX2: 206-222, 170-191, 143-153 ms.
M = 4
ALPHA = M + 2
BT, G, AT = (MATRICES[M][name] for name in ("BT", "G", "AT"))
# Input channels (Q) and output channels (N) below which the patch GEMM stays. A 16-channel 3x3
# convolution's forward and backward (32 images of 32x32) take 4.7-5.0 ms with it against the patch
# GEMM's 5.5-5.8 ms (AVX-512; AVX2 5.5-6.8 against 6.1-6.6), 24 channels 8.0-9.3 against 11.3-11.6.
MIN_CHANNELS = 16
BLOCK_BYTES = 320 * 1024   # a block's transformed tiles and products, kept in a core's L2
BLOCK_TILES = 32           # at most this many tiles a block


def chosen(spec, n) -> bool:
    """Whether a matmul of `n` columns reading the patch matrix `spec` (patches.Patches) runs as a
    Winograd convolution: a 3x3 stride-1 grid, at least MIN_CHANNELS channels in and out; the
    patch matrix X (the forward product, the input gradient) or X^T (the weight's gradient)."""
    return (spec.grid is not None and spec.grid.k == 3 and spec.Q >= MIN_CHANNELS
            and isinstance(n, int) and n >= MIN_CHANNELS)


def _literal(c: F, ctype: str) -> str:
    if c.denominator == 1:
        return f"{c.numerator}.0f" if ctype == "float" else f"{c.numerator}.0"
    return f"(({ctype})({c.numerator}.0 / {c.denominator}.0))"


def _combination(row, ctype: str) -> str:
    """sum(row[k] * x[k]) as a C expression over `x[k]`, zero terms left out."""
    text = ""
    for k, c in enumerate(F(c) for c in row):
        if c == 0:
            continue
        sign = "-" if c < 0 else "+"
        term = f"x[{k}]" if abs(c) == 1 else f"{_literal(abs(c), ctype)} * x[{k}]"
        text = (f"-{term}" if sign == "-" else term) if not text else f"{text} {sign} {term}"
    return text or "0"


def transforms(ctype: str) -> dict:
    """The 1-D transforms as lists of C expressions over x[0..], one per output: `input` (B^T,
    alpha -> alpha), `kernel` (G, 3 -> alpha), `output` (A^T, alpha -> m); for the weight's
    gradient, their transposes `gradient` (A, m -> alpha: the output gradient's tile) and `sums`
    (G^T, alpha -> 3: the summed products to the kernel's taps); with m and alpha."""
    A, GT = tuple(zip(*AT)), tuple(zip(*G))
    return dict(m=M, alpha=ALPHA, input=[_combination(r, ctype) for r in BT],
                kernel=[_combination(r, ctype) for r in G], output=[_combination(r, ctype) for r in AT],
                gradient=[_combination(r, ctype) for r in A], sums=[_combination(r, ctype) for r in GT],
                block_tiles=BLOCK_TILES, block_bytes=BLOCK_BYTES)


def reference(d: np.ndarray, g: np.ndarray, BT=BT, G=G, AT=AT) -> np.ndarray:
    """Y = A^T [(G g G^T) . (B^T d B)] A for one alpha x alpha tile d and 3x3 kernel g, in float64
    (by default with the matrices in use): the m x m correlation of d with g, which the tests
    check the matrices against."""
    bt, gm, at = (np.array(x, dtype=np.float64) for x in (BT, G, AT))
    return at @ ((gm @ g @ gm.T) * (bt @ d @ bt.T)) @ at.T
