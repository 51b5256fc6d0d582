"""col2im as a gather: a convolution's input gradient computed as the convolution of its output
gradient, not scattered from a stored patch gradient.

conv2d gathers its patches with a take at a constant index map idx (position l, tap t -> pixel
idx[l, t]); autodiff writes the take's gradient as one product into the patch gradient
(N*L, K2*C), nine times the image for a 3x3 kernel, then a scatter_add of it into the pixels
(col2im). For each tap t the map l -> idx[l, t] is one to one, so pixel r receives, per tap,
the row of the one position l whose tap t reads it, if any. Gathering the output gradient's rows
at that inverse map (a zero row where no position's tap reads the pixel) gives the same sums as
one product over taps and channels together: the transposed convolution written as a
convolution, as torch computes conv2d's input gradient.

    scatter_add(reshape(dY @ B), idx, size R)  ->  reshape(take(dY with a zero row, inv) @ B', (N, R, C))

with B (O, K2*C) the weight's rows, B' (K2*O, C) the same numbers with the taps as rows, and
inv[r, t] the position whose tap t reads pixel r (L: the zero row). The new product runs over
the R pixels where the old one ran over the L positions; the rewrite applies when that costs
little (R <= 1.5 L: stride 1, the padded image about as large as the output) and the product
has more than 16 output channels, so that the C backend's GEMM gathers its patch matrix as it
packs it (symgrad.backends.decide.patches) and neither matrix is stored. The sums differ from the
scatter's only in their order.

Where the convolution has stride 1 and covers its whole padded image (patch_grid.Grid, origin 0),
the output gradient is padded by k - 1 zeros on every side instead of given one zero row, and
each pixel's taps read that grid: the gather is then a stride-1 convolution of the padded
gradient with the flipped kernel, which the C backend may compute by Winograd's algorithm
(symgrad.backends.decide.winograd).
"""

from __future__ import annotations

import numpy as np

from ..ir import shapes as S
from ..ir.graph import Graph
from ..ir.registry import MATMUL, lookup
from ..ir.value import Value, make
from ..narrow_limit import NARROW_N  # channels at or below which a product is not the blocked GEMM's
from .patch_grid import grid
from .rewrite import rebuild

GROWTH = 1.5       # the most the pixels R may outnumber the positions L (the product grows as R / L)


def inverse_taps(idx: np.ndarray, pixels: int) -> np.ndarray | None:
    """inv[r, t] = the l with idx[l, t] == r, else L (the zero row), when every tap's map l -> idx[l, t]
    is one to one into [0, pixels); else None."""
    L, K2 = idx.shape
    if idx.min() < 0 or idx.max() >= pixels:
        return None
    inv = np.full((pixels, K2), L, dtype=np.int64)
    inv[idx, np.arange(K2)[None, :]] = np.arange(L)[:, None]
    if ((inv != L).sum(axis=0) != L).any():  # two positions' tap t on one pixel: not one to one
        return None
    return inv


def col2im_as_gather(node: Value, uses: dict) -> Value | None:
    """scatter_add(reshape(dY @ B), idx) -> reshape(take(embed(dY), inv) @ B') (see the module doc)."""
    if node.op.name != "scatter_add" or node.attrs["axis"] != 1 or node.dtype not in ("float32", "float64"):
        return None
    src, idx = node.inputs
    product = src.inputs[0] if src.op.name == "reshape" else None
    if (product is None or product.op.kind != MATMUL or product.ndim != 2 or src.ndim != 4
            or uses.get(id(src)) != 1 or uses.get(id(product)) != 1 or idx.op.name != "const" or idx.ndim != 2):
        return None
    P, L, K2, C = src.shape
    R, value = node.attrs["size"], idx.attrs["value"]
    dy, weight = product.inputs
    O = dy.shape[1]
    if not all(isinstance(s, int) for s in (L, K2, C, R, O)) or not isinstance(value, np.ndarray) \
            or value.shape != (L, K2) or C <= NARROW_N or R > GROWTH * L:
        return None
    if product.shape[1] != K2 * C or not S.same_size(product.shape[0], S.as_size(P * L)):
        return None  # the product's rows are not the patch rows (another factoring of the same size)
    padded = _padded_gradient(dy, value, R, (P, L, O))
    if padded is not None:
        rows, inv = padded
    else:
        inv = inverse_taps(value.astype(np.int64), R)
        if inv is None:
            return None
        rows = make(lookup("embed"), (_reshape(dy, (P, L, O)),), shape=S.as_shape((P, L + 1, O)),
                    starts=(0, 0, 0), steps=(1, 1, 1))                               # a zero row at L
    inv.flags.writeable = False
    purpose = (f"col2im as a gather: the output gradient at each of {R} pixels' {K2} taps, "
               f"{K2 * O} columns, one GEMM")
    gathered = make(lookup("take"), (rows, make(lookup("const"), value=inv, shape=inv.shape, dtype="int64")),
                    axis=1, purpose=purpose)                                          # (P, R, K2, O)
    taps_as_rows = _reshape(make(lookup("transpose"), (_reshape(weight, (O, K2, C)),), perm=(1, 0, 2)), (K2 * O, C))
    product = make(lookup("matmul"), (_reshape(gathered, (P * R, K2 * O)), taps_as_rows))
    return _reshape(product, node.shape)


def _padded_gradient(dy: Value, idx: np.ndarray, R: int, shape: tuple):
    """(dY padded, inv) for a k x k stride-1 convolution whose padded image is exactly its taps'
    extent (patch_grid.Grid with origin 0, rows of Wo + k - 1 pixels, R of them): dY's Ho x Wo
    grid of positions padded by k - 1 zeros on every side, and the index map reading it, pixel
    (iy, ix)'s tap (ky, kx) at (iy + k - 1 - ky, ix + k - 1 - kx). The gather is then a stride-1
    convolution itself (the flipped kernel over the padded gradient), which the C backend may
    compute by Winograd's algorithm (backends.decide.winograd); else None."""
    g = grid(idx)
    if g is None or g.origin != 0 or g.Wp != g.Wo + g.k - 1 or R != (g.Ho + g.k - 1) * g.Wp:
        return None
    P, L, O = shape
    k, Hq, Wq = g.k, g.Ho + 2 * (g.k - 1), g.Wo + 2 * (g.k - 1)
    padded = make(lookup("embed"), (_reshape(dy, (P, g.Ho, g.Wo, O)),), shape=S.as_shape((P, Hq, Wq, O)),
                  starts=(0, k - 1, k - 1, 0), steps=(1, 1, 1, 1))
    iy, ix = np.divmod(np.arange(R), g.Wp)
    ky, kx = np.divmod(np.arange(k * k), k)
    inv = np.empty((R, k * k), dtype=np.int64)
    inv[:, list(g.tap)] = (iy[:, None] + k - 1 - ky[None, :]) * Wq + ix[:, None] + k - 1 - kx[None, :]
    return _reshape(padded, (P, Hq * Wq, O)), inv


def _reshape(x: Value, shape) -> Value:
    shape = S.as_shape(shape)
    return x if x.shape == shape else make(lookup("reshape"), (x,), shape=shape)


def col2im(graph: Graph, counts: dict | None = None) -> Graph:
    """The graph with each convolution's col2im that `col2im_as_gather` applies to rewritten.

    A rewrite rebuilds what reads it, so a chain of convolutions (each one's input gradient the
    next one's output gradient) is rewritten over a few sweeps, each over fresh use counts."""
    while True:
        uses, fired = graph.use_counts(), 0

        def rewrite(node: Value) -> Value:
            nonlocal fired
            new = col2im_as_gather(node, uses)
            if new is None:
                return node
            fired += 1
            return new
        rebuilt = rebuild(graph, rewrite)
        if not fired:
            return graph
        if counts is not None:
            counts["col2im_as_gather"] = counts.get("col2im_as_gather", 0) + fired
        graph = rebuilt
