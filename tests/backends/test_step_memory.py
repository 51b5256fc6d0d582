"""The step memory `step.report()` gives before any call: each part counted from what the step
holds (its parameters' and optimizer state's arrays, the inputs and outputs of a call, the
arena the memory plan sizes), and the GEMM's packing bounded by what the runtime allocates."""

from __future__ import annotations

import numpy as np
import pytest

import symgrad as sg
from symgrad.backends import runtime
from symgrad.backends.report import step_memory

pytest.importorskip("symgrad.backends.c")


@pytest.fixture(scope="module")
def adam_step():
    x, y = sg.input("x", (sg.Dim("B"), 20)), sg.input("y", (sg.Dim("B"),), dtype="int64")
    W1, b1 = sg.param("W1", (20, 300), init="normal"), sg.param("b1", (300,), init="zeros")
    W2, b2 = sg.param("W2", (300, 5), init="normal"), sg.param("b2", (5,), init="zeros")
    loss = sg.cross_entropy(sg.relu(x @ W1 + b1) @ W2 + b2, y)
    return sg.train_step(loss, params=[W1, b1, W2, b2], optimizer=sg.optim.Adam(lr=1e-3), backend="c")


def test_each_part_is_what_the_step_holds(adam_step, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    program = adam_step.program
    parts = step_memory(program.graph, program.plan, program.memory_plan)
    param_bytes = sum(v.nbytes for v in adam_step.params.values())
    assert parts["parameters"] == param_bytes == 4 * (20 * 300 + 300 + 300 * 5 + 5)
    assert parts["optimizer state"] >= 2 * param_bytes   # Adam's two moments (and its step count)
    batch = program.memory_plan.bindings[sg.Dim("B")]
    assert parts["inputs"] == batch * (20 * 4 + 8)
    assert parts["arena"] == program.memory_plan.arena_bytes > 0
    assert 0 < parts["GEMM packing"] <= max(runtime.packing_bytes("float32", batch, 300, 20, threads=2),
                                            runtime.packing_bytes("float32", 20, 300, batch, threads=2),
                                            runtime.packing_bytes("float32", batch, 20, 300, threads=2))
    line = next(line for line in str(adam_step.report().memory).splitlines() if "step memory" in line)
    assert f"{sum(parts.values()) / 1024:.1f} KiB" in line and "optimizer state" in line


def test_the_blocked_gemm_bound_covers_its_buffers():
    """packing_bytes against gemm.c.j2's allocations, worked by hand for one product per path."""
    # Rows path, one thread (below the parallel threshold): B's panel, K x 16 rounded columns, and
    # one MC x KC block of A.
    assert runtime.packing_bytes("float32", 20, 30, 40) == (40 * 32 + 72 * 40) * 4
    # Columns path (one row block, many columns, 2 threads): all of A, 8-row rounded, and per
    # thread K x 32.
    assert runtime.packing_bytes("float32", 64, 4096, 512, threads=2) == (64 * 512 + 2 * 512 * 32) * 4
    # A narrow product packs its few columns.
    assert runtime.packing_bytes("float32", 64, 10, 784, kind="dot") == (784 * (32 + 10) + 64) * 4
