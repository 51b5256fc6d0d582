"""erf, log1p, softplus, gelu, sign, rounding, clip, var, std, logsumexp, prod against torch.

Every function is an output of one graph per backend (one C build), evaluated in
float64 at ordinary and special values (+-0, +-inf, NaN, ties of rounding), and
so is its gradient (of sum(f(x) * cot)); finite differences check the
differentiable ones at smooth points.
"""

from __future__ import annotations

import numpy as np
import pytest
import sympy
import torch

import symgrad as sg
from symgrad.ir.elementwise import partial_derivative

NAN, INF = float("nan"), float("inf")
X = np.array([-INF, -30.0, -2.5, -1.5, -0.5, -0.0, 0.0, 0.3, 0.5, 1.5, 2.5, 25.0, INF, NAN])
M = np.random.default_rng(3).standard_normal((3, 5))
ROWS = np.array([[1.0, 2.0, 3.0, 4.0], [-INF, -INF, -INF, -INF], [0.0, INF, 1.0, 2.0], [1.0, NAN, 0.0, 0.0]])

# name -> (symgrad on a graph value, torch on a tensor)
POINTWISE = {
    "erf": (sg.erf, torch.erf),
    "log1p": (sg.log1p, torch.log1p),
    "softplus": (sg.softplus, torch.nn.functional.softplus),
    "softplus_beta": (lambda x: sg.softplus(x, beta=2.0, threshold=5.0),
                      lambda x: torch.nn.functional.softplus(x, beta=2.0, threshold=5.0)),
    "gelu": (sg.gelu, torch.nn.functional.gelu),
    "gelu_tanh": (lambda x: sg.gelu(x, approximate="tanh"),
                  lambda x: torch.nn.functional.gelu(x, approximate="tanh")),
    "sign": (sg.sign, torch.sign),
    "floor": (sg.floor, torch.floor),
    "ceil": (sg.ceil, torch.ceil),
    "round": (sg.round, torch.round),
    "trunc": (sg.trunc, torch.trunc),
    "clip": (lambda x: sg.clip(x, -1.5, 2.0), lambda x: torch.clamp(x, -1.5, 2.0)),
    "clip_min": (lambda x: sg.clip(x, min=0.3), lambda x: torch.clamp(x, min=0.3)),
    "clip_crossed": (lambda x: sg.clip(x, 1.0, -1.0), lambda x: torch.clamp(x, 1.0, -1.0)),
}
# name -> (symgrad, torch) on a matrix, along axes
STATISTICS = {
    "var": (lambda m: sg.var(m, axis=1), lambda m: torch.var(m, dim=1)),
    "var_all_biased": (lambda m: sg.var(m, correction=0), lambda m: torch.var(m, correction=0)),
    "std_keep": (lambda m: sg.std(m, axis=0, keepdims=True), lambda m: torch.std(m, dim=0, keepdim=True)),
    "logsumexp": (lambda m: sg.logsumexp(m, axis=1), lambda m: torch.logsumexp(m, dim=1)),
    "logsumexp_all": (lambda m: sg.logsumexp(m), lambda m: torch.logsumexp(m, dim=(0, 1))),
    "prod": (lambda m: sg.prod(m, axis=1), lambda m: torch.prod(m, dim=1)),
    "prod_keep": (lambda m: sg.prod(m, axis=0, keepdims=True), lambda m: torch.prod(m, dim=0, keepdim=True)),
    "prod_all": (lambda m: sg.prod(m), lambda m: torch.prod(m)),
}
# special rows: a -inf row, a +inf, a NaN; for prod, rows with no, one and two zeros (whose
# gradients torch computes without dividing by them)
ZEROS = np.array([[1.5, -2.0, 0.5, 3.0, -0.7], [1.5, 0.0, 2.0, -1.0, 0.3], [0.0, 2.0, -0.0, 1.1, 4.0]])
STAT_INPUTS = {"logsumexp": ROWS, "prod": ZEROS, "prod_keep": ZEROS}


def _graph(backend):
    x = sg.input("x", (len(X),), dtype="float64")
    m = sg.input("m", M.shape, dtype="float64")
    rows = sg.input("rows", ROWS.shape, dtype="float64")
    zeros = sg.input("zeros", ZEROS.shape, dtype="float64")
    outs = []
    for fn, _ in POINTWISE.values():
        y = fn(x)
        outs += [y, *sg.grad(sg.sum(y * 0.75), [x])]
    for name, (fn, _) in STATISTICS.items():
        source = {"logsumexp": rows, "prod": zeros, "prod_keep": zeros}.get(name, m)
        y = fn(source)
        outs += [y, *sg.grad(sg.sum(y * 0.75), [source])]
    return sg.function([x, m, rows, zeros], outs, backend=backend)


@pytest.fixture(scope="module")
def results():
    cache = {}

    def get(backend):
        if backend not in cache:
            cache[backend] = iter(_graph(backend)(X, M, ROWS, ZEROS))
            cache[backend] = list(cache[backend])
        return cache[backend]
    return get


def _torch(fn, values):
    t = torch.tensor(values, requires_grad=True)
    y = fn(t)
    (g,) = torch.autograd.grad((y * 0.75).sum(), [t])
    return y.detach().numpy(), g.numpy()


def _cases():
    for name, (_, fn) in POINTWISE.items():
        yield name, fn, X
    for name, (_, fn) in STATISTICS.items():
        yield name, fn, STAT_INPUTS.get(name, M)


@pytest.mark.parametrize("k, name", list(enumerate(name for name, _, _ in _cases())))
def test_values_and_gradients_match_torch(results, backend, k, name):
    _, fn, values = list(_cases())[k]
    got_value, got_grad = results(backend)[2 * k: 2 * k + 2]
    want_value, want_grad = _torch(fn, values)
    np.testing.assert_allclose(got_value, want_value, rtol=1e-12, atol=1e-12, equal_nan=True, err_msg=f"{name} value")
    np.testing.assert_allclose(got_grad, want_grad, rtol=1e-10, atol=1e-12, equal_nan=True, err_msg=f"{name} grad")


def test_rounding_ties_go_to_even_and_signed_zeros_stay(results, backend):
    rounded = dict(zip(POINTWISE, results(backend)[0::2]))["round"]
    assert rounded[X == 0.5] == 0.0 and rounded[X == 1.5] == 2.0 and rounded[X == 2.5] == 2.0
    trunc = dict(zip(POINTWISE, results(backend)[0::2]))["trunc"]
    assert np.signbit(trunc[X == -0.5]).all()  # trunc(-0.5) = -0.0, as torch


@pytest.mark.parametrize("name", ["erf", "log1p", "softplus", "gelu", "gelu_tanh", "clip"])
def test_gradients_match_finite_differences(name):
    fn = POINTWISE[name][0]
    sg.gradcheck(lambda x: fn(x), [np.array([-2.1, -0.7, 0.2, 0.9, 1.7])])


def test_statistics_match_finite_differences():
    sg.gradcheck(lambda m: sg.std(m, axis=1) + sg.logsumexp(m, axis=1) + sg.prod(m, axis=1), [M])


def test_prod_second_order_matches_torch_where_elements_are_zero():
    """d/dm of (dL/dm . v) for L = sum(prod(m, axis=1) * w): the product tree's own gradients."""
    rng = np.random.default_rng(5)
    v, w = rng.standard_normal(ZEROS.shape), rng.standard_normal(ZEROS.shape[0])
    t = torch.tensor(ZEROS, requires_grad=True)
    (g,) = torch.autograd.grad((torch.prod(t, dim=1) * torch.tensor(w)).sum(), [t], create_graph=True)
    (want,) = torch.autograd.grad((g * torch.tensor(v)).sum(), [t])
    m = sg.input("m", ZEROS.shape, dtype="float64")
    (first,) = sg.grad(sg.sum(sg.prod(m, axis=1) * sg.constant(w, "float64")), [m])
    (second,) = sg.grad(sg.sum(first * sg.constant(v, "float64")), [m])
    (got,) = sg.function([m], [second], backend="numpy")(ZEROS)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-12, atol=1e-12)


def test_prod_of_nothing_is_one_and_symbolic_axes_are_refused():
    e = sg.input("e", (3, 0), dtype="float64")
    (got,) = sg.function([e], [sg.prod(e, axis=1)], backend="numpy")(np.zeros((3, 0)))
    np.testing.assert_array_equal(got, torch.prod(torch.zeros((3, 0)), dim=1).numpy())
    with pytest.raises(ValueError, match=r"prod: the reduced axes \[0\] of x \[B,3\] must have fixed sizes"):
        sg.prod(sg.input("x", (sg.Dim("B"), 3)), axis=0)


def test_integer_inputs_round_to_themselves_and_clip_as_integers():
    i = sg.input("i", (4,), dtype="int32")
    f = sg.function([i], [sg.floor(i), sg.round(i), sg.clip(i, 0, 2), sg.sign(i)], backend="numpy")
    values = np.array([-3, 0, 1, 7], np.int32)
    floor, rounded, clipped, sign = f(values)
    assert floor.dtype == np.int32 and (floor == values).all() and (rounded == values).all()
    np.testing.assert_array_equal(clipped, torch.clamp(torch.tensor(values), 0, 2).numpy())
    np.testing.assert_array_equal(sign, torch.sign(torch.tensor(values)).numpy())


def test_bad_arguments_are_refused_with_the_op_named():
    x = sg.input("x", (3,))
    with pytest.raises(ValueError, match="gelu: approximate must be 'none' or 'tanh', got 'fast'"):
        sg.gelu(x, approximate="fast")
    with pytest.raises(ValueError, match="clip: give min, max or both"):
        sg.clip(x)
    with pytest.raises(ValueError, match="softplus: beta must be positive"):
        sg.softplus(x, beta=0.0)
    with pytest.raises(TypeError, match="erf: argument x must be a graph value"):
        sg.erf(np.ones(3))


def test_a_user_op_with_a_hard_inverse_gets_its_derivative_at_once():
    """GELU's tanh form written by a user: sympy.solve (inverting it) and sympy.simplify (of its
    41-operation derivative) each ran for minutes; both are bounded, and the plain derivative
    is used, which matches torch."""
    c = sympy.sqrt(2 / sympy.pi)
    user_gelu = sg.elementwise("user_gelu_tanh", lambda x: x / 2 * (1 + sympy.tanh(c * (x + sympy.Rational(44715, 10**6) * x**3))))
    x = sg.input("x", (5,), dtype="float64")
    (g,) = sg.grad(sg.sum(user_gelu(x)), [x])
    op = user_gelu(x).op
    assert str(partial_derivative(op.name, 0)) == str(sympy.diff(op.expr, sympy.Symbol("x0", real=True)))
    values = np.array([-2.0, -0.5, 0.0, 0.5, 2.0])
    _, want = _torch(lambda t: torch.nn.functional.gelu(t, approximate="tanh"), values)
    np.testing.assert_allclose(sg.function([x], g, backend="numpy")(values), want / 0.75, rtol=1e-12)


def test_gelu_slope_keeps_its_sign_far_below_zero(backend):
    """gelu'(x) = Phi(x) + x phi(x) is a tiny negative number for x << 0 (torch: x phi(x), its Phi
    being 0 there); sympy's form x phi(x) + erf(x/sqrt 2)/2 + 1/2 summed it to 0 below x = -8.7,
    so an infinite cotangent gave NaN where torch gives -inf (the fuzzer found it). The slope is
    now Phi(-|x|) by erfc: accurate, and torch's wherever torch's own Phi is exact."""
    import math
    xs = np.array([-9.0, -12.5, -28.0, -37.0, -8.0, -3.0, 0.5, 4.0])
    cot = np.array([INF, -INF, INF, 1.0, 1.0, 1.0, 1.0, 1.0])
    t = torch.tensor(xs, requires_grad=True)
    (want,) = torch.autograd.grad(torch.nn.functional.gelu(t), [t], torch.tensor(cot))
    x, c = sg.input("x", xs.shape, dtype="float64"), sg.input("c", xs.shape, dtype="float64")
    (got,) = sg.function([x, c], sg.grad(sg.sum(sg.gelu(x) * c), [x]), backend=backend)(xs, cot)
    np.testing.assert_array_equal(got[:3], want.numpy()[:3])    # -inf, inf, -inf: not NaN
    exact = [math.erfc(abs(v) / math.sqrt(2)) / 2 * (1 if v < 0 else -1) + (v >= 0)
             + v * math.exp(-v * v / 2) / math.sqrt(2 * math.pi) for v in xs]
    np.testing.assert_allclose(got[3:], exact[3:], rtol=1e-13)   # x = -37: 4e-297, sign and all


def test_gelu_tanh_keeps_its_tail_in_float32_and_computes_no_tanh():
    """gelu(x, approximate="tanh") = x/2 (1 + tanh(u)) = x / (1 + exp(-2u)). In float32 the tanh
    form's 1 + tanh(u) cancels to 0 from x = -5.3 on (torch's float32 GELU gives 0 there; the true
    value is -8.4e-11 at x = -6); the op computes the second form, within a few ulp of it in float64
    (and u's rounding) wherever that is normal, and its forward kernel calls exp, not tanh (its C
    loop costs one exp and one division, not a tanh's polynomial as well)."""
    xs = np.concatenate([np.linspace(-9.0, 9.0, 3601), [-12.0, -20.0]]).astype(np.float32)
    wide = xs.astype(np.float64)
    u = np.sqrt(2 / np.pi) * (wide + 0.044715 * wide**3)
    exact = wide / (1 + np.exp(-2 * u))
    assert np.allclose(exact, torch.nn.functional.gelu(torch.tensor(wide), approximate="tanh").numpy(),
                       rtol=1e-12, atol=1e-15)    # the same function
    x = sg.input("x", xs.shape)
    f = sg.function([x], [sg.gelu(x, approximate="tanh")], backend="c")
    (got,) = f(xs)
    normal = np.abs(exact) >= np.finfo(np.float32).tiny
    assert (got[normal] != 0).all() and (np.signbit(got) == np.signbit(xs)).all()
    # exp(-2u) carries u's rounding times |2u| (float32's u is within an ulp or so): a few ulp
    # where u is small, ~130 at x = -8 (2u = -53). The tanh form's 1 + tanh(u) is off by 100%.
    ulp = np.abs(got - exact)[normal] / np.spacing(np.abs(exact[normal]).astype(np.float32))
    bound = 4 + 3 * np.abs(2 * u[normal])
    assert (ulp <= bound).all(), f"{ulp.max():.1f} ulp at x = {xs[normal][(ulp / bound).argmax()]}"
    kernel = [line for line in f.source.splitlines() if "= gelu_tanh(" in line and "const float" in line]
    assert kernel and "sg_expf(" in kernel[0] and "tanh" not in kernel[0].split("/*")[0], kernel
