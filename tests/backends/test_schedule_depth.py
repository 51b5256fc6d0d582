"""The kernel schedule's work grows with the graph, not with its square (issue 34: passes, lowering
and rendering grow no faster than the graph).

A GPT's backward parks its layers' recomputed values (symgrad.backends.decide.schedule._Parking)
until a kernel reading them could otherwise run. Looking at every parked kernel's readers at
every pick made the schedule quadratic in depth (a 24-layer GPT small: 165 ms of scheduling
against 55 ms at 12 layers). Counted here without timing: how many times the schedule asks
whether a reader waits only for parked kernels, at 4 and 8 layers."""

from __future__ import annotations

import dataclasses

from benchmarks import gpt as bench_gpt
from symgrad import passes
from symgrad.backends.decide import schedule
from symgrad.backends.decide.decisions import decide


def _looks_and_parks(layers: int, monkeypatch) -> tuple[int, int]:
    """(readers looked at, kernels parked) while the small GPT's step of `layers` layers is scheduled."""
    bench = dataclasses.replace(bench_gpt.CONFIGS["small"], layers=layers)
    _, state, _, _ = bench_gpt.setup(bench)
    step = bench_gpt.symgrad_step(bench, state, "numpy")   # the graph only: nothing is compiled
    graph = passes.optimize(step.graph)
    counts = {"looks": 0, "parks": 0}
    looks, parks = schedule._Parking._needs_only_parked, schedule._Parking.park

    def counted_look(self, c, parked_ids):
        counts["looks"] += 1
        return looks(self, c, parked_ids)

    def counted_park(self, n):
        counts["parks"] += 1
        return parks(self, n)

    monkeypatch.setattr(schedule._Parking, "_needs_only_parked", counted_look)
    monkeypatch.setattr(schedule._Parking, "park", counted_park)
    decide(graph, step.graph.variables, matmul_epilogues=True)
    monkeypatch.undo()
    return counts["looks"], counts["parks"]


def test_the_schedule_of_twice_the_layers_looks_at_about_twice_the_readers(monkeypatch):
    looks4, parks4 = _looks_and_parks(4, monkeypatch)
    looks8, parks8 = _looks_and_parks(8, monkeypatch)
    assert parks4 > 0 and parks8 - parks4 >= 4   # each layer parks its recomputations
    # Linear: twice the layers, about twice the looks (the quadratic release looked at 3.8x as many).
    assert looks8 <= 2.5 * looks4, (looks4, looks8)
