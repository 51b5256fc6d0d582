"""The attention kind: fused attention and its gradient, one `AttentionKernel` per node, with its
lowering and render (templates <language>/attention).

attention(q, k, v) and attention_grad(q, k, v, out, g) read their operands as H heads of T rows
of E contiguous elements (E = the head dimension): head h of an operand starts where the view
puts batch index unravel(h), and its rows are `row` elements apart. That is how a transformer
hands them over, (B, T, H, E) transposed to (B, H, T, E), so nothing is copied first; an operand
whose last axis is not contiguous (or a broadcast constant) is copied into a buffer of its own.

The C kernel (templates/attention/attention.c.j2) takes a tile of SG_ROW_TILE query rows against a
block of SG_KEY_BLOCK keys at a time. Its sums over E and over the keys are small matrix products
(q k^T, p v; in the backward also g v^T, ds k, p^T g, ds^T q) on register tiles of 8 (AVX-512) or
4 rows by 2 vectors (templates/attention/attention_tile.h.j2), reading k (and v) from a scratch copy
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
whole heads, so no two add into one dk or dv row.

CUDA (templates/attention/attention.cu.j2) walks rows (languages.Language.attention "rows"): the forward
takes a query row (storing m and 1 / l into `stats` where decide paired it with its gradient); the
gradient runs two kernels, one per query row (m and 1 / l read from `stats`, or found by a sweep and
kept in the scratch; D_i = g_i . out_i kept in the scratch; dq_i summed over the keys), then one
per key row summing dk_j and dv_j over the query rows. A row is a block of 32 threads (the warp
walk: lane t takes keys or rows t, t + 32, ..., the row's vectors in registers, the lanes' sums
added in lane order through shared memory) where E is a constant and a row at most WARP_BYTES,
else a thread.
Every sum has one owner and a fixed order: no atomics, the same bits every run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import sympy

from ...ir import dtypes as D
from ...ir import shapes as S
from ...ir.elementwise import ARGS
from ...ir.value import Value
from ..build import runtime
from ..plan import Swap
from ..render.expressions import comment
from ..render.renderer import Renderer, small
from ..render.templates import render as render_template
from ..views import Buffer, View, buffer_view, contiguous_strides
from .gather import contiguous_operand

WORDS = (("attention", "fused attention"),)  # the report's count line
# CUDA's warp walk holds a row's E-element vectors in registers (four in the gradient's key pass:
# dk, dv and the key's k and v): up to this many bytes each (E = 128 in float32; in float64 E = 128
# spilled 9 KB a thread); a longer or symbolic E takes the row walk.
WARP_BYTES = 512


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
    scratch: tuple = ()   # buffers the kernel fills and reads, as its language walks (`_scratch`)
    stats: Buffer | None = None  # 2 x H x T: each row's largest score m, then 1 / l (see `forward_stats`)
    written: View | None = None  # the output as it lies in `out` (the forward's heads last: `heads_last`); set by `lower`
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

    def swap(self, s: Swap) -> "AttentionKernel":
        """This kernel with the buffers `s` maps swapped in."""
        return replace(self, operands=tuple(s.view(v) for v in self.operands), out=s.buffer(self.out),
                       scratch=tuple(s.buffer(b) for b in self.scratch), stats=s.buffer(self.stats),
                       written=s.view(self.written))

    def flops(self, n) -> int:
        """Arithmetic per call (`n` evaluates a size), as FlashAttention counts: the products over
        the visible (row, key) pairs."""
        pairs = n(self.T) * (n(self.T) + 1) // 2 if self.causal else n(self.T) ** 2
        return (4 if self.op == "attention" else 10) * n(self.heads) * n(self.E) * pairs

    report_kind = "attention"  # what `step.report()` counts it as

    def report_line(self) -> str:
        """What the kernel does, for the report's list of kernels: what it holds instead of the
        T x T weights (its scratch, as its language walks the rows: `_scratch`)."""
        scratch = f"; scratch {', '.join(b.name for b in self.scratch)}" if self.scratch else ""
        return (f"fused {self.op}{' (causal)' if self.causal else ''}, {self.heads} head(s) of {self.T} x {self.E}, "
                f"no T x T buffer{scratch} -> {self.out.name}")


def heads_last(graph) -> frozenset:
    """ids of the attention nodes whose output is stored heads last: (B, T, H, E) for a value of
    shape (B, H, T, E), since a reader takes it through a transpose of those two axes (a transformer
    handing its heads to the output projection: `y.transpose(1, 2).reshape(B, T, C)`). The transpose
    is then a view of the buffer, the reshape after it copies nothing, and the gradient reads the
    output's rows where they lie (H x E apart). An output of the graph keeps its own order."""
    outputs = {id(v) for v in graph.outputs}
    chosen = set()
    for node in graph.nodes:
        n = len(node.shape)
        if node.op.name != "attention" or n < 4 or id(node) in outputs:
            continue
        swap = (*range(n - 3), n - 2, n - 3, n - 1)
        if any(u.op.name == "transpose" and tuple(u.attrs["perm"]) == swap for u in graph.users[id(node)]):
            chosen.add(id(node))
    return frozenset(chosen)


def _out_view(ctx, node: Value, out: Buffer) -> View:
    """The view of `node`'s value in `out`: contiguous, or heads last (`heads_last`)."""
    if id(node) not in ctx.decisions.heads_last:
        return buffer_view(out, node.shape)
    strides = contiguous_strides(_stored_shape(node.shape))
    return View("buffer", node.shape, node.dtype, (*strides[:-3], strides[-2], strides[-3], strides[-1]), 0, out)


def _stored_shape(shape) -> tuple:
    """(..., H, T, E) -> (..., T, H, E): the order a heads-last output is stored in."""
    return (*shape[:-3], shape[-2], shape[-3], shape[-1])


def _rows_view(ctx, node: Value) -> View:
    """The view of `node` if its rows are contiguous in a buffer, else a contiguous copy's."""
    view = ctx.views[id(node)]
    if view.kind == "buffer" and view.shape == node.shape and view.strides[-1] == 1:
        return view
    return contiguous_operand(ctx, node)


def _forward_of(grad: Value) -> Value | None:
    """The attention node whose gradient attention_grad node `grad` is, or None: its q, k, v the
    forward's, its `out` the forward's value, the same mask and scale. Under a 16-bit float `out` is
    the rounding of that value (half.legalize computes the attention in float32 and casts its result):
    the statistics are the float32 kernel's, the ones a sweep would find again."""
    forward = grad.inputs[3]
    if forward.op.name == "cast" and forward.inputs[0].op.name == "attention" and D.is_half(forward.dtype):
        forward = forward.inputs[0]
    if (forward.op.name == "attention" and all(a is b for a, b in zip(grad.inputs[:3], forward.inputs))
            and grad.attrs == forward.attrs):
        return forward
    return None


def shared_stats(graph) -> dict:
    """id(attention_grad node) -> the attention node whose stored softmax statistics it reads: an
    attention whose gradient the same graph computes stores each row's m and 1 / l (2 x H x T
    elements), and that gradient reads them instead of sweeping every key block once more to find
    them (decide records it; a gradient computed where its forward is not, in another plan, sweeps)."""
    pairs = {id(node): _forward_of(node) for node in graph.nodes if node.op.name == "attention_grad"}
    return {grad: forward for grad, forward in pairs.items() if forward is not None}


def _stats(ctx, node: Value) -> Buffer | None:
    """The statistics buffer `node`'s kernel shares with its gradient's (as decide paired them):
    made at the forward, read at the gradient; None for any other kernel."""
    if node.op.name == "attention_grad":
        forward = ctx.decisions.attention_stats.get(id(node))
        return None if forward is None else ctx.kept[(id(forward), "stats")]
    if id(node) not in ctx.decisions.stats_stored:
        return None
    shape = node.inputs[0].shape
    ctx.kept[(id(node), "stats")] = ctx.scratch(node, (2, S.numel(shape[:-2]), shape[-2]), node.dtype)
    return ctx.kept[(id(node), "stats")]


def _scratch(ctx, node: Value) -> tuple:
    """The buffers `node`'s kernel fills and reads besides its output, as its language walks the rows
    (languages.Language.attention). "key blocks": k (and for the gradient v) transposed per head, H x E
    x T each: the keys along a dot product's vector lanes. "rows": nothing for the forward; for the
    gradient, each query row's D = g . out (H x T), after its m and 1 / l (2 x H x T) where no forward
    stored them: what the key rows' threads read of every query row."""
    shape = node.inputs[0].shape
    heads, gradient = S.numel(shape[:-2]), node.op.name == "attention_grad"
    if ctx.language.attention == "rows":
        if not gradient:
            return ()
        rows = 1 if id(node) in ctx.decisions.attention_stats else 3
        return (ctx.scratch(node, (rows, heads, shape[-2]), node.dtype),)
    return tuple(ctx.scratch(node, (heads, shape[-1], shape[-2]), node.dtype) for _ in range(2 if gradient else 1))


def lower(ctx, node: Value) -> View:
    """The kernel computing an attention-kind node; returns the view of its value."""
    operands = tuple(_rows_view(ctx, operand) for operand in node.inputs)
    shape = node.inputs[0].shape
    heads_last = id(node) in ctx.decisions.heads_last
    out = ctx.alloc(node, shape=_stored_shape(node.shape)) if heads_last else ctx.alloc(node)
    written = _out_view(ctx, node, out)
    scratch = _scratch(ctx, node)
    ctx.emit(AttentionKernel(
        ctx.kernel_name(node), [ctx.line(node)], node.op.name, operands,
        tuple(ctx.name(operand) for operand in node.inputs), out, tuple(shape[:-2]), shape[-2], shape[-1],
        node.attrs["causal"], node.attrs["scale"], scratch, _stats(ctx, node), written=written))
    return written


def render(r: Renderer, k: AttentionKernel) -> dict:
    """Fused attention or its gradient over H heads of T rows (templates <language>/attention):
    Python gives each operand's head pointer and row stride, and the softmax's exp expressions."""
    ctype = D.C_TYPES[k.out.dtype]
    params, args = r.params(k.reads(), k.writes())  # stats: the forward's output, the gradient's input
    # Head h's batch indices n0, n1, ... (row-major over k.batch), then each operand's head pointer.
    unravel = []
    for j, size in enumerate(k.batch):
        inner = r.ex.paren(S.numel(k.batch[j + 1:]))
        value = "h" if inner == "1" else f"h / {inner}"
        unravel.append(dict(var=f"n{j}", value=value if j == 0 else f"{value} % {r.ex.paren(size)}"))
    names = [u["var"] for u in unravel]
    def head(view: View) -> dict:  # head h's first row, and the rows' distance
        return dict(row=r.ex.paren(view.strides[-2]),
                    at=f"{view.buffer.name} + {r.ex.index(view.offset, names, view.strides[:-2])}")
    operands = [dict(role=role, label=comment(label), **head(view))
                for role, label, view in zip(("q", "k", "v", "o", "g"), k.labels, k.operands)]
    written = head(k.written)
    printer = r.lang.printer(k.out.dtype)
    # exp(s - m): the rescale of a row's sums as its max grows, a block's p, and a key row's p of query row i;
    # CUDA's warp walk: a lane's p and rescale as its max grows, and a lane's weight in the row's sums
    exp = {name: printer.print_named(sympy.exp(ARGS[0] - ARGS[1]), {ARGS[0]: a, ARGS[1]: b})
           for name, (a, b) in dict(rescale=("before", "top"), p=("s[jj]", "top"), p_key=("s", "mi"),
                                    p_lane=("s", "m"), grow=("m", "s"), weight=("mt", "M")).items()}
    r.features.add("attention")
    if any("sg_expf(" in text for text in exp.values()):
        r.features.add("fast_exp")
    return r.kernel(k, "attention", params=params, args=args, op=k.op, ctype=ctype, unravel=unravel,
                       suffix=runtime.GEMM[k.out.dtype]["suffix"], operands=operands, H=r.ex.paren(k.heads),
                       T=r.ex.paren(k.T), E=r.ex.paren(k.E),
                       causal=k.causal, scale=r.ex.literal(k.scale, k.out.dtype), out=k.out.name, written=written,
                       scratch=[b.name for b in k.scratch], stats=None if k.stats is None else k.stats.name,
                       parallel=not small(sympy.sympify(k.heads) * k.T * k.T * k.E), helper_lines=_helper_lines(),
                       warp=sympy.sympify(k.E).is_Integer and int(k.E) * D.native_itemsize(k.out.dtype) <= WARP_BYTES,
                       **exp)


@lru_cache(maxsize=None)
def _helper_lines() -> int:
    """The lines of tile products an attention function is compiled with besides its own (one
    dtype's half of templates/attention/attention_tile.h.j2): static functions of the program's
    preamble, which the compiler builds in each translation unit calling them. The units are
    balanced by lines (render/program.py): counted without them, a GPT's two attention functions
    went to one unit of two, which took 1.4x the other's time."""
    return render_template("attention/attention_tile.h.j2").count("\n") // 2
