"""Lowering of fused attention (kind attention): one `AttentionKernel` per node.

attention(q, k, v) and attention_grad(q, k, v, out, g) read their operands as H heads of T rows
of E contiguous elements (E = the head dimension): head h of an operand starts where the view
puts batch index unravel(h), and its rows are `row` elements apart. That is how a transformer
hands them over, (B, T, H, E) transposed to (B, H, T, E), so nothing is copied first; an operand
whose last axis is not contiguous (or a broadcast constant) is copied into a buffer of its own.

The C kernel (templates/c/attention.c.j2) takes a tile of SG_ROW_TILE query rows against a
block of SG_KEY_BLOCK keys at a time. Its sums over E and over the keys are small matrix products
(q k^T, p v; in the backward also g v^T, ds k, p^T g, ds^T q) on register tiles of 8 (AVX-512) or
4 rows by 2 vectors (templates/c/attention_tile.h.j2), reading k (and v) from a scratch copy
transposed per head (H x E x T, a workspace temporary) so that a tile's scores lie along the
vector lanes:

    forward:   m, l, out_i = running max, sum of exp(s_ij - m) and sum of exp(s_ij - m) v_j
               over the blocks, each rescaled by exp(m_old - m_new) as the max grows; out_i /= l
    backward:  m and l as the forward stored them (`stats`), or, where this plan does not compute
               the forward, recomputed so (a first sweep over the blocks); D_i = g_i . out_i; then
               p = exp(s_ij - m) / l,  ds = p (g_i . v_j - D_i) scale,
               dq_i += ds k_j,  dv_j += p g_i,  dk_j += ds q_i

s_ij = scale q_i . k_j, and key j is visible from row i when j <= i if causal. No buffer of T x T
elements exists: a tile's scores live on the stack of one thread. The backward's threads take
whole heads, so no two add into one dk or dv row. CUDA (templates/cuda/attention.cu.j2) runs one
thread per query row and adds into dk and dv atomically.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..ir import shapes as S
from ..ir.value import Value
from .gather import contiguous_operand
from .views import Buffer, View, buffer_view


@dataclass(frozen=True, eq=False)
class AttentionKernel:
    """attention (`op` "attention": out = softmax(q k^T scale) v) or its gradient ("attention_grad":
    out = [dq, dk, dv], each H x T x E). `operands`: q, k, v (and out, g for the gradient), views
    of `batch + (T, E)` with contiguous rows; `out` is contiguous."""

    name: str
    lines: list[str]
    op: str
    operands: tuple       # View per operand, in the op's input order
    labels: tuple         # the graph value each operand holds, for comments
    out: Buffer
    batch: tuple          # the sizes of the batch axes (their product: the heads H)
    T: Any
    E: Any
    causal: bool
    scale: float
    scratch: tuple = ()   # H x E x T buffers the kernel fills and reads: k (and v) transposed per head
    stats: Buffer | None = None  # 2 x H x T: each row's largest score m, then 1 / l (see `forward_stats`)
    kind: str = "attention"

    @property
    def heads(self):
        """H: the number of heads, the product of the batch sizes."""
        return S.numel(self.batch)

    def reads(self) -> list:
        read = [view.buffer for view in self.operands]
        return read + [self.stats] if self.stats is not None and self.op == "attention_grad" else read

    def writes(self) -> list:
        written = [self.out, *self.scratch]
        return written + [self.stats] if self.stats is not None and self.op == "attention" else written

    def swap(self, view, new: dict) -> "AttentionKernel":
        """This kernel with the buffers `new` maps swapped in (`view` swaps one view)."""
        return replace(self, operands=tuple(view(v) for v in self.operands), out=new.get(id(self.out), self.out),
                       scratch=tuple(new.get(id(b), b) for b in self.scratch),
                       stats=None if self.stats is None else new.get(id(self.stats), self.stats))

    report_kind = "attention"  # what `step.report()` counts it as

    def report_line(self) -> str:
        """What the kernel does, for the report's list of kernels: what it holds instead of the
        T x T weights (k, and v, transposed per head)."""
        return (f"fused {self.op}{' (causal)' if self.causal else ''}, {self.heads} head(s) of {self.T} x {self.E}, "
                f"no T x T buffer; scratch {', '.join(b.name for b in self.scratch)} -> {self.out.name}")


def _rows_view(lowerer, node: Value) -> View:
    """The view of `node` if its rows are contiguous in a buffer, else a contiguous copy's."""
    view = lowerer.views[id(node)]
    if view.kind == "buffer" and view.shape == node.shape and view.strides[-1] == 1:
        return view
    return contiguous_operand(lowerer, node)


def _differentiates(grad: Value, forward: Value) -> bool:
    """Whether attention_grad node `grad` is the gradient of attention node `forward`: its q, k, v
    the forward's, its `out` the forward's value, the same mask and scale."""
    return (grad.op.name == "attention_grad" and forward.op.name == "attention" and grad.inputs[3] is forward
            and all(a is b for a, b in zip(grad.inputs[:3], forward.inputs)) and grad.attrs == forward.attrs)


def forward_stats(lowerer, node: Value) -> Buffer | None:
    """The buffer of softmax statistics `node`'s kernel shares: an attention whose gradient this
    plan computes stores each row's m and 1 / l there (2 x H x T elements), and that gradient reads
    them instead of sweeping every key block once more to find them. None for any other kernel
    (its gradient then sweeps, as one computed where the forward is not, in another plan, must)."""
    shared = lowerer.attention_stats
    if node.op.name == "attention_grad":
        forward = node.inputs[3]
        return shared.get(id(forward)) if _differentiates(node, forward) else None
    if any(_differentiates(user, node) for user in lowerer.graph.users[id(node)]):
        shape = node.inputs[0].shape
        shared[id(node)] = lowerer.scratch(node, (2, S.numel(shape[:-2]), shape[-2]), node.dtype)
        return shared[id(node)]
    return None


def lower_attention(lowerer, node: Value) -> View:
    """The kernel computing an attention-kind node; returns the view of its value."""
    operands = tuple(_rows_view(lowerer, operand) for operand in node.inputs)
    shape = node.inputs[0].shape
    out = lowerer.alloc(node)
    # k (and for the gradient v) transposed, head by head: the keys along a dot product's vector lanes.
    transposed = (S.numel(shape[:-2]), shape[-1], shape[-2])
    scratch = tuple(lowerer.scratch(node, transposed, node.dtype) for _ in range(1 if node.op.name == "attention" else 2))
    lowerer.kernels.append(AttentionKernel(
        lowerer.kernel_name(node), [lowerer.line(node)], node.op.name, operands,
        tuple(lowerer.name(operand) for operand in node.inputs), out, tuple(shape[:-2]), shape[-2], shape[-1],
        node.attrs["causal"], node.attrs["scale"], scratch, forward_stats(lowerer, node)))
    return buffer_view(out, node.shape)
