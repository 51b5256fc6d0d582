"""The step memory `step.report()` gives before any call: each part counted from what the step
holds (its parameters' and optimizer state's arrays, the inputs and outputs of a call, the
arena the memory plan sizes, and the runtime's scratch region after it, as the runtime counts it)."""

from __future__ import annotations

import numpy as np
import pytest

import symgrad as sg
from symgrad.backends.build import runtime
from symgrad.backends.kinds.matmul import MatmulKernel
from symgrad.backends.report import step_memory
from symgrad.ir import shapes as S
from helpers import omp_threads

pytest.importorskip("symgrad.backends.c")


@pytest.fixture(scope="module")
def adam_step():
    x, y = sg.input("x", (sg.Dim("B"), 20)), sg.input("y", (sg.Dim("B"),), dtype="int64")
    W1, b1 = sg.param("W1", (20, 300), init="normal"), sg.param("b1", (300,), init="zeros")
    W2, b2 = sg.param("W2", (300, 5), init="normal"), sg.param("b2", (5,), init="zeros")
    loss = sg.cross_entropy(sg.relu(x @ W1 + b1) @ W2 + b2, y)
    return sg.train_step(loss, params=[W1, b1, W2, b2], optimizer=sg.optim.Adam(lr=1e-3), backend="c")


def test_each_part_is_what_the_step_holds(adam_step):
    program = adam_step.program
    parts = step_memory(program.graph, program.plan, program.memory_plan)
    param_bytes = sum(v.nbytes for v in adam_step.params.values())
    assert parts["parameters"] == param_bytes == 4 * (20 * 300 + 300 + 300 * 5 + 5)
    assert parts["optimizer state"] >= 2 * param_bytes   # Adam's two moments (and its step count)
    batch = program.memory_plan.bindings[sg.Dim("B")]
    assert parts["inputs"] == batch * (20 * 4 + 8)
    assert parts["arena"] == program.memory_plan.arena_bytes > 0
    # The runtime's scratch: the most one of the step's matmuls takes, as the runtime counts it.
    assert parts["runtime scratch"] == program.memory_plan.scratch_bytes == max(
        runtime.scratch_bytes(k.function, *(S.evaluate(n, {sg.Dim("B"): batch})
                                                                       for n in (k.M, k.N, k.K)), threads=omp_threads())
        for k in program.plan.kernels if isinstance(k, MatmulKernel)) > 0
    line = next(line for line in str(adam_step.report().memory).splitlines() if "step memory" in line)
    assert f"{sum(parts.values()) / 1024:.1f} KiB" in line and "runtime scratch" in line


def test_the_scratch_region_is_the_runtimes_count_for_every_batch(adam_step):
    """For a grid of batch sizes (one thread's products and the team's, narrow and blocked), the
    region the program asks for (symgrad_scratch_bytes, which Python sizes the workspace with) is
    the most any of its matmuls' runtime functions reports."""
    program = adam_step.program
    for batch in (1, 7, 64, 1000, 5000):
        want = max(runtime.scratch_bytes(k.function,
                                         *(S.evaluate(n, {sg.Dim("B"): batch}) for n in (k.M, k.N, k.K)),
                                         threads=omp_threads())
                   for k in program.plan.kernels if isinstance(k, MatmulKernel))
        assert program._scratch_bytes((batch,)) == want > 0, batch
