"""Implicit GEMM: a convolution's im2col patches read by its matmuls where they lie, never stored.

conv2d (symgrad.api.convolution) gathers the padded image, channels last, into patch rows and
multiplies them by the weight; autodiff multiplies the same patches, transposed, by the output's
gradient for the weight's gradient. The patch matrix is 9 times the image for a 3x3 kernel (72 MiB
for 32 images of 32x32 with 64 channels), written once and read twice. Where the runtime's
blocked GEMM is the one that reads it, it can gather each block of patches from the image as it
packs that block (templates/matmul/gemm_patches.c.j2, sg_pack_patches), so the take writes nothing.

`patch_takes(graph)` decides which takes are read that way, a pure function of the graph: a take
along axis 1 of a (P, R, Q) value at a constant (L, K2) index map, whose every reader is a
reshape to the (P*L, K2*Q) patch matrix that only matmuls read as their left operand (directly,
or transposed: the weight's gradient), each product wide enough for the blocked GEMM. The
lowering then gives the take, its reshape and the transpose a `patches` view instead of kernels
(`patch_view`, `moved`), and the matmul kernel passes the view's `Patches` to the runtime.

A convolution with few output channels over short patches (a first layer's: LeNet's 6 channels of
5x5 taps on one input channel) or with groups is lowered per image instead: the take along axis 2
of the (P, C, R) images makes each image's patch columns (C*K2, L), the right operand of a batched
product with the weight (and, transposed, of the weight's gradient). There the GEMM would tile a
6-row product, mostly padding; where each tap's pixels run along whole output rows (stride 1
along the width), the runtime computes the product as a direct convolution instead
(templates/matmul/conv_rows.c.j2, sg_conv_rows): each output row is a few vectors of consecutive
positions, and a tap's vector is a plain load from the image at the tap's offset. `Columns` is
that view's spec.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ...ir import shapes as S
from ...ir.graph import Graph
from ...ir.registry import MATMUL
from ...ir.value import Value
from ...passes.patch_grid import Grid, grid
from .gemm_table import gemm_function
from ..views import PATCHES as KIND  # the View kind of a patch matrix read in place
from ..views import Buffer, View


@dataclass(frozen=True, eq=False)
class Patches:
    """X[r, k] = src[(r // L) * R * Q + indices[r % L, k // Q] * Q + k % Q] for r < P*L, k < K2*Q
    (`src`, the view's buffer, holds P images of R pixels of Q channels each); the operand is X,
    or X^T when `transposed`."""

    indices: Buffer   # const int64 (L, K2), every entry in [0, R)
    L: int
    K2: int
    Q: int
    R: int
    purpose: str = ""      # the take's: what the patches are for (a convolution), for the report
    transposed: bool = False
    grid: Grid | None = None   # a stride-1 convolution's geometry (passes.patch_grid), else None


@dataclass(frozen=True, eq=False)
class Columns:
    """The patch columns of each image and group: X[g][c * K2 + k, l] = src[p, g * C/G + c, indices[k, l]]
    for c < C/G, k < K2, l < L (`src`, the view's buffer, holds P images of C channels of R pixels);
    the operand is X, or X^T when `transposed`. Along each output row of `W` positions a tap's
    pixels are consecutive: indices[k, y * W + x] = indices[k, y * W] + x."""

    indices: Buffer   # const int64 (K2, L), every entry in [0, R)
    L: int
    K2: int
    W: int            # output positions per row
    R: int
    C: int            # the image's channels
    groups: int
    purpose: str = ""
    transposed: bool = False


COLUMN_ROWS = 32  # the most output channels (per group) a direct convolution computes; wider ones tile a GEMM
# The fewest columns of a patch product the blocked GEMM computes, gathering its patches, where a
# product of a stored matrix would take a narrow kernel (NARROW_N): 16 fill the micro-kernel's
# two-vector sliver of floats. LeNet's second convolution (16 channels), with the packing's runs
# continued across a kernel row's taps (gemm_patches.c.j2): its step 2.34-2.40 -> 1.94-1.99 ms on AVX2,
# 2.14-2.19 -> 1.98-2.00 ms on AVX-512 (its patches no longer stored, nor its narrow kernels run).
PATCH_GEMM_MIN_N = 16


def patch_takes(graph: Graph) -> frozenset:
    """ids of the take nodes whose patch matrix the matmuls read in place (see the module doc)."""
    users, outputs = graph.users, {id(v) for v in graph.outputs} | {id(new) for _, new in graph.updates}
    chosen = set()
    for node in graph.nodes:
        if node.op.name != "take" or id(node) in outputs or not users[id(node)]:
            continue
        readers = users[id(node)]
        rows, columns = _patch_shape(node), _column_shape(node)
        if rows is not None and all(_is_patch_matrix(r, rows, users, outputs) for r in readers):
            chosen.add(id(node))
        elif columns is not None and all(_is_column_matrix(r, node, columns, users, outputs) for r in readers):
            chosen.add(id(node))
    return frozenset(chosen)


def _constant_take(take: Value, axis: int):
    """(source shape, index map) of a float take along `axis` of a 3-D value at a constant 2-D int64
    index map of known sizes, every entry inside the source's axis; else None."""
    source, indices = take.inputs
    if take.attrs["axis"] != axis or source.ndim != 3 or indices.ndim != 2 or indices.op.name != "const":
        return None
    if take.dtype not in ("float32", "float64") or indices.dtype != "int64":
        return None
    value = indices.attrs["value"]
    if not all(isinstance(s, int) for s in (*source.shape[1:], *indices.shape)) or not isinstance(value, np.ndarray) \
            or value.shape != indices.shape or value.size == 0 or value.min() < 0 or value.max() >= source.shape[axis]:
        return None
    return source.shape, value


def _patch_shape(take: Value):
    """(P, R, Q, L, K2) of a take that gathers patch rows, else None."""
    found = _constant_take(take, 1)
    if found is None:
        return None
    (P, R, Q), value = found
    return (P, R, Q, *value.shape)


def _column_shape(take: Value):
    """(P, C, R, K2, L, W) of a take that gathers each image's patch columns along whole output rows
    of W positions, else None."""
    found = _constant_take(take, 2)
    if found is None:
        return None
    (P, C, R), value = found
    K2, L = value.shape
    W = row_length(value)
    return None if W is None else (P, C, R, K2, L, W)


def row_length(indices: np.ndarray) -> int | None:
    """W where every row of `indices` (K2, L) runs in steps of one along output rows of W > 1
    positions (the longest such W dividing L), else None: a stride-1 convolution's index map."""
    K2, L = indices.shape
    steps = np.diff(indices, axis=1) == 1                     # (K2, L - 1)
    breaks = np.flatnonzero(~steps.all(axis=0))
    W = int(breaks[0]) + 1 if breaks.size else L
    if L % W or (W == 1 and L > 1):   # (rows of one position: no run to load as a vector)
        return None
    rows = indices.reshape(K2, L // W, W)
    return W if np.array_equal(rows - rows[:, :, :1], np.broadcast_to(np.arange(W), rows.shape)) else None


def _is_column_matrix(reader: Value, take: Value, shape: tuple, users: dict, outputs: set) -> bool:
    """Whether `reader` of a take of column `shape` (_column_shape) reads the take's patch columns
    only as the right operand of batched matmuls of at most COLUMN_ROWS rows, directly (the forward
    product) or through the transpose of their last two axes (the weight's gradient): the take's
    value is the (P, C, K2, L) columns of C groups of one channel; a reshape of it, those of G groups
    of C/G channels (P, G, C/G * K2, L)."""
    P, C, R, K2, L, W = shape
    matrix = take
    if reader.op.name == "reshape":
        if id(reader) in outputs or reader.ndim != 4:
            return False
        p, G, CK, l = reader.shape
        if not (S.same_size(S.as_size(p), S.as_size(P)) and isinstance(G, int) and G > 0 and C % G == 0
                and CK == C // G * K2 and l == L):
            return False
        matrix, readers = reader, users[id(reader)]
    else:
        readers = [reader]
    for r in readers:
        if r.op.name == "transpose" and r.attrs["perm"] == (0, 1, 3, 2) and id(r) not in outputs:
            if not users[id(r)] or not all(_right_operand_only(m, r, matrix.shape[:2]) for m in users[id(r)]):
                return False
        elif not _right_operand_only(r, matrix, matrix.shape[:2]):
            return False
    return bool(readers)


def _right_operand_only(matmul: Value, operand: Value, batch: tuple) -> bool:
    """A matmul over the (P, G) batch of `operand` reading it as its right operand only, of at most
    COLUMN_ROWS rows."""
    if matmul.op.kind != MATMUL or matmul.ndim != 4:
        return False
    a, b = matmul.inputs
    return (b is operand and a is not operand and tuple(matmul.shape[:2]) == tuple(batch)
            and isinstance(matmul.shape[2], int) and matmul.shape[2] <= COLUMN_ROWS)


def _is_patch_matrix(reshape: Value, shape: tuple, users: dict, outputs: set) -> bool:
    """Whether `reshape` makes the (P*L, K2*Q) patch matrix of a take of patch `shape`
    (_patch_shape), read only as the left operand of blocked-GEMM matmuls, directly or through
    one transpose."""
    P, R, Q, L, K2 = shape
    if reshape.op.name != "reshape" or id(reshape) in outputs or reshape.ndim != 2 \
            or reshape.shape[1] != K2 * Q or not S.same_size(reshape.shape[0], S.as_size(P * L)):
        return False
    for reader in users[id(reshape)]:
        if reader.op.name == "transpose" and reader.attrs["perm"] == (1, 0) and id(reader) not in outputs:
            if not users[id(reader)] or not all(_left_operand_only(m, reader) for m in users[id(reader)]):
                return False
        elif not _left_operand_only(reader, reshape):
            return False
    return True


def _left_operand_only(matmul: Value, operand: Value) -> bool:
    """A 2-D matmul reading `operand` as its left operand only, of at least PATCH_GEMM_MIN_N columns
    or computed by the blocked GEMM anyway (the narrow kernels read A in place through strides, not
    gathered)."""
    a, b = matmul.inputs
    n = matmul.shape[1]
    return (matmul.op.kind == MATMUL and matmul.ndim == 2 and a is operand and b is not operand
            and ((isinstance(n, int) and n >= PATCH_GEMM_MIN_N)
                 or gemm_function(matmul.dtype, n, 1, 1)[1] == "gemm"))


def _spec(take: Value, indices: Buffer | None):
    """The Patches (a take along axis 1) or Columns (along axis 2) of a patch take."""
    purpose = take.attrs.get("purpose", "")
    if take.attrs["axis"] == 1:
        P, R, Q, L, K2 = _patch_shape(take)
        return Patches(indices, L, K2, Q, R, purpose, grid=grid(take.inputs[1].attrs["value"]))
    P, C, R, K2, L, W = _column_shape(take)
    return Columns(indices, L, K2, W, R, C, C, purpose)  # C groups of one channel, until a reshape


def patch_view(take: Value, source: View, indices: View) -> View:
    """The patches view of `take`'s value: `source` its contiguous (P, R, Q) or (P, C, R) buffer
    view, `indices` the constant index map's buffer view. Patch rows (P, L, K2, Q) for a take along
    axis 1, patch columns (P, C, K2, L) along axis 2."""
    return View(KIND, tuple(take.shape), take.dtype, (), source.offset, source.buffer, _spec(take, indices.buffer))


def patch_spec(operand: Value, patches: frozenset):
    """The Patches or Columns of the patch matrix a matmul's `operand` reads in place (a take of
    `patches`, through the reshape and transpose patch_takes allows), without its index buffer;
    None for any other operand."""
    node = operand
    while node.op.name in ("reshape", "transpose") and id(node) not in patches:
        node = node.inputs[0]
    return _spec(node, None) if id(node) in patches else None


def moved(view: View, node: Value) -> View:
    """A patches view through `node`, the reshape to the patch matrix (or to each group's patch
    columns) or its transpose (the only movements patch_takes allows)."""
    spec = view.literal
    if node.op.name == "transpose":
        spec = replace(spec, transposed=not spec.transposed)
    elif isinstance(spec, Columns):
        spec = replace(spec, groups=node.shape[1])
    return replace(view, shape=tuple(node.shape), literal=spec)


def is_columns(view: View) -> bool:
    """Whether `view` is each image's patch columns read in place (a direct convolution's)."""
    return view.kind == KIND and isinstance(view.literal, Columns)
