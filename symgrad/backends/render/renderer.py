"""The one C-style renderer's pieces: what every kernel kind's render builds its template context from.

Each kernel kind (symgrad.backends.kinds) turns its kernels into a template context with a
`Renderer`; symgrad.backends.render.program puts them in the language's program template.
Python computes names and expressions only (symgrad.backends.render.expressions); a kernel body is a
list of statements as plain data (`Let`, `Store`, `Fold`) that templates/statements.j2 prints;
loops, pragmas, launches and signatures are the templates'. Whatever differs between languages
is a row of symgrad.backends.render.languages, read here and by the kinds:
how loops map to threads (`index`), how a reduction combines (`combine`), the
printer, the qualifiers. The program's own context (entry point, memory) is
symgrad.backends.render.program's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import sympy

from ...ir import dtypes as D
from .expressions import Exprs, comment
from .languages import PARALLEL_MIN, Language
from ..plan import Plan


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


def small(numel) -> bool:
    """Whether a kernel's element count is known at compile time to be below PARALLEL_MIN."""
    if isinstance(numel, sympy.Basic):
        if not numel.is_Integer:
            return False  # an expression of Dims
        numel = int(numel)
    return isinstance(numel, (int, np.integer)) and int(numel) < PARALLEL_MIN


def used_axes(views, axes: int, offset: int = 0) -> set[int]:
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
    the kernels call ("int_pow", "random", "fast_exp", "fast_erf", "fast_log", "gemm", "argmax", "rows")."""

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
        if numel is not None and small(numel):
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
