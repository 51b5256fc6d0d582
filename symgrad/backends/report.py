"""The compilation report of a compiled program (`step.report()`, `symgrad inspect --report`).

Backend-neutral: it reads what a program built from the kernel plan keeps
(`pass_report`, `optimized`, `plan`, `memory_plan`, `timings`) and formats
it; nothing here changes a program.

A `Report` is plain data: a summary that fits a screen (step memory at its peak and the largest
buffers, compile time by stage, the passes' effect in nodes, the ten largest kernels), then the
sections (`report.passes`, `report.kernels`, `report.decisions`, `report.memory`,
`report.compile_time`), each printable alone; `str(report)` is the summary followed by every
section. The numbers behind the tables (`kernel_rows`, `buffer_rows`, `step_memory`,
`compile_times`) are kept beside the text for tools that draw them (`symgrad inspect --html`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from ..ir import dtypes as D
from ..ir import shapes as S
from ..passes import format_report
from .decide import half
from .render.kernel_functions import calls
from .kinds import KINDS
from .plan import kernel_reads, kernel_writes

# Compile stages in the order they run, with the words the report uses.
STAGES = (("graph", "graph build + autodiff"), ("step_cache", "step graph from the step cache: autodiff skipped"),
          ("lookup", "program cache lookup"), ("passes", "graph passes"), ("lower", "lowering to kernels"),
          ("render", "render source"), ("build", "compiler or cache load"))
IN_PLACE_SHOWN = 12  # variables named on the in-place line; the rest are counted


@contextmanager
def timed(timings: dict, stage: str):
    """Add the seconds spent in the `with` body to timings[stage]."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[stage] = timings.get(stage, 0.0) + time.perf_counter() - start


# The report kinds the count line always names, in its order, with their words (each kernel kind's,
# symgrad.backends.kinds); the others (a gather, fused attention, a collective) where a plan has them.
COUNTED = tuple(pair for kind in KINDS.values() if kind.always for pair in kind.words)
WORDS = {report_kind: words for kind in KINDS.values() if not kind.always for report_kind, words in kind.words}


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
    """The gathers a composite op asked for by name (a convolution's im2col and its col2im, or the
    patches its products read in place), with the bytes of what each writes or never stores, for
    the memory plan's Dim binding: each kernel whose kind words a `purpose_line`."""
    def size(view) -> str:  # the bytes of a view's whole value (a patch matrix read in place)
        return format_bytes(int(S.evaluate(S.numel(view.shape), mp.bindings)) * D.to_numpy(view.dtype).itemsize)

    lines = []
    for k in plan.kernels:
        purpose = KINDS[k.kind].purpose
        line = None if purpose is None else purpose(k, size)
        if line is not None:
            lines.append(f"  {k.name}: {line}")
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
    outputs a call returns, the arena of temporaries, and the runtime's scratch region after it
    (its GEMMs' packed panels, a Winograd convolution's transformed tiles: as the compiled code
    counts them, mp.scratch_bytes). A call allocates nothing more. Known before any call."""
    def nbytes(value) -> int:
        return int(np.prod(S.evaluate_shape(value.shape, mp.bindings), dtype=np.int64)) * D.to_numpy(value.dtype).itemsize

    parts = {}
    for v in graph.variables:
        name = ROLE_NAMES.get(v.attrs.get("role"), "other variables")
        parts[name] = parts.get(name, 0) + nbytes(v)
    parts["inputs"] = sum(nbytes(v) for v in graph.inputs)
    parts["outputs"] = sum(nbytes(v) for v in graph.outputs)
    parts["arena"] = mp.arena_bytes
    parts["runtime scratch"] = mp.scratch_bytes
    return parts


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


def _bytes_of(buffer, bindings: dict) -> int:
    """The bytes of a whole buffer at the Dim values of `bindings`."""
    return int(S.evaluate(buffer.numel, bindings)) * D.to_numpy(buffer.dtype).itemsize


def kernel_work(k, bindings: dict) -> tuple[int, int]:
    """(FLOPs, bytes) of one call of kernel `k`, estimated from the plan at the Dim values of
    `bindings`: the bytes of every buffer it reads or writes, each counted once and whole; the
    FLOPs as its kind counts them (its `flops`: 2*M*N*K per product, attention's products over
    the visible (row, key) pairs, one per fused op per element of a loop, reduction or row pass)."""
    seen = {id(b): b for b in [*kernel_reads(k), *kernel_writes(k)] if b is not None and b.numel is not None}
    nbytes = sum(_bytes_of(b, bindings) for b in seen.values())

    def n(size) -> int:
        return int(size) if isinstance(size, (int, float)) else int(S.evaluate(size, bindings))
    return n(k.flops(n)), nbytes


@dataclass(frozen=True)
class Section:
    """One part of a report: `print(report.kernels)` prints its title and its lines."""

    name: str     # the attribute that gives it: report.<name>
    title: str
    lines: tuple

    def __str__(self) -> str:
        return "\n".join([f"== {self.title} ==", *self.lines])

    def __contains__(self, text: str) -> bool:
        return text in str(self)


SUMMARY_KERNELS = 10  # kernels named in the summary, the largest first
SUMMARY_BUFFERS = 5   # buffers named in the summary, the largest first


@dataclass
class Report:
    """What `step.report()` returns: `print(report)` shows the summary, then each section.

    `report.summary` alone fits a screen; `report.passes`, `.kernels`, `.decisions` (save or
    recompute), `.memory` and `.compile_time` are the sections (`report.sections` by name), each
    printable. The numbers behind the tables: `kernel_rows` (per kernel in run order: name,
    kind, FLOPs, bytes, what it does), `buffer_rows` (per arena temporary: name, the value it
    holds, bytes, arena offset, first and last kernel it is live in), `step_memory` (bytes by
    part), `compile_times` (seconds by stage), `nodes` (before and after the passes).
    """

    summary: Section
    sections: dict = field(default_factory=dict)
    kernel_rows: list = field(default_factory=list)
    buffer_rows: list = field(default_factory=list)
    step_memory: dict = field(default_factory=dict)
    compile_times: dict = field(default_factory=dict)
    nodes: tuple = ()
    arena_bytes: int = 0

    def __getattr__(self, name: str) -> Section:
        sections = self.__dict__.get("sections") or {}
        if name in sections:
            return sections[name]
        raise AttributeError(f"the report has no section {name!r}; it has {', '.join(sections) or 'none'}")

    def __str__(self) -> str:
        return "\n\n".join(str(part) for part in [self.summary, *self.sections.values()])

    def __repr__(self) -> str:  # at a prompt: the summary, which fits a screen
        return str(self.summary)

    def __contains__(self, text: str) -> bool:
        return text in str(self)

    # Joined to text (a data-parallel step adds its buckets), a report is text.
    def __add__(self, other: str) -> str:
        return str(self) + other

    def __radd__(self, other: str) -> str:
        return other + str(self)


def _kernel_rows(plan, mp) -> list[dict]:
    rows = []
    for index, k in enumerate(plan.kernels):
        flops, nbytes = kernel_work(k, mp.bindings)
        rows.append({"index": index, "name": k.name, "kind": k.report_kind, "flops": flops, "bytes": nbytes,
                     "does": k.report_line()})
    return rows


def _buffer_rows(plan, mp) -> list[dict]:
    return [{"name": b.name, "value": b.label, "bytes": size, "offset": offset, "first": first, "last": last}
            for b, size, offset, (first, last) in zip(plan.workspace, mp.sizes, mp.offsets, mp.live)]


def _largest_buffers(plan, mp) -> list[tuple[int, str]]:
    """(bytes, line) of the largest buffers a call holds: temporaries, variables, inputs, outputs."""
    out = []
    for b, size, (first, last) in zip(plan.workspace, mp.sizes, mp.live):
        out.append((size, f"{b.name:<7} {format_bytes(size):>10}  {b.label}: a temporary, live from kernel "
                          f"{first} to {last}"))
    roles = [node.attrs.get("role") for node in plan.variable_nodes] or [None] * len(plan.variables)
    for b, role in zip(plan.variables, roles):
        size = _bytes_of(b, mp.bindings)
        what = ROLE_NAMES.get(role, "variables").rstrip("s").replace("parameter", "a parameter")
        out.append((size, f"{b.name:<7} {format_bytes(size):>10}  {b.label}: {what}"))
    for kind, buffers in (("an input", plan.inputs), ("an output", plan.outputs)):
        for b in buffers:
            size = _bytes_of(b, mp.bindings)
            out.append((size, f"{b.name:<7} {format_bytes(size):>10}  {b.label}: {kind}"))
    return sorted(out, key=lambda item: -item[0])


def _compile_words(program, stage: str, words: str) -> str:
    cached = getattr(program, "from_cache", None)
    if stage == "build" and cached is not None:
        return "cache load (no compiler ran)" if cached else "C compiler (a cache miss)"
    if stage == "lookup" and getattr(program, "from_program_cache", False):
        return "program cache hit: passes, lowering and render skipped"
    return words


def _format_seconds(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.0f} ms"


SUMMARY_WIDTH = 100  # the summary's lines wrap at this many columns


def _wrapped(head: str, items: list[str], indent: str = "  ") -> list[str]:
    """`head` then the items, comma-separated, packed into lines of at most SUMMARY_WIDTH columns."""
    lines, line = [], head
    for k, item in enumerate(items):
        piece = item + ("," if k < len(items) - 1 else "")
        if line.strip() and len(line) + len(piece) > SUMMARY_WIDTH and line not in (head, indent):
            lines.append(line.rstrip())
            line = indent
        line += piece + " "
    return lines + [line.rstrip()]


def _summary(program, plan, mp, parts: dict, times: dict, rows: list) -> Section:
    before, after = len(program.graph.nodes), len(program.optimized.nodes)
    binding = ", ".join(f"{d}={v}" for d, v in mp.bindings.items()) or "no Dims"
    if getattr(mp, "assumed", False):
        binding += ", assumed: not called yet"
    lines = [f"{program.backend or 'native'} program: {before} nodes built, {after} after the passes, "
             f"{len(plan.kernels)} kernels [{binding}]"]
    lines.extend(half.report_lines(program.graph, mp.bindings, program.optimized))  # 16-bit floats' casts, bytes
    shown = [f"{name} {format_bytes(n)}" for name, n in parts.items() if n]
    lines.extend(_wrapped(f"step memory {format_bytes(sum(parts.values()))} at its peak: ", shown))
    bound = f"{mp.arena_bytes / mp.lower_bound_bytes:.2f}x" if mp.lower_bound_bytes else "1.00x"
    lines.append(f"  the arena of temporaries is {bound} the most bytes live at once "
                 f"({format_bytes(mp.lower_bound_bytes)}); the largest buffers:")
    lines.extend(f"    {line}" for _, line in _largest_buffers(plan, mp)[:SUMMARY_BUFFERS])
    if times:
        cached = getattr(program, "from_cache", None)
        how = {"build": "" if cached is None else " (a cache load)" if cached else " (the C compiler)",
               "lookup": " (a program cache hit)" if getattr(program, "from_program_cache", False) else ""}
        staged = sorted(times.items(), key=lambda item: -item[1])
        lines.extend(_wrapped(f"compile {_format_seconds(sum(times.values()))}: ",
                              [f"{stage} {_format_seconds(seconds)}{how.get(stage, '')}" for stage, seconds in staged]))
    entries = (getattr(program, "pass_report", None) or {}).get("passes") or []
    if entries:
        effect: dict[str, int] = {}
        for e in entries:
            effect[e["pass"]] = effect.get(e["pass"], 0) + e["nodes_after"] - e["nodes_before"]
        moved = sorted(((name, d) for name, d in effect.items() if d), key=lambda item: item[1])
        lines.extend(_wrapped(f"passes: {before} -> {after} nodes: ", [f"{name} {d:+d}" for name, d in moved]
                              or ["none changed the count"]))
    else:
        lines.append("passes: off (compiled with optimize=False)")
    largest = sorted(rows, key=lambda r: (-r["flops"], -r["bytes"], r["index"]))[:SUMMARY_KERNELS]
    total_flops = sum(r["flops"] for r in rows)
    counts = kernel_counts(plan)
    kinds = [f"{counts[kind]} {words}" for kind, words in [*COUNTED, *WORDS.items()] if counts.get(kind)]
    kinds += [f"{n} {kind}" for kind, n in counts.items() if n and kind not in ("total", *dict(COUNTED), *WORDS)]
    lines.extend(_wrapped(f"{len(_functions(program, plan))} C functions for {counts['total']} kernels: ", kinds))
    moved = format_bytes(sum(r["bytes"] for r in rows))
    lines.append(f"  {format_count(total_flops)}FLOP, {moved} read or written a call "
                 f"(estimated from the plan); the {len(largest)} largest:")
    lines.append(f"    {'kernel':<32} {'kind':<15} {'FLOPs':>9} {'share':>6} {'bytes':>11}")
    lines.extend(f"    {r['name']:<32} {r['kind']:<15} {format_count(r['flops']):>9} "
                 f"{r['flops'] / (total_flops or 1):>6.1%} {format_bytes(r['bytes']):>11}" for r in largest)
    lines.extend(_wrapped("sections, each printable alone and all of them below: ",
                          [f"report.{name}" for name in SECTION_TITLES]))
    return Section("summary", "summary", tuple(lines))


# The sections of a report, in the order `str(report)` prints them, with their titles.
SECTION_TITLES = {"passes": "passes", "kernels": "kernels", "decisions": "save / recompute",
                  "memory": "memory plan", "compile_time": "compile time"}


def _functions(program, plan) -> dict[str, list[str]]:
    """The program's C functions, each with the kernels calling it (kernel_functions.calls)."""
    return calls(getattr(program, "source", "") or "", [k.name for k in plan.kernels])


def _function_lines(program, plan) -> list[str]:
    """Each distinct kernel (a C function) with its call count, the most called first."""
    functions = _functions(program, plan)
    shared = sorted(((name, users) for name, users in functions.items() if len(users) > 1),
                    key=lambda item: -len(item[1]))
    lines = [f"{len(functions)} distinct kernels (C functions), {len(shared)} of them called for several kernels:"]
    lines.extend(f"  {name:<32} x{len(users):<4} for {', '.join(users[1:4])}{', ...' if len(users) > 4 else ''}"
                 for name, users in shared)
    return lines


def format_count(n: float) -> str:
    """A count as the summary prints it: 516, 20.5 k, 8.39 M, 1.20 G."""
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            v = n / scale
            return f"{v:.2f} {unit}" if v < 10 else f"{v:.1f} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{n:.0f} "


def program_report(program, timings: dict | None = None) -> Report:
    """The report of `program` (a CProgram or CudaProgram); `timings`: the stages measured by
    the caller before the program was compiled (graph building)."""
    plan, mp = program.plan, program.memory_plan
    body: dict[str, list[str]] = {name: [] for name in SECTION_TITLES}
    passes = getattr(program, "pass_report", None) or {}
    before, after = len(program.graph.nodes), len(program.optimized.nodes)
    body["passes"].append(f"nodes: {before} before, {after} after")
    body["passes"].append(format_report(passes) if passes.get("passes")
                          else "(passes off: compiled with optimize=False)")
    counts = kernel_counts(plan)
    body["kernels"].append(count_line(counts))
    body["kernels"].extend(_function_lines(program, plan))
    body["kernels"].extend(_kernel_line(k) for k in plan.kernels)
    body["kernels"].extend(_purpose_lines(plan, mp))
    if not plan.choices:
        body["decisions"].append("(no forward value is read by a later kernel)")
    for c in plan.choices:
        body["decisions"].append(f"  {c['decision']:<9} {c['value']} = {c['op']} ({c['bytes']} bytes): {c['reason']}")
    binding = ", ".join(f"{d}={v}" for d, v in mp.bindings.items()) or "no Dims"
    if getattr(mp, "assumed", False):
        binding += ", assumed: not called yet"
    body["memory"].append(f"{mp.summary()} [{binding}]")
    body["memory"].append(f"  arena {mp.arena_bytes} B, naive {mp.naive_bytes} B (every value its own buffer), "
                          f"temporaries unshared {mp.unshared_bytes} B, lower bound {mp.lower_bound_bytes} B")
    parts = step_memory(program.graph, plan, mp)
    body["memory"].extend(step_memory_lines(program.graph, plan, mp))
    shown = ", ".join(plan.in_place[:IN_PLACE_SHOWN]) or "none"
    more = len(plan.in_place) - IN_PLACE_SHOWN
    body["memory"].append(f"  in-place updates: {shown}" + (f" and {more} more" if more > 0 else ""))
    times = {**(timings or {}), **program.timings}
    for stage, words in STAGES:
        if stage in times:
            body["compile_time"].append(f"  {stage:<10} {times[stage] * 1e3:>9.1f} ms  "
                                        f"{_compile_words(program, stage, words)}")
    body["compile_time"].append(f"  {'total':<10} {sum(times.values()) * 1e3:>9.1f} ms")
    rows = _kernel_rows(plan, mp)
    sections = {name: Section(name, title, tuple(body[name])) for name, title in SECTION_TITLES.items()}
    return Report(_summary(program, plan, mp, parts, times, rows), sections, rows, _buffer_rows(plan, mp), parts,
                  times, (before, after), mp.arena_bytes)
