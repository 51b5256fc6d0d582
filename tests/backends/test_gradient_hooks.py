"""The C program tells its caller when each gradient buffer is final (sg_context.gradient_final).

symgrad.tools.distributed starts a bucket's allreduce from that hook, while the rest
of the backward runs: a gradient announced too early would be sent before its
last kernel wrote it. One accumulate program serves every test here.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import symgrad as sg
from symgrad.backends.plan import gradients_final_after

pytest.importorskip("symgrad.backends.c")

ROWS, IN, HIDDEN, OUT = 16, 8, 12, 5


@pytest.fixture(scope="module")
def step():
    rng = np.random.default_rng(0)
    x = sg.input("x", (ROWS, IN))
    y = sg.input("y", (ROWS,), dtype="int64")
    W0 = sg.param("W0", (IN, HIDDEN), init=rng.standard_normal((IN, HIDDEN)).astype(np.float32))
    b0 = sg.param("b0", (HIDDEN,), init=rng.standard_normal(HIDDEN).astype(np.float32))
    W1 = sg.param("W1", (HIDDEN, OUT), init=rng.standard_normal((HIDDEN, OUT)).astype(np.float32))
    b1 = sg.param("b1", (OUT,), init=rng.standard_normal(OUT).astype(np.float32))
    loss = sg.cross_entropy(sg.relu(x @ W0 + b0) @ W1 + b1, y)
    return sg.train_step(loss, [W0, b0, W1, b1], sg.optim.SGD(lr=0.1), backend="c")


def _batch(seed: int):
    rng = np.random.default_rng(seed)
    return rng.random((ROWS, IN), dtype=np.float32), rng.integers(0, OUT, ROWS)


def test_each_gradient_is_announced_once_holding_its_final_value_in_backward_order(step):
    program = step.program_for("accumulate")
    seen = []

    def announced(slot):
        name = program.graph.variables[slot].name
        seen.append((name, program._storage[name].copy()))  # what the buffer holds right then

    program.program.on_gradient_final(announced)
    try:
        xb, yb = _batch(1)
        step.accumulate(x=xb, y=yb)
        step.accumulate(x=xb, y=yb)  # the buffers now hold twice the gradient: still final when announced
    finally:
        program.program.on_gradient_final(None)
    names = [name for name, _ in seen]
    assert sorted(names[:4]) == sorted(names[4:]) == ["W0.grad", "W1.grad", "b0.grad", "b1.grad"]
    assert names[:4] == names[4:]
    assert names.index("W1.grad") < names.index("W0.grad")  # the last layer's gradient is final first
    for name, value in seen[4:]:
        np.testing.assert_array_equal(value, program._storage[name])
    step.apply()  # zeroes the buffers for the next test


def _call_of(source: str, kernel: str, start: int = 0) -> int:
    """Where the entry point calls `kernel` (its own function, or another's it shares, the call
    then commented with its name) from `start` on; -1 if it does not."""
    found = re.compile(rf"^    (?:{kernel}\(.*|\w+\(.*\);  /\* {kernel} \*/)$", re.M).search(source, start)
    return found.start() if found else -1


def test_the_hook_calls_follow_the_last_kernel_that_touches_each_buffer(step):
    program = step.program_for("accumulate")
    plan = program.program.plan
    final = gradients_final_after(plan)
    source = program.source
    for position, slots in final.items():
        call = _call_of(source, plan.kernels[position].name)
        assert call >= 0
        for slot in slots:
            hook = source.index(f"context->gradient_final(context->gradient_final_data, {slot});")
            later = [_call_of(source, k.name, call + 1) for k in plan.kernels[position + 1:]]
            assert call < hook < min([i for i in later if i > 0], default=len(source))
    # no later kernel reads or writes an announced buffer
    from symgrad.backends.plan import kernel_reads, kernel_writes
    for position, slots in final.items():
        for kernel in plan.kernels[position + 1:]:
            touched = {b.index for b in (*kernel_reads(kernel), *kernel_writes(kernel))
                       if b is not None and b.storage == "variable"}
            assert not touched & set(slots)


def test_programs_without_gradient_buffers_emit_no_hook_and_a_cleared_hook_is_not_called(step):
    assert "gradient_final(" not in step.source  # the fused step updates parameters, no .grad buffers
    program = step.program_for("accumulate")
    calls = []
    program.program.on_gradient_final(calls.append)
    program.program.on_gradient_final(None)
    xb, yb = _batch(2)
    step.accumulate(x=xb, y=yb)
    assert calls == []
    step.apply()
