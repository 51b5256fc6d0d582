"""The kernel kinds, one module each, and the table that dispatches on a kernel's `kind`.

A kind's module holds its kernel type, its lowering from graph nodes (through the public lowering
context, symgrad.backends.lower.lowering.LoweringContext), its render (the template context of
templates/<language>/<kind>) and its report line. Every kernel type answers the protocol:

    reads() / writes()   the buffers it reads and writes (memory planning, in-place sweeps)
    swap(Swap)           itself with buffers swapped in (symgrad.backends.plan.Swap)
    flops(n)             its arithmetic per call, `n` evaluating a size at the report's Dims
    report_kind          what the report's count line counts it as (a key of the kind's WORDS)
    report_line()        what it does, for the report's list of kernels

`KINDS` maps each `kernel.kind` to its row: the kernel type, the render, the op kinds it lowers,
its words for the report, and where a kind has them, its refusal (what a language cannot build,
asked by decide), its line in the report's gathers by purpose, the bytes its runtime call
allocates and its context with the element count an argument (render/program.py shares one
function between kernels that differ only in their counts). Adding a kind is a module and a row
here; plan, lowering walk, render and report only read the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ...ir.registry import ATTENTION, COLLECTIVE, ELEMENTWISE, GATHER, MATMUL, REDUCE
from . import attention, collective, gather, loop, matmul, reduce, row


@dataclass(frozen=True)
class Kind:
    """One kernel kind's row of the dispatch table."""

    name: str                 # the kernel's `kind`
    kernel: type
    render: Callable          # (Renderer, kernel) -> the kernel's template context
    lower: Callable | None    # (LoweringContext, node) -> the View of its value, for the op kinds `ops`
    ops: tuple                # op kinds (symgrad.ir.registry) whose nodes this kind lowers
    words: tuple              # (report_kind, words) pairs of the report's count line
    always: bool = False      # the count line names its report kinds even where a plan has none
    refuse: Callable | None = None     # (node, language) -> why the language cannot build it, or None
    purpose: Callable | None = None    # (kernel, size of a view) -> its line of the gathers by purpose, or None
    sized: Callable | None = None      # (template context) -> the same with its element count an argument, or None


KINDS = {kind.name: kind for kind in (
    Kind("loop", loop.LoopKernel, loop.render, loop.lower, (ELEMENTWISE,), loop.WORDS, always=True,
         sized=loop.with_count_argument),
    Kind("reduce", reduce.ReduceKernel, reduce.render, reduce.lower, (REDUCE,), reduce.WORDS, always=True,
         refuse=reduce.refuse),
    Kind("row", row.RowKernel, row.render, None, (), row.WORDS, always=True),
    Kind("matmul", matmul.MatmulKernel, matmul.render, matmul.lower, (MATMUL,), matmul.WORDS, always=True,
         refuse=matmul.refuse, purpose=matmul.MatmulKernel.purpose_line),
    Kind("gather", gather.GatherKernel, gather.render, gather.lower, (GATHER,), gather.WORDS,
         purpose=gather.GatherKernel.purpose_line),
    Kind("attention", attention.AttentionKernel, attention.render, attention.lower, (ATTENTION,),
         attention.WORDS),
    Kind("collective", collective.CollectiveKernel, collective.render, collective.lower, (COLLECTIVE,),
         collective.WORDS, refuse=collective.refuse),
)}

#: op kind -> the kernel kind lowering its nodes
BY_OP = {op: kind for kind in KINDS.values() for op in kind.ops}


def kind_of(kernel) -> Kind:
    """The table row of `kernel` (by its `kind`)."""
    try:
        return KINDS[kernel.kind]
    except KeyError:
        raise KeyError(f"kernel {kernel.name} of kind {kernel.kind!r}: no kernel kind {kernel.kind!r} in "
                       f"symgrad.backends.kinds.KINDS") from None
