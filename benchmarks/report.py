"""Turning measurements into the result rows, the Markdown tables and the notes.

A cell is a dict with "status": "ok" (with us_per_step, gflops and the
timing details), "unavailable" (an optional dependency is missing) or
"error" (the system failed on this model); the last two carry "reason".
"""

from __future__ import annotations

import math

from .models import Model
from .systems import BASE, OTHERS

SUBJECT = "symgrad-c"   # the system whose ratio against the others is the target


def ok_cell(model: Model, timing: dict) -> dict:
    """A measured cell: the timing plus GFLOP/s by the model's FLOP count."""
    return {"status": "ok", **timing, "gflops": model.flops / (timing["us_per_step"] * 1e-6) / 1e9}


def failed_cell(status: str, reason: str) -> dict:
    """A cell that holds no number: status "unavailable" or "error", and why."""
    return {"status": status, "reason": reason}


def make_row(model: Model, cells: dict[str, dict]) -> dict:
    """One table row: the model, its cells, and symgrad-C / the fastest other system."""
    others = {name: cells[name]["us_per_step"] for name in OTHERS
              if name in cells and cells[name]["status"] == "ok"}
    fastest = min(others, key=others.get) if others else None
    subject = cells.get(SUBJECT, {})
    ratio = subject["us_per_step"] / others[fastest] if fastest and subject.get("status") == "ok" else None
    base = cells.get(BASE, {})
    base_ratio = subject["us_per_step"] / base["us_per_step"] \
        if subject.get("status") == "ok" and base.get("status") == "ok" else None
    return {
        "model": model.label, "key": model.key, "widths": list(model.widths), "batch": model.batch,
        "flops_per_step": model.flops, "target": model.target, "cells": cells,
        "fastest_other": fastest, "fastest_other_us": others.get(fastest),
        "ratio": ratio, "base_ratio": base_ratio,
        "meets_target": None if ratio is None or model.target is None else ratio <= model.target,
    }


def _us(value: float) -> str:
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _gflops(value: float) -> str:
    return f"{value:.1f}" if value >= 1 else f"{value:.3g}"


def _first_line(text: str, width: int = 60) -> str:
    line = (text.strip().splitlines() or [""])[0]
    return line if len(line) <= width else line[: width - 3] + "..."


class _Notes:
    """Numbered footnotes, one per distinct reason."""

    def __init__(self):
        self.items: list[str] = []

    def ref(self, text: str) -> str:
        if text not in self.items:
            self.items.append(text)
        return f"[{self.items.index(text) + 1}]"


def _cell_text(name: str, cell: dict, value: str, notes: _Notes) -> str:
    if cell["status"] == "ok":
        return value
    mark = notes.ref(f"{name}: {cell['reason']}")
    if cell["status"] == "error":
        return f"error: {_first_line(cell['reason'])} {mark}"
    return f"n/a {mark}"


def _ratio_text(row: dict) -> str:
    if row["ratio"] is None:
        return "n/a"
    target = f" (target <= {row['target']}: {'met' if row['meets_target'] else 'MISSED'})" \
        if row["target"] is not None else ""
    return f"{row['ratio']:.2f} vs {row['fastest_other']}{target}"


def _table(header: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    out += ["| " + " | ".join(line) + " |" for line in lines]
    return "\n".join(out)


def render_steps(rows: list[dict], systems: list[str], notes_by_system: dict[str, str]) -> str:
    """The two Markdown tables (us per step with the ratio; GFLOP/s) and their footnotes."""
    notes = _Notes()
    us_lines, gf_lines = [], []
    with_base = BASE in systems
    for row in rows:
        cells = row["cells"]
        base = [] if not with_base else ["n/a" if row["base_ratio"] is None else f"{row['base_ratio']:.2f}"]
        us_lines.append([row["model"]]
                        + [_cell_text(s, cells[s], _us(cells[s].get("us_per_step", 0)), notes) for s in systems]
                        + [_ratio_text(row)] + base)
        gf_lines.append([row["model"], f"{row['flops_per_step'] / 1e9:.4g}"]
                        + [_cell_text(s, cells[s], _gflops(cells[s].get("gflops", 0)), notes) for s in systems])
    parts = [
        "Training step, microseconds per step (median of blocks):",
        "",
        _table(["model", *systems, f"{SUBJECT} / fastest other"]
               + ([f"{SUBJECT} / {BASE}"] if with_base else []), us_lines),
        "",
        "GFLOP/s (3 GEMMs of 2*B*in*out FLOPs per Linear):",
        "",
        _table(["model", "GFLOP/step", *systems], gf_lines),
    ]
    if notes.items:
        parts += [""] + [f"[{k + 1}] {text}" for k, text in enumerate(notes.items)]
    described = [f"- {s}: {notes_by_system[s]}" for s in systems if notes_by_system.get(s)]
    if described:
        parts += ["", "How each system runs the step:"] + described
    return "\n".join(parts)


def all_finite_positive(rows: list[dict]) -> bool:
    """True when every measured cell's time and GFLOP/s are positive finite numbers."""
    return all(math.isfinite(c[k]) and c[k] > 0
               for row in rows for c in row["cells"].values() if c["status"] == "ok"
               for k in ("us_per_step", "gflops"))
