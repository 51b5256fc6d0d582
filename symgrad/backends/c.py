"""The C/OpenMP backend: a kernel plan rendered through templates/c/, built by cffi.

`compile(graph)` lowers the graph (symgrad.backends.lowering), renders one
C11 file with one function per kernel and one entry point,

    int symgrad_run(const int64_t* dims, void** inputs, void** variables,
                    void** outputs, char* workspace, const int64_t* offsets,
                    sg_context* context);

beside two small ones: `symgrad_workspace_bytes` (how many temporaries, and
the bytes each needs for given dims) and `symgrad_set_num_threads` (caps the
calling thread's OpenMP team). Its matmuls call the runtime
(symgrad.backends.runtime), whose header it includes and whose library,
built once per compiler and flags, it links; it builds the file through
the cache (symgrad.backends.cache). Python owns all memory: inputs, variables and
outputs are NumPy arrays passed with `ffi.from_buffer` (no copies);
temporaries live in one workspace array whose layout is computed here from
the Dim bindings, and checked against the sizes the code itself reports.
User names never enter C except inside comments, escaped.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time

import numpy as np
import sympy

from ..ir import dtypes as D
from ..ir import shapes as S
from ..ir.elementwise import ARGS
from ..ir.graph import Graph
from ..ir.ops import check_labels, label_checks
from . import cache, runtime
from .c_printer import CPrintError, format_literal, printer
from .. import passes
from .lowering import (PRODUCT, REDUCED, LoopKernel, MatmulKernel, Plan, ReduceKernel, RowKernel, View,
                       contiguous_strides, lower)
from . import program_cache
from .memory import ArenaSpec, MemoryPlan, latest_or_assumed, memory_plan
from .report import program_report, timed as _timed
from .templates import render

_refcount = getattr(sys, "getrefcount", None)  # CPython's; elsewhere outputs are always new arrays
ENTRY = "symgrad_run"
BAD_LABEL = 2  # the entry's status when a class-label input holds a label outside [0, classes)
# What the workspace must hold: the number of temporaries, and (given nbytes) the bytes each needs
# for these dims: the kernels' own sizes, against which a caller checks its arena.
WORKSPACE_SIZES = "symgrad_workspace_bytes"
# Caps the OpenMP team of the calling thread's later parallel regions (see _ForkedChild).
SET_THREADS = "symgrad_set_num_threads"
SIGNATURE = (f"int {ENTRY}(const int64_t* dims, void** inputs, void** variables, void** outputs, "
             f"char* workspace, const int64_t* offsets, sg_context* context)")
# The program's sg_context (symgrad_runtime.h): Python owns one per program and reads `failed`.
CDEF = ("typedef struct { const char* failed; ...; } sg_context;\n"
        f"{SIGNATURE};\n"
        f"int64_t {WORKSPACE_SIZES}(const int64_t* dims, int64_t* nbytes);\n"
        f"void {SET_THREADS}(int threads);")
PARALLEL_MIN = 1 << 15          # elements: below this a loop runs on one thread
COLUMN_TILE = 256              # accumulators per column tile of a column sum (a few KB on the stack)
LAYOUTS_KEPT = 4                # workspaces kept for the most recent distinct Dim bindings
ALIGN = 64                      # bytes: every workspace buffer starts on a cache line


def comment(text) -> str:
    """`text` safe inside a C block comment on one line: no `*/`, no newlines, printable ASCII only."""
    text = str(text).encode("ascii", "backslashreplace").decode("ascii")
    out = []
    for ch in text:
        if ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif not (32 <= ord(ch) < 127):
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    text = "".join(out)
    while "*/" in text or "/*" in text:
        text = text.replace("*/", "*\\/").replace("/*", "/\\*")
    return text.replace("??", "?\\?")  # no trigraphs either


# ---- expressions ---------------------------------------------------------------------

class _Exprs:
    """Prints sizes, indices and literals with Dims as their C arguments (d0, d1, ...)."""

    def __init__(self, dims: list):
        self.dim_syms = {d: sympy.Symbol(f"d{k}", integer=True, positive=True) for k, d in enumerate(dims)}
        self.int = printer("int64")

    def size(self, value) -> str:
        """An int64 C expression of a size or index."""
        if isinstance(value, (int, np.integer)):
            return str(int(value))
        return self.int.doprint(sympy.sympify(value).xreplace(self.dim_syms))

    def index(self, offset, loop_vars: list[str], strides) -> str:
        """offset + sum(var * stride), simplified where a stride is 0 or 1."""
        terms = []
        for var, stride in zip(loop_vars, strides):
            if isinstance(stride, int) and stride == 0:
                continue
            terms.append(var if isinstance(stride, int) and stride == 1 else f"{var} * {self._paren(stride)}")
        if not (isinstance(offset, int) and offset == 0):
            terms.append(self._paren(offset))
        return " + ".join(terms) if terms else "0"

    def _paren(self, value) -> str:
        text = self.size(value)
        return text if text.isidentifier() or text.isdigit() else f"({text})"

    def literal(self, value, dtype: str) -> str:
        """A constant (a number, or an expression of Dims such as 1/B) as a C expression of `dtype`."""
        if isinstance(value, sympy.Basic):
            if not value.free_symbols:
                value = float(value) if D.is_float(dtype) else int(value)
            else:
                text = printer(dtype if D.is_float(dtype) else "int64").doprint(value.xreplace(self.dim_syms))
                return f"(({D.C_TYPES[dtype]})({text}))"
        if isinstance(value, (bool, np.bool_)) and dtype != "bool":
            value = int(value)
        return format_literal(value, dtype)


def _convert(text: str, src: str, dst: str) -> str:
    """C for converting a value of dtype `src` to `dst` (NumPy's astype semantics)."""
    if src == dst:
        return text
    if dst == "bool":
        return f"(uint8_t)(({text}) != 0)"
    if src == "bool" and D.is_float(dst):
        # A select rather than a conversion: gcc vectorizes `b ? 1.0f : 0.0f` beside 64-bit lanes
        # (an int64 index compared to a label, a one-hot), where a uint8 -> float convert keeps the
        # whole loop scalar (8x slower on a cross-entropy row).
        one, zero = ("1.0f", "0.0f") if dst == "float32" else ("1.0", "0.0")
        return f"(({text}) ? {one} : {zero})"
    return f"({D.C_TYPES[dst]})({text})"


def _is_boolean_expr(expr) -> bool:
    return isinstance(expr, (sympy.core.relational.Relational, sympy.logic.boolalg.BooleanFunction,
                             sympy.logic.boolalg.BooleanAtom))


# ---- kernels -> template contexts ----------------------------------------------------

class _Renderer:
    """Turns a plan's kernels into template contexts; Python computes names and expressions only.

    `printer` (dtype -> expression printer) and `language` are the only differences a
    renderer for another C-like language must supply to reuse `statement` and `kernels`.
    """

    printer = staticmethod(printer)
    language = "C"
    restrict = "restrict"  # the no-alias qualifier of kernel parameters in this language

    def __init__(self, plan: Plan):
        self.plan = plan
        self.ex = _Exprs(plan.dims)
        self.int_pow = False
        self.random = False
        self.fast_exp = False  # a statement calls sg_expf (templates/c/expf.h.j2 goes in the prelude)
        self.gemm = False  # a kernel calls the runtime's GEMMs

    def params(self, buffers: list, out) -> tuple[str, list[str]]:
        """The kernel's C parameters (dims first, then each buffer once) and the call's arguments
        (`out`: the buffer written, or a list of them)."""
        outs = out if isinstance(out, list) else [out]
        seen, order = set(), []
        for b in [*buffers, *outs]:
            if id(b) not in seen:
                seen.add(id(b))
                order.append(b)
        decls = [f"int64_t d{k}" for k in range(len(self.plan.dims))]
        args = [f"d{k}" for k in range(len(self.plan.dims))]
        for b in order:
            const = "" if any(b is o for o in outs) else "const "
            decls.append(f"{const}{D.C_TYPES[b.dtype]}* {self.restrict} {b.name}")
            args.append(b.name)
        return ", ".join(decls) or "void", args

    def load(self, view: View, loop_vars: list[str]) -> str:
        if view.kind == "literal":
            return self.ex.literal(view.literal, view.dtype)
        index = self.ex.index(view.offset, loop_vars, view.strides)
        if view.kind == "index":
            return _convert(index, "int64", view.dtype)
        return f"{view.buffer.name}[{index}]"

    def loops(self, shape, prefix: str, depth0: int = 1, parallel: bool = True, numel=None) -> list[dict]:
        if numel is not None and _small(numel):
            parallel = False  # no OpenMP region at all: even one with a false if() costs ~0.5 us
        return [dict(var=f"{prefix}{k}", size=self.ex.size(s), indent="    " * (depth0 + k),
                     parallel=parallel and k == 0) for k, s in enumerate(shape)]

    def loop_kernel(self, k: LoopKernel) -> dict:
        loops = self.loops(k.shape, "i", numel=k.numel)
        loop_vars = [l["var"] for l in loops]
        body = self.element_lines(k, loop_vars)
        out_index = self.ex.index(0, loop_vars, k.out_view.strides)
        body.append(f"{k.out.name}[{out_index}] = {k.result};")
        params, args = self.params([op.view.buffer for op in k.operands if op.view.buffer is not None], k.out)
        return dict(template="c/loop.c.j2", name=k.name, comments=[comment(l) for l in k.lines], params=params,
                    args=args, loops=loops, body=body, indent="    " * (len(loops) + 1),
                    numel=self.ex._paren(k.numel))

    def statement(self, st, dtypes: dict) -> str:
        """One node's C expression: operands cast to the compute dtype, result converted to st.dtype."""
        if st.node.op.name == "pow" and not D.is_float(st.compute_dtype):
            self.int_pow = True
            a, b = (_convert(a, d, "int64") for a, d in zip(st.args, st.arg_dtypes))
            return _convert(f"sg_ipow({a}, {b})", "int64", st.dtype)
        if st.node.op.name == "random_bits":
            self.random = True  # the generator's C body (templates/c/random.h.j2) goes in the prelude
        names = {}
        for i, (name, dtype) in enumerate(zip(st.args, st.arg_dtypes)):
            text = name if dtype == st.compute_dtype else f"(({D.C_TYPES[st.compute_dtype]}){name})"
            if st.compute_dtype == "bool" and dtype != "bool":
                text = f"({name} != 0)"
            names[ARGS[i]] = text
        expr = sympy.sympify(st.expr)
        try:
            text = self.printer(st.compute_dtype).print_named(expr, names)
        except CPrintError as exc:
            raise CPrintError(f"op {st.node.op.name!r} ({st.node.op.expr}): {exc}") from None
        self.fast_exp = self.fast_exp or "sg_expf(" in text
        if _is_boolean_expr(expr) and st.dtype != "bool":
            return _convert(text, "bool", st.dtype)
        if _is_boolean_expr(expr):
            return f"(uint8_t)({text})"
        return _convert(text, st.compute_dtype, st.dtype)

    def reduce_kernel(self, k: ReduceKernel) -> dict:
        if k.op == "sum" and len(k.kept) == 1 and k.kept[0][1] == 1 and k.reduced and k.input.kind == "buffer" \
                and not k.epilogue_statements:
            return self.column_sum_kernel(k)
        outer = self.loops([s for s, _ in k.kept], "o", numel=k.numel)
        inner = self.loops([s for s, _ in k.reduced], "r", depth0=1 + len(outer), parallel=False)
        acc_t = D.C_TYPES[k.acc_dtype]
        in_t = D.C_TYPES[k.input.dtype]
        offset_vars = [l["var"] for l in outer] + [l["var"] for l in inner]
        strides = [st for _, st in k.kept] + [st for _, st in k.reduced]
        prologue = []
        if k.operands:  # a fused elementwise prologue: the reduced element is computed in the loop
            prologue, load = self.element_lines(k, offset_vars), k.result
        else:
            view = View(k.input.kind, (), k.input.dtype, tuple(strides), k.input.offset, k.input.buffer,
                        k.input.literal)
            load = self.load(view, offset_vars)
        out_index = self.ex.index(0, [l["var"] for l in outer],
                                  _contiguous([s for s, _ in k.kept]))
        simd = ""  # argmax's first-maximum search is no OpenMP reduction
        reduced = "acc"
        if k.op == "sum":
            init = [f"{acc_t} acc = 0;"]
            body = [f"acc += ({acc_t}){load};"]
            finish = [f"{k.out.name}[{out_index}] = {_convert('acc', k.acc_dtype, k.out.dtype)};"]
            simd = _simd_reductions({"+": ["acc"]})
        elif k.op == "max":
            init, fold, reduced, accumulators = _max_fold("acc", "v", k.acc_dtype)
            body = [f"const {in_t} v = {load};", *fold]
            finish = [f"{k.out.name}[{out_index}] = {reduced};"]
            simd = _simd_reductions(accumulators)
        elif k.op == "argmax":
            flat = self.ex.index(0, [l["var"] for l in inner], _contiguous([s for s, _ in k.reduced]))
            init = [f"{acc_t} acc = {_lowest(k.acc_dtype)};", "int64_t best = -1;"]
            body = [f"const {in_t} v = {load};",
                    "if (best < 0 || v > acc || (v != v && acc == acc)) {  /* the first maximum; NaN wins */",
                    "    acc = v;",
                    f"    best = {flat};",
                    "}"]
            finish = [f"{k.out.name}[{out_index}] = best < 0 ? 0 : best;"]
        else:
            raise NotImplementedError(f"no C lowering for reduction {k.op!r}")
        body = prologue + body
        if k.epilogue_statements:  # the reduced value goes through the fused epilogue before it is stored
            value = {"sum": _convert("acc", k.acc_dtype, k.reduced_dtype), "max": reduced,
                     "argmax": "(best < 0 ? 0 : best)"}[k.op]
            finish = [f"const {D.C_TYPES[k.reduced_dtype]} {REDUCED} = {value};",
                      *self.epilogue_lines(k, out_index)]
        for l in inner:
            l["simd"] = simd if l is inner[-1] else ""
        buffers = [k.input.buffer] if k.input.buffer is not None else []
        buffers += [op.view.buffer for op in [*k.operands, *k.epilogue] if op.view.buffer is not None]
        params, args = self.params(buffers, k.out)
        return dict(template="c/reduce.c.j2", name=k.name, comments=[comment(l) for l in k.lines],
                    params=params, args=args, outer=outer, inner=inner, init=init, body=body, finish=finish,
                    indent="    " * (len(outer) + 1), inner_indent="    " * (len(outer) + len(inner) + 1),
                    numel=self.ex._paren(k.numel))

    def epilogue_lines(self, k: ReduceKernel, out_index: str) -> list[str]:
        """A fused epilogue's C lines: operands read at the output's index, one line per node, the store."""
        lines = []
        for op in k.epilogue:
            load = (self.ex.literal(op.view.literal, op.view.dtype) if op.view.kind == "literal"
                    else f"{op.view.buffer.name}[{out_index}]")
            lines.append(f"const {D.C_TYPES[op.view.dtype]} {op.name} = {load};  /* {comment(op.label)} */")
        dtypes = {op.name: op.view.dtype for op in k.epilogue}
        dtypes[REDUCED] = k.reduced_dtype
        for st in k.epilogue_statements:
            text = self.statement(st, dtypes)
            dtypes[st.name] = st.dtype
            lines.append(f"const {D.C_TYPES[st.dtype]} {st.name} = {text};  /* {comment(st.line)} */")
        lines.append(f"{k.out.name}[{out_index}] = {k.epilogue_result};")
        return lines

    def element_lines(self, k, loop_vars: list[str]) -> list[str]:
        """The lines computing one element of a loop kernel or a fused reduction's input:
        operand loads, then one line per fused node (the same in C and CUDA)."""
        return self.body_lines(k.operands, k.statements, loop_vars)

    def body_lines(self, operands: list, statements: list, loop_vars: list[str]) -> list[str]:
        """Operand loads at `loop_vars` (each operand's view indexed by them), then one line per
        statement: one element of a fused elementwise group."""
        lines = []
        for op in operands:
            lines.append(f"const {D.C_TYPES[op.view.dtype]} {op.name} = {self.load(op.view, loop_vars)};"
                         f"  /* {comment(op.label)} */")
        dtypes = {op.name: op.view.dtype for op in operands}
        for st in statements:
            text = self.statement(st, dtypes)
            dtypes[st.name] = st.dtype
            lines.append(f"const {D.C_TYPES[st.dtype]} {st.name} = {text};  /* {comment(st.line)} */")
        return lines

    def row_pass_lines(self, k: RowKernel, loop_vars: list[str]) -> list[dict]:
        """Per pass of a row kernel: the accumulators' `init`, the element `body` (loads, one line per
        node, the folds, the stores) and the per-row `finish` (reduced values, per-row maps, stores);
        `reduced`, each reduction's value from its accumulators (a max's NaN flag folded in), and
        `accumulators` by reduction operator ("+", "max", "|"). Combining a row's accumulators
        across threads is the caller's (C has one thread per row)."""
        out = []
        for n, p in enumerate(k.passes):
            init, folds, reduced, accumulators = [], [], [], {"+": [], "max": [], "|": []}
            for r in p.reductions:
                acc_t = D.C_TYPES[r.acc_dtype]
                if r.op == "sum":
                    init.append(f"{acc_t} {r.acc} = 0;")
                    folds.append(f"{r.acc} += ({acc_t}){r.value};  /* {comment(r.line)} */")
                    reduced.append(r.acc)
                    accumulators["+"].append(r.acc)
                else:
                    more, fold, value, accs = _max_fold(r.acc, r.value, r.acc_dtype)
                    init += more
                    folds += [f"{fold[0]}  /* {comment(r.line)} */", *fold[1:]]
                    reduced.append(value)
                    for op, names in accs.items():
                        accumulators[op] += names
            stores = [f"{self.store(st, loop_vars)}  /* {comment(st.label)} */" for st in p.stores]
            after = self.element_lines(_Body([], p.after), loop_vars)
            row_stores = [f"{self.store(st, loop_vars)}  /* {comment(st.label)} */" for st in p.row_stores]
            what = [f"{r.op} {r.name}" for r in p.reductions] + [f"store {st.label}" for st in p.stores]
            out.append(dict(title=f"pass {n + 1} of {len(k.passes)} over the row: {', '.join(what)}",
                            init=init, body=self.element_lines(p, loop_vars) + folds + stores, after=after,
                            row_stores=row_stores, reductions=p.reductions, reduced=reduced,
                            accumulators=accumulators))
        return out

    def store(self, st, loop_vars: list[str]) -> str:
        """`buffer[index] = value;` for a row kernel's store (its view is at the kernel's loop shape)."""
        return f"{st.view.buffer.name}[{self.ex.index(st.view.offset, loop_vars, st.view.strides)}] = {st.value};"

    def row_kernel(self, k: RowKernel) -> dict:
        """A row kernel: rows split over OpenMP threads; per row, the per-row loads, then each pass's
        loop over the row's elements and what follows it."""
        outer = self.loops(k.rows, "o", numel=k.numel)
        loop_vars = [l["var"] for l in outer] + ["c"]
        passes = []
        for p in self.row_pass_lines(k, loop_vars):
            finish = [f"const {D.C_TYPES[r.dtype]} {r.name} = {_convert(value, r.acc_dtype, r.dtype)};"
                      for r, value in zip(p["reductions"], p["reduced"])]
            passes.append(dict(p, finish=finish + p["after"] + p["row_stores"],
                               simd=_simd_reductions(p["accumulators"])))
        reads = [o.view.buffer for o in [*k.operands, *(o for p in k.passes for o in p.operands)]
                 if o.view.buffer is not None]
        params, args = self.params(reads, k.outs)
        return dict(template="c/row.c.j2", name=k.name, comments=[comment(k.summary())] + [comment(l) for l in k.lines],
                    params=params, args=args, outer=outer, row=self.element_lines(_Body(k.operands, []), loop_vars),
                    passes=passes, size=self.ex.size(k.size), indent="    " * (len(outer) + 1),
                    numel=self.ex._paren(k.numel))

    def column_sum_kernel(self, k: ReduceKernel) -> dict:
        """A sum over leading axes into a contiguous kept axis: rows added into a tile (bias gradients)."""
        inner = self.loops([s for s, _ in k.reduced], "r", depth0=2, parallel=False)
        row_offset = self.ex.index(k.input.offset, [l["var"] for l in inner], [st for _, st in k.reduced])
        params, args = self.params([k.input.buffer], k.out)
        return dict(template="c/reduce_columns.c.j2", name=k.name, comments=[comment(l) for l in k.lines],
                    params=params, args=args, inner=inner, size=self.ex._paren(k.kept[0][0]), tile=COLUMN_TILE,
                    acc_t=D.C_TYPES[k.acc_dtype], in_t=D.C_TYPES[k.input.dtype],
                    row=f"{k.input.buffer.name} + {row_offset}" if row_offset != "0" else k.input.buffer.name,
                    out=k.out.name, store=_convert("acc[j]", k.acc_dtype, k.out.dtype),
                    inner_indent="    " * (len(inner) + 2), numel=self.ex._paren(k.numel),
                    parallel=not _small(k.numel))

    def matmul_kernel(self, k: MatmulKernel) -> dict:
        a, b = k.a, k.b
        ptr = lambda v: v.buffer.name if v.offset == 0 else f"{v.buffer.name} + {self.ex._paren(v.offset)}"
        epilogue_buffers = [op.view.buffer for op in k.epilogue if op.view.buffer is not None]
        params, args = self.params([a.buffer, b.buffer, *epilogue_buffers], k.out)
        ctx = dict(template="c/matmul.c.j2", name=k.name, comments=[comment(l) for l in k.lines],
                   params=params, args=args, M=self.ex.size(k.M), N=self.ex.size(k.N), K=self.ex.size(k.K),
                   a=ptr(a), b=ptr(b), out=k.out.name,
                   sam=self.ex.size(a.strides[0]), sak=self.ex.size(a.strides[1]),
                   sbk=self.ex.size(b.strides[0]), sbn=self.ex.size(b.strides[1]),
                   epilogue=self.matmul_epilogue(k, epilogue_buffers) if k.epilogue_statements else None)
        self.gemm = True
        gemm, kind = runtime.gemm_function(k.out.dtype, k.N, a.strides[0], a.strides[1])
        # The dot kernel needs only A's row stride (its columns are contiguous), the transposed one
        # only A's column stride (its rows are). The kernel leaves the GEMM's status in context->status.
        a_strides = {"gemm": [ctx["sam"], ctx["sak"]], "dot": [ctx["sam"]], "tn": [ctx["sak"]]}[kind]
        return dict(ctx, gemm=gemm, a_strides=a_strides, params=f"{params}, sg_context* context",
                    args=[*args, "context"], status=True)

    def matmul_epilogue(self, k: MatmulKernel, buffers: list) -> dict:
        """The fused epilogue of a matmul kernel: a function the GEMM calls on each block of the
        product once the block holds its final sums; it reads each element back (the local
        PRODUCT), computes the fused nodes at that (row, col) and stores the root's value."""
        ctype = D.C_TYPES[k.out.dtype]
        dims = [f"d{n}" for n in range(len(self.plan.dims))]
        fields = [f"int64_t {d}" for d in dims]
        unpack = [f"const int64_t {d} = args->{d};" for d in dims]
        buffers = list(dict.fromkeys(buffers))  # each buffer once, in order (a Buffer hashes by identity)
        for buf in buffers:
            fields.append(f"const {D.C_TYPES[buf.dtype]}* {buf.name}")
            unpack.append(f"const {D.C_TYPES[buf.dtype]}* restrict {buf.name} = args->{buf.name};")
        fields.append(f"{ctype}* {k.out.name}")
        unpack.append(f"{ctype}* restrict {k.out.name} = args->{k.out.name};")
        at = self.ex.index(0, ["row", "col"], contiguous_strides((k.M, k.N)))
        body = [f"const {ctype} {PRODUCT} = {k.out.name}[{at}];  /* {comment(k.lines[0])} */",
                *self.body_lines(k.epilogue, k.epilogue_statements, ["row", "col"]),
                f"{k.out.name}[{at}] = {k.epilogue_result};"]
        return dict(fields=fields, unpack=unpack, init=[*dims, *(b.name for b in buffers), k.out.name], body=body)

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
            else:
                raise NotImplementedError(f"no {self.language} rendering for kernel {type(k).__name__}")
        return contexts

    def label_checks(self, labels: list) -> list[dict]:
        """The entry's checks of class-label inputs: the buffer, its size and the class count."""
        checks = []
        for position, classes in labels:
            buf = next(b for b in self.plan.inputs if b.index == position)
            numel = sympy.Mul(*self.plan.graph.inputs[position].shape)
            checks.append(dict(labels=buf.name, numel=self.ex.size(numel), classes=self.ex.size(classes),
                               comment=comment(buf.label)))
        return checks

    def render(self, labels: list = ()) -> str:
        plan = self.plan
        kernels = self.kernels()
        prologue = []
        for k, d in enumerate(plan.dims):
            prologue.append(f"const int64_t d{k} = dims[{k}];  /* Dim {comment(d)} */")
        for group, storage in ((plan.inputs, "inputs"), (plan.variables, "variables"), (plan.outputs, "outputs")):
            for b in group:
                const = "const " if storage == "inputs" else ""
                t = D.C_TYPES[b.dtype]
                prologue.append(f"{const}{t}* {b.name} = ({const}{t}*){storage}[{b.index}];  /* {comment(b.label)} */")
        for b in plan.workspace:
            t = D.C_TYPES[b.dtype]
            prologue.append(f"{t}* {b.name} = ({t}*)(workspace + offsets[{b.index}]);  /* {comment(b.label)} */")
        prologue += ["(void)dims; (void)inputs; (void)variables; (void)outputs; (void)workspace; (void)offsets;"]
        workspace_bytes = [f"nbytes[{b.index}] = {self.ex._paren(b.numel)} * (int64_t)sizeof({D.C_TYPES[b.dtype]});"
                           f"  /* {b.name}: {comment(b.label)} */" for b in plan.workspace]
        sized_by = " ".join(workspace_bytes)
        dim_lines = [f"const int64_t d{k} = dims[{k}];" for k in range(len(plan.dims))
                     if re.search(rf"\bd{k}\b", sized_by)]
        calls = [dict(name=k["name"], args=", ".join(k["args"]), status=k.get("status", False)) for k in kernels]
        consts = [self.const(c) for c in plan.consts]
        arguments = [f"dims[{k}] = {comment(d)}" for k, d in enumerate(plan.dims)]
        arguments += [f"inputs[{b.index}] = {comment(b.label)}: {D.SHORT_NAMES[b.dtype]}{_fmt(plan.graph.inputs[b.index].shape)}"
                      for b in plan.inputs]
        arguments += [f"variables[{b.index}] = {comment(b.label)}: "
                      f"{D.SHORT_NAMES[b.dtype]}{_fmt(plan.variable_nodes[b.index].shape)}" for b in plan.variables]
        arguments += [f"outputs[{b.index}]: {D.SHORT_NAMES[b.dtype]}{_fmt(plan.graph.outputs[b.index].shape)}"
                      for b in plan.outputs]
        arguments += [f"workspace + offsets[k]: temporary ws<k> ({len(plan.workspace)} buffers)"]
        from .. import __version__
        return render("c/program.c.j2", version=__version__,
                      header=[comment(line) for line in plan.header.splitlines()],
                      entry=ENTRY, arguments=arguments, parallel_min=PARALLEL_MIN, int_pow=self.int_pow,
                      random=self.random, fast_exp=self.fast_exp, bad_label=BAD_LABEL,
                      label_checks=self.label_checks(labels),
                      consts=consts, runtime_header=runtime.HEADER, gemm=self.gemm, kernels=kernels,
                      signature=SIGNATURE, prologue=prologue, calls=calls,
                      workspace_sizes=WORKSPACE_SIZES, dim_lines=dim_lines, workspace_bytes=workspace_bytes,
                      set_threads=SET_THREADS)

    def const(self, buf) -> dict:
        flat = np.asarray(buf.value).reshape(-1)
        items = [format_literal(v.item(), buf.dtype) for v in flat]
        rows = [", ".join(items[i:i + 8]) + ("," if i + 8 < len(items) else "") for i in range(0, len(items), 8)]
        return dict(name=buf.name, ctype=D.C_TYPES[buf.dtype], size=max(len(items), 1), rows=rows or ["0"],
                    comment=comment(f"constant {buf.label}: {list(np.shape(buf.value))}"))


class _Body:
    """Operands and statements for `element_lines` (a row kernel's per-row loads, or its per-row maps)."""

    def __init__(self, operands: list, statements: list):
        self.operands, self.statements = operands, statements


def _small(numel) -> bool:
    """Whether a kernel's element count is known at compile time to be below SG_PARALLEL_MIN."""
    if isinstance(numel, sympy.Basic):
        if not numel.is_Integer:
            return False
        numel = int(numel)
    return isinstance(numel, (int, np.integer)) and int(numel) < PARALLEL_MIN


def _contiguous(shape) -> list:
    strides, step = [], 1
    for s in reversed(shape):
        strides.append(step)
        step = step * s
    return list(reversed(strides))


def _lowest(dtype: str) -> str:
    return {"float32": "-INFINITY", "float64": "-INFINITY", "int32": "INT32_MIN", "int64": "INT64_MIN",
            "bool": "0"}[dtype]


def _max_fold(acc: str, value: str, dtype: str) -> tuple[list[str], list[str], str, dict[str, list[str]]]:
    """A max reduction that vectorizes and still propagates NaN as NumPy does: a plain `>` select
    (an OpenMP `max` reduction, one vmaxps per vector) beside an `|` reduction of "saw a NaN",
    applied once the loop is done. Returns the (init, fold) lines, the reduced value's C
    expression, and the accumulators by OpenMP reduction operator."""
    init = [f"{D.C_TYPES[dtype]} {acc} = {_lowest(dtype)};"]
    fold = [f"{acc} = {value} > {acc} ? {value} : {acc};"]
    if not D.is_float(dtype):
        return init, fold, acc, {"max": [acc]}
    flag = f"{acc}_nan"
    init.append(f"int {flag} = 0;")
    fold.append(f"{flag} |= {value} != {value};  /* NaN propagates, as in NumPy */")
    return init, fold, f"({flag} ? NAN : {acc})", {"max": [acc], "|": [flag]}


def _simd_reductions(accumulators: dict[str, list[str]]) -> str:
    """`simd reduction(op: accs) ...`: the OpenMP pragma for a loop folding into these accumulators."""
    clauses = [f"reduction({op}:{', '.join(accs)})" for op, accs in accumulators.items() if accs]
    return " ".join(["simd", *clauses])


def _fmt(shape) -> str:
    return comment(S.format_shape(shape))


def render_source(plan: Plan, labels: list = ()) -> str:
    """The C source of a kernel plan; `labels`: (input position, number of classes) of the
    class-label inputs the entry checks before it computes anything."""
    return _Renderer(plan).render(labels)


def c_source(graph: Graph) -> str:
    """The C source that `backend="c"` compiles for `graph`; no compiler runs. Its matmuls call the
    runtime (symgrad.backends.runtime.source() holds their code)."""
    return render_source(lower(passes.optimize(graph), variables=graph.variables, matmul_epilogues=True),
                         _label_inputs(graph))


def build_program(source: str, flags: list[str] | None = None) -> cache.BuiltModule:
    """What a C program includes and links: its `source` built (cached) with the runtime's header on
    its include path, linked to the runtime library built with the same `flags` (once per compiler
    and flags; default `cache.default_flags()`)."""
    return cache.build(source, CDEF, flags=flags, headers={runtime.HEADER: runtime.header()},
                       link=runtime.build(flags))


def _label_inputs(graph: Graph) -> list:
    """(input position, number of classes) of each class-label input of `graph` (before the
    passes, which drop the class_labels nodes that mark them)."""
    return [(position, node.attrs["num_classes"]) for position, node in label_checks(graph)]


# ---- the program ------------------------------------------------------------------------

class _ForkedChild:
    """Whether this process was forked (os.fork, multiprocessing's default "fork" start method,
    DataLoader-style workers): then its C programs run on one thread.

    libgomp keeps the threads of a parallel region in a pool for the next one. A forked child
    inherits the pool's bookkeeping but not its threads (fork copies only the calling thread),
    so the child's next parallel region on more than one thread waits for them forever. With
    the OpenMP team capped at one thread (omp_set_num_threads(1) in the calling thread, before
    every call) no region ever reaches the pool. A process started with "spawn" or "forkserver"
    keeps every thread.
    """

    forked = False

    @classmethod
    def after_fork(cls) -> None:
        cls.forked = True


os.register_at_fork(after_in_child=_ForkedChild.after_fork)


class CProgram:
    """A graph compiled to a native module: `run` computes outputs and updates variables in place."""

    backend = "c"
    checks_labels = True  # the entry refuses class labels outside [0, classes) itself (BAD_LABEL)

    def __init__(self, graph: Graph, flags: list[str] | None = None, optimize: bool = True):
        self.graph = graph  # as given: its variables are the program's variable slots
        self.timings: dict[str, float] = {}
        self._optimize = optimize
        self._compiled_graph = None  # (optimized graph, pass report, plan), made on first need
        with _timed(self.timings, "lookup"):
            key = program_cache.key(graph, self.backend, flags=flags, optimize=optimize)
            entry = program_cache.load(key, graph)
        self._program_key = key
        self.from_program_cache = entry is not None
        if entry is None:
            with _timed(self.timings, "passes"):
                optimized, pass_report = self._passes()
            with _timed(self.timings, "lower"):
                plan = self._lower(optimized)
            self._compiled_graph = (optimized, pass_report, plan)
            with _timed(self.timings, "render"):
                self.source = render_source(plan, labels=_label_inputs(graph))
            self.dims, self.arena = list(plan.dims), ArenaSpec.of(plan)
            program_cache.store(key, self.source, self.dims, self.arena)
        else:
            self.source, self.dims, self.arena = entry["source"], entry["dims"], entry["arena"]
        started = time.time()
        with _timed(self.timings, "build"):
            built = build_program(self.source, flags)
        # The library predates this build call: it came from the cache, no compiler ran.
        self.from_cache = built.library_path.stat().st_mtime < started
        self.module = built.module
        self.module_name = built.module_name
        self.source_path = built.source_path
        self.library_path = built.library_path
        self._ffi = built.module.ffi
        self._entry = getattr(built.module.lib, ENTRY)
        self._workspace_bytes = getattr(built.module.lib, WORKSPACE_SIZES)
        self._set_threads = getattr(built.module.lib, SET_THREADS)
        self._context = self._ffi.new("sg_context*")  # what the program keeps between its calls
        self._layouts: dict[tuple, tuple] = {}
        self.memory_plans: dict[tuple, MemoryPlan] = {}  # per Dim binding, as planned for the calls
        self._variables = [(v.name, D.to_numpy(v.dtype), tuple(v.shape)) for v in graph.variables]
        self._inputs = [(v.name, D.to_numpy(v.dtype)) for v in graph.inputs]
        # Pointer arrays filled in place at each call; variable pointers cached while the
        # caller keeps passing the same arrays (the usual case: Compiled owns them).
        self._pointer_arrays = tuple(self._ffi.new("void*[]", max(n, 1)) for n in
                                     (len(graph.inputs), len(graph.variables), len(graph.outputs)))
        self._var_cache = None
        self._lock = threading.Lock()

    # The optimized graph, the pass report and the kernel plan: kept from a compile that made
    # them; remade on first use by a program whose source came from the program cache (the
    # stages are deterministic, so they describe that source).
    def _passes(self) -> tuple:
        report: dict = {}
        optimized = passes.optimize(self.graph, report=report) if self._optimize else self.graph
        return optimized, report

    def _lower(self, optimized: Graph) -> Plan:
        return lower(optimized, variables=self.graph.variables, matmul_epilogues=True)

    def _compiled(self) -> tuple:
        if self._compiled_graph is None:
            optimized, pass_report = self._passes()
            self._compiled_graph = (optimized, pass_report, self._lower(optimized))
        return self._compiled_graph

    @property
    def optimized(self) -> Graph:
        """The graph after the passes (the graph itself with optimize=False)."""
        return self._compiled()[0]

    @property
    def pass_report(self) -> dict:
        """What each pass did: nodes before and after (symgrad.passes.optimize's report)."""
        return self._compiled()[1]

    @property
    def plan(self) -> Plan:
        """The kernel plan the source renders."""
        return self._compiled()[2]

    def _layout(self, key: tuple, bindings: dict) -> tuple:
        """Per Dim binding: output shapes and the workspace (array, offsets), made once and reused."""
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) >= LAYOUTS_KEPT:  # bound the memory held for past batch sizes
                self.memory_plans.pop(next(iter(self._layouts)), None)
                self._layouts.pop(next(iter(self._layouts)))
            outs = [(S.evaluate_shape(v.shape, bindings), D.to_numpy(v.dtype)) for v in self.graph.outputs]
            inputs = [S.evaluate_shape(v.shape, bindings) for v in self.graph.inputs]
            ffi = self._ffi
            dims = ffi.new("int64_t[]", [int(bindings[d]) for d in self.dims] or [0])
            # Temporaries share one arena: buffers whose lifetimes do not overlap reuse bytes.
            planned = self._planned_arena({d: bindings[d] for d in self.dims}, dims)
            self.memory_plans[key] = planned
            offsets, total = planned.offsets, planned.arena_bytes
            raw = np.zeros(total + 2 * ALIGN, dtype=np.uint8)
            shift = (-raw.ctypes.data) % ALIGN
            workspace = raw[shift:shift + total + ALIGN]
            # The last element holds each output's last array (see _outputs), once there is one.
            layout = (outs, inputs, dims, workspace, ffi.from_buffer(workspace), ffi.new("int64_t[]", offsets or [0]),
                      [None] * len(outs))
            self._layouts[key] = layout
        return layout

    def _planned_arena(self, bindings: dict, dims) -> MemoryPlan:
        """The arena plan for one Dim binding (`dims`: the same values, as the C array), its sizes
        checked against the ones the compiled code says its kernels use.

        They differ only when the arena came from a damaged or forged program-cache entry: then
        it is planned again from the kernel plan (which describes this very source: the stages
        are deterministic) and the entry is rewritten. A call never gets a workspace too small.
        """
        ffi = self._ffi
        count = self._workspace_bytes(ffi.NULL, ffi.NULL)
        sizes = ffi.new("int64_t[]", max(count, 1))
        self._workspace_bytes(dims, sizes)
        needed = list(sizes)[:count]
        planned = memory_plan(self.arena, bindings, align=ALIGN)
        if planned.sizes == needed:
            return planned
        self.arena = ArenaSpec.of(self.plan)
        planned = memory_plan(self.arena, bindings, align=ALIGN)
        if planned.sizes != needed:
            raise RuntimeError(f"{self.module_name}: the memory plan sizes the workspace temporaries at "
                               f"{planned.sizes} bytes, the compiled code at {needed}")
        if self.from_program_cache:
            program_cache.store(self._program_key, self.source, self.dims, self.arena)
        return planned

    @property
    def memory_plan(self) -> MemoryPlan:
        """The arena plan (see `latest_or_assumed`): of the Dim binding first called with most
        recently, else assumed before any call."""
        return latest_or_assumed(self.arena, self.dims, self.memory_plans, ALIGN)

    def report(self, timings: dict | None = None) -> str:
        """Passes, kernels, save/recompute choices, the memory plan and compile time by stage
        (`timings`: earlier stages measured by the caller, such as graph building)."""
        return program_report(self, timings)

    def run(self, inputs: list, bindings: dict, variables: dict) -> list:
        """Compute the outputs, then write the updates into `variables` (name -> ndarray) in place.

        Calls are serialized: they share the workspace and the pointer arrays.
        """
        with self._lock:
            return self._run(inputs, bindings, variables)

    def run_checked(self, inputs: list, bindings: dict, variables: dict) -> list:
        """`run` for a caller that has already checked the inputs against the graph's inputs
        (ndarrays of its dtypes, C-contiguous, of the shapes `bindings` give) and serializes its
        calls itself: symgrad.compiled checks each input signature once and holds its storage's
        lock, and a small step should not pay for the same checks and a second lock."""
        return self._run(inputs, bindings, variables, check_inputs=False)

    def _outputs(self, outs: list, held: list, out_ptrs) -> list:
        """The arrays this call's outputs go to, their pointers set in `out_ptrs`. An output array of
        the last call that nobody kept (only `held` and its pointer view refer to it: a step's loss,
        read as a float and dropped) is written again, saving its allocation; otherwise a new one."""
        results = []
        for k, (shape, dtype) in enumerate(outs):
            last = held[k]
            if last is not None and _refcount is not None and _refcount(last[0]) == last[2]:  # nobody kept it
                array, pointer = last[0], last[1]
            else:
                array = np.empty(shape, dtype)
                pointer = self._ffi.from_buffer(array, require_writable=True)
                # Its references now (the local name, the pointer view's) are those it has unused
                # later (held's tuple instead of the name). Counted in a statement of its own: inside
                # the tuple display below, the tuple's first item would be counted too.
                unused = _refcount(array) if _refcount is not None else -1
                held[k] = (array, pointer, unused)
            out_ptrs[k] = pointer
            results.append(array)
        return results

    def _run(self, inputs: list, bindings: dict, variables: dict, check_inputs: bool = True) -> list:
        dims = self.dims
        try:
            key = tuple([int(bindings[d]) for d in dims]) if dims else ()
        except KeyError as exc:
            raise ValueError(f"no binding for Dim {exc.args[0]}") from None
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layout(key, bindings)
        outs, in_shapes, dims_ptr, _, ws_ptr, offsets, held = layout
        if len(inputs) != len(self._inputs):
            raise TypeError(f"expected {len(self._inputs)} inputs, got {len(inputs)}")
        from_buffer = self._ffi.from_buffer
        in_ptrs, var_ptrs, out_ptrs = self._pointer_arrays
        # The cdata views must outlive the call: `keep` holds them.
        keep = [None] * len(inputs)
        if check_inputs:
            for (name, dtype), shape, array in zip(self._inputs, in_shapes, inputs):
                if not isinstance(array, np.ndarray) or (array.dtype is not dtype and array.dtype != dtype) \
                        or array.shape != shape or not array.flags.c_contiguous:
                    raise ValueError(f"input {name!r}: expected a C-contiguous {dtype} array of shape {shape}, "
                                     f"got {getattr(array, 'dtype', type(array).__name__)} "
                                     f"{getattr(array, 'shape', '')}")
        for k, array in enumerate(inputs):
            in_ptrs[k] = keep[k] = from_buffer(array)
        cached = self._var_cache
        if cached is not None:
            # The usual case: the same variable arrays as last call (Compiled owns them); an array
            # replaced, reshaped or re-typed in place is checked again from scratch.
            for (name, dtype, shape), old in zip(self._variables, cached[0]):
                array = variables.get(name)
                if array is not old or array.shape != shape or (array.dtype is not dtype and array.dtype != dtype):
                    cached = self._var_cache = None
                    break
        if cached is None:
            arrays = [variables.get(name) for name, _, _ in self._variables]
            for (name, dtype, shape), array in zip(self._variables, arrays):
                if not isinstance(array, np.ndarray) or array.dtype != dtype or array.shape != shape \
                        or not array.flags.c_contiguous or not array.flags.writeable:
                    raise ValueError(f"variable {name!r}: expected a writeable C-contiguous {dtype} array of "
                                     f"shape {shape}, got {getattr(array, 'dtype', type(array).__name__)} "
                                     f"{getattr(array, 'shape', '')}")
            self._var_cache = (arrays, [from_buffer(a, require_writable=True) for a in arrays])
            for k, p in enumerate(self._var_cache[1]):
                var_ptrs[k] = p
        results = self._outputs(outs, held, out_ptrs)
        if _ForkedChild.forked:
            self._set_threads(1)  # this thread's OpenMP setting: set on each call, whichever thread calls
        status = self._entry(dims_ptr, in_ptrs, var_ptrs, out_ptrs, ws_ptr, offsets, self._context)
        if status != 0:
            if status == runtime.OUT_OF_MEMORY:
                failed = self._ffi.string(self._context.failed).decode()
                raise MemoryError(f"{self.module_name}: kernel {failed} could not allocate the memory it "
                                  f"needs; the call stopped there (outputs and variable updates of the "
                                  f"kernels before it may be written)")
            if status == BAD_LABEL:  # refused before anything ran: say which label, as Python would
                for position, node in label_checks(self.graph):
                    check_labels(inputs[position], S.evaluate(node.attrs["num_classes"], bindings), node,
                                 f"input {self.graph.inputs[position].name!r}")
            raise RuntimeError(f"the compiled program failed with status {status}")
        return results


def compile(graph: Graph, flags: list[str] | None = None, optimize: bool = True, **options) -> CProgram:
    """Compile `graph` to C and build it (cached): the backend protocol's entry point.

    flags: compiler flags instead of the default (`-O3 -march=native -fopenmp`, or SYMGRAD_CFLAGS).
    optimize: run the graph passes (symgrad.passes.optimize) first; False compiles the graph as given.
    """
    if options:
        raise TypeError(f"backend 'c' takes only flags= and optimize=, got {sorted(options)}")
    return CProgram(graph, flags=flags, optimize=optimize)
