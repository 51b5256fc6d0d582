"""Chain composition (symgrad.passes.chains) leaves a chain as its nodes when sympy cannot compose
it: clip(log(clip(x, -2, 1.5))) composes log of the inlined bound -2, a complex number that the
outer clip's Piecewise cannot compare (sympy raised TypeError, and the C compile failed with it)."""

import contextlib
import signal

import numpy as np
import pytest
import sympy
import torch

import symgrad as sg
from symgrad.ir import rounding


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


@contextlib.contextmanager
def _within(seconds: int):
    """Raise where the body runs longer than `seconds` (sympy is Python: SIGALRM interrupts it), so
    a composition that hangs fails the test instead of the whole run."""
    def expired(*_):
        raise TimeoutError(f"still running after {seconds} s")
    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_rounded_branch_composes_in_bounded_time():
    """softplus(round(relu(x))): composing it folds relu's branches through the rounding, leaving
    round(0) in one; unevaluated, sympy's comparison of softplus's threshold with it recursed for
    minutes (the fuzzer: seed 71, 6,000 graphs, batch 17). The rounding of an exact number now
    evaluates, and the chain compiles as torch computes it, its gradient (zero) included."""
    x = sg.input("x", (4, 2, 4), dtype="float64")
    out = sg.floor(sg.softplus(sg.round(sg.relu(sg.tanh(x))))) ** -2.0
    (grad,) = sg.grad(sg.sum(out), [x])
    values = np.random.default_rng(0).standard_normal((4, 2, 4)) * 3
    with _within(60):
        got = sg.function([x], [out, grad], backend="c")(values)
    xt = torch.tensor(values, requires_grad=True)
    want = torch.floor(torch.nn.functional.softplus(torch.round(torch.relu(torch.tanh(xt))))) ** -2.0
    (want_grad,) = torch.autograd.grad(want.sum(), [xt])
    np.testing.assert_array_equal(got[0], want.detach().numpy())
    np.testing.assert_array_equal(got[1], want_grad.numpy())


@pytest.mark.parametrize("name", ["round", "trunc"])
def test_rounding_an_exact_number_evaluates_as_numpy_does(name):
    """round and trunc of a rational are the integer NumPy gives (ties to even; toward zero),
    except where that is -0.0, which no sympy integer is: those stay unevaluated."""
    function, reference = getattr(rounding, {"round": "round_half_even", "trunc": "trunc"}[name]), \
        {"round": np.round, "trunc": np.trunc}[name]
    for numerator in range(-11, 12):
        for denominator in (1, 2, 3, 4):
            value = sympy.Rational(numerator, denominator)
            got, want = function(value), reference(numerator / denominator)
            if want == 0 and np.signbit(want):
                assert isinstance(got, function), (value, got)
            else:
                assert got == int(want) and got.is_Integer, (value, got, want)


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_a_chain_whose_factor_underflows_keeps_its_value(backend):
    """sign(gelu_tanh(x)): sympy composes it to sign(x) (gelu is x times a positive factor), but
    the factor underflows to 0 below x = -30 or so and is NaN at -inf, where the chain gives 0 and
    sign(x) -1 (the fuzzer: seed 5150, batch 15). A composed form must keep the finite values the
    chain gives, not only its NaNs and infinities."""
    x = sg.input("x", (8,), dtype="float64")
    out = sg.sign(sg.nn.functional.gelu(x, approximate="tanh"))
    values = np.array([-372.5, -np.inf, -40.0, -1.0, -0.0, 0.5, np.nan, 3.0])
    got = sg.function([x], out, backend=backend)(values)
    want = torch.sign(torch.nn.functional.gelu(torch.from_numpy(values), approximate="tanh"))
    np.testing.assert_array_equal(got, want.numpy())
