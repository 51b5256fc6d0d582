"""In-place writes, end to end through `lower`: copies removed where a kernel can store the value itself.

A variable's new value computed by a loop is stored into the variable (no copy, `plan.in_place`
names it); a value shared by two updates, or a variable's old value given to another variable,
keeps its copies (the old value saved before any variable is written); an output that is the
whole of a temporary is stored by the temporary's kernel, and the C program computes the same.
"""

from __future__ import annotations

import re

import numpy as np

import symgrad as sg
from symgrad.backends.lower.lowering import LoopKernel, lower


def copies(plan) -> list:
    return [k for k in plan.kernels if k.name.endswith("_copy")]


def test_sgd_updates_are_written_in_place():
    x = sg.input("x", (5, 3))
    w, b = sg.param("w", (3,), init="ones"), sg.param("b", (3,), init="zeros")
    graph = sg.Graph([x], [sg.sum(x * w)], [(w, w - sg.sum(x * w, axis=0) * 0.1), (b, b * 0.5 + 1.0)])
    plan = lower(graph)
    assert plan.in_place == ["w", "b"] and copies(plan) == []
    assert {"var0", "var1"} <= {k.out.name for k in plan.kernels if isinstance(k, LoopKernel)}
    # Kernels and temporaries numbered by their place once the copies are gone.
    assert [re.match(r"k(\d+)_", k.name).group(1) for k in plan.kernels] == [str(i) for i in range(len(plan.kernels))]
    assert [b.name for b in plan.workspace] == [f"ws{k}" for k in range(len(plan.workspace))]


def test_an_update_shared_or_taken_from_a_variable_keeps_its_copy():
    x = sg.input("x", (4,))
    u, v, w = (sg.param(n, (4,), init="ones") for n in "uvw")
    shared = u * 2.0 + x
    # u and v get the same new value; w gets v's old value (saved before any variable is written).
    graph = sg.Graph([x], [sg.sum(u * x)], [(u, shared), (v, shared), (w, v)])
    plan = lower(graph)
    assert plan.in_place == []
    assert [k.lines[0].split(":")[0] for k in copies(plan)] == [
        "save the new value of variable w", "update u <- t3", "update v <- t3", "update w <- v"]
    step = sg.step.compiled.Compiled(graph, "c")
    step._run([np.arange(4, dtype="f4")])
    np.testing.assert_array_equal(step._read_variable("u"), 2.0 + np.arange(4))
    np.testing.assert_array_equal(step._read_variable("v"), 2.0 + np.arange(4))
    np.testing.assert_array_equal(step._read_variable("w"), np.ones(4))  # v's old value


def test_an_output_that_is_a_whole_temporary_is_written_by_its_kernel():
    x = sg.input("x", (4, 6))
    outputs = [sg.reshape(sg.exp(x) + 1.0, (24,)), sg.transpose(sg.exp(x) * 2.0)]
    plan = lower(sg.Graph([x], outputs))
    # The reshape: exp(x) + 1 is stored straight into out0. The transpose still needs its copy.
    assert [k.out.name for k in copies(plan)] == ["out1"]
    assert any(k.out.name == "out0" and not k.name.endswith("_copy") for k in plan.kernels)
    run = sg.function([x], outputs, backend="c")
    a = np.random.default_rng(0).standard_normal((4, 6)).astype("f4")
    got = run(a)
    np.testing.assert_allclose(got[0], (np.exp(a) + 1).reshape(24), rtol=1e-6)
    np.testing.assert_allclose(got[1], (np.exp(a) * 2).T, rtol=1e-6)
