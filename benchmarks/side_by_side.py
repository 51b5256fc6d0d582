"""One side-by-side table for the model benchmarks (GPT, CNN): build every system, time them in
turns (benchmarks.timing), print ms per step, symgrad-C's ratios, and every system's first loss.

A builder is `builder(bench, *setup(bench)) -> Runner`; it raises systems.Unavailable when an
optional dependency is missing, and any other error becomes its table cell.
"""

from __future__ import annotations

import importlib
import time
import traceback
from typing import Callable

from . import timing
from .systems import Unavailable


def run(benches: list, names: list[str], builders: dict, setup: Callable, plan: timing.Plan, log=print,
        preload: tuple = ()) -> list[dict]:
    """Per bench (anything with a `name`): build every system from setup(bench), time them side by
    side; one row per bench with a cell per system. `preload`: libraries imported before any
    build is timed (those that are installed): a library's import is not a system's build, as
    symgrad's own import (in setup) is not symgrad-c's, so the first system to need torch does
    not carry torch's import in its build time."""
    for library in preload:
        try:
            importlib.import_module(library)
        except ImportError:
            pass  # the systems that need it report themselves unavailable
    rows = []
    for bench in benches:
        context = setup(bench)
        cells, runners = {}, {}
        for name in names:
            start = time.perf_counter()
            try:
                runners[name] = builders[name](bench, *context)
            except Unavailable as exc:
                cells[name] = {"status": "unavailable", "reason": str(exc)}
            except Exception as exc:   # the error text becomes the cell
                cells[name] = {"status": "error", "reason": f"{type(exc).__name__}: {exc}",
                               "traceback": traceback.format_exc()}
            log(f"  {bench.name:8s} {name:14s} {'built' if name in runners else cells[name]['status']}"
                f"  ({time.perf_counter() - start:.1f} s)")

        def failed(name: str, exc: Exception) -> None:
            cells[name] = {"status": "error", "reason": f"{type(exc).__name__}: {exc}"}

        for name, result in timing.measure_side_by_side(runners, plan, on_error=failed).items():
            cells[name] = {"status": "ok", "ms_per_step": result["us_per_step"] / 1e3, **result,
                           "note": runners[name].note}
        rows.append({"config": bench.name, "bench": dict(vars(bench)), "cells": cells})
    return rows


def ratio(cells: dict, names, ours: str = "symgrad-c") -> str:
    """`ours` over the fastest of `names` that ran, with its name; "-" when either is missing."""
    mine = cells.get(ours, {})
    others = [(cells[n]["ms_per_step"], n) for n in names if cells.get(n, {}).get("status") == "ok"]
    if mine.get("status") != "ok" or not others:
        return "-"
    best, who = min(others)
    return f"{mine['ms_per_step'] / best:.2f} vs {who}"


def render(rows: list[dict], names: list[str], anchors, reference: str | None = None) -> str:
    """The markdown table (ms per step, symgrad-C over the fastest anchor and over `reference`),
    then the first losses, then why any system did not run."""
    head = ["config", *names, "symgrad-c / fastest anchor"] + ([f"symgrad-c / {reference}"] if reference else [])
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for row in rows:
        cells = row["cells"]
        text = [f"{cells[n]['ms_per_step']:.1f}" if cells[n]["status"] == "ok" else cells[n]["status"] for n in names]
        extra = [ratio(cells, [reference])] if reference else []
        lines.append("| " + " | ".join([row["config"], *text, ratio(cells, anchors), *extra]) + " |")
    losses = ["", "First loss of each system (same weights, same batch):", ""]
    for row in rows:
        losses.append(f"- {row['config']}: " + ", ".join(
            f"{n} {c['loss_first']:.6f}" for n, c in row["cells"].items() if c["status"] == "ok"))
    failures = [f"- {row['config']} {n}: {c['reason'].splitlines()[0][:160]}" for row in rows
                for n, c in row["cells"].items() if c["status"] != "ok"]
    return "\n".join(lines + losses + (["", "Not run:", *failures] if failures else []))
