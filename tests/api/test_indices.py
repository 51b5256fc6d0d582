"""arange, tril, triu, permute, swapaxes and a causal mask, against torch on every backend."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import symgrad as sg

RNG = np.random.default_rng(4)
X = RNG.standard_normal((2, 4, 5))
SCORES = RNG.standard_normal((2, 4, 4))
T = sg.Dim("T")


def _graph(backend):
    x = sg.input("x", (2, 4, 5), dtype="float64")
    s = sg.input("s", (2, T, T), dtype="float64")
    outs = [sg.tril(x), sg.tril(x, -1), sg.triu(x, 2), sg.permute(x, (2, 0, 1)), sg.swapaxes(x, 0, -1)]
    grads = sg.grad(sg.sum(sg.tril(x, 1) * sg.triu(x, -1)), [x])
    causal = sg.greater(sg.expand_dims(sg.arange(T), 0), sg.expand_dims(sg.arange(T), 1))  # j > i
    attention = sg.softmax(sg.masked_fill(s, causal, float("-inf")), axis=-1)
    outs += [*grads, attention, *sg.grad(sg.sum(attention * attention), [s]), sg.arange(T), sg.arange(T, 0, -1)]
    return sg.function([x, s], outs, backend=backend)


@pytest.fixture(scope="module")
def results():
    cache = {}

    def get(backend):
        if backend not in cache:
            cache[backend] = _graph(backend)(X, SCORES)
        return cache[backend]
    return get


def test_masks_permutations_and_causal_softmax_match_torch(results, backend):
    got = results(backend)
    x = torch.tensor(X, requires_grad=True)
    s = torch.tensor(SCORES, requires_grad=True)
    (gx,) = torch.autograd.grad((torch.tril(x, 1) * torch.triu(x, -1)).sum(), [x])
    causal = torch.ones(4, 4, dtype=torch.bool).triu(1)
    attention = torch.softmax(s.masked_fill(causal, float("-inf")), dim=-1)
    (gs,) = torch.autograd.grad((attention * attention).sum(), [s])
    want = [torch.tril(x), torch.tril(x, -1), torch.triu(x, 2), x.permute(2, 0, 1), x.swapaxes(0, -1), gx,
            attention, gs, torch.arange(4), torch.arange(4, 0, -1)]
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w.detach().numpy(), rtol=1e-12, atol=1e-15, err_msg=f"output {k}")
    assert (got[6][:, 0, 1:] == 0).all()  # masked: exact zeros, not exp(-huge)


@pytest.mark.parametrize("args", [(5,), (2, 9), (9, 2, -3), (0.5, 2.0, 0.25), (3, 3), (-2.5, 1)])
def test_arange_matches_torch(args):
    got = sg.function([], sg.arange(*args), backend="numpy")()
    want = torch.arange(*args)
    assert got.dtype == want.numpy().dtype
    np.testing.assert_array_equal(got, want.numpy())


def test_bad_arguments_name_the_op():
    with pytest.raises(ValueError, match="arange: step must not be zero"):
        sg.arange(0, 3, 0)
    with pytest.raises(ValueError, match="arange: stop 1 is not reached from start 4 by step 1"):
        sg.arange(4, 1)
    with pytest.raises(TypeError, match="arange: a length of Dims must divide exactly"):
        sg.arange(T, 0, -2)
    with pytest.raises(ValueError, match="tril: the input needs at least 2 axes"):
        sg.tril(sg.input("v", (3,)))
    with pytest.raises(TypeError, match="triu: diagonal must be an int"):
        sg.triu(sg.input("m", (3, 3)), 0.5)
