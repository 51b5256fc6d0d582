"""Implicit GEMM: a convolution's im2col patches read by its matmuls where they lie, never stored.

conv2d (symgrad.convolution) gathers the padded image, channels last, into patch rows and
multiplies them by the weight; autodiff multiplies the same patches, transposed, by the output's
gradient for the weight's gradient. The patch matrix is 9 times the image for a 3x3 kernel (72 MiB
for 32 images of 32x32 with 64 channels), written once and read twice. Where the runtime's
blocked GEMM is the one that reads it, it can gather each block of patches from the image as it
packs that block (templates/c/gemm.c.j2, sg_pack_patches), so the take writes nothing.

`patch_takes(graph)` decides which takes are read that way, a pure function of the graph: a take
along axis 1 of a (P, R, Q) value at a constant (L, K2) index map, whose every reader is a
reshape to the (P*L, K2*Q) patch matrix that only matmuls read as their left operand (directly,
or transposed: the weight's gradient), each product wide enough for the blocked GEMM. The
lowering then gives the take, its reshape and the transpose a `patches` view instead of kernels
(`patch_view`, `moved`), and the matmul kernel passes the view's `Patches` to the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..ir import shapes as S
from ..ir.graph import Graph
from ..ir.registry import MATMUL
from ..ir.value import Value
from . import runtime
from .views import Buffer, View

KIND = "patches"  # the View kind of a patch matrix read in place


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


def patch_takes(graph: Graph) -> frozenset:
    """ids of the take nodes whose patch matrix the matmuls read in place (see the module doc)."""
    users, outputs = graph.users, {id(v) for v in graph.outputs} | {id(new) for _, new in graph.updates}
    chosen = set()
    for node in graph.nodes:
        shape = _patch_shape(node) if node.op.name == "take" and id(node) not in outputs else None
        readers = users[id(node)]
        if shape is not None and readers and all(_is_patch_matrix(r, shape, users, outputs) for r in readers):
            chosen.add(id(node))
    return frozenset(chosen)


def _patch_shape(take: Value):
    """(P, R, Q, L, K2) of a take that gathers patch rows, else None."""
    source, indices = take.inputs
    if take.attrs["axis"] != 1 or source.ndim != 3 or indices.ndim != 2 or indices.op.name != "const":
        return None
    if take.dtype not in ("float32", "float64") or indices.dtype != "int64":
        return None
    P, R, Q = source.shape
    L, K2 = indices.shape
    value = indices.attrs["value"]
    if not all(isinstance(s, int) for s in (R, Q, L, K2)) or not isinstance(value, np.ndarray) \
            or value.shape != (L, K2) or value.size == 0 or value.min() < 0 or value.max() >= R:
        return None
    return P, R, Q, L, K2


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
    """A 2-D matmul reading `operand` as its left operand only, computed by the blocked GEMM (the
    narrow kernels read A in place through strides, not gathered)."""
    a, b = matmul.inputs
    return (matmul.op.kind == MATMUL and matmul.ndim == 2 and a is operand and b is not operand
            and runtime.gemm_function(matmul.dtype, matmul.shape[1], 1, 1)[1] == "gemm")


def patch_view(take: Value, source: View, indices: View) -> View:
    """The patches view of `take`'s value (shape (P, L, K2, Q)): `source` its contiguous (P, R, Q)
    buffer view, `indices` the constant index map's buffer view."""
    P, R, Q, L, K2 = _patch_shape(take)
    return View(KIND, tuple(take.shape), take.dtype, (), source.offset, source.buffer,
                Patches(indices.buffer, L, K2, Q, R, take.attrs.get("purpose", "")))


def moved(view: View, node: Value) -> View:
    """A patches view through `node`, the reshape to the patch matrix or its transpose (the only
    movements patch_takes allows)."""
    spec: Patches = view.literal
    if node.op.name == "transpose":
        spec = replace(spec, transposed=not spec.transposed)
    return replace(view, shape=tuple(node.shape), literal=spec)


def is_patches(view: View) -> bool:
    """Whether `view` is a patch matrix read in place."""
    return view.kind == KIND


def matmul_gemm(dtype: str, n, a: View) -> tuple[str, str]:
    """runtime.gemm_function for a matmul of `n` columns reading `a`: the patch GEMM (kind "gemm",
    the blocked one) when `a` is a patch matrix."""
    if is_patches(a):
        return f"sg_gemm_patches_{runtime.GEMM[dtype]['suffix']}", "gemm"
    return runtime.gemm_function(dtype, n, a.strides[0], a.strides[1])
