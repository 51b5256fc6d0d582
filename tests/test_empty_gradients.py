"""Gradients through an empty value are exactly 0.

A value with no elements (a take of no indices, a slice x[1:1]) holds nothing, so nothing after it
depends on what came before it. torch chains its empty cotangent back anyway, as zeros, through
each op's local derivative: where that derivative is infinite or NaN (sqrt at 0, pow of a negative
base), 0 * inf makes NaN where the gradient is 0. symgrad passes no cotangent through an empty
value. Each case is checked against torch with the empty value detached (the same function, whose
gradient torch then computes exactly), and shown to reach the defect: torch's own gradient has a NaN.
"""

import numpy as np
import pytest
import torch

import symgrad as sg

X = np.array([0.0, -0.375, 2.25, 1e-8])
NONE = np.zeros(0, dtype=np.int64)


def _sg_cases(x):
    none = sg.constant(NONE)
    return {
        "sum(take(sqrt(x), []))": sg.sum(sg.take(sg.sqrt(x), none)),
        "sum(pow(2, take(sum(x / pow(x, 1.5)), []))) + sum(x)":
            sg.sum(2.0 ** sg.take(sg.reshape(sg.sum(x / x ** 1.5), (1,)), none)) + sg.sum(x),
        "sum(sqrt(x)[1:1]) + sum(x * x)": sg.sum(sg.sqrt(x)[1:1]) + sg.sum(x * x),
    }


def _torch_cases(x, empty):
    """The same functions in torch; `empty` is applied to each empty value (detach, or nothing)."""
    none = torch.from_numpy(NONE)
    return {
        "sum(take(sqrt(x), []))": torch.sum(empty(torch.sqrt(x)[none])),
        "sum(pow(2, take(sum(x / pow(x, 1.5)), []))) + sum(x)":
            torch.sum(torch.pow(2.0, empty(torch.sum(x / torch.pow(x, 1.5)).reshape(1)[none]))) + torch.sum(x),
        "sum(sqrt(x)[1:1]) + sum(x * x)": torch.sum(empty(torch.sqrt(x)[1:1])) + torch.sum(x * x),
    }


@pytest.fixture(scope="module", params=["numpy", "c"])
def gradients(request):
    """Every case's gradient in one function per backend."""
    x = sg.input("x", X.shape, dtype="float64")
    cases = _sg_cases(x)
    grads = [sg.grad(loss, [x])[0] for loss in cases.values()]
    return dict(zip(cases, sg.function([x], grads, backend=request.param)(X)))


def _torch_grad(case, empty):
    x = torch.tensor(X, requires_grad=True)
    loss = _torch_cases(x, empty)[case]
    if not loss.requires_grad:   # all of it detached: x does not reach the loss
        return np.zeros_like(X)
    return torch.autograd.grad(loss, [x])[0].numpy()


@pytest.mark.parametrize("case", list(_torch_cases(torch.tensor(X), lambda v: v)))
def test_no_gradient_passes_through_an_empty_value(gradients, case):
    np.testing.assert_array_equal(gradients[case], _torch_grad(case, torch.Tensor.detach))
    assert np.isnan(_torch_grad(case, lambda v: v)).any(), "the case no longer reaches 0 * inf"
