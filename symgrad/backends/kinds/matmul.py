"""The matmul kind: `MatmulKernel`, a (batched) matrix product, and which implementation computes it.

`choose` (called by decide) picks each product's implementation once, from the graph, the other
decisions and the language's capabilities (languages.Language.matmuls), and decide records it:

    gemm          the runtime's register-tiled blocked GEMM (sg_gemm_f32), with a fused epilogue
    narrow        a runtime narrow-N kernel (at most runtime.NARROW_N columns, known at compile
                  time): "dot" where A's rows are contiguous, "tn" where its columns are (the
                  lowering copies an A that is neither into a buffer of its own)
    bf16 gemm     bfloat16 operands: the runtime's bfloat16 GEMM (sg_gemm_bf16)
    patch gemm    a convolution's patch matrix gathered as the GEMM packs it (implicit GEMM)
    winograd      a 3x3 stride-1 convolution's patch product by Winograd's F(4x4, 3x3)
    direct rows   each image's patch columns: the runtime's direct convolution (sg_conv_rows)
    template gemm the program's own tiled GEMM kernel (templates/matmul/gemm.cu.j2; no epilogue), a
                  batched product in one launch; a convolution's over the patches its take gathered

The lowering (`lower`) builds the kernel with that implementation and its runtime function;
render (`render`) and the report only read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import sympy

from ...ir import dtypes as D
from ...ir import shapes as S
from ...ir.registry import GATHER, MATMUL
from ...ir.value import Value
from ..build import runtime
from ..decide import winograd
from ..render.expressions import comment, contiguous
from ..decide.patches import patch_spec
from ..decide.gemm_table import gemm_function
from ..views import is_patches
from ..plan import PRODUCT, Swap
from ..render.renderer import Let, Renderer, Store
from ..views import Buffer, View, broadcast_view, buffer_view, contiguous_strides

WORDS = (("matmul", "matmuls"), ("fused matmul", "fused matmuls"))  # the report's count line
IMPLEMENTATIONS = ("gemm", "narrow", "bf16 gemm", "patch gemm", "winograd", "direct rows", "template gemm")
RUNTIME = IMPLEMENTATIONS[:-1]  # those the precompiled runtime computes (status, context, packing)


@dataclass(frozen=True, eq=False)
class MatmulKernel:
    """out[M,N] = a[M,K] @ b[K,N], both read through strides (a transpose costs no copy); with
    `batch`, one such product per index of the leading axes.

    A fused epilogue (`relu(a @ b + bias)`): each element of the product, the local PRODUCT,
    goes through `epilogue_statements` as it is stored; each epilogue operand's view is at
    [M, N] (read at the element's (row, col)), and `out` receives `epilogue_result`.
    """

    name: str
    lines: list[str]
    a: View
    b: View
    out: Buffer
    M: Any
    N: Any
    K: Any
    kind: str = "matmul"
    epilogue: list = field(default_factory=list)             # Operand
    epilogue_statements: list = field(default_factory=list)  # Statement
    epilogue_result: str = ""
    # A batched product: one GEMM per index of the leading axes, (size, a stride, b stride, out
    # stride) each, outer to inner (a stride of 0: that operand is broadcast over the axis).
    batch: tuple = ()
    # The implementation decide chose (IMPLEMENTATIONS), and the runtime function computing it with
    # its variant ("gemm", or a narrow kernel's "dot" or "tn"): the lowering's, from the decision
    # and the operands' layout; render and report read them.
    impl: str = "gemm"
    function: str = ""
    variant: str = "gemm"

    def reads(self) -> list:
        patches = [v.literal.indices for v in (self.a, self.b) if is_patches(v)]  # a patch matrix's index map
        return [self.a.buffer, *patches, self.b.buffer] + [o.view.buffer for o in self.epilogue
                                                            if o.view.buffer is not None]

    def writes(self) -> list:
        return [self.out]

    def swap(self, s: Swap) -> "MatmulKernel":
        """This kernel with the buffers `s` maps swapped in."""
        return s.rebuilt(self, out=s.buffer(self.out), a=s.view(self.a), b=s.view(self.b),
                         epilogue=s.each(self.epilogue))

    def flops(self, n) -> int:
        """Arithmetic per call (`n` evaluates a size): 2*M*N*K per product, and the epilogue's ops."""
        batch = int(np.prod([n(size) for size, *_ in self.batch], dtype=np.int64)) if self.batch else 1
        return batch * n(self.M) * n(self.N) * (2 * n(self.K) + len(self.epilogue_statements))

    @property
    def report_kind(self) -> str:
        """What `step.report()` counts it as: a matmul, or one with an epilogue fused."""
        return "fused matmul" if self.epilogue_statements else "matmul"

    def report_line(self) -> str:
        """What the kernel does, for the report's list of kernels."""
        fused = f" + {len(self.epilogue_statements)} fused op(s)" if self.epilogue_statements else ""
        batched = f", batched over {' x '.join(str(size) for size, *_ in self.batch)}" if self.batch else ""
        return f"matmul{fused}{batched} -> {self.out.name}"

    def purpose_line(self, size) -> str | None:
        """How a convolution's patches are read in place (`size(view)`: the bytes never stored), for
        the report's gathers by purpose; None for a product of stored matrices."""
        if self.impl == "direct rows":
            spec = self.b.literal
            return (f"{spec.purpose}: read{' transposed' if spec.transposed else ''} from {self.b.buffer.name} "
                    f"along output rows of {spec.W} (direct convolution), {size(self.b)} never stored")
        spec = self.a.literal
        if self.impl == "winograd":
            g = spec.grid
            what = f"summed over {g.Ho}x{g.Wo} outputs" if spec.transposed else f"{g.Ho}x{g.Wo} outputs"
            return (f"{spec.purpose}: {what} from {self.a.buffer.name} by Winograd's F({winograd.M}x{winograd.M}, "
                    f"3x3){' transposed' if spec.transposed else ''}, {size(self.a)} never stored")
        if self.impl == "patch gemm":
            return (f"{spec.purpose}: gathered{' transposed' if spec.transposed else ''} from {self.a.buffer.name} "
                    f"as the GEMM packs it (implicit GEMM), {size(self.a)} never stored")
        return None



def reads_bfloat16(node: Value) -> bool:
    """Whether the product `node` is of bfloat16 operands: as built (autocast's casts before it), or
    with those casts folded into it (backends/decide/half.py: it reads their float32 inputs and
    rounds them, which its float32 operands then are)."""
    return node.inputs[0].dtype == "bfloat16" or node.attrs.get("operands") == "bfloat16"


def _narrow(node: Value) -> bool:
    """Whether the product has few enough output columns, known, for a narrow kernel."""
    n = S.as_size(node.shape[-1])
    return isinstance(n, int) and 1 <= n <= runtime.NARROW_N


def bf16_gemm_applies(node: Value, language) -> bool:
    """Whether `choose` gives the product `node` the bfloat16 GEMM on `language`: bfloat16
    operands, neither of them a gather (which may be a convolution's patches), no implementation
    ahead of it."""
    if not reads_bfloat16(node) or "bf16 gemm" not in language.matmuls or "template gemm" in language.matmuls:
        return False
    # A gather, reached through the moves patch_spec follows (and a cast, which the fold may remove),
    # may be read as a convolution's patches.
    for operand in node.inputs:
        while operand.op.name in ("reshape", "transpose", "cast"):
            operand = operand.inputs[0]
        if operand.op.kind == GATHER:
            return False
    return not (_narrow(node) and "narrow" in language.matmuls)


def choose(graph, language, patches: frozenset, epilogued) -> dict:
    """id(matmul node) -> its implementation (IMPLEMENTATIONS) for `language`: the first it builds
    of those that fit the product, in this order. A convolution's patch operand read in place (a
    take of `patches`) fits only its own; any other product: the template GEMM, a narrow kernel (at
    most runtime.NARROW_N columns), the bfloat16 GEMM (bfloat16 operands), the blocked GEMM."""
    chosen = {}
    for node in graph.nodes:
        if node.op.kind != MATMUL:
            continue
        a, b = node.inputs
        spec_a = patch_spec(a, patches)
        if patch_spec(b, patches) is not None:
            fits = ["direct rows"] if id(node) not in epilogued else []
        elif spec_a is not None:
            by_winograd = id(node) not in epilogued and winograd.chosen(spec_a, S.as_size(node.shape[-1]))
            fits = (["winograd"] if by_winograd else []) + ["patch gemm"]
        else:
            fits = ["template gemm", *(["narrow"] if _narrow(node) else []),
                    *(["bf16 gemm"] if reads_bfloat16(node) else []), "gemm"]
        impl = next((f for f in fits if f in language.matmuls), None)
        if impl is None:
            raise language.refusal(node, f"no {language.name} matmul as {' or '.join(fits) or 'its convolution'}")
        if node.attrs.get("operands") == "bfloat16" and impl != "bf16 gemm":  # it would not round them
            raise RuntimeError(f"matmul {node.type_str}: casts to bfloat16 were folded into it, but {impl} "
                               f"computes it, which does not round its operands (bf16_gemm_applies disagrees)")
        chosen[id(node)] = impl
    return chosen


def refuse(node: Value, language) -> str | None:
    """Why `language` cannot build the product `node`, or None."""
    if node.dtype not in language.matmul_dtypes:
        return f"no {language.name} matmul for dtype {node.dtype}"
    most = language.matmul_batch_axes
    if most is not None and node.ndim - 2 > most:
        return f"no {language.name} matmul over more than {most} batch axes"
    return None


def _unit(stride) -> bool:
    return isinstance(stride, (int, np.integer, sympy.Integer)) and int(stride) == 1


def _function(impl: str, dtype: str, n, a: View, rounds: str = "") -> tuple[str, str]:
    """The runtime function computing a product of implementation `impl` reading `a`, and its variant;
    `rounds`: the operands ("a", "b", "ab") a bfloat16 GEMM rounds (float32 values, a cast folded)."""
    suffix = runtime.GEMM[dtype]["suffix"] if dtype in runtime.GEMM else ""
    if impl == "narrow":
        return gemm_function(dtype, n, a.strides[0], a.strides[1])
    if impl == "bf16 gemm" and rounds:
        return f"sg_gemm_bf16_round_{rounds}", "gemm"
    if impl == "winograd":
        return f"sg_conv_winograd_{'grad_' if a.literal.transposed else ''}{suffix}", "gemm"
    return {"gemm": f"sg_gemm_{suffix}", "bf16 gemm": "sg_gemm_bf16", "patch gemm": f"sg_gemm_patches_{suffix}",
            "direct rows": f"sg_conv_rows_{suffix}", "template gemm": ""}[impl], "gemm"


def lower(ctx, node: Value, epilogue_root: Value | None = None) -> View:
    """The MatmulKernel of `node`; with `epilogue_root`, the kernel also computes the elementwise
    chain from the product up to that root as it stores each element, and stores the root."""
    a, b = node.inputs
    impl = ctx.decisions.matmuls[id(node)]
    views = []
    for v in (a, b):
        view = ctx.views[id(v)]
        # A narrow kernel reads A's rows or its columns contiguously: A laid out neither way is copied.
        narrow_misfit = (impl == "narrow" and v is a and view.kind == "buffer"
                         and not (_unit(view.strides[-1]) or _unit(view.strides[-2])))
        if (view.kind != "buffer" and not is_patches(view)) or narrow_misfit:
            buf = ctx.alloc(v)
            ctx.copy(v, view, buf, "materialize a matmul operand")
            view = buffer_view(buf, v.shape)
        views.append(view)
    batch = ()
    if node.ndim > 2:  # torch.matmul's batch axes: each operand's view at the broadcast batch shape
        # (Each image's patch columns, read in place, are not strided: the direct convolution
        # walks their batch itself, so their batch strides are 0 here.)
        lead = node.shape[:-2]
        a_view, b_view = (vw if is_patches(vw) else broadcast_view(vw, lead + v.shape[-2:])
                          for vw, v in zip(views, (a, b)))
        out_strides = contiguous_strides(node.shape)
        batch = tuple(zip(lead, *((vw.strides[:-2] or (0,) * len(lead)) for vw in (a_view, b_view)),
                          out_strides[:-2]))
        views = [vw if is_patches(vw) else replace(vw, shape=v.shape[-2:], strides=vw.strides[-2:])
                 for vw, v in zip((a_view, b_view), (a, b))]
    root = node if epilogue_root is None else epilogue_root
    out = ctx.alloc(root)
    name, lines, epilogue = ctx.kernel_name(root), [ctx.line(node)], {}
    if epilogue_root is not None:
        operands, statements, result = ctx.fused_body(root, root.shape, {id(node): PRODUCT})
        lines += [st.line for st in statements]
        epilogue = dict(epilogue=operands, epilogue_statements=statements, epilogue_result=result)
    rounds = "".join(name for name, v in zip("ab", (a, b)) if v.dtype != "bfloat16") if impl == "bf16 gemm" else ""
    function, variant = _function(impl, out.dtype, node.shape[-1], views[0], rounds)
    ctx.emit(MatmulKernel(name, lines, views[0], views[1], out, node.shape[-2], node.shape[-1], a.shape[-1],
                          batch=batch, impl=impl, function=function, variant=variant, **epilogue))
    return buffer_view(out, root.shape)


def render(r: Renderer, k: MatmulKernel) -> dict:
    """A matmul as its implementation: a runtime GEMM (with its fused epilogue), a convolution's
    runtime call, or the program's tiled GEMM kernel ("template gemm")."""
    if k.impl not in r.lang.matmuls:  # (decide chose among the language's own)
        raise ValueError(f"{k.name}: a matmul decided for another language ({k.impl}); {r.lang.name} builds "
                         f"{', '.join(r.lang.matmuls)}")
    a, b = k.a, k.b
    r.features.add("gemm")
    epilogue_buffers = list(dict.fromkeys(op.view.buffer for op in k.epilogue if op.view.buffer is not None))
    runtime_gemm = k.impl in RUNTIME
    if k.impl == "direct rows":
        return _direct_convolution(r, k)
    patches = a.literal if k.impl in ("patch gemm", "winograd") else None  # gathered by the GEMM
    winograd = k.impl == "winograd"
    read = [a.buffer, *([patches.indices] if patches and not winograd else []), b.buffer, *epilogue_buffers]
    params, args = r.params(read, k.out, context=runtime_gemm)
    # A batched product: one GEMM per batch index n0, n1, ..., each operand's pointer moved by
    # its batch strides (0 where it is broadcast): the C loops over them, CUDA's kernel walks them
    # from the first elements (`a_base`, `b_base`) by the strides.
    batch = [dict(var=f"n{j}", size=r.ex.size(size), a=r.ex.size(sa), b=r.ex.size(sb), out=r.ex.size(so))
             for j, (size, sa, sb, so) in enumerate(k.batch)]
    names = [loop["var"] for loop in batch]
    a_at, b_at, out_at = (r.ex.index(offset, names, [step[j] for step in k.batch])
                          for offset, j in ((a.offset, 1), (b.offset, 2), (0, 3)))
    ctx = r.kernel(k, "matmul", params=params, args=args, ctype=D.C_TYPES[k.out.dtype],
                      M=r.ex.size(k.M), N=r.ex.size(k.N), K=r.ex.size(k.K), batch=batch,
                      a=r.ex.pointer(a) if not batch else f"{a.buffer.name} + {a_at}",
                      b=r.ex.pointer(b) if not batch else f"{b.buffer.name} + {b_at}",
                      out=k.out.name if not batch else f"{k.out.name} + {out_at}",
                      a_base=r.ex.pointer(a) if not patches else None, b_base=r.ex.pointer(b), out_base=k.out.name,
                      batch_count=r.ex.size(sympy.Mul(*(size for size, *_ in k.batch))),
                      sam=r.ex.size(a.strides[0]) if not patches else None,
                      sak=r.ex.size(a.strides[1]) if not patches else None,
                      sbk=r.ex.size(b.strides[0]), sbn=r.ex.size(b.strides[1]), epilogue=None,
                      patches=None, columns=None, winograd=None)
    if not runtime_gemm:
        return ctx
    gemm, kind = k.function, k.variant
    if winograd:
        grid, suffix = patches.grid, runtime.GEMM[k.out.dtype]['suffix']
        ctx["winograd"] = dict(type=f"sg_winograd_{suffix}", R=patches.R, Q=patches.Q, Ho=grid.Ho, Wo=grid.Wo,
                               Wp=grid.Wp, origin=grid.origin, tap=list(grid.tap), transposed=patches.transposed)
    elif patches is not None:
        ctx["patches"] = dict(type=f"sg_patches_{runtime.GEMM[k.out.dtype]['suffix']}", idx=patches.indices.name,
                              L=patches.L, K2=patches.K2, Q=patches.Q, R=patches.R,
                              transposed=int(patches.transposed))
    # The dot kernel needs only A's row stride (its columns are contiguous), the transposed one
    # only A's column stride (its rows are). The kernel leaves the GEMM's status in context->status.
    a_strides = [] if patches else {"gemm": [ctx["sam"], ctx["sak"]], "dot": [ctx["sam"]], "tn": [ctx["sak"]]}[kind]
    if k.epilogue_statements:
        # The GEMM calls it on each block of the product once the block holds its final sums: it
        # reads each element back (the local PRODUCT), computes the fused nodes, stores the root.
        at = r.ex.index(0, ["row", "col"], contiguous((k.M, k.N)))
        body = [Let(ctx["ctype"], PRODUCT, f"{k.out.name}[{at}]", comment(k.lines[0])),
                *r.element(k.epilogue, k.epilogue_statements, ["row", "col"]),
                Store(k.out.name, at, k.epilogue_result)]
        ctx["epilogue"] = dict(dims=[f"d{n}" for n in range(len(r.plan.dims))], body=body,
                               buffers=[dict(name=buf.name, ctype=D.C_TYPES[buf.dtype]) for buf in epilogue_buffers])
    # A batched product's GEMMs share the team out between them when each runs on one thread.
    share_min = runtime.GEMM_PARALLEL_MIN if kind == "gemm" else runtime.NARROW_PARALLEL_MIN
    return dict(ctx, gemm=gemm, a_strides=a_strides, status=True, share_min=share_min,
                parallel_min=runtime.GEMM_PARALLEL_MIN)


def _direct_convolution(r: Renderer, k: MatmulKernel) -> dict:
    """A batched matmul over (images, groups) whose right operand is each image's patch columns
    (patches.Columns): one call of the runtime's direct convolution for the whole batch."""
    a, b, columns = k.a, k.b, k.b.literal
    params, args = r.params([a.buffer, columns.indices, b.buffer], k.out, context=True)
    (P, sap, _, _), (G, sag, _, _) = k.batch
    suffix = runtime.GEMM[k.out.dtype]["suffix"]
    return r.kernel(k, "matmul", params=params, args=args, ctype=D.C_TYPES[k.out.dtype],
                       M=r.ex.size(k.M), N=r.ex.size(k.N), K=r.ex.size(k.K), batch=[],
                       # the images start at the view's offset (a slice of a larger buffer)
                       a=r.ex.pointer(a), b=r.ex.pointer(b), out=k.out.name, patches=None, epilogue=None,
                       columns=dict(type=f"sg_columns_{suffix}", function=k.function,
                                    idx=columns.indices.name, L=columns.L, K2=columns.K2, W=columns.W,
                                    R=columns.R, C=columns.C, transposed=int(columns.transposed),
                                    P=r.ex.size(P), G=r.ex.size(G),
                                    a_strides=[r.ex.size(x) for x in (sap, sag, *a.strides)]))
