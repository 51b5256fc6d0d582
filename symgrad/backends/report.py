"""The compilation report of a compiled program (`step.report()`, `symgrad inspect --report`).

Backend-neutral: it reads what a program built from the kernel plan keeps
(`pass_report`, `optimized`, `plan`, `memory_plan`, `timings`) and formats
it; nothing here changes a program.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np

from ..ir import dtypes as D
from ..ir import shapes as S
from ..passes import format_report
from . import runtime, winograd
from .gather import GatherKernel
from .lowering import MatmulKernel
from .patches import is_columns, is_patches, is_winograd, matmul_gemm

# Compile stages in the order they run, with the words the report uses.
STAGES = (("graph", "graph build + autodiff"), ("lookup", "program cache lookup"), ("passes", "graph passes"),
          ("lower", "lowering to kernels"), ("render", "render source"), ("build", "compiler or cache load"))
IN_PLACE_SHOWN = 12  # variables named on the in-place line; the rest are counted


@contextmanager
def timed(timings: dict, stage: str):
    """Add the seconds spent in the `with` body to timings[stage]."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[stage] = timings.get(stage, 0.0) + time.perf_counter() - start


# The kernel kinds the report's count line always names, in its order, with their words; a kind
# not listed (a gather, fused attention, a collective, one added later) is named where a plan has it.
COUNTED = (("loop", "loops"), ("reduce", "reductions"), ("fused reduce", "fused reductions"),
           ("row", "row kernels"), ("matmul", "matmuls"), ("fused matmul", "fused matmuls"), ("copy", "copies"))
WORDS = {"gather": "gathers", "attention": "fused attention", "collective": "collectives"}


def kernel_counts(plan) -> dict:
    """How many kernels of each kind (each kernel's `report_kind`) the plan runs per call."""
    counts = {"total": len(plan.kernels), **{kind: 0 for kind, _ in COUNTED}}
    for k in plan.kernels:
        counts[k.report_kind] = counts.get(k.report_kind, 0) + 1
    return counts


def count_line(counts: dict) -> str:
    """`kernels: 12 (3 loops, ..., 2 copies, 1 gathers)`: the kinds of COUNTED always, the others when present."""
    always = [f"{counts[kind]} {words}" for kind, words in COUNTED]
    rest = sorted((kind for kind, n in counts.items() if n and kind != "total" and kind not in dict(COUNTED)),
                  key=lambda kind: (list(WORDS).index(kind) if kind in WORDS else len(WORDS), kind))
    others = [f"{counts[kind]} {WORDS.get(kind, kind)}" for kind in rest]
    return f"kernels: {counts['total']} ({', '.join(always + others)})"


def _purpose_lines(plan, mp) -> list[str]:
    """The gathers a composite op asked for by name (a convolution's im2col and its col2im), with
    the bytes of what each writes, for the memory plan's Dim binding."""
    def size(view) -> str:  # the bytes of a view's whole value (a patch matrix read in place)
        return format_bytes(int(S.evaluate(S.numel(view.shape), mp.bindings)) * D.to_numpy(view.dtype).itemsize)

    lines = []
    for k in plan.kernels:
        if isinstance(k, GatherKernel) and k.purpose:
            nbytes = int(S.evaluate(k.out.numel, mp.bindings)) * D.to_numpy(k.out.dtype).itemsize
            lines.append(f"  {k.name}: {k.purpose} -> {k.out.name}, {format_bytes(nbytes)}")
        elif isinstance(k, MatmulKernel) and is_columns(k.b):
            spec = k.b.literal
            lines.append(f"  {k.name}: {spec.purpose}: read{' transposed' if spec.transposed else ''} from "
                         f"{k.b.buffer.name} along output rows of {spec.W} (direct convolution), "
                         f"{size(k.b)} never stored")
        elif isinstance(k, MatmulKernel) and is_winograd(k.a, k.N, k.epilogue_statements):
            spec, g = k.a.literal, k.a.literal.grid
            what = f"summed over {g.Ho}x{g.Wo} outputs" if spec.transposed else f"{g.Ho}x{g.Wo} outputs"
            lines.append(f"  {k.name}: {spec.purpose}: {what} from {k.a.buffer.name} by Winograd's "
                         f"F({winograd.M}x{winograd.M}, 3x3){' transposed' if spec.transposed else ''}, "
                         f"{size(k.a)} never stored")
        elif isinstance(k, MatmulKernel) and is_patches(k.a):
            spec = k.a.literal
            lines.append(f"  {k.name}: {spec.purpose}: gathered{' transposed' if spec.transposed else ''} from "
                         f"{k.a.buffer.name} as the GEMM packs it (implicit GEMM), {size(k.a)} never stored")
    return ["", "== gathers by purpose =="] + lines if lines else []


def _kernel_line(k) -> str:
    # Each kernel kind words its own line (its `report_line`, beside its type): a kind added later
    # needs nothing here.
    return f"  {k.name:<32} {k.report_line()}"


# What a variable of each role is, in the step-memory lines.
ROLE_NAMES = {"param": "parameters", "grad": "gradient buffers", "optimizer": "optimizer state",
              "state": "running statistics", "rng": "random streams", "hyper": "hyperparameters"}


def step_memory(graph, plan, mp) -> dict:
    """Bytes a call of the program holds at its peak, by what they are, for the memory plan's Dim
    binding: the variables by role (parameters, optimizer state, ...), the inputs and the
    outputs a call returns, the arena of temporaries, and the most that the runtime's GEMM
    allocates while one product runs (its packed panels, freed after it). Known before any call."""
    def nbytes(value) -> int:
        return int(np.prod(S.evaluate_shape(value.shape, mp.bindings), dtype=np.int64)) * D.to_numpy(value.dtype).itemsize

    parts = {}
    for v in graph.variables:
        name = ROLE_NAMES.get(v.attrs.get("role"), "other variables")
        parts[name] = parts.get(name, 0) + nbytes(v)
    parts["inputs"] = sum(nbytes(v) for v in graph.inputs)
    parts["outputs"] = sum(nbytes(v) for v in graph.outputs)
    parts["arena"] = mp.arena_bytes
    # A batched product's GEMMs may run one per thread at once (their batch indices shared out).
    team = runtime.team_size()
    packing = [_workspace(k, mp, team) for k in plan.kernels
               if isinstance(k, MatmulKernel) and not is_columns(k.b)]  # (a direct convolution allocates nothing)
    parts["GEMM packing"] = max(packing, default=0)
    return parts


def _workspace(k: MatmulKernel, mp, team: int) -> int:
    """The most a matmul's runtime call allocates while it runs: a Winograd convolution's
    transformed weight and blocks, else the GEMM's packed panels."""
    if is_winograd(k.a, k.N, k.epilogue_statements):
        return winograd.workspace_bytes(k.a.literal, k.N, D.to_numpy(k.out.dtype).itemsize, team)
    return runtime.packing_bytes(k.out.dtype, *(S.evaluate(size, mp.bindings) for size in (k.M, k.N, k.K)),
                                 kind=matmul_gemm(k.out.dtype, k.N, k.a)[1]) * (team if k.batch else 1)


def step_memory_lines(graph, plan, mp) -> list[str]:
    """The step-memory part of the report: the total, then each part of it."""
    parts = step_memory(graph, plan, mp)
    total = sum(parts.values())
    shown = ", ".join(f"{name} {format_bytes(n)}" for name, n in parts.items() if n)
    return [f"  step memory {format_bytes(total)} at its peak: {shown}"]


def format_bytes(nbytes: float) -> str:
    """Bytes as the reports print them: B below 1 KiB, KiB below 1 MiB, else MiB."""
    if nbytes < 1024:
        return f"{nbytes:.0f} B"
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes / 1024:.1f} KiB"


def program_report(program, timings: dict | None = None) -> str:
    """A readable multi-line report of `program` (a CProgram or CudaProgram)."""
    plan = program.plan
    out = []
    passes = getattr(program, "pass_report", None) or {}
    before, after = len(program.graph.nodes), len(program.optimized.nodes)
    out.append("== passes ==")
    out.append(f"nodes: {before} before, {after} after")
    if passes.get("passes"):
        out.append(format_report(passes))
    else:
        out.append("(passes off: compiled with optimize=False)")
    counts = kernel_counts(plan)
    out.append("")
    out.append("== kernels ==")
    out.append(count_line(counts))
    out.extend(_kernel_line(k) for k in plan.kernels)
    out.extend(_purpose_lines(plan, program.memory_plan))
    out.append("")
    out.append("== save / recompute ==")
    if not plan.choices:
        out.append("(no forward value is read by a later kernel)")
    for c in plan.choices:
        out.append(f"  {c['decision']:<9} {c['value']} = {c['op']} ({c['bytes']} bytes): {c['reason']}")
    mp = program.memory_plan
    out.append("")
    out.append("== memory plan ==")
    binding = ", ".join(f"{d}={v}" for d, v in mp.bindings.items()) or "no Dims"
    if getattr(mp, "assumed", False):
        binding += ", assumed: not called yet"
    out.append(f"{mp.summary()} [{binding}]")
    out.append(f"  arena {mp.arena_bytes} B, naive {mp.naive_bytes} B (every value its own buffer), "
               f"temporaries unshared {mp.unshared_bytes} B, lower bound {mp.lower_bound_bytes} B")
    out.extend(step_memory_lines(program.graph, plan, mp))
    shown = ", ".join(plan.in_place[:IN_PLACE_SHOWN]) or "none"
    more = len(plan.in_place) - IN_PLACE_SHOWN
    out.append(f"  in-place updates: {shown}" + (f" and {more} more" if more > 0 else ""))
    times = {**(timings or {}), **program.timings}
    out.append("")
    out.append("== compile time ==")
    cached = getattr(program, "from_cache", None)
    for stage, words in STAGES:
        if stage in times:
            if stage == "build" and cached is not None:
                words = "cache load (no compiler ran)" if cached else "C compiler (a cache miss)"
            if stage == "lookup" and getattr(program, "from_program_cache", False):
                words = "program cache hit: passes, lowering and render skipped"
            out.append(f"  {stage:<7} {times[stage] * 1e3:>9.1f} ms  {words}")
    out.append(f"  {'total':<7} {sum(times.values()) * 1e3:>9.1f} ms")
    return "\n".join(out)
