"""pow where torch's meaning is not IEEE pow's: a Python exponent's fast paths, the masked gradients.

torch computes `x ** 0.5` as sqrt(x) (NaN at -inf, -0.0 at -0.0, where IEEE pow gives inf and
+0.0), and the gradient of `x ** e` as e * x ** (e - 1) with that same fast path (1.5 * sqrt(x)
for e = 1.5). The gradient of x ** y in y is g * where(x == 0 & y >= 0, 0, x**y * log(x)): the
mask is on the factor, so it is NaN where the cotangent g is infinite or NaN, where the gradient
in x is where(y == 0, 0, g * ...), 0 whatever g is. The fuzzer (tests/test_fuzz.py, seed 7) found
all three: NaN against 0 at x = -inf, and at x = 0 under an infinite cotangent.

Everything is float64, one graph per backend, compared with torch's values: NaN where torch has
NaN, the same infinities, the same sign of zero, and close elsewhere.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import symgrad as sg

NAN, INF = float("nan"), float("inf")
X = np.array([-INF, -2.5, -1.0, -0.0, 0.0, 0.3, 1.0, 2.5, INF, NAN])
EXPONENTS = (0.5, 1.5, 2.5, 2.0, 3.0, -1.0, -2.0, 0.0, 1.0, 1e-8)
# tensor exponents: every pair of these bases and exponents, under finite, infinite and NaN cotangents
BASES = np.array([-INF, -2.0, -0.0, 0.0, 0.5, 2.0, INF, NAN])
POWERS = np.array([-1.5, -1.0, 0.0, 0.5, 1.0, 2.0, INF, NAN])
COTANGENTS = np.array([1.5, -INF, INF, NAN])


def _grid():
    b, p, c = np.meshgrid(BASES, POWERS, COTANGENTS, indexing="ij")
    return b.ravel(), p.ravel(), c.ravel()


def _torch():
    want = []
    for e in EXPONENTS:
        x = torch.tensor(X, requires_grad=True)
        y = x ** e
        want += [y.detach().numpy(), torch.autograd.grad(y.sum(), x)[0].numpy()]
    b, p, c = (torch.tensor(a, requires_grad=True) for a in _grid())
    y = torch.pow(b, p)
    want += [y.detach().numpy(), *(g.numpy() for g in torch.autograd.grad(y, [b, p], grad_outputs=c))]
    return want


def _symgrad(backend):
    x = sg.input("x", X.shape, dtype="float64")
    outputs = []
    for e in EXPONENTS:
        y = x ** e
        outputs += [y, *sg.grad(sg.sum(y), [x])]
    n = len(_grid()[0])
    b, p, c = (sg.input(name, (n,), dtype="float64") for name in ("b", "p", "c"))
    y = b ** p
    outputs += [y, *sg.grad(sg.sum(y * c), [b, p])]
    return [np.asarray(r) for r in sg.function([x, b, p, c], outputs, backend=backend)(X, *_grid())]


@pytest.fixture(scope="module")
def expected():
    return _torch()


@pytest.fixture(scope="module")
def results():
    return {}


def _names():
    names = []
    for e in EXPONENTS:
        names += [f"x ** {e}", f"d(x ** {e})/dx"]
    return names + ["pow(b, p)", "d pow(b, p)/db", "d pow(b, p)/dp"]


@pytest.mark.parametrize("k, name", list(enumerate(_names())))
def test_pow_matches_torch_at_special_values(results, expected, backend, k, name):
    if backend not in results:
        results[backend] = _symgrad(backend)
    got, want = results[backend][k], expected[k]
    assert got.shape == want.shape, name
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{name} on {backend}: NaN")
    same = ~np.isnan(want)
    np.testing.assert_array_equal(np.signbit(got[same]), np.signbit(want[same]), err_msg=f"{name}: sign")
    np.testing.assert_allclose(got[same], want[same], rtol=1e-12, atol=0, err_msg=f"{name} on {backend}")
