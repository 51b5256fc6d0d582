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
