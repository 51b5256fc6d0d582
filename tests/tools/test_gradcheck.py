"""sg.gradcheck, and custom ops / sg.elementwise / second derivatives compiled on every backend."""

import numpy as np
import pytest
import sympy
import torch

import symgrad as sg
from symgrad import nn
from symgrad.ir.elementwise import ARGS, define

from helpers import MySquare

torch.set_num_threads(1)  # a 2-core machine shared by parallel runs: torch's thread pool only contends


class BadSquare(sg.Function):
    """x * x with a planted wrong backward (3x instead of 2x)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x * g


softplus = sg.elementwise("gc_softplus", lambda x: sympy.log(1 + sympy.exp(x)))
# An elementwise op whose VJP is deliberately wrong: d sin = cos, planted as -cos.
bad_sin_op = define("gc_bad_sin", sympy.sin(ARGS[0]), 1, "float",
                    vjp=lambda node, g, wants: [-g * sg.cos(node.inputs[0])])


def bad_sin(x):
    return sg.api.functional.apply_elementwise(bad_sin_op, [x])


def test_gradcheck_passes_on_correct_ops(backend, rng):
    labels = rng.integers(0, 4, 3)
    assert sg.gradcheck(lambda x, w, y: sg.cross_entropy(sg.tanh(x @ w), y),
                        [rng.standard_normal((3, 5)), rng.standard_normal((5, 4)), labels], backend=backend)
    assert sg.gradcheck(lambda a, b: (MySquare.apply(a) * softplus(b), sg.softmax(a, axis=1)),
                        [rng.standard_normal((2, 3)), rng.standard_normal((2, 3))], backend=backend)


def test_gradcheck_names_a_planted_wrong_custom_backward(rng):
    x = rng.standard_normal(4)
    with pytest.raises(sg.GradcheckError) as info:
        sg.gradcheck(lambda x: sg.sum(sg.exp(BadSquare.apply(x)) * 0.5), [x])
    message = str(info.value)
    assert "input 'x'" in message and "input element (0,)" in message
    assert "BadSquare (a custom Function's backward)" in message
    assert "MySquare" not in message
    assert sg.gradcheck(lambda x: sg.sum(sg.exp(BadSquare.apply(x)) * 0.5), [x], raise_exception=False) is False


def test_gradcheck_names_a_wrong_op_vjp_and_the_disagreeing_element(rng):
    a, b = rng.standard_normal((2, 2)), rng.standard_normal(2)
    with pytest.raises(sg.GradcheckError, match=r"input 'b' \(input 1\).*op 'gc_bad_sin'"):
        sg.gradcheck(lambda a, b: sg.tanh(a) + bad_sin(b), [a, b])


def test_gradcheck_on_a_graph_and_its_argument_checks(rng):
    x = sg.input("x", (3,), "float64")
    graph = sg.Graph([x], [sg.sum(sg.sin(x) * x)])
    assert sg.gradcheck(graph, [rng.standard_normal(3)])
    x32 = sg.input("x32", (3,))
    with pytest.raises(TypeError, match="float64"):
        sg.gradcheck(sg.Graph([x32], [sg.sum(x32)]), [np.zeros(3)])
    with pytest.raises(ValueError, match="takes 1 inputs"):
        sg.gradcheck(graph, [np.zeros(3), np.zeros(3)])


def test_custom_op_and_elementwise_train_like_torch(backend, rng):
    """MySquare and a sympy-defined softplus inside a compiled training step, against torch."""
    w0, xb = rng.standard_normal((4, 3)), rng.standard_normal((6, 4))
    x = sg.input("x", (6, 4), "float64")
    w = sg.param("w", (4, 3), init=w0, dtype="float64")
    loss = sg.mean(softplus(MySquare.apply(x @ w)))
    step = sg.train_step(loss, [w], sg.optim.SGD(lr=0.5), backend=backend)
    tw = torch.tensor(w0, requires_grad=True)
    opt = torch.optim.SGD([tw], lr=0.5)
    for _ in range(5):
        opt.zero_grad()
        tl = torch.nn.functional.softplus((torch.from_numpy(xb) @ tw) ** 2).mean()
        tl.backward()
        opt.step()
        assert step(x=xb) == pytest.approx(tl.item(), abs=1e-10)
    np.testing.assert_allclose(step.params["w"], tw.detach().numpy(), atol=1e-10)


def test_second_derivative_compiles(backend, rng):
    """d/dx of (d/dx sum(softplus(x) * tanh(x)**2)): torch's double backward as the reference."""
    xb = rng.standard_normal(5)
    x = sg.input("x", (5,), "float64")
    y = sg.sum(softplus(x) * sg.tanh(x) ** 2 + MySquare.apply(x) * sg.sin(x))
    (gx,) = sg.grad(y, [x])
    (ggx,) = sg.grad(sg.sum(gx), [x])
    f = sg.function([x], [gx, ggx], backend=backend)
    got_g, got_gg = f(xb)
    tx = torch.tensor(xb, requires_grad=True)
    ty = (torch.nn.functional.softplus(tx) * torch.tanh(tx) ** 2 + tx * tx * torch.sin(tx)).sum()
    (tg,) = torch.autograd.grad(ty, tx, create_graph=True)
    (tgg,) = torch.autograd.grad(tg.sum(), tx)
    np.testing.assert_allclose(got_g, tg.detach().numpy(), atol=1e-10)
    np.testing.assert_allclose(got_gg, tgg.numpy(), atol=1e-10)
    assert sg.gradcheck(lambda x: sg.grad(sg.sum(softplus(x) * sg.tanh(x) ** 2), [x])[0], [xb], backend=backend)


def test_gradcheck_through_a_model(rng):
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    assert sg.gradcheck(lambda x: model(x), [rng.standard_normal((2, 3))])
