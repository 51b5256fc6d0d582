"""sg.var and sg.std for every N and correction against torch: fixed sizes and Dims, values and
gradients, N - correction above, at and below 0 (where torch clamps the divisor at 0).

All cases are outputs of one sg.function per backend (one C build). Where the divisor is 0
torch's gradient depends on the form of the call: with dim=None it is g * (NaN where x == mean,
else inf), with a dim 2 g (x - mean) / (N - correction). Below 0, that second form divides by a
negative number (a finite gradient of an infinite value); symgrad divides by the 0 its value
divides by, which is torch's own gradient at correction = N: the oracle for those cases.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import symgrad as sg

SIZES = (1, 3)
# name -> symgrad axis; torch's dim is None for "all" (its dim=None backward), else the same axes
FORMS = {"all": None, "last": 1, "both": (0, 1)}
FUNCTIONS = {"var": (sg.var, torch.var), "std": (sg.std, torch.std)}


def _data(n: int, kind: str) -> np.ndarray:
    """(2, n): "mixed" has a row of distinct values and a row of equal ones (inf and NaN where
    the divisor is 0), "equal" only equal values."""
    if kind == "equal":
        return np.full((2, n), 0.75)
    return np.array([[0.5, -1.25, 2.0][:n], [0.75] * n])


# (label, N, size is a Dim, dtype, kind of data, forms): fixed and Dim sizes in float64; all-equal
# data where one (2, N) sum of squares is 0; float32 for var over a Dim.
SOURCES = [(f"{kind}{n}{'_dim' if dim else ''}_{dtype}", n, dim, dtype, kind, forms)
           for n in SIZES for dim, dtype, kind, forms in (
               (False, "float64", "mixed", ("all", "last", "both")), (True, "float64", "mixed", ("all", "last")),
               (False, "float64", "equal", ("all", "both")), (True, "float32", "mixed", ("all", "last")))]


def _count(n: int, form: str) -> int:
    return n if form == "last" else 2 * n


def _corrections(fn: str, count: int) -> list:
    """N - correction at 0.5, 0, -0.5 and -2: above, at and below a divisor of 0 (std, whose
    gradient is var's through sqrt, above and below)."""
    return [count - 0.5, count, count + 0.5, count + 2] if fn == "var" else [count - 0.5, count + 2]


CASES = [(fn, source, form, correction)
         for source in SOURCES for form in source[-1] for fn in FUNCTIONS
         for correction in _corrections(fn, _count(source[1], form)) if fn == "var" or source[3] == "float64"]


def _cotangent(k: int, shape) -> np.ndarray:
    """A fixed cotangent with both signs (torch's dim=None gradient at a divisor of 0 is g * inf)."""
    return np.resize(np.array([0.75, -1.5, 0.5]), shape) * (-1) ** k


def _graph(backend: str, n: int):
    """One function of every case over (2, n) data: (case index, output position) pairs and it."""
    N = sg.Dim("N")
    sources = [source for source in SOURCES if source[1] == n]
    inputs = {label: sg.input(label, (2, N if dim else n), dtype=dtype) for label, _, dim, dtype, *_ in sources}
    outs, where = [], {}
    for k, (fn, (label, *_), form, correction) in enumerate(CASES):
        if label not in inputs:
            continue
        x = inputs[label]
        y = FUNCTIONS[fn][0](x, axis=FORMS[form], correction=correction)
        cot = sg.constant(_cotangent(k, (2,) if form == "last" else ()), x.dtype)
        where[k] = len(outs)
        outs += [y, *sg.grad(sg.sum(y * cot), [x])]
    data = [_data(n, kind).astype(dtype) for _, _, _, dtype, kind, _ in sources]
    return where, sg.function(list(inputs.values()), outs, backend=backend), data


@pytest.fixture(scope="module")
def results():
    """results(backend, k): case k's value and gradient, from one call per (backend, N)."""
    cache = {}

    def get(backend, k):
        n = CASES[k][1][1]
        if (backend, n) not in cache:
            where, f, data = _graph(backend, n)
            cache[backend, n] = where, f(*data)
        where, outs = cache[backend, n]
        return outs[where[k]: where[k] + 2]
    return get


def _torch(fn: str, values: np.ndarray, form: str, correction, cot: np.ndarray):
    t = torch.tensor(values, requires_grad=True)
    kwargs = {} if form == "all" else {"dim": FORMS[form]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "degrees of freedom is <= 0": the cases under test
        y = FUNCTIONS[fn][1](t, correction=correction, **kwargs)
        (g,) = torch.autograd.grad((y * torch.tensor(cot, dtype=t.dtype)).sum(), [t])
    return y.detach().numpy(), g.numpy()


def _case_id(case) -> str:
    fn, (label, *_), form, correction = case
    return f"{fn}-{label}-{form}-c{correction}"


@pytest.mark.parametrize("k", range(len(CASES)), ids=[_case_id(c) for c in CASES])
def test_var_and_std_match_torch_for_every_correction(results, backend, k):
    fn, (label, n, _, dtype, kind, _), form, correction = CASES[k]
    values = _data(n, kind).astype(dtype)
    cot = _cotangent(k, (2,) if form == "last" else ())
    got_value, got_grad = results(backend, k)
    count = _count(n, form)
    want_value, _ = _torch(fn, values, form, correction, cot)
    # Below a divisor of 0 torch's gradient with a dim divides by N - correction < 0 (see the
    # module docstring): symgrad's is torch's at correction = N, where that divisor is the 0.
    grad_correction = count if form != "all" and count - correction < 0 else correction
    _, want_grad = _torch(fn, values, form, grad_correction, cot)
    tol = {"float64": 1e-12, "float32": 1e-5}[dtype]
    np.testing.assert_allclose(got_value, want_value, rtol=tol, atol=tol, equal_nan=True, err_msg="value")
    np.testing.assert_allclose(got_grad, want_grad, rtol=tol, atol=tol, equal_nan=True, err_msg="gradient")


def test_a_dim_decides_the_divisor_at_run_time(backend):
    """One compiled var over a Dim, called at sizes on both sides of the correction."""
    N = sg.Dim("N")
    x = sg.input("x", (N,), dtype="float64")
    outs = []
    for axis in (None, 0):
        y = sg.var(x, axis=axis, correction=2)
        outs += [y, *sg.grad(y * -0.5, [x])]
    f = sg.function([x], outs, backend=backend)
    for n in (1, 2, 3, 5):  # N - correction = -1, 0, 1, 3
        values = np.linspace(-1.0, 2.0, n)
        got = f(values)
        for k, form in enumerate(("all", "last")):
            grad_correction = n if form == "last" and n < 2 else 2
            want_value, _ = _torch("var", values[None], form, 2, np.array(-0.5) if form == "all" else np.array([-0.5]))
            _, want_grad = _torch("var", values[None], form, grad_correction,
                                  np.array(-0.5) if form == "all" else np.array([-0.5]))
            np.testing.assert_allclose(got[2 * k], want_value.reshape(got[2 * k].shape), rtol=1e-12,
                                       equal_nan=True, err_msg=f"value, N={n}, {form}")
            np.testing.assert_allclose(got[2 * k + 1], want_grad[0], rtol=1e-12, atol=1e-12,
                                       equal_nan=True, err_msg=f"gradient, N={n}, {form}")


def test_second_order_over_a_dim_matches_torch():
    """d/dx of (dvar/dx . v) through the run-time choice of the mean's path (N - correction > 0)."""
    rng = np.random.default_rng(7)
    values, v = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    t = torch.tensor(values, requires_grad=True)
    (g,) = torch.autograd.grad(torch.std(t, dim=1, correction=1).sum() + torch.var(t, correction=2),
                               [t], create_graph=True)
    (want,) = torch.autograd.grad((g * torch.tensor(v)).sum(), [t])
    B = sg.Dim("B")
    x = sg.input("x", (3, B), dtype="float64")
    direction = sg.input("v", (3, B), dtype="float64")
    (first,) = sg.grad(sg.sum(sg.std(x, axis=1, correction=1)) + sg.var(x, correction=2), [x])
    (second,) = sg.grad(sg.sum(first * direction), [x])
    (got,) = sg.function([x, direction], [second], backend="numpy")(values, v)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-10, atol=1e-12)
