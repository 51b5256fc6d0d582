"""The pass pipeline: the passes, listed once, in the order they run.

`optimize` threads a graph through them; each pass is a pure Graph -> Graph
function, so every intermediate graph can be printed, verified and compared.
"""

from __future__ import annotations

import inspect
import time
from typing import Callable, Sequence

from ..ir.graph import Graph
from .col2im import col2im
from .cse import cse
from .dce import dce
from .fold import fold
from .layout import layout
from .masks import masks
from .remat import remat
from .simplify import simplify
from .verify import verify as verify_graph

Pass = Callable[..., Graph]

# Why this order: dce first strips autodiff-only wrappers (custom,
# stop_gradient) that would hide patterns; folding turns constant scaffolding
# (1.0 * 1/B, broadcast seeds) into consts the identities can see; simplify
# rewrites; masks makes relu's backward read the kept activation (so the
# pre-activation can die early); col2im turns a convolution's input gradient from a scatter
# of the patch gradient into a product gathering the output gradient; layout sinks transposes
# below the elementwise work that reads them (a convolution's channels-last output read by
# BatchNorm and ReLU in that layout; after col2im, which matches the scatter it rewrites); cse then merges what the rewrites made equal (forward and
# backward alike); a last dce drops what merging and rewriting left unused; remat, after
# CSE (which would merge them back), gives the backward its own copies of cheap forward values.
DEFAULT_PIPELINE: tuple[tuple[str, Pass], ...] = (
    ("dce", dce),
    ("fold", fold),
    ("simplify", simplify),
    ("masks", masks),
    ("col2im", col2im),
    ("layout", layout),
    ("cse", cse),
    ("dce", dce),
    ("remat", remat),
)


def _takes_counts(fn: Pass) -> bool:
    try:
        return "counts" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no introspection, no counts
        return False


def optimize(graph: Graph, passes: Sequence[tuple[str, Pass]] = DEFAULT_PIPELINE,
             verify: bool = False, report: dict | None = None) -> Graph:
    """Run `passes` over `graph`; return the optimized graph (the input is not changed).

    passes: (name, function) pairs; a function takes the graph (and, if it
        has such a parameter, `counts`: a dict it may fill with what fired).

    verify: check the IR invariants after every pass (VerifyError names the pass).
    report: when given a dict, `report["passes"]` receives one entry per pass:
        {"pass", "nodes_before", "nodes_after", "seconds", "rewrites"} where
        rewrites counts what fired (rules by name, merged nodes, folded values).
    """
    entries = []
    if verify:
        verify_graph(graph)
    for name, fn in passes:
        counts: dict = {}
        before = len(graph.nodes)
        start = time.perf_counter()
        graph = fn(graph, counts=counts) if _takes_counts(fn) else fn(graph)
        seconds = time.perf_counter() - start
        if verify:
            try:
                verify_graph(graph)
            except ValueError as exc:
                raise type(exc)(f"after pass {name!r}: {exc}") from None
        entries.append({"pass": name, "nodes_before": before, "nodes_after": len(graph.nodes),
                        "seconds": seconds, "rewrites": counts})
    if report is not None:
        report["passes"] = entries
    return graph


def format_report(report: dict) -> str:
    """The per-pass table of a report, one line per pass."""
    lines = [f"{'pass':<10} {'nodes':>13} {'ms':>8}  rewrites"]
    for e in report.get("passes", []):
        fired = ", ".join(f"{k}={v}" for k, v in sorted(e["rewrites"].items()))
        lines.append(f"{e['pass']:<10} {e['nodes_before']:>5} -> {e['nodes_after']:<5} "
                     f"{e['seconds'] * 1e3:>8.1f}  {fired}")
    return "\n".join(lines)
