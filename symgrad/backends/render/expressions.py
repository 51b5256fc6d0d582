"""C expressions of a kernel plan: sizes, indices, literals, conversions, comments, node values.

Everything here returns one C *expression* (or comment text), never a statement: what a
statement looks like is written once in templates/statements.j2. Used by the one C-style
renderer (symgrad.backends.render.renderer) for C/OpenMP and CUDA alike; a language enters only
through its expression printer (symgrad.backends.render.c_printer / cuda_printer).
"""

from __future__ import annotations

import re

import numpy as np
import sympy

from ...ir import dtypes as D
from ...ir import shapes as S
from ...ir.elementwise import ARGS
from ...ir.integer import HELPERS as INTEGER_HELPERS
from .c_printer import OWN_FLOAT32, CPrintError, format_literal


_PRINTABLE = re.compile(r"[ -~]*")  # printable ASCII, nothing else


class Comment(str):
    """Text that a kernel's source prints inside a comment only: left out when kernels are compared
    for sharing one function (symgrad.backends.render.kernel_functions.sharing_key)."""

    __slots__ = ()


def comment(text) -> Comment:
    """`text` safe inside a C block comment on one line: no `*/`, no newlines, printable ASCII only."""
    text = str(text)
    if _PRINTABLE.fullmatch(text) and "*/" not in text and "/*" not in text and "??" not in text:
        return Comment(text)  # the usual case, already safe (a render calls this a few hundred times)
    text = text.encode("ascii", "backslashreplace").decode("ascii")
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
    return Comment(text.replace("??", "?\\?"))  # no trigraphs either


def shape_comment(shape) -> str:
    """A shape as comment text, e.g. `[B, 784]`."""
    return comment(S.format_shape(shape))


def convert(text: str, src: str, dst: str) -> str:
    """C for converting a value of dtype `src` to `dst` (NumPy's astype semantics)."""
    if src == dst:
        return text
    if D.is_half(dst):
        # A 16-bit float is a float holding a value of the narrower type: converting to one rounds
        # to nearest even (the runtime header's sg_round_bf16 / sg_round_f16), as torch does.
        return f"{HALF_ROUND[dst]}({convert(text, src, 'float32')})"
    if D.is_half(src):
        src = "float32"
        if dst == "float32":
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


# The C function that rounds a float to each 16-bit float's values (templates/runtime/runtime.h.j2).
HALF_ROUND = {"bfloat16": "sg_round_bf16", "float16": "sg_round_f16"}


def lowest(dtype: str) -> str:
    """The identity of a max: the lowest value of `dtype` as a C constant."""
    return {"float32": "-INFINITY", "float64": "-INFINITY", "bfloat16": "-INFINITY", "float16": "-INFINITY", "int32": "INT32_MIN", "int64": "INT64_MIN",
            "bool": "0"}[dtype]


def contiguous(shape) -> list:
    """Row-major strides of `shape` (sizes may be expressions of Dims)."""
    strides, step = [], 1
    for s in reversed(shape):
        strides.append(step)
        step = step * s
    return list(reversed(strides))


# The program's own float32 functions (c_printer.OWN_FLOAT32), as a call begins.
MATH_FUNCTIONS = tuple(f"{own}(" for own in OWN_FLOAT32.values())


def calls_math(text: str) -> bool:
    """Whether C expression `text` calls one of MATH_FUNCTIONS."""
    return "sg_" in text and any(name in text for name in MATH_FUNCTIONS)


def _is_boolean_expr(expr) -> bool:
    return isinstance(expr, (sympy.core.relational.Relational, sympy.logic.boolalg.BooleanFunction,
                             sympy.logic.boolalg.BooleanAtom))


class Exprs:
    """Prints a plan's expressions with Dims as their C arguments (d0, d1, ...) and `printer`
    (dtype -> expression printer) for the fused nodes. `features` collects the helpers the
    printed expressions call ("int_pow", "random", "fast_exp", "fast_erf", "fast_log"), for the program's prelude."""

    def __init__(self, dims: list, printer):
        self.dim_syms = {d: sympy.Symbol(f"d{k}", integer=True, positive=True) for k, d in enumerate(dims)}
        self.printer = printer
        self.int = printer("int64")
        self.features: set[str] = set()

    def size(self, value) -> str:
        """An int64 C expression of a size or index."""
        if isinstance(value, (int, np.integer)):
            return str(int(value))
        return self.int.doprint(sympy.sympify(value).xreplace(self.dim_syms))

    def paren(self, value) -> str:
        """`size(value)`, parenthesised unless it is a name or a number."""
        text = self.size(value)
        return text if text.isidentifier() or text.isdigit() else f"({text})"

    def numel(self, sizes) -> str:
        """The product of loop sizes as a C expression (1 for none)."""
        return self.paren(S.numel(tuple(sizes))) if sizes else "1"

    def dims_used(self, values) -> set[int]:
        """The positions k of the Dims (C arguments d<k>) that the sizes `values` depend on."""
        used = set()
        names = {sym: k for k, sym in enumerate(self.dim_syms.values())}
        for value in values:
            if not isinstance(value, (int, np.integer)):
                used |= {names[s] for s in sympy.sympify(value).xreplace(self.dim_syms).free_symbols if s in names}
        return used

    def index(self, offset, loop_vars: list[str], strides) -> str:
        """offset + sum(var * stride), simplified where a stride is 0 or 1."""
        terms = []
        for var, stride in zip(loop_vars, strides):
            if isinstance(stride, int) and stride == 0:
                continue
            terms.append(var if isinstance(stride, int) and stride == 1 else f"{var} * {self.paren(stride)}")
        if not (isinstance(offset, int) and offset == 0):
            terms.append(self.paren(offset))
        return " + ".join(terms) if terms else "0"

    def literal(self, value, dtype: str) -> str:
        """A constant (a number, or an expression of Dims such as 1/B) as a C expression of `dtype`."""
        if isinstance(value, sympy.Basic):
            if not value.free_symbols:
                value = float(value) if D.is_float(dtype) else int(value)
            else:
                text = self.printer(D.compute_type(dtype) if D.is_float(dtype) else "int64").doprint(
                    value.xreplace(self.dim_syms))
                if D.is_half(dtype):
                    self.features.add(HALF_ROUND[dtype])
                return convert(f"(({D.C_TYPES[dtype]})({text}))", D.compute_type(dtype), dtype)
        if isinstance(value, (bool, np.bool_)) and dtype != "bool":
            value = int(value)
        if D.is_half(dtype):  # a float local: the value rounded to the 16-bit type, then printed exactly
            value = float(np.asarray(value).astype(D.to_numpy(dtype)))
        return format_literal(value, D.compute_type(dtype))

    def load(self, view, loop_vars: list[str]) -> str:
        """The value of `view` at the loop indices `loop_vars`: a literal, an index, or a buffer element."""
        if view.kind == "literal":
            return self.literal(view.literal, view.dtype)
        index = self.index(view.offset, loop_vars, view.strides)
        if view.kind == "index":
            return convert(index, "int64", view.dtype)
        return f"{view.buffer.name}[{index}]"

    def pointer(self, view) -> str:
        """A pointer to the first element of `view` (its buffer plus its offset)."""
        return view.buffer.name if view.offset == 0 else f"{view.buffer.name} + {self.paren(view.offset)}"

    def statement(self, st) -> str:
        """One node's C expression: operands cast to the compute dtype, result converted to st.dtype."""
        if st.node.op.name == "pow" and not D.is_float(st.compute_dtype):
            self.features.add("int_pow")
            a, b = (convert(a, d, "int64") for a, d in zip(st.args, st.arg_dtypes))
            return convert(f"sg_ipow({a}, {b})", "int64", st.dtype)
        if st.node.op.name == "random_bits":
            self.features.add("random")  # the generator's C body (templates/program/random.h.j2) goes in the prelude
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
        if calls_math(text):
            self.features.add("fast_exp")  # templates/program/expf.h.j2 goes in the prelude
            if "sg_erf" in text:
                self.features.add("fast_erf")  # ... and templates/program/erff.h.j2 after it
            if "sg_log" in text:
                self.features.add("fast_log")  # ... and templates/program/logf.h.j2
        if "sg_" in text:  # division and shift helpers (templates/program/integer.h.j2): each one called goes in
            self.features.update(name for name in INTEGER_HELPERS if name + "(" in text)
        if D.is_half(st.dtype):  # the rounding helper goes in the prelude (templates/program/integer.h.j2)
            self.features.add(HALF_ROUND[st.dtype])
        if _is_boolean_expr(expr) and st.dtype != "bool":
            return convert(text, "bool", st.dtype)
        if _is_boolean_expr(expr):
            return f"(uint8_t)({text})"
        if st.compute_dtype == "bool" and expr.has(sympy.Add):
            # A sum of truth values (torch's bool add is an or): C computes it on uint8, where
            # True + True is 2; the result is True, 1, as the NumPy reference's bool. (Products,
            # selects and copies of truth values stay 0 or 1.)
            return convert(convert(text, "int64", "bool"), "bool", st.dtype)
        return convert(text, st.compute_dtype, st.dtype)
