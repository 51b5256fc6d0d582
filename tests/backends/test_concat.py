"""Sums of embeds into disjoint windows stored in place (symgrad.backends.lower.concat).

A concatenation (sg.cat) and a split's gradient are sums of embedded parts: each part is stored
straight into its window of the sum's buffer, nothing else is zeroed when the windows cover it,
and the sum has no kernel. Parts that overlap, or an embed read by something else, keep the
plain lowering. Every case is checked against the NumPy reference on C, in float64.
"""

from __future__ import annotations

import numpy as np
import pytest

import symgrad as sg
from symgrad.backends.lower.lowering import LoopKernel

RNG = np.random.default_rng(21)


def _cases():
    """name -> (the outputs of one input x of shape (4, 12), and how many sums are stored in place)."""
    x = sg.input("x", (4, 12), dtype="float64")
    a, b, c = sg.split(x, 4, 1)
    joined = sg.cat([sg.tanh(c), b * 2, a], 1)                     # covers all 12 columns
    split_grad = sg.grad((sg.sin(a) * b * sg.exp(c)).sum(), [x])[0]  # embed(da) + embed(db) + embed(dc)
    gapped = sg.nn.functional.pad(a, (0, 6)) + sg.nn.functional.pad(c, (6, 0))   # columns 0-3 and 6-9 of 10
    overlapping = sg.nn.functional.pad(a, (0, 2)) + sg.nn.functional.pad(b, (2, 0))  # columns 0-3 and 2-5
    part = sg.nn.functional.pad(b, (0, 4))
    shared = part + sg.nn.functional.pad(c, (4, 0))                 # `part` is read twice
    return x, {"cat": ([joined], 1), "split's gradient": ([split_grad], 1), "gapped": ([gapped], 1),
               "overlapping": ([overlapping], 0), "a part read twice": ([shared, part * 3], 0)}


@pytest.fixture(scope="module")
def compiled():
    """case -> (C function, NumPy function, its expected in-place sums); one x for all."""
    x, cases = _cases()
    return {name: (sg.function([x], outs, backend="c"), sg.function([x], outs, backend="numpy"), sums)
            for name, (outs, sums) in cases.items()}


@pytest.mark.parametrize("case", ["cat", "split's gradient", "gapped", "overlapping", "a part read twice"])
def test_sums_of_embedded_parts_match_the_reference(compiled, case):
    c, numpy, sums = compiled[case]
    x = RNG.standard_normal((4, 12))
    for got, want in zip(c(x), numpy(x)):
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)
    stored = [k for k in c.program.plan.kernels if isinstance(k, LoopKernel)
              and any("stored in place" in line for line in k.lines)]
    adds = [k for k in c.program.plan.kernels if isinstance(k, LoopKernel) and k.name.split("_")[1] == "add"]
    if sums:
        assert stored, f"{case}: no part stored into its sum's buffer"
        assert not adds, f"{case}: the sum still has a kernel: {[k.name for k in adds]}"
        zeroed = [k for k in c.program.plan.kernels if any("no part of the sum covers" in line for line in k.lines)]
        assert bool(zeroed) == (case == "gapped"), f"{case}: zeroed {[k.name for k in zeroed]}"
    else:
        assert not stored, f"{case}: parts stored in place: {[k.name for k in stored]}"
