"""maximum / minimum gradients at ties and NaN when a chain makes both operands one value.

torch halves the cotangent between tied operands and passes it whole to both where one is NaN
(no comparison holds). symgrad's mask tests a < b and a == b; once a fused chain substitutes one
value for both operands (maximum(v, minimum(v, v))), sympy reads v == v as True, so the NaN test
must be its own function (is_nan), or a NaN splits its cotangent (C gave 2 where torch gives 3).
"""

import numpy as np
import pytest
import torch

import symgrad as sg

CASES = {
    "maximum(v, minimum(v, v))": lambda m, v: m.maximum(v, m.minimum(v, v)),
    "maximum(maximum(v, v), v)": lambda m, v: m.maximum(m.maximum(v, v), v),
    "minimum(v, v)": lambda m, v: m.minimum(v, v),
    "maximum(v, v) * v": lambda m, v: m.maximum(v, v) * v,
    "clip(maximum(v, v), -1, 1)": lambda m, v: (m.clip(m.maximum(v, v), -1.0, 1.0) if m is sg
                                                else torch.clamp(torch.maximum(v, v), -1.0, 1.0)),
}
VALUES = np.array([-15.0, np.nan, 0.0, -0.0, np.inf, -np.inf, 0.5, 3.0])


@pytest.fixture(scope="module", params=["numpy", "c"])
def gradients(request):
    """Every case's gradient of sum(out * cot) in one function per backend."""
    v, cot = sg.input("v", VALUES.shape, dtype="float64"), sg.input("cot", VALUES.shape, dtype="float64")
    grads = [sg.grad(sg.sum(fn(sg, v) * cot), [v])[0] for fn in CASES.values()]
    cots = np.linspace(0.5, 2.0, VALUES.size)
    return dict(zip(CASES, sg.function([v, cot], grads, backend=request.param)(VALUES, cots))), cots


@pytest.mark.parametrize("case", list(CASES))
def test_ties_and_nan_pass_the_cotangent_as_torch(gradients, case):
    got, cots = gradients
    v = torch.tensor(VALUES, requires_grad=True)
    (CASES[case](torch, v) * torch.from_numpy(cots)).sum().backward()
    np.testing.assert_array_equal(got[case], v.grad.numpy())
