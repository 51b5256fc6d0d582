"""Time one full training step per model and system; print the tables and write JSON.

    python -m benchmarks.bench_step [--models A,B,C] [--systems ...] [--quick] [--json PATH]

In one process and one run: for each model (benchmarks/models.py), build
every system's step (benchmarks/systems.py), warm each up, then time them
side by side, their blocks of several steps taken in turns, and report the
median block of each (benchmarks/timing.py). Then, unless
--no-latency, measure compile latency in fresh processes
(benchmarks/compile_latency.py). A system that is missing here (the C
backend not built yet, JAX not installed) or fails on a model shows as a
cell with the reason; the other cells are still measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

from . import THREADS, compile_latency
from . import models as M
from . import report, systems, timing

RESULTS = Path(__file__).resolve().parent / "results"


def run_steps(models: list[M.Model], names: list[str], plan: timing.Plan, log=print) -> list[dict]:
    """Measure every (model, system) pair; one result row per model.

    Per model, every system's step is built first, then all are timed side by side
    (timing.measure_side_by_side: their blocks in turns), so they share the machine's
    conditions and the ratios compare the systems rather than the minutes they ran in.
    """
    rows = []
    for model in models:
        cells, runners = {}, {}
        for name in names:
            start = time.perf_counter()
            try:
                runners[name] = systems.SYSTEMS[name](model)
            except systems.Unavailable as exc:
                cells[name] = report.failed_cell("unavailable", str(exc))
            except Exception as exc:  # the error text becomes the table cell
                cells[name] = _error_cell(exc)
            shown = "built" if name in runners else \
                f"{cells[name]['status']}: {report._first_line(cells[name]['reason'], 100)}"
            log(f"  {model.label:7s} {name:19s} {shown}  ({time.perf_counter() - start:.1f} s)")

        def failed(name: str, exc: Exception) -> None:
            cells[name] = _error_cell(exc)

        start = time.perf_counter()
        measured = timing.measure_side_by_side(runners, plan, on_error=failed)
        for name, result in measured.items():
            cells[name] = {**report.ok_cell(model, result), "note": runners[name].note}
        log(f"  {model.label:7s} timed side by side ({time.perf_counter() - start:.1f} s): " + ", ".join(
            f"{name} {cells[name]['us_per_step']:.1f} us" if cells[name]["status"] == "ok"
            else f"{name} {cells[name]['status']}" for name in names if name in runners))
        rows.append(report.make_row(model, {name: cells[name] for name in names}))
    return rows


def _error_cell(exc: Exception) -> dict:
    cell = report.failed_cell("error", f"{type(exc).__name__}: {exc}")
    cell["traceback"] = traceback.format_exc()
    return cell


def system_notes(names: list[str]) -> dict[str, str]:
    """One line per system on how its step is built (from the builders' docstrings)."""
    return {name: (systems.SYSTEMS[name].__doc__ or "").strip().splitlines()[0] for name in names}


def _versions() -> dict:
    # From the installed metadata: importing jax just to read its version costs a second.
    out = {"python": platform.python_version()}
    for package in ("numpy", "symgrad", "torch", "jax", "jaxlib", "sympy"):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = None
    return out


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=RESULTS.parent,
                              capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def meta(argv: list[str], plan: timing.Plan) -> dict:
    """Where and how the run was made."""
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "argv": argv,
        "cpu": _cpu(), "cores": os.cpu_count(), "threads": THREADS,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "symgrad_cflags": os.environ.get("SYMGRAD_CFLAGS"),
        "versions": _versions(), "git_commit": _git_commit(),
        "plan": dataclasses.asdict(plan), "lr": M.LR,
        "load_average_at_start": _load(),
    }


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _busy_warning() -> str | None:
    """A warning when other processes already load the cores: OpenMP timings then mean little."""
    load, cores = _load(), os.cpu_count() or 1
    if load is None or load < 0.5 * cores:
        return None
    return (f"warning: load average {load:.1f} on {cores} cores before the run; other processes "
            "compete for the cores and OpenMP systems slow down by orders of magnitude: "
            "these timings are not a result")


def parse_args(argv=None):
    """The command line; see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_step",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="A,B,C",
                        help="comma list of model letters or keys (A, B, C; A64, A256, B128, C512); default A,B,C")
    parser.add_argument("--systems", default=",".join(systems.SYSTEMS),
                        help=f"comma list from {', '.join(systems.SYSTEMS)}; default all")
    parser.add_argument("--quick", action="store_true",
                        help=f"fewer, shorter blocks ({timing.QUICK.blocks}): a quick look, not a result")
    parser.add_argument("--blocks", type=int, help="blocks per measurement (overrides the plan)")
    parser.add_argument("--steps", type=int, help="steps per block (default: enough for the block time)")
    parser.add_argument("--warmup", type=int, help="warm-up steps after the first (default: by time)")
    parser.add_argument("--march", help="build symgrad for this gcc -march level instead of the default flags "
                                        "(x86-64, x86-64-v3 for AVX2, x86-64-v4 for AVX-512, native): an "
                                        "AVX-512 machine measures the AVX2 build too; sets SYMGRAD_CFLAGS")
    parser.add_argument("--no-latency", action="store_true", help="skip the compile-latency measurement")
    parser.add_argument("--latency-repeats", type=int, default=1, help="cold/warm pairs per system")
    parser.add_argument("--base", type=Path,
                        help="a checkout of another commit (git worktree add DIR REV): its symgrad-C "
                             f"runs beside this one as system {systems.BASE}, in the same rounds")
    parser.add_argument("--json", type=Path,
                        help=f"where to write the results (default {RESULTS.name}/bench-<time>.json "
                             "beside this file)")
    args = parser.parse_args(argv)
    unknown = [s for s in args.systems.split(",") if s.strip() and s.strip() not in systems.SYSTEMS]
    if unknown:
        parser.error(f"unknown system(s) {unknown}; expected {list(systems.SYSTEMS)}")
    try:
        args.model_list = M.select(args.models)
    except ValueError as exc:
        parser.error(str(exc))
    for flag in ("blocks", "steps", "latency_repeats"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.warmup is not None and args.warmup < 0:
        parser.error("--warmup must be at least 0")
    return args


def march_flags(march: str) -> list[str]:
    """symgrad's default C flags with `-march=<march>` in place of theirs."""
    from symgrad.backends.build.cache import DEFAULT_FLAGS
    return [f"-march={march}" if flag.startswith("-march=") else flag for flag in DEFAULT_FLAGS]


def make_plan(args) -> timing.Plan:
    """The timing plan: FULL or QUICK, with any --blocks/--steps/--warmup overrides."""
    plan = timing.QUICK if args.quick else timing.FULL
    changes = {}
    if args.blocks is not None:
        changes["blocks"] = args.blocks
    if args.steps is not None:
        changes["steps"] = args.steps
    if args.warmup is not None:
        # An exact count: the first call, then `warmup` more, whatever time they take.
        changes.update(warmup_steps=args.warmup + 1, warmup_s=0.0)
    return dataclasses.replace(plan, **changes)


def main(argv=None) -> int:
    """Run the benchmark; print the tables; write the JSON. Returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    plan = make_plan(args)
    if args.march:  # read at each build, and inherited by the compile-latency processes
        os.environ["SYMGRAD_CFLAGS"] = " ".join(march_flags(args.march))
    names = [s.strip() for s in args.systems.split(",") if s.strip()]
    if args.base:
        systems.SYSTEMS[systems.BASE] = systems.base_builder(args.base)
        names.insert(names.index(report.SUBJECT) + 1 if report.SUBJECT in names else 0, systems.BASE)
    info, warning = meta(argv, plan), _busy_warning()
    print(f"symgrad step benchmark: {len(args.model_list)} model(s) x {len(names)} system(s), "
          f"{plan.blocks} blocks, {THREADS} threads", flush=True)
    if warning:
        print(warning, flush=True)
    rows = run_steps(args.model_list, names, plan, log=lambda s: print(s, flush=True))
    info["load_average_at_end"] = _load()
    result = {"meta": info, "systems": names, "system_notes": system_notes(names), "rows": rows}
    text = report.render_steps(rows, names, result["system_notes"])
    if warning:
        text = warning + "\n\n" + text
    if not args.no_latency:
        print("measuring compile latency in fresh processes ...", flush=True)
        result["compile_latency"] = compile_latency.measure(repeats=args.latency_repeats)
        text += "\n\n" + compile_latency.render(result["compile_latency"])
    path = args.json or RESULTS / f"bench-{datetime.datetime.now():%Y%m%d-%H%M%S}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print()
    print(text)
    print(f"\nJSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
