"""Arithmetic on truth values, inside a fused chain, as torch computes it.

torch's bool + bool is a logical or and bool * bool an and: the result is a bool. C computed the
sum on uint8 and kept 2 for True + True, which a later op in the same kernel read as 2
(maximum(m + m, x) gave 2 where torch gives 1; the fuzzer at seed 27112026, batch 21, graph 31).
"""

import numpy as np
import pytest
import torch

import symgrad as sg

A = np.array([1.0, 2.0, -3.0, 4.0, np.nan, 0.5])
B = np.array([0.0, 3.0, -4.0, 4.0, 0.0, -1.0])


def _graphs(lib, a, b):
    """The same expressions in symgrad or torch (bool m, n from comparisons of a and b)."""
    m, n = a > b, a < b + 1
    maximum = sg.maximum if lib is sg else torch.maximum
    to_float = (lambda v: v.to("float64")) if lib is sg else (lambda v: v.to(torch.float64))
    return {
        "maximum(m + m, a)": maximum(m + m, a),
        "(m + n) * a": to_float(m + n) * a,
        "m * n + m": to_float(m * n + m),
        "where(m + m, a, b)": (sg.where if lib is sg else torch.where)(m + m, a, b),
    }


@pytest.fixture(scope="module", params=["numpy", "c"])
def results(request):
    a, b = sg.input("a", A.shape, dtype="float64"), sg.input("b", B.shape, dtype="float64")
    graphs = _graphs(sg, a, b)
    return dict(zip(graphs, sg.function([a, b], list(graphs.values()), backend=request.param)(A, B)))


@pytest.mark.parametrize("case", list(_graphs(torch, torch.from_numpy(A), torch.from_numpy(B))))
def test_bool_sums_and_products_are_truth_values(results, case):
    want = _graphs(torch, torch.from_numpy(A), torch.from_numpy(B))[case].numpy()
    np.testing.assert_array_equal(results[case], want)
