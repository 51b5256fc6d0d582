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
from .attention import AttentionKernel
from .gather import GatherKernel
from .lowering import LoopKernel, MatmulKernel, ReduceKernel, RowKernel
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


def kernel_counts(plan) -> dict:
    """How many kernels of each kind the plan runs per call."""
    counts = {"total": len(plan.kernels), "loop": 0, "copy": 0, "reduce": 0, "fused reduce": 0, "matmul": 0,
              "row": 0, "fused matmul": 0, "gather": 0, "attention": 0}
    for k in plan.kernels:
        if isinstance(k, LoopKernel):
            counts["copy" if k.name.endswith("_copy") else "loop"] += 1
        elif isinstance(k, ReduceKernel):
            counts["fused reduce" if k.operands else "reduce"] += 1
        elif isinstance(k, MatmulKernel):
            counts["fused matmul" if k.epilogue_statements else "matmul"] += 1
        elif isinstance(k, RowKernel):
            counts["row"] += 1
        elif isinstance(k, GatherKernel):
            counts["gather"] += 1
        elif isinstance(k, AttentionKernel):
            counts["attention"] += 1
    return counts


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
    if isinstance(k, RowKernel):
        return f"  {k.name:<32} {k.summary()} -> {', '.join(b.name for b in k.outs)}"
    if isinstance(k, LoopKernel):
        what = f"loop, {len(k.statements)} op(s) fused, {len(k.operands)} operand(s)"
    elif isinstance(k, ReduceKernel):
        what = f"{k.op}" + (f" with {len(k.statements)} fused op(s)" if k.operands else "")
    elif isinstance(k, GatherKernel):
        what = f"{k.op} of {k.I} index(es)"
    elif isinstance(k, AttentionKernel):
        # What the fused kernel holds instead of the T x T weights: k (and v) transposed per head.
        what = (f"fused {k.op}{' (causal)' if k.causal else ''}, {k.heads} head(s) of {k.T} x {k.E}, "
                f"no T x T buffer; scratch {', '.join(b.name for b in k.scratch)}")
    else:
        what = "matmul" + (f" + {len(k.epilogue_statements)} fused op(s)" if k.epilogue_statements else "") \
            + (f", batched over {' x '.join(str(size) for size, *_ in k.batch)}" if k.batch else "")
    return f"  {k.name:<32} {what} -> {k.out.name}"


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
    out.append(f"kernels: {counts['total']} ({counts['loop']} loops, {counts['reduce']} reductions, "
               f"{counts['fused reduce']} fused reductions, {counts['row']} row kernels, {counts['matmul']} matmuls, "
               f"{counts['fused matmul']} fused matmuls, {counts['copy']} copies"
               + (f", {counts['gather']} gathers" if counts["gather"] else "")
               + (f", {counts['attention']} fused attention" if counts["attention"] else "") + ")")
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
