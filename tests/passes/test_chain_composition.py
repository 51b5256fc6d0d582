"""Chain composition (symgrad.passes.chains) leaves a chain as its nodes when sympy cannot compose
it: clip(log(clip(x, -2, 1.5))) composes log of the inlined bound -2, a complex number that the
outer clip's Piecewise cannot compare (sympy raised TypeError, and the C compile failed with it)."""

import numpy as np
import pytest
import torch

import symgrad as sg


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_a_chain_sympy_cannot_compose_compiles_as_its_nodes(backend):
    x = sg.input("x", (3, 5), dtype="int32")
    out = sg.clip(sg.log(sg.clip(sg.cast(x, "float64"), -2.0, 1.5)), -2.0, 1.5)
    values = np.arange(-7, 8, dtype=np.int32).reshape(3, 5)
    got = sg.function([x], out, backend=backend)(values)
    want = torch.clamp(torch.log(torch.clamp(torch.from_numpy(values).double(), -2.0, 1.5)), -2.0, 1.5)
    np.testing.assert_array_equal(got, want.numpy())


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_adding_zero_keeps_the_sign_of_zero(backend):
    """-s + 0.0 is +0.0 at s = 0 (IEEE), where a composed -s is -0.0; a division by it then had the
    other infinity (found by the fuzzer: seed 112720261 batch 39). The sum over an empty axis is 0;
    the value feeds two kernels (the output and the gradient), so the chain ends at the add."""
    x, y = sg.input("x", (3, 0), dtype="float64"), sg.input("y", (3,), dtype="float64")
    denominator = -sg.sum(x, axis=1) + 0.0
    out = y / denominator
    (grad,) = sg.grad(sg.sum(out), [y])
    xs, ys = np.zeros((3, 0)), np.array([-1.5, -0.5, 2.0])
    got = sg.function([x, y], [out, grad], backend=backend)(xs, ys)
    yt = torch.tensor(ys, requires_grad=True)
    want = yt / (-torch.from_numpy(xs).sum(1) + 0.0)
    (want_grad,) = torch.autograd.grad(want.sum(), [yt])
    np.testing.assert_array_equal(got[0], want.detach().numpy())
    np.testing.assert_array_equal(got[1], want_grad.numpy())
