"""User-defined ops: sympy elementwise ops (derivatives for free) and sg.Function."""

import functools

import numpy as np
import pytest
import sympy
import torch
import torch.nn.functional as TF

import symgrad as sg
from symgrad.ir.elementwise import ARGS, OUT, partial_derivative
from helpers import MySquare, assert_close

softplus = sg.elementwise("log_one_plus_exp", lambda x: sympy.log(1 + sympy.exp(x)))

_a, _b = sympy.symbols("a b")
# The sympy-expression form: operands are the named symbols, sorted by name.
smooth_mix = sg.elementwise("smooth_mix", _a * sympy.tanh(_b) + sympy.exp(-_a ** 2) / (1 + _b ** 2))
# Explicit operand order.
ratio = sg.elementwise("ratio_ba", _b / (1 + _a ** 2), args=[_b, _a])


class ScaledCube(sg.Function):
    """A Function with a non-value argument and two value inputs; backward returns None for the scale."""

    @staticmethod
    def forward(ctx, x, scale, y):
        ctx.save_for_backward(x, y)
        ctx.scale = scale
        return scale * x * x * x + y

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved
        return 3 * ctx.scale * x * x * g, None, g


class WrongBackward(sg.Function):
    """Its backward is deliberately 'wrong' (returns 7*g): proves sg.grad uses it, not the forward."""

    @staticmethod
    def forward(ctx, x):
        return sg.sin(x)

    @staticmethod
    def backward(ctx, g):
        return 7 * g


@functools.lru_cache(maxsize=None)
def _compiled(backend):
    """All custom-op graphs of this file in one compiled function per backend."""
    x = sg.input("x", (3, 4), dtype="float64")
    y = sg.input("y", (4,), dtype="float64")
    g = sg.input("g", (3, 4), dtype="float64")
    outs = []
    for f in (lambda: softplus(x), lambda: smooth_mix(x, y), lambda: ratio(y, x), lambda: MySquare.apply(x),
              lambda: ScaledCube.apply(x, 0.5, y), lambda: WrongBackward.apply(x)):
        out = f()
        gx, gy = sg.grad(out, [x, y], grad_output=g)
        # Second order through the custom backward: d/dx <gx, 1>.
        (hx,) = sg.grad(sg.sum(gx), [x])
        outs += [out, gx, gy, hx]
    return sg.function([x, y, g], outs, backend=backend)


def _run(backend):
    rng = np.random.default_rng(3)
    xv, yv, gv = rng.standard_normal((3, 4)), rng.standard_normal(4), rng.standard_normal((3, 4))
    results = _compiled(backend)(xv, yv, gv)
    return xv, yv, gv, [results[k:k + 4] for k in range(0, len(results), 4)]


def _torch(fn, xv, yv, gv):
    x = torch.tensor(xv, requires_grad=True)
    y = torch.tensor(yv, requires_grad=True)
    out = fn(x, y)
    gx, gy = torch.autograd.grad(out, [x, y], torch.tensor(gv), create_graph=True, allow_unused=True)
    gy = torch.zeros_like(y) if gy is None else gy
    (hx,) = torch.autograd.grad(gx.sum(), [x], allow_unused=True) if gx.requires_grad else (None,)
    hx = torch.zeros_like(x) if hx is None else hx
    return [t.detach().numpy() for t in (out, gx, gy, hx)]


REFERENCES = {
    "log_one_plus_exp": lambda x, y: TF.softplus(x),
    "smooth_mix": lambda x, y: x * torch.tanh(y) + torch.exp(-x ** 2) / (1 + y ** 2),
    # ratio = b / (1 + a**2) with operands ordered (b, a), applied as ratio(y, x).
    "ratio_ba": lambda x, y: y / (1 + x ** 2),
    "MySquare": lambda x, y: x * x,
    "ScaledCube": lambda x, y: 0.5 * x ** 3 + y,
}


@pytest.mark.parametrize("index, name", list(enumerate(REFERENCES)))
def test_custom_op_matches_torch(backend, index, name):
    xv, yv, gv, results = _run(backend)
    want = _torch(REFERENCES[name], xv, yv, gv)
    for label, got, ref in zip(("out", "grad x", "grad y", "hess x"), results[index], want):
        assert_close(got, ref, 1e-10, 1e-12, f"{name} {label} ({backend})")


def test_user_backward_is_used_not_the_forward(backend):
    xv, yv, gv, results = _run(backend)
    out, gx, gy, hx = results[5]
    np.testing.assert_allclose(out, np.sin(xv), rtol=1e-12)
    np.testing.assert_allclose(gx, 7 * gv, rtol=1e-12)   # not cos(x) * g
    np.testing.assert_array_equal(gy, np.zeros(4))
    np.testing.assert_array_equal(hx, np.zeros((3, 4)))


def test_softplus_derivative_is_derived_in_terms_of_output():
    """d softplus = sigmoid(x) = 1 - exp(-y): derived by sympy, rewritten to reuse the output."""
    d = partial_derivative("log_one_plus_exp", 0)
    x = ARGS[0]
    assert sympy.simplify(d.subs(OUT, sympy.log(1 + sympy.exp(x))) - 1 / (1 + sympy.exp(-x))) == 0


def test_named_symbols_become_operands_in_sorted_order():
    assert smooth_mix.op.arity == 2
    assert smooth_mix.op.expr == ARGS[0] * sympy.tanh(ARGS[1]) + sympy.exp(-ARGS[0] ** 2) / (1 + ARGS[1] ** 2)
    assert ratio.op.expr == ARGS[0] / (1 + ARGS[1] ** 2)


def test_redefining_same_expression_is_idempotent_different_is_refused():
    again = sg.elementwise("log_one_plus_exp", lambda x: sympy.log(1 + sympy.exp(x)))
    assert again.op is softplus.op
    with pytest.raises(ValueError, match="log_one_plus_exp"):
        sg.elementwise("log_one_plus_exp", lambda x: sympy.log(2 + sympy.exp(x)))
    with pytest.raises(ValueError, match="softplus"):  # a built-in's name is taken too
        sg.elementwise("softplus", lambda x: sympy.log(1 + sympy.exp(x)))


def test_elementwise_definition_errors():
    with pytest.raises(ValueError, match="identifier"):
        sg.elementwise("not a name", lambda x: x)
    c = sympy.Symbol("c")
    with pytest.raises(ValueError, match="c"):
        sg.elementwise("uses_stray", _a * c, args=[_a])
    with pytest.raises(TypeError, match="log_one_plus_exp.*2"):
        softplus(sg.input("x", (3,)), sg.input("y", (3,)))


def test_elementwise_scalar_operand_and_dtype():
    x = sg.input("x", (3,))
    out = smooth_mix(x, 2.0)
    assert out.dtype == "float32" and out.shape == (3,)
    f = sg.function([x], out, backend="numpy")
    xv = np.array([0.1, -0.5, 1.0], np.float32)
    want = xv * np.tanh(2.0) + np.exp(-xv ** 2) / 5
    np.testing.assert_allclose(f(xv), want, rtol=1e-6)


def test_function_errors():
    class NoValue(sg.Function):
        @staticmethod
        def forward(ctx, x):
            return 3.0

    class TooMany(sg.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g, g

    class BadShape(sg.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return sg.sum(g, axis=0, keepdims=True) @ sg.input("junk", (4, 5))

    x = sg.input("x", (3, 4))
    with pytest.raises(TypeError, match="NoValue.forward"):
        NoValue.apply(x)
    with pytest.raises(TypeError, match="TooMany.backward returned 2"):
        sg.grad(sg.sum(TooMany.apply(x)), [x])
    with pytest.raises(ValueError, match=r"BadShape.backward.*\[1,5\].*\[3,4\]"):
        sg.grad(sg.sum(BadShape.apply(x)), [x])


def test_custom_node_prints_its_name():
    x = sg.input("x", (3,))
    graph = sg.Graph([x], [MySquare.apply(x)])
    assert "custom[MySquare]" in str(graph)


def test_backward_may_return_a_smaller_broadcastable_gradient():
    """A backward that returns a scalar for a [3] input: spread to the input's shape."""

    class SumScaled(sg.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return sg.sum(g) * 2

    x = sg.input("x_small", (3,), dtype="float64")
    (gx,) = sg.grad(sg.sum(SumScaled.apply(x) * sg.constant(np.array([1.0, 2.0, 3.0]))), [x])
    assert gx.shape == (3,)
    np.testing.assert_array_equal(sg.function([x], gx, backend="numpy")(np.ones(3)), [12.0, 12.0, 12.0])


gelu = sg.elementwise("gelu_erf", lambda x: x / 2 * (1 + sympy.erf(x / sympy.sqrt(2))))


def test_gelu_with_erf_matches_torch(backend):
    """A user op calling a function NumPy lacks (erf): value, gradient and second derivative vs torch."""
    x = sg.input("x_gelu", (7,), dtype="float64")
    (gx,) = sg.grad(sg.sum(gelu(x)), [x])
    (hx,) = sg.grad(sg.sum(gx), [x])
    xv = np.linspace(-3, 3, 7) + 0.05
    got = sg.function([x], [gelu(x), gx, hx], backend=backend)(xv)
    t = torch.tensor(xv, requires_grad=True)
    y = TF.gelu(t)
    (d1,) = torch.autograd.grad(y.sum(), t, create_graph=True)
    (d2,) = torch.autograd.grad(d1.sum(), t)
    for label, a, b in zip(("out", "grad", "second"), got, (y, d1, d2)):
        assert_close(a, b.detach().numpy(), 1e-10, 1e-12, f"gelu {label} ({backend})")
