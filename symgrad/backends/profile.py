"""Where a compiled step's time goes: `step.profile(steps=20, **inputs)`.

The timing comes from the generated code itself. The program's plan is rendered once more with
the profiling option (symgrad.backends.render.program, templates/program/profile.h.j2): the same
kernels, the same entry point, the same workspace, with the clock read around each kernel call
and (kernel, start, end) recorded into an array Python lends it. That build (cached as any
other) runs `steps` calls of the step on the given inputs in place of the normal one; the
normal build and its source are untouched.

Per kernel (named as in `step.source` and `print(step.optimized_graph)`) the profile has its
calls, its time per step and share of the step's wall time, its FLOPs and bytes per call, and
its rate against the machine's peaks (symgrad.backends.peaks): GFLOP/s of the FMA peak for a
kernel whose FLOPs per byte reach the machine's balance, GB/s of the memory bandwidth for the
others. FLOPs and bytes are the report's (symgrad.backends.report.kernel_work: 2 M N K per
product, one per fused op per element, the bytes of each buffer the kernel reads or writes, once
and whole): an estimate from the plan, so a kernel whose buffers stay in cache can show more than
the memory peak, and one reading a slice of a buffer more bytes than it moves. Kernels are
grouped by the graph region they came from (symgrad.backends.lower.regions).

`trace=` writes the calls in Chrome's trace event format (Perfetto, chrome://tracing): one row
per thread that issued kernel calls (the calling thread: the kernels' OpenMP teams work inside
each call), a "step" event per call and an "X" (complete) event per kernel call inside it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .driver import label_inputs
from .render.languages import C_ENTRY, C_OPENMP, C_PROFILE_COUNT, C_PROFILE_EVENTS, C_SIGNATURE
from .peaks import Peaks, peaks
from .lower.regions import kernel_regions
from .report import kernel_work
from .render.program import render

SHOWN = 20  # kernels the table lists; the rest are one line


@dataclass(frozen=True)
class KernelRow:
    """One kernel of a profile: `seconds` per step over its `calls`, `share` of the step's wall
    time, `flops` and `bytes` per call, its rates, and `of_peak`: the rate that bounds it (GFLOP/s
    when `bound` is "compute", GB/s when "memory") as a fraction of the machine's peak."""

    name: str
    region: str
    kind: str
    calls: int
    seconds: float
    share: float
    flops: int
    bytes: int
    gflops: float
    gbs: float
    bound: str
    of_peak: float


@dataclass(frozen=True)
class RegionRow:
    """One graph region: its kernels' time per step and share of the step."""

    name: str
    kernels: int
    seconds: float
    share: float


class Profile:
    """What `step.profile()` measured. `str()` is the table; `rows` the kernels (slowest first),
    `regions` the regions (slowest first), as data; `wall` the step's seconds per call (from the
    Python call to its return), `kernel_seconds` the kernels' sum, `entry_seconds` the compiled
    entry point's own (kernels and what it does between them), all per step on average;
    `step_walls` and `step_kernel_seconds` the same two for each call."""

    def __init__(self, name: str, steps: int, rows: list, wall: float, entry_seconds: float,
                 peaks: Peaks, trace: Path | None = None, step_walls: tuple = (), step_kernel_seconds: tuple = ()):
        self.name, self.steps, self.peaks, self.trace = name, steps, peaks, trace
        self.step_walls, self.step_kernel_seconds = tuple(step_walls), tuple(step_kernel_seconds)
        self.shown = SHOWN  # kernels str() lists
        self.rows: list[KernelRow] = sorted(rows, key=lambda r: -r.seconds)
        self.wall, self.entry_seconds = wall, entry_seconds
        self.kernel_seconds = sum(r.seconds for r in rows)
        regions: dict[str, list] = {}
        for r in self.rows:
            regions.setdefault(r.region, []).append(r)
        self.regions = sorted((RegionRow(name, len(rs), sum(r.seconds for r in rs), sum(r.share for r in rs))
                               for name, rs in regions.items()), key=lambda r: -r.seconds)

    @property
    def ratio(self) -> float:
        """The kernels' time over the step's wall time (at most 1: each kernel call lies inside one)."""
        return self.kernel_seconds / self.wall if self.wall else 0.0

    def __getitem__(self, name: str) -> KernelRow:
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(f"no kernel named {name!r} in this profile")

    def __str__(self) -> str:
        return self.table(self.shown)

    def __repr__(self) -> str:
        return (f"<Profile of {self.name}: {len(self.rows)} kernels, {self.wall * 1e3:.3f} ms per step, "
                f"kernels {self.ratio:.1%} of it>")

    def table(self, shown: int | None = None) -> str:
        """The profile as text: a summary, then the `shown` slowest kernels grouped by region (the
        regions slowest first, each with its total), then the rest in one line."""
        shown = self.shown if shown is None else shown
        ms = lambda s: f"{s * 1e3:9.3f}"  # noqa: E731
        out = [f"profile of {self.name}: {self.steps} steps, {self.wall * 1e3:.3f} ms per step "
               f"(call to return); kernels {self.kernel_seconds * 1e3:.3f} ms ({self.ratio:.1%}), "
               f"the entry point between them {max(self.entry_seconds - self.kernel_seconds, 0) * 1e3:.3f} ms, "
               f"the Python call {max(self.wall - self.entry_seconds, 0) * 1e3:.3f} ms",
               str(self.peaks), "",
               f"{'region / kernel':<40} {'calls':>6} {'ms/step':>9} {'share':>6} {'FLOP/call':>10} "
               f"{'bytes/call':>10}  {'rate':>14} {'of peak':>12}"]
        top = set(id(r) for r in self.rows[:shown])
        for region in self.regions:
            rows = [r for r in self.rows if r.region == region.name and id(r) in top]
            if not rows:
                continue
            label = f"{region.name or '(top)'} ({region.kernels} kernel{'s' if region.kernels != 1 else ''})"
            out.append(f"{label:<40} {'':>6} {ms(region.seconds)} {region.share:6.1%}")
            for r in rows:
                rate = f"{r.gflops:.2f} GFLOP/s" if r.bound == "compute" else f"{r.gbs:.2f} GB/s"
                peak = f"{r.of_peak:.1%} {'FMA' if r.bound == 'compute' else 'mem'}" if r.bound else ""
                out.append(f"  {r.name:<38} {r.calls:>6} {ms(r.seconds)} {r.share:6.1%} {_si(r.flops):>10} "
                           f"{_si(r.bytes, 'B'):>10}  {rate:>14} {peak:>12}")
        rest = self.rows[shown:]
        if rest:
            seconds = sum(r.seconds for r in rest)
            label = f"the other {len(rest)} kernel{'s' if len(rest) != 1 else ''}"
            out.append(f"{label:<40} {'':>6} {ms(seconds)} {sum(r.share for r in rest):6.1%}")
        outside = max(self.wall - self.kernel_seconds, 0.0)
        out.append(f"{'outside kernels (entry point, Python call)':<40} {'':>6} {ms(outside)} "
                   f"{outside / self.wall if self.wall else 0:6.1%}")
        if self.trace is not None:
            out.append(f"trace: {self.trace}")
        return "\n".join(out)


def _si(n: float, unit: str = "") -> str:
    """1234567 -> `1.23M`: three figures and a prefix (k, M, G, T)."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{prefix}{unit}"
    return f"{n:.0f}{unit}" if unit else f"{n:.0f}"


# ---- the profiling build ----------------------------------------------------------------------

class ProfiledBuild:
    """The profiling build of a C program's plan: its entry point, and the array its calls record into."""

    def __init__(self, program):
        from .c import CDEF, build_program
        source = render(program.plan, C_OPENMP, label_inputs(program.graph), profile=True)
        cdef = f"{CDEF}\nvoid {C_PROFILE_EVENTS}(double* events, int64_t capacity);\nint64_t {C_PROFILE_COUNT}(void);"
        self.built = build_program(source, program.flags, cdef=cdef)
        lib, ffi = self.built.module.lib, self.built.module.ffi
        # The entry as a function of the program's own ffi, whose arrays and context the calls pass.
        address = int(ffi.cast("uintptr_t", ffi.addressof(lib, C_ENTRY)))
        self.entry = program._ffi.cast(C_SIGNATURE.replace(C_ENTRY, "(*)", 1), address)
        self._lend, self._count = getattr(lib, C_PROFILE_EVENTS), getattr(lib, C_PROFILE_COUNT)
        self._ffi = self.built.module.ffi
        self._lent = None

    def lend(self, events: np.ndarray | None) -> None:
        """Have the later calls record into `events` (n x 3 float64: kernel, start, end); None: stop."""
        if events is None:
            self._lend(self._ffi.NULL, 0)
            self._lent = None
            return
        self._lent = self._ffi.from_buffer("double[]", events, require_writable=True)  # kept alive while lent
        self._lend(self._lent, events.shape[0])

    def count(self) -> int:
        return int(self._count())


def kernel_costs(plan, bindings: dict) -> list[tuple[int, int]]:
    """(FLOPs, bytes) per call of each kernel of `plan` for the Dim `bindings`: what the report
    counts (symgrad.backends.report.kernel_work)."""
    return [kernel_work(k, bindings) for k in plan.kernels]


def profile_program(program, run, bindings: dict, steps: int = 20, trace=None, name: str | None = None) -> Profile:
    """Profile `steps` calls of `run()` (one call of the program's owner on fixed inputs, whose Dim
    values are `bindings`) with the program's profiling build in place of its own. The caller
    holds the lock that serializes the program's calls, and restores what the calls change."""
    if getattr(program, "backend", None) != "c":
        backend = getattr(program, "backend", None) or "numpy"
        raise ValueError(f"profile: times the kernels of C programs; this one is {backend!r} "
                         f"(compile with backend=\"c\" to profile it)")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"profile: steps must be a positive int, got {steps!r}")
    plan = program.plan
    kernels = len(plan.kernels)
    build = ProfiledBuild(program)
    events = np.zeros(((kernels + 1) * steps, 3), dtype=np.float64)
    walls = []
    with program.running(build.entry):
        run()  # the profiling build's first call: its pages, the team's threads
        build.lend(events)
        try:
            for _ in range(steps):
                start = time.perf_counter()
                run()
                walls.append(time.perf_counter() - start)
            recorded = build.count()
        finally:
            build.lend(None)
    if recorded > len(events):
        raise RuntimeError(f"profile: the program recorded {recorded} kernel calls in {steps} steps, "
                           f"more than its {kernels} kernels and the call each")
    events = events[:recorded]
    index = events[:, 0].astype(np.int64)
    durations = events[:, 2] - events[:, 1]
    calls = np.bincount(index, minlength=kernels + 1)
    ends = index == kernels  # the whole call's record closes each step
    step_of = np.cumsum(ends) - ends
    per_step = np.bincount(step_of[~ends], weights=durations[~ends], minlength=steps)[:steps]
    seconds = np.bincount(index, weights=durations, minlength=kernels + 1) / steps
    wall = sum(walls) / steps
    regions = kernel_regions(plan)
    the_peaks = peaks()
    rows = []
    for k, (kernel, region, (flops, nbytes)) in enumerate(zip(plan.kernels, regions, kernel_costs(plan, bindings))):
        total = seconds[k] * steps
        gflops = flops * calls[k] / total / 1e9 if total > 0 else 0.0
        gbs = nbytes * calls[k] / total / 1e9 if total > 0 else 0.0
        if flops == 0 and nbytes == 0:
            bound, of_peak = "", 0.0
        elif nbytes == 0 or flops / nbytes >= the_peaks.balance:
            bound, of_peak = "compute", gflops / the_peaks.gflops
        else:
            bound, of_peak = "memory", gbs / the_peaks.gbs
        rows.append(KernelRow(kernel.name, region, kernel.report_kind, int(calls[k]),
                              float(seconds[k]), float(seconds[k] / wall) if wall else 0.0, flops, nbytes,
                              gflops, gbs, bound, of_peak))
    path = None
    if trace is not None:
        path = Path(trace)
        write_trace(path, events, plan, regions, name or program.module_name)
    return Profile(name or program.module_name, steps, rows, wall, float(seconds[kernels]), the_peaks, path,
                   walls, [float(s) for s in per_step])


def trace_events(events: np.ndarray, plan, regions: list, name: str) -> dict:
    """The Chrome trace event format of recorded calls (`events`: kernel, start, end; the call as a
    whole as kernel len(plan.kernels)): metadata naming the process and the calling thread, then
    a "step" and one "X" event per kernel call, times in microseconds from the first call."""
    pid, tid = os.getpid(), threading.get_native_id()
    kernels = plan.kernels
    origin = float(events[:, 1].min()) if len(events) else 0.0
    out = [{"name": "process_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": f"symgrad {name}"}},
           {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
            "args": {"name": "calling thread (kernels; their OpenMP teams inside)"}}]
    step = 0
    for k, start, end in events:
        k = int(k)
        ts, dur = (start - origin) * 1e6, (end - start) * 1e6
        if k == len(kernels):
            out.append({"name": f"step {step}", "cat": "step", "ph": "X", "ts": ts, "dur": dur, "pid": pid,
                        "tid": tid, "args": {"step": step}})
            step += 1
        else:
            out.append({"name": kernels[k].name, "cat": "kernel", "ph": "X", "ts": ts, "dur": dur, "pid": pid,
                        "tid": tid, "args": {"region": regions[k] or "(top)", "step": step,
                                             "kind": kernels[k].report_kind}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_trace(path: Path, events: np.ndarray, plan, regions: list, name: str) -> None:
    """Write `trace_events` as JSON to `path`."""
    path.write_text(json.dumps(trace_events(events, plan, regions, name)))


__all__ = ["KernelRow", "Profile", "ProfiledBuild", "RegionRow", "kernel_costs", "profile_program",
           "trace_events", "write_trace"]
