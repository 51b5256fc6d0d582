"""The static memory plan: where each temporary of a kernel plan lives in one arena.

Liveness is over the plan's kernel order (a buffer is live from the kernel
that writes it to the last kernel that reads it); buffers are placed greedily,
largest first, each into the smallest gap that no overlapping-lifetime buffer
uses (best fit). The plan is made per Dim binding, before any kernel runs,
with two totals beside it for the report: the naive total (every value the
step computes its own buffer, as an interpreter without fusion or reuse would
hold them) and the temporaries' total without reuse, and the lower bound (the
most bytes live at one kernel).

What the plan needs of a kernel plan, each temporary's size and lifetime, is
an `ArenaSpec`: small, and kept by the program cache beside the source, so a
program loaded from that cache plans its arena without lowering the graph.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import sympy

from ...ir import dtypes as D
from ...ir import shapes as S
from ...ir.registry import MOVEMENT, SOURCE
from ..decide.fusion import DEFAULT_DIM
from ..plan import Plan, kernel_reads, kernel_writes


@dataclass
class MemoryPlan:
    """Where each workspace buffer lives in one arena, for one Dim binding.

    offsets[k] is the byte offset of plan.workspace[k]; two buffers share
    bytes only when no kernel runs while both are live (liveness is over the
    kernel order: from the kernel writing a buffer to the last kernel reading it).
    """

    offsets: list[int]
    arena_bytes: int        # the arena's size (best-fit reuse)
    naive_bytes: int        # every value the step computes its own buffer (no fusion, no reuse)
    unshared_bytes: int     # every temporary of the kernels its own buffer (fusion, no reuse)
    lower_bound_bytes: int  # the most bytes live at once: no plan can be smaller
    sizes: list[int]        # bytes of each workspace buffer, before alignment
    live: list[tuple]       # (first kernel, last kernel) of each workspace buffer
    bindings: dict          # the Dim values it was planned for
    assumed: bool = False   # bindings assumed before any call (a program with Dims not yet run)
    scratch_bytes: int = 0  # the runtime's scratch region after the arena's temporaries (as the
                            # compiled code counts it: symgrad_scratch_bytes), 0 where it has none

    def summary(self) -> str:
        """One line: planned arena beside the naive total, the unshared temporaries and the lower bound."""
        ratio = self.arena_bytes / self.lower_bound_bytes if self.lower_bound_bytes else 1.0
        return (f"arena {_kib(self.arena_bytes)} (naive {_kib(self.naive_bytes)}, temporaries unshared "
                f"{_kib(self.unshared_bytes)}, lower bound {_kib(self.lower_bound_bytes)}, {ratio:.2f}x the bound) "
                f"over {len(self.sizes)} temporaries")


def _kib(nbytes: int) -> str:
    return f"{nbytes} B" if nbytes < 1024 else f"{nbytes / 1024:.1f} KiB"


def _align(nbytes: int, align: int) -> int:
    return -(-nbytes // align) * align


def liveness(plan: Plan) -> list[tuple]:
    """(first, last) kernel index during which each workspace buffer holds a value."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for k, kernel in enumerate(plan.kernels):
        for buf in [*kernel_reads(kernel), *kernel_writes(kernel)]:
            if buf is not None and buf.storage == "workspace":
                first.setdefault(id(buf), k)
                last[id(buf)] = k
    n = len(plan.kernels)
    return [(first.get(id(b), n), last.get(id(b), n)) for b in plan.workspace]


@dataclass(frozen=True)
class ArenaSpec:
    """The temporaries of a kernel plan as the arena sees them.

    nbytes[k]: the size of workspace buffer k in bytes, an int or a sympy
    expression of Dims; live[k]: its (first, last) kernel; kernels: how many
    kernels the plan runs; value_bytes: the bytes of every value the graph
    computes (not its inputs, variables, constants or views), for the naive total.
    """

    nbytes: tuple
    live: tuple
    kernels: int
    value_bytes: object = 0
    # (align, offsets): where `memory_plan` placed the temporaries of a spec without Dims, kept
    # with it by the program cache so that a program loaded from there does not place them again
    # (the greedy scan is quadratic: 12 ms of a 12-layer GPT's first call); None: not planned yet.
    placed: tuple | None = None

    def with_placement(self, planned: "MemoryPlan", align: int) -> "ArenaSpec":
        """This spec carrying `planned`'s offsets (a plan of it without Dims, at `align`)."""
        return replace(self, placed=(align, tuple(planned.offsets)))

    @classmethod
    def of(cls, plan: Plan) -> "ArenaSpec":
        """The spec of a kernel plan."""
        nbytes = tuple(_as_int(b.numel * D.native_itemsize(b.dtype)) for b in plan.workspace)
        values = [S.numel(n.shape) * D.native_itemsize(n.dtype) for n in plan.graph.nodes
                  if n.op.kind not in (SOURCE, MOVEMENT)]
        # The sizes without Dims summed as ints (sympy's sum of 2,000 of them took 5 ms).
        fixed = sum(v for v in values if type(v) is int)
        symbolic = [v for v in values if type(v) is not int]
        total = _as_int(sympy.Add(fixed, *symbolic)) if symbolic else fixed
        return cls(nbytes, tuple(liveness(plan)), len(plan.kernels), total)

    def to_json(self) -> dict:
        """A JSON-ready dict: sizes that depend on Dims are written as sympy text."""
        text = lambda n: n if isinstance(n, int) else str(n)  # noqa: E731
        return {"nbytes": [text(n) for n in self.nbytes], "live": [list(r) for r in self.live],
                "kernels": self.kernels, "value_bytes": text(self.value_bytes),
                **({"placed": [self.placed[0], list(self.placed[1])]} if self.placed else {})}

    @classmethod
    def from_json(cls, data: dict, dims: dict) -> "ArenaSpec":
        """The spec `to_json` wrote; `dims` maps each Dim's name to its symbol."""
        parse = lambda n: n if isinstance(n, int) else sympy.sympify(n, locals=dims)  # noqa: E731
        placed = data.get("placed")
        return cls(tuple(parse(n) for n in data["nbytes"]), tuple(tuple(r) for r in data["live"]),
                   int(data["kernels"]), parse(data["value_bytes"]),
                   (int(placed[0]), tuple(int(o) for o in placed[1])) if placed else None)


def _as_int(size):
    if type(size) is int:
        return size
    size = sympy.sympify(size)
    return int(size) if size.is_Integer else size


def arena_sizes(spec: ArenaSpec, bindings: dict) -> list[int]:
    """The bytes of each temporary of `spec` for these Dim values (what a memory plan places)."""
    return [n if isinstance(n, int) else int(S.evaluate(n, bindings)) for n in spec.nbytes]


def memory_plan(plan: "Plan | ArenaSpec", bindings: dict | None = None, align: int = 64) -> MemoryPlan:
    """Offsets of the plan's temporaries in one arena, with reuse: greedy best-fit by size.

    Buffers are placed largest first; each goes into the smallest gap (between
    already placed buffers whose lifetimes overlap its own) that holds it, else
    above them all. Every offset is a multiple of `align` bytes. A spec without
    Dims that carries its placement (`ArenaSpec.placed`, at this `align`) is not
    placed again.
    """
    spec = plan if isinstance(plan, ArenaSpec) else ArenaSpec.of(plan)
    bindings = dict(bindings or {})
    sizes = arena_sizes(spec, bindings)
    live = list(spec.live)
    needs = [_align(s, align) for s in sizes]
    if _placed_here(spec, align):
        offsets = list(spec.placed[1])
        arena = max((o + n for o, n in zip(offsets, needs)), default=0)
        return _totals(spec, bindings, offsets, arena, needs, sizes, live)
    order = sorted(range(len(sizes)), key=lambda k: (-needs[k], live[k][0], k))
    offsets = [0] * len(sizes)
    # (first kernel, last kernel, start, end) of each buffer placed so far: every later buffer
    # scans them all (a 12-layer GPT's 1,200 temporaries), so the tuple holds what the scan reads.
    placed: list[tuple] = []
    arena = 0
    for k in order:
        need = needs[k]
        lo, hi = live[k]
        busy = sorted([(start, end) for first, last, start, end in placed if first <= hi and lo <= last])
        best, best_gap, cursor = None, None, 0
        for start, end in busy:
            gap = start - cursor
            if gap >= need and (best_gap is None or gap < best_gap):
                best, best_gap = cursor, gap
            if end > cursor:
                cursor = end
        offsets[k] = offset = cursor if best is None else best
        placed.append((lo, hi, offset, offset + need))
        arena = max(arena, offset + need)
    return _totals(spec, bindings, offsets, arena, needs, sizes, live)


def _placed_here(spec: ArenaSpec, align: int) -> bool:
    """Whether `spec` carries a placement usable at `align`: one offset per temporary, each a
    multiple of `align`, for sizes without Dims (otherwise it is placed again)."""
    if spec.placed is None or spec.placed[0] != align or len(spec.placed[1]) != len(spec.nbytes):
        return False
    return all(isinstance(n, int) for n in spec.nbytes) and all(o >= 0 and o % align == 0 for o in spec.placed[1])


def _totals(spec: ArenaSpec, bindings: dict, offsets: list, arena: int, needs: list, sizes: list,
            live: list) -> MemoryPlan:
    """The MemoryPlan of these placed temporaries, with the totals the report compares."""
    unshared = sum(needs)
    values = spec.value_bytes
    naive = values if isinstance(values, int) else int(S.evaluate(values, bindings))
    # The most bytes live at once, from the changes at each kernel (a sweep, not a sum per kernel).
    change = [0] * (max([spec.kernels, *(hi for _, hi in live)]) + 2)
    for need, (lo, hi) in zip(needs, live):
        change[lo] += need
        change[hi + 1] -= need
    bound = max(itertools.islice(itertools.accumulate(change), spec.kernels + 1))
    return MemoryPlan(offsets, arena, naive, unshared, bound, sizes, live, bindings)


def latest_or_assumed(plan: "Plan | ArenaSpec", dims: list, plans: dict, align: int) -> MemoryPlan:
    """A program's arena plan for its report: the newest of `plans` (Dim binding -> plan, as made
    for its calls), else one planned before any call with every Dim (of `dims`) at DEFAULT_DIM
    and marked assumed (sizes without Dims are exact either way)."""
    if plans:
        return next(reversed(plans.values()))
    planned = memory_plan(plan, {d: DEFAULT_DIM for d in dims}, align=align)
    planned.assumed = bool(dims)
    return planned
