"""Every op's value, gradient and Hessian-vector product against torch.autograd.

The case table lives in tests/helpers.py; all cases of one backend are
compiled into one sg.function (one build per backend and dtype). Each case
is checked on two random draws in float64, and in float32 against the
reference (NumPy backend for compiled backends, torch for NumPy itself).
"""

import functools

import numpy as np
import pytest
import torch

import symgrad as sg
from helpers import (BY_NAME, CASE_NAMES, assert_close, bundle, float32_tolerance, output_labels,
                     torch_reference)


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("name", CASE_NAMES)
def test_matches_torch_float64(backend, name, seed):
    case = BY_NAME[name]
    arrays, ours = bundle(backend, "float64").results(name, seed)
    want = torch_reference(case, arrays)
    assert len(ours) == len(want)
    for label, got, ref in zip(output_labels(case), ours, want):
        assert got.dtype == ref.dtype, f"{name} {label}: dtype {got.dtype} != torch {ref.dtype}"
        assert_close(got, ref, rtol=1e-9, atol=1e-12, what=f"{name} {label} ({backend})")


@pytest.mark.parametrize("name", CASE_NAMES)
def test_float32(backend, name):
    """float32 against the NumPy reference (compiled backends) or torch in float32 (NumPy)."""
    case = BY_NAME[name]
    arrays, ours = bundle(backend, "float32").results(name, 3)
    if backend == "numpy":
        want, rtol, atol = torch_reference(case, arrays), 1e-5, 1e-5
    else:
        want = bundle("numpy", "float32").results(name, 3)[1]
        rtol, atol = float32_tolerance(backend, 1e-5, 1e-6)
    assert len(ours) == 1 + sum(a.differentiable for a in case.args)  # value and grads; no HVP
    for label, got, ref in zip(output_labels(case), ours, want):
        assert got.dtype == ref.dtype, f"{name} {label}: dtype {got.dtype} != reference {ref.dtype}"
        assert_close(got, ref, rtol=rtol, atol=atol, what=f"{name} {label} ({backend}, float32)")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_every_case_compiles_together(backend, dtype):
    """No chunk of the shared build may have fallen back to per-case builds."""
    errors = bundle(backend, dtype).errors
    assert not errors, f"chunked build failed: {errors!r}"


def _grad_of_grad_graph(name):
    x = sg.input(f"x_{name}", (7,), dtype="float64")
    fn = getattr(sg, name) if name != "neg" else (lambda v: -v)
    (gx,) = sg.grad(sg.sum(fn(x)), [x])
    (ggx,) = sg.grad(sg.sum(gx), [x])
    (gggx,) = sg.grad(sg.sum(ggx), [x])
    return x, [gx, ggx, gggx]


UNARY_DOMAINS = {"exp": "any", "log": "pos", "sin": "any", "cos": "any", "tanh": "any",
                 "sigmoid": "any", "relu": "away0", "sqrt": "pos", "abs": "away0", "neg": "any"}


@functools.lru_cache(maxsize=None)
def unary_derivatives(backend):
    """First, second and third derivatives of every unary op, in one compiled function."""
    inputs, outputs = [], []
    for name in UNARY_DOMAINS:
        x, outs = _grad_of_grad_graph(name)
        inputs.append(x)
        outputs += outs
    return sg.function(inputs, outputs, backend=backend)


def _torch_grad(d, t):
    """d(sum(d))/dt as torch computes it; zeros where d no longer depends on t."""
    if not d.requires_grad:
        return torch.zeros_like(t)
    (out,) = torch.autograd.grad(d.sum(), t, create_graph=True, allow_unused=True)
    return torch.zeros_like(t) if out is None else out


def test_grad_of_grad_of_each_unary_op(backend):
    from helpers import Arg
    rng = np.random.default_rng(5)
    arrays = [Arg((7,), d).sample(rng, "float64") for d in UNARY_DOMAINS.values()]
    results = unary_derivatives(backend)(*arrays)
    for k, (name, a) in enumerate(zip(UNARY_DOMAINS, arrays)):
        t = torch.tensor(a, requires_grad=True)
        fn = getattr(torch, name)
        d1, = torch.autograd.grad(fn(t).sum(), t, create_graph=True)
        d2 = _torch_grad(d1, t)
        d3 = _torch_grad(d2, t)
        for order, (got, ref) in enumerate(zip(results[3 * k:3 * k + 3], (d1, d2, d3)), 1):
            assert_close(got, ref.detach().numpy(force=True), rtol=1e-9, atol=1e-12, what=f"{name} order {order}")


def test_hessian_of_scalar_function_matches_torch(backend):
    """The full Hessian of f(x, w) = sum(softplus-ish net) via grad of grad, row by row."""
    x = sg.input("x", (3,), dtype="float64")
    w = sg.input("w", (3, 2), dtype="float64")
    f = sg.sum(sg.log(1 + sg.exp(x @ w)) * sg.cos(x @ w)) + sg.sum(x ** 3) / 3
    (gx,) = sg.grad(f, [x])
    rows = [sg.grad(sg.sum(gx * sg.constant(np.eye(3)[i])), [x, w]) for i in range(3)]
    fn = sg.function([x, w], [h for row in rows for h in row], backend=backend)
    rng = np.random.default_rng(9)
    xv, wv = rng.standard_normal(3), rng.standard_normal((3, 2))
    got = fn(xv, wv)

    def tf(xt, wt):
        z = xt @ wt
        return (torch.log(1 + torch.exp(z)) * torch.cos(z)).sum() + (xt ** 3).sum() / 3
    hxx, hxw = torch.autograd.functional.hessian(tf, (torch.tensor(xv), torch.tensor(wv)))[0]
    for i in range(3):
        assert_close(got[2 * i], hxx[i].numpy(), 1e-9, 1e-12, f"d2f/dx dx row {i}")
        assert_close(got[2 * i + 1], hxw[i].numpy(), 1e-9, 1e-12, f"d2f/dx dw row {i}")


@functools.lru_cache(maxsize=None)
def _kinks(backend):
    x = sg.input("kx", (6,), dtype="float64")
    y = sg.input("ky", (6,), dtype="float64")
    m = sg.input("km", (2, 3), dtype="float64")
    g = sg.input("kg", (6,), dtype="float64")
    gm = sg.input("kgm", (2,), dtype="float64")
    outs = []
    for fn in (sg.relu, sg.abs, lambda v: sg.maximum(v, y), lambda v: sg.minimum(v, y)):
        outs.append(sg.grad(fn(x), [x, y], grad_output=g))
    outs.append(sg.grad(sg.max(m, axis=1), [m], grad_output=gm))
    return sg.function([x, y, m, g, gm], [v for grads in outs for v in grads], backend=backend)


def test_kinks_and_ties_match_torch(backend):
    """At the kinks: relu'(0) = abs'(0) = 0; ties split maximum/minimum/max gradients evenly, as torch."""
    xv = np.array([0.0, -1.0, 2.0, 0.0, 3.0, -2.0])
    yv = np.array([0.0, -1.0, 1.0, 5.0, 3.0, -3.0])   # ties at 0, 1, 4
    mv = np.array([[1.0, 1.0, 0.0], [2.0, 2.0, 2.0]])  # ties inside each row
    gv = np.arange(1.0, 7.0)
    got = _kinks(backend)(xv, yv, mv, gv, gv[:2].copy())
    xt, yt = torch.tensor(xv, requires_grad=True), torch.tensor(yv, requires_grad=True)
    mt = torch.tensor(mv, requires_grad=True)
    gt = torch.tensor(gv)
    want = []
    for fn in (torch.relu, torch.abs):
        want.append(torch.autograd.grad(fn(xt), [xt], gt)[0])
        want.append(torch.zeros_like(yt))
    for fn in (torch.maximum, torch.minimum):
        want += torch.autograd.grad(fn(xt, yt), [xt, yt], gt)
    want.append(torch.autograd.grad(torch.amax(mt, dim=1), [mt], gt[:2])[0])
    assert len(got) == len(want)
    for k, (a, b) in enumerate(zip(got, want)):
        assert_close(a, b.numpy(), 0, 0, f"output {k}")


def test_derivatives_reuse_the_forward_output():
    """sigmoid' = y(1-y), exp' = y, tanh' = 1-y**2: sympy's derivative, rewritten in terms of the output.

    sin and cos keep cos(x) / -sin(x): sqrt(1 - y**2) is right only on half the line and is refused.
    """
    import sympy
    from symgrad.ir.elementwise import ARGS, OUT, partial_derivative
    x0 = ARGS[0]
    assert sympy.expand(partial_derivative("sigmoid", 0) - OUT * (1 - OUT)) == 0
    assert partial_derivative("exp", 0) == OUT
    assert sympy.expand(partial_derivative("tanh", 0) - (1 - OUT ** 2)) == 0
    assert partial_derivative("sin", 0) == sympy.cos(x0)
    assert partial_derivative("cos", 0) == -sympy.sin(x0)
    assert partial_derivative("log", 0) == 1 / x0
    # The backward graph reads the forward node itself, not x.
    x = sg.input("x_reuse", (3,), dtype="float64")
    g = sg.input("g_reuse", (3,), dtype="float64")
    for fn in (sg.sigmoid, sg.exp, sg.tanh):
        y = fn(x)
        (gx,) = sg.grad(y, [x], grad_output=g)
        assert any(v is y for v in gx.inputs), f"{fn.__name__}: VJP {gx.op.name}{gx.inputs} does not reuse y"
        assert not any(v is x for v in gx.inputs)
