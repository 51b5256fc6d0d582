"""The one C-style renderer: a kernel plan as C/OpenMP or CUDA source, through templates.

`render(plan, language, labels)` turns each kernel of the plan into a template
context and renders the language's program template. Python computes names and
expressions only (symgrad.backends.expressions); a kernel body is a list of
statements as plain data (`Let`, `Store`, `Fold`) that templates/statements.j2
prints; loops, pragmas, launches and signatures are the templates'. Whatever
differs between languages is a row of symgrad.backends.languages, read here:
how loops map to threads (`index`), how a reduction combines (`combine`), the
printer, the qualifiers. The program's own context (entry point, memory) is
symgrad.backends.render_program's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import sympy

from ..ir import dtypes as D
from ..ir import shapes as S
from ..ir.elementwise import ARGS
from . import runtime
from .attention import AttentionKernel
from .collective import DTYPES as COLLECTIVE_DTYPES, CollectiveKernel
from .gather import GatherKernel
from .patches import is_columns, is_patches, is_winograd, matmul_gemm
from .expressions import Exprs, comment, contiguous, convert, lowest
from .languages import COLUMN_TILE, PARALLEL_MIN, Language
from .plan import PRODUCT, REDUCED, LoopKernel, MatmulKernel, Plan, ReduceKernel, RowKernel, View


# ---- statements: what a kernel body is made of, printed by templates/statements.j2 -----

@dataclass(frozen=True)
class Let:
    """`const ctype name = value;  /* note */`: one local of a kernel body."""

    ctype: str
    name: str
    value: str
    note: str = ""
    kind: ClassVar[str] = "let"


@dataclass(frozen=True)
class Store:
    """`buffer[index] = value;  /* note */`."""

    buffer: str
    index: str
    value: str
    note: str = ""
    kind: ClassVar[str] = "store"


@dataclass(frozen=True)
class Accumulator:
    """A reduction's running value in one thread: declared by `init`, fed by `fold` (statements.j2).

    `value`: the element folded in; `fold`: how a max folds ("flag": a select that vectorizes,
    NaN kept in `nan_flag`; "select": one select that lets a NaN in); `index`: argmax's flat
    index of the element."""

    op: str
    acc: str
    ctype: str
    value: str
    fold: str = "flag"
    lowest: str = ""
    index: str = ""
    nan_flag: str = ""
    note: str = ""


@dataclass(frozen=True)
class Fold:
    """One element folded into `acc` (a statement of a kernel body)."""

    acc: Accumulator
    kind: ClassVar[str] = "fold"


def _small(numel) -> bool:
    """Whether a kernel's element count is known at compile time to be below PARALLEL_MIN."""
    if isinstance(numel, sympy.Basic):
        if not numel.is_Integer:
            return False  # an expression of Dims
        numel = int(numel)
    return isinstance(numel, (int, np.integer)) and int(numel) < PARALLEL_MIN


def _used(views, axes: int, offset: int = 0) -> set[int]:
    """The loop axes (of `axes`, starting at view axis `offset`) whose index some view reads:
    the index a view reads is offset + sum(var * stride) without the int 0 strides."""
    used = set()
    for view in views:
        if view.kind == "literal":
            continue
        for d in range(axes):
            stride = view.strides[offset + d]
            if not (isinstance(stride, int) and stride == 0):
                used.add(d)
    return used


class Renderer:
    """Template contexts of a plan's kernels in one `language`; `features` collects the helpers
    the kernels call ("int_pow", "random", "fast_exp", "gemm", "argmax", "rows")."""

    def __init__(self, plan: Plan, language: Language):
        self.plan, self.lang = plan, language
        self.ex = Exprs(plan.dims, language.printer)
        self.features = self.ex.features
        self.flat = language.index == "flat"

    # ---- pieces shared by every kernel ----

    def params(self, buffers: list, out, context: bool = False) -> tuple[list[dict], list[str]]:
        """The kernel's parameters (dims first, then each buffer once; `out`: the buffer written,
        or a list of them) for statements.j2's `params`, and the call's arguments."""
        outs = out if isinstance(out, list) else [out]
        order = list({id(b): b for b in [*buffers, *outs]}.values())
        params = [dict(ctype="int64_t", name=f"d{k}", const=False, pointer=False, restrict=False) for k in range(len(self.plan.dims))]
        args = [f"d{k}" for k in range(len(self.plan.dims))]
        for b in order:
            params.append(dict(ctype=D.C_TYPES[b.dtype], name=b.name, const=not any(b is o for o in outs),
                               pointer=True, restrict=True))
            args.append(b.name)
        if context:
            params.append(dict(ctype="sg_context", name="context", const=False, pointer=True, restrict=False))
            args.append("context")
        return params, args

    def element(self, operands: list, statements: list, loop_vars: list[str]) -> list:
        """One element of a fused elementwise group: operand loads at `loop_vars`, one local per node."""
        body = [Let(D.C_TYPES[op.view.dtype], op.name, self.ex.load(op.view, loop_vars), comment(op.label))
                for op in operands]
        return body + self.nodes(statements)

    def nodes(self, statements: list) -> list:
        """One local per fused node, commented with the IR line it computes."""
        return [Let(D.C_TYPES[st.dtype], st.name, self.ex.statement(st), comment(st.line)) for st in statements]

    def loops(self, shape, prefix: str, depth0: int = 1, parallel: bool = True, numel=None) -> list[dict]:
        """Nested loops (index "nested"): the outer one split over the OpenMP team unless `numel` is small."""
        if numel is not None and _small(numel):
            parallel = False  # no OpenMP region at all: even one with a false if() costs ~0.5 us
        return [dict(var=f"{prefix}{k}", size=self.ex.size(s), indent="    " * (depth0 + k),
                     parallel=parallel and k == 0) for k, s in enumerate(shape)]

    def split(self, shape, prefix: str, used: set[int]) -> list[dict]:
        """A flat index split into the row-major indices prefix<k> (index "flat"), innermost first,
        down to the outermost index `used` (statements.j2's `split_step`)."""
        if not used or not self.flat:
            return []
        low, steps = min(used), []
        for k in range(len(shape) - 1, low - 1, -1):
            step = "rest" if k == 0 else "last_mod" if k == low else "mod" if k in used else "div"
            steps.append(dict(var=f"{prefix}{k}", size=self.ex.paren(shape[k]), step=step))
        return steps

    def kernel(self, k, kind: str, **context) -> dict:
        """The context every kernel template reads, plus the kind's own."""
        return dict(kind=kind, template=self.lang.kernel_template(kind), name=k.name,
                    comments=[comment(line) for line in k.lines], restrict=self.lang.restrict, status=False,
                    **context)

    # ---- kernels ----

    def loop_kernel(self, k: LoopKernel) -> dict:
        """A fused elementwise loop over `k.shape`."""
        loops = self.loops(k.shape, "i", numel=k.numel)
        loop_vars = [l["var"] for l in loops]
        body = self.element(k.operands, k.statements, loop_vars)
        # out_view's offset: 0 but for embed, which stores into a window of its buffer.
        body.append(Store(k.out.name, self.ex.index(k.out_view.offset, loop_vars, k.out_view.strides), k.result))
        params, args = self.params([op.view.buffer for op in k.operands if op.view.buffer is not None], k.out)
        used = _used([op.view for op in k.operands] + [k.out_view], len(k.shape))
        return self.kernel(k, "loop", params=params, args=args, loops=loops, body=body,
                           indent="    " * (len(loops) + 1), numel=self.ex.numel(k.shape),
                           split=self.split(k.shape, "i", used))

    def reduce_kernel(self, k: ReduceKernel) -> dict:
        """A sum, max or argmax over `k.reduced` for each index of `k.kept`, with its fused prologue
        and epilogue: each thread folds into an accumulator, `language.combine` combines them."""
        if self.lang.column_sums and k.op == "sum" and len(k.kept) == 1 and k.kept[0][1] == 1 and k.reduced \
                and k.input.kind == "buffer" and not k.epilogue_statements:
            return self.column_sum_kernel(k)
        if k.op not in ("sum", "max", "argmax"):
            raise NotImplementedError(f"no {self.lang.name} lowering for reduction {k.op!r}")
        kept, reduced = [s for s, _ in k.kept], [s for s, _ in k.reduced]
        outer = self.loops(kept, "o", numel=k.numel)
        inner = self.loops(reduced, "r", depth0=1 + len(outer), parallel=False)
        outer_vars, inner_vars = [l["var"] for l in outer], [l["var"] for l in inner]
        acc_t = D.C_TYPES[k.acc_dtype]
        view = View(k.input.kind, (), k.input.dtype, tuple(st for _, st in [*k.kept, *k.reduced]),
                    k.input.offset, k.input.buffer, k.input.literal)
        views = [op.view for op in k.operands] if k.operands else [view]
        if k.operands:  # a fused elementwise prologue: the reduced element is computed in the loop
            body, value = self.element(k.operands, k.statements, outer_vars + inner_vars), k.result
        else:
            body, value = [], self.ex.load(view, outer_vars + inner_vars)
        if k.op != "sum":
            body.append(Let(D.C_TYPES[k.input.dtype], "v", value))
            value = "v"
        nan_flag = "acc_nan" if k.op == "max" and self.lang.max_fold == "flag" and D.is_float(k.acc_dtype) else ""
        # argmax's index: the flat index over the reduced axes (a flat loop strides over it as r)
        index = "r" if self.flat else self.ex.index(0, inner_vars, contiguous(reduced))
        acc = Accumulator(k.op, "acc", acc_t, value, fold=self.lang.max_fold, lowest=lowest(k.acc_dtype),
                          index=index, nan_flag=nan_flag)
        if k.op == "argmax":
            self.features.add("argmax")
        body.append(Fold(acc))
        total, best = self.lang.reduced_at  # the accumulators once the threads' parts are combined
        if nan_flag:
            total = f"({nan_flag} ? NAN : {total})"
        out_index = "o" if self.flat else self.ex.index(0, outer_vars, contiguous(kept))
        if k.op == "argmax":
            result = f"{best} < 0 ? 0 : {best}"
            finish = [Store(k.out.name, out_index, result)]
            result = f"({result})"
        else:
            finish = [Store(k.out.name, out_index, convert(total, k.acc_dtype, k.out.dtype))]
            result = convert(total, k.acc_dtype, k.reduced_dtype or k.acc_dtype)
        if k.epilogue_statements:  # the reduced value goes through the fused epilogue before it is stored
            finish = [Let(D.C_TYPES[k.reduced_dtype], REDUCED, result), *self.reduce_epilogue(k, out_index)]
        for l in inner:
            # lanes combine by OpenMP's simd reduction; argmax's first-maximum search is no OpenMP reduction
            l["simd"] = self.lang.combine == "simd" and l is inner[-1] and k.op != "argmax"
        buffers = [k.input.buffer] if k.input.buffer is not None else []
        buffers += [op.view.buffer for op in [*k.operands, *k.epilogue] if op.view.buffer is not None]
        params, args = self.params(buffers, k.out)
        return self.kernel(k, "reduce", params=params, args=args, op=k.op, acc_t=acc_t, outer=outer, inner=inner,
                           accumulators=[acc], body=body, finish=finish, indent="    " * (len(outer) + 1),
                           inner_indent="    " * (len(outer) + len(inner) + 1), numel=self.ex.paren(k.numel),
                           n_out=self.ex.numel(kept), n_red=self.ex.numel(reduced),
                           split_out=self.split(kept, "o", _used(views, len(kept))),
                           split_red=self.split(reduced, "r", _used(views, len(reduced), len(kept))))

    def reduce_epilogue(self, k: ReduceKernel, out_index: str) -> list:
        """A fused epilogue: operands read at the output's index, one local per node, the store."""
        body = [Let(D.C_TYPES[op.view.dtype], op.name,
                    self.ex.literal(op.view.literal, op.view.dtype) if op.view.kind == "literal"
                    else f"{op.view.buffer.name}[{out_index}]", comment(op.label)) for op in k.epilogue]
        return body + self.nodes(k.epilogue_statements) + [Store(k.out.name, out_index, k.epilogue_result)]

    def column_sum_kernel(self, k: ReduceKernel) -> dict:
        """A sum over leading axes into a contiguous kept axis: rows added into a tile (bias gradients)."""
        inner = self.loops([s for s, _ in k.reduced], "r", depth0=2, parallel=False)
        row_offset = self.ex.index(k.input.offset, [l["var"] for l in inner], [st for _, st in k.reduced])
        params, args = self.params([k.input.buffer], k.out)
        return self.kernel(k, "reduce_columns", params=params, args=args, inner=inner, size=self.ex.paren(k.kept[0][0]),
                           tile=COLUMN_TILE, acc_t=D.C_TYPES[k.acc_dtype], in_t=D.C_TYPES[k.input.dtype],
                           row=f"{k.input.buffer.name} + {row_offset}" if row_offset != "0" else k.input.buffer.name,
                           out=k.out.name, store=convert("acc[j]", k.acc_dtype, k.out.dtype),
                           inner_indent="    " * (len(inner) + 2), numel=self.ex.paren(k.numel),
                           parallel=not _small(k.numel))

    def row_kernel(self, k: RowKernel) -> dict:
        """A row kernel: per row, the per-row loads, then each pass's loop over the row's elements
        (its folds and stores) and what follows it (the reduced values, per-row maps and stores)."""
        outer = self.loops(k.rows, "o", numel=k.numel)
        loop_vars = [l["var"] for l in outer] + ["c"]
        passes, shared, views = [], [], [op.view for op in k.operands]
        for n, p in enumerate(k.passes):
            accumulators, finish = [], []
            for r in p.reductions:
                acc_t = D.C_TYPES[r.acc_dtype]
                nan_flag = f"{r.acc}_nan" if r.op == "max" and D.is_float(r.acc_dtype) else ""
                accumulators.append(Accumulator(r.op, r.acc, acc_t, r.value, lowest=lowest(r.acc_dtype),
                                                nan_flag=nan_flag, note=comment(r.line)))
                value = f"({nan_flag} ? NAN : {r.acc})" if nan_flag else r.acc  # this thread's part
                shared += [acc_t] if acc_t not in shared else []  # a block's scratch, by type
                value = self.lang.row_combine.format(op=r.op, ctype=acc_t, value=value)
                finish.append(Let(D.C_TYPES[r.dtype], r.name, convert(value, r.acc_dtype, r.dtype)))
            stores = [self.store(st, loop_vars) for st in p.stores]
            what = [f"{r.op} {r.name}" for r in p.reductions] + [f"store {st.label}" for st in p.stores]
            passes.append(dict(title=f"pass {n + 1} of {len(k.passes)} over the row: {', '.join(what)}",
                               accumulators=accumulators, simd=self.lang.combine == "simd",
                               body=[*self.element(p.operands, p.statements, loop_vars),
                                     *(Fold(a) for a in accumulators), *stores],
                               finish=finish + self.nodes(p.after),
                               row_stores=[self.store(st, loop_vars) for st in p.row_stores]))
            views += [op.view for op in p.operands] + [st.view for st in [*p.stores, *p.row_stores]]
        self.features.add("rows")
        reads = [o.view.buffer for o in [*k.operands, *(o for p in k.passes for o in p.operands)]
                 if o.view.buffer is not None]
        params, args = self.params(reads, k.outs)
        return dict(self.kernel(k, "row", params=params, args=args, outer=outer, passes=passes, shared=shared,
                                row=self.element(k.operands, [], loop_vars), size=self.ex.size(k.size),
                                indent="    " * (len(outer) + 1), numel=self.ex.paren(k.numel),
                                n_rows=self.ex.numel(k.rows), split=self.split(k.rows, "o", _used(views, len(k.rows)))),
                    comments=[comment(k.summary())] + [comment(line) for line in k.lines])

    def store(self, st, loop_vars: list[str]) -> Store:
        """A row kernel's store (its view is at the kernel's loop shape)."""
        return Store(st.view.buffer.name, self.ex.index(st.view.offset, loop_vars, st.view.strides), st.value,
                     comment(st.label))

    def matmul_kernel(self, k: MatmulKernel) -> dict:
        """A matmul: the runtime's GEMM chosen for its shape, with its fused epilogue (`gemm`
        "runtime"), or the program's tiled GEMM kernel ("template")."""
        a, b = k.a, k.b
        if self.lang.gemm == "template" and k.out.dtype not in ("float32", "float64"):
            raise NotImplementedError(f"no {self.lang.name} matmul for dtype {k.out.dtype}")
        self.features.add("gemm")
        epilogue_buffers = list(dict.fromkeys(op.view.buffer for op in k.epilogue if op.view.buffer is not None))
        runtime_gemm = self.lang.gemm == "runtime"
        if k.epilogue_statements and not runtime_gemm:
            raise NotImplementedError(f"no {self.lang.name} matmul with a fused epilogue ({k.name})")
        if is_columns(b):
            return self.direct_convolution(k)
        patches = a.literal if is_patches(a) else None  # a convolution's patches, gathered by the GEMM
        winograd = patches is not None and runtime_gemm and not k.batch and is_winograd(a, k.N, k.epilogue_statements)
        if patches is not None and (not runtime_gemm or k.batch):
            raise NotImplementedError(f"no {self.lang.name} matmul gathering its patches ({k.name})")
        read = [a.buffer, *([patches.indices] if patches and not winograd else []), b.buffer, *epilogue_buffers]
        params, args = self.params(read, k.out, context=runtime_gemm)
        # A batched product: one GEMM per batch index n0, n1, ..., each operand's pointer moved by
        # its batch strides (0 where it is broadcast).
        batch = [dict(var=f"n{j}", size=self.ex.size(size)) for j, (size, *_) in enumerate(k.batch)]
        names = [loop["var"] for loop in batch]
        a_at, b_at, out_at = (self.ex.index(offset, names, [step[j] for step in k.batch])
                              for offset, j in ((a.offset, 1), (b.offset, 2), (0, 3)))
        ctx = self.kernel(k, "matmul", params=params, args=args, ctype=D.C_TYPES[k.out.dtype],
                          M=self.ex.size(k.M), N=self.ex.size(k.N), K=self.ex.size(k.K), batch=batch,
                          a=self.ex.pointer(a) if not batch else f"{a.buffer.name} + {a_at}",
                          b=self.ex.pointer(b) if not batch else f"{b.buffer.name} + {b_at}",
                          out=k.out.name if not batch else f"{k.out.name} + {out_at}",
                          sam=self.ex.size(a.strides[0]) if not patches else None,
                          sak=self.ex.size(a.strides[1]) if not patches else None,
                          sbk=self.ex.size(b.strides[0]), sbn=self.ex.size(b.strides[1]), epilogue=None,
                          patches=None, columns=None, winograd=None)
        if not runtime_gemm:
            return ctx
        gemm, kind = matmul_gemm(k.out.dtype, k.N, a)
        if winograd:
            grid, suffix = patches.grid, runtime.GEMM[k.out.dtype]['suffix']
            gemm = f"sg_conv_winograd_{'grad_' if patches.transposed else ''}{suffix}"
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
            at = self.ex.index(0, ["row", "col"], contiguous((k.M, k.N)))
            body = [Let(ctx["ctype"], PRODUCT, f"{k.out.name}[{at}]", comment(k.lines[0])),
                    *self.element(k.epilogue, k.epilogue_statements, ["row", "col"]),
                    Store(k.out.name, at, k.epilogue_result)]
            ctx["epilogue"] = dict(dims=[f"d{n}" for n in range(len(self.plan.dims))], body=body,
                                   buffers=[dict(name=buf.name, ctype=D.C_TYPES[buf.dtype]) for buf in epilogue_buffers])
        # A batched product's GEMMs share the team out between them when each runs on one thread.
        share_min = runtime.GEMM_PARALLEL_MIN if kind == "gemm" else runtime.NARROW_PARALLEL_MIN
        return dict(ctx, gemm=gemm, a_strides=a_strides, status=True, share_min=share_min,
                    parallel_min=runtime.GEMM_PARALLEL_MIN)

    def direct_convolution(self, k: MatmulKernel) -> dict:
        """A batched matmul over (images, groups) whose right operand is each image's patch columns
        (patches.Columns): one call of the runtime's direct convolution for the whole batch."""
        a, b, columns = k.a, k.b, k.b.literal
        if self.lang.gemm != "runtime" or len(k.batch) != 2 or k.epilogue_statements:
            raise NotImplementedError(f"no {self.lang.name} direct convolution ({k.name})")
        params, args = self.params([a.buffer, columns.indices, b.buffer], k.out, context=True)
        (P, sap, _, _), (G, sag, _, _) = k.batch
        suffix = runtime.GEMM[k.out.dtype]["suffix"]
        return self.kernel(k, "matmul", params=params, args=args, ctype=D.C_TYPES[k.out.dtype],
                           M=self.ex.size(k.M), N=self.ex.size(k.N), K=self.ex.size(k.K), batch=[],
                           a=self.ex.pointer(a), b=b.buffer.name, out=k.out.name, patches=None, epilogue=None,
                           columns=dict(type=f"sg_columns_{suffix}", function=f"sg_conv_rows_{suffix}",
                                        idx=columns.indices.name, L=columns.L, K2=columns.K2, W=columns.W,
                                        R=columns.R, C=columns.C, transposed=int(columns.transposed),
                                        P=self.ex.size(P), G=self.ex.size(G),
                                        a_strides=[self.ex.size(x) for x in (sap, sag, *a.strides)]))

    def gather_kernel(self, k: GatherKernel) -> dict:
        """take or scatter_add over (P, I, Q) loops (templates <language>/gather)."""
        params, args = self.params([k.src.buffer, k.indices.buffer], k.out)
        sizes = {name: self.ex.paren(getattr(k, name)) for name in ("P", "I", "Q", "rows")}
        threads = f"{sizes['P']} * {sizes['I']} * {sizes['Q']}" if k.op == "take" else f"{sizes['P']} * {sizes['Q']}"
        return self.kernel(k, "gather", params=params, args=args, op=k.op, ctype=D.C_TYPES[k.out.dtype],
                           itype=D.C_TYPES[k.indices.dtype], src=self.ex.pointer(k.src),
                           idx=self.ex.pointer(k.indices), out=k.out.name, threads=threads,
                           parallel=not _small(self.ex_numel(k)), **sizes)

    def ex_numel(self, k: GatherKernel):
        """Elements a gather kernel moves: P * I * Q."""
        return sympy.sympify(k.P) * sympy.sympify(k.I) * sympy.sympify(k.Q)

    def attention_kernel(self, k: AttentionKernel) -> dict:
        """Fused attention or its gradient over H heads of T rows (templates <language>/attention):
        Python gives each operand's head pointer and row stride, and the softmax's exp expressions."""
        ctype = D.C_TYPES[k.out.dtype]
        params, args = self.params(k.reads(), k.writes())  # stats: the forward's output, the gradient's input
        # Head h's batch indices n0, n1, ... (row-major over k.batch), then each operand's head pointer.
        unravel = []
        for j, size in enumerate(k.batch):
            inner = self.ex.paren(S.numel(k.batch[j + 1:]))
            value = "h" if inner == "1" else f"h / {inner}"
            unravel.append(dict(var=f"n{j}", value=value if j == 0 else f"{value} % {self.ex.paren(size)}"))
        names = [u["var"] for u in unravel]
        operands = [dict(role=role, label=label, row=self.ex.paren(view.strides[-2]),
                         at=f"{view.buffer.name} + {self.ex.index(view.offset, names, view.strides[:-2])}")
                    for role, label, view in zip(("q", "k", "v", "o", "g"), k.labels, k.operands)]
        printer = self.lang.printer(k.out.dtype)
        exp = {name: printer.print_named(sympy.exp(ARGS[0] - ARGS[1]), {ARGS[0]: a, ARGS[1]: b})
               for name, (a, b) in dict(rescale=("before", "top"), p=("s[jj]", "top")).items()}
        self.features.add("attention")
        if any("sg_expf(" in text for text in exp.values()):
            self.features.add("fast_exp")
        return self.kernel(k, "attention", params=params, args=args, op=k.op, ctype=ctype, unravel=unravel,
                           suffix=runtime.GEMM[k.out.dtype]["suffix"], operands=operands, H=self.ex.paren(k.heads),
                           T=self.ex.paren(k.T), E=self.ex.paren(k.E),
                           causal=k.causal, scale=self.ex.literal(k.scale, k.out.dtype), out=k.out.name,
                           scratch=[b.name for b in k.scratch], stats=None if k.stats is None else k.stats.name,
                           parallel=not _small(sympy.sympify(k.heads) * k.T * k.T * k.E), **exp)

    def collective_kernel(self, k: CollectiveKernel) -> dict:
        """all_reduce: the buffer handed to the caller's hook, which sums it over the processes
        (templates/c/collective); the entry point checks the status the hook returns."""
        if self.lang.memory == "device":
            raise NotImplementedError(f"all_reduce ({k.name}): the {self.lang.name} backend has no collectives; "
                                      f"sg.distributed runs them on the c and numpy backends")
        params, args = self.params([], k.buffer, context=True)
        ctx = self.kernel(k, "collective", params=params, args=args, buffer=k.buffer.name,
                          numel=self.ex.size(k.numel), dtype=k.buffer.dtype, dtype_code=COLLECTIVE_DTYPES.index(k.buffer.dtype))
        return dict(ctx, status=True)

    def kernels(self) -> list[dict]:
        """The template context of every kernel of the plan, in schedule order."""
        contexts = []
        for k in self.plan.kernels:
            if isinstance(k, LoopKernel):
                contexts.append(self.loop_kernel(k))
            elif isinstance(k, ReduceKernel):
                contexts.append(self.reduce_kernel(k))
            elif isinstance(k, MatmulKernel):
                contexts.append(self.matmul_kernel(k))
            elif isinstance(k, RowKernel):
                contexts.append(self.row_kernel(k))
            elif isinstance(k, GatherKernel):
                contexts.append(self.gather_kernel(k))
            elif isinstance(k, AttentionKernel):
                contexts.append(self.attention_kernel(k))
            elif isinstance(k, CollectiveKernel):
                contexts.append(self.collective_kernel(k))
            else:
                raise NotImplementedError(f"no {self.lang.name} rendering for kernel {type(k).__name__}")
        return contexts
