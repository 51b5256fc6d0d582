"""The seeds' worked examples, exact, and the DESIGN.md API snippet run unchanged.

Each example is the hand calculation a reader can redo: the numbers are
exact in float64, so they are compared with ==.
"""

import functools
import re
from pathlib import Path

import numpy as np
import sympy

import symgrad as sg
from symgrad.ir.elementwise import ARGS, COTANGENT, partial_derivative
from tests.helpers import MySquare


def scalar(name):
    return sg.input(name, (), dtype="float64")


def f64(v):
    return np.array(v, dtype=np.float64)


@functools.lru_cache(maxsize=None)
def _seed_function(backend):
    """All the scalar seed examples in one compiled function (one build per backend)."""
    x, y = scalar("x"), scalar("y")
    loss = (x * y) ** 2
    gx, gy = sg.grad(loss, [x, y])
    a, b, d = scalar("a"), scalar("b"), scalar("d")
    e = (a + b) * d
    ga, gb, gd = sg.grad(e, [a, b, d])
    z_in = scalar("z_in")
    z = z_in * z_in + 3
    (gz,) = sg.grad(z, [z_in])
    p = scalar("p")
    yy = p * p
    c = (yy + 1) + (yy * 2)
    (gp,) = sg.grad(c, [p])
    s = scalar("s")
    (gs,) = sg.grad(sg.sin(s), [s])
    inputs = [x, y, a, b, d, z_in, p, s]
    outputs = [loss, gx, gy, e, ga, gb, gd, z, gz, c, gp, gs]
    return sg.function(inputs, outputs, backend=backend)


def _seed_results(backend):
    out = _seed_function(backend)(f64(2), f64(3), f64(2), f64(3), f64(4), f64(2), f64(2), f64(0.7))
    return [float(v) for v in out]


def test_product_squared(backend):
    """loss = (x*y)**2 at x=2, y=3: dloss/dx = 2*x*y**2 = 36, dloss/dy = 2*x**2*y = 24."""
    loss, gx, gy = _seed_results(backend)[0:3]
    assert (loss, gx, gy) == (36.0, 36.0, 24.0)


def test_sum_times(backend):
    """e = (a+b)*d at 2, 3, 4: de/da = de/db = d = 4, de/dd = a+b = 5."""
    e, ga, gb, gd = _seed_results(backend)[3:7]
    assert (e, ga, gb, gd) == (20.0, 4.0, 4.0, 5.0)


def test_square_plus_three(backend):
    """z = x*x + 3 at 2: z = 7, dz/dx = 4 (two uses of x, contributions summed)."""
    z, gz = _seed_results(backend)[7:9]
    assert (z, gz) == (7.0, 4.0)


def test_two_paths(backend):
    """y = x*x; a = y+1; b = y*2; c = a+b at x=2: dc/dx = (1 + 2) * 2x = 12."""
    c, gp = _seed_results(backend)[9:11]
    assert (c, gp) == (13.0, 12.0)


def test_sin_backward_is_cos(backend):
    """The value: d sin(s)/ds at 0.7 is cos(0.7)."""
    gs = _seed_results(backend)[11]
    assert abs(gs - np.cos(0.7)) <= 1e-15


def test_sin_vjp_expression_is_cos():
    """The derivation: sympy gives cos, and the VJP node computes g*cos(x), nothing else."""
    assert partial_derivative("sin", 0) == sympy.cos(ARGS[0])
    s = sg.input("s_expr", (3,), dtype="float64")
    g = sg.input("g_expr", (3,), dtype="float64")
    (gs,) = sg.grad(sg.sin(s), [s], grad_output=g)
    assert {id(v) for v in gs.inputs} == {id(g), id(s)}   # ids: == on values builds a node
    # The node's defining expression, in terms of its own operands.
    operands = dict(zip(gs.inputs, ARGS))
    expected = sympy.cos(operands[s]) * operands[g]
    assert sympy.simplify(gs.op.expr - expected) == 0, gs.op.expr
    # Rewritten in terms of the derivative's own symbols it is g*cos(x).
    assert sympy.simplify(COTANGENT * partial_derivative("sin", 0) - COTANGENT * sympy.cos(ARGS[0])) == 0


def test_my_square_custom_function():
    """MySquare (sg.Function with ctx.save_for_backward; tests.helpers holds the seeds' class) at 3:
    forward 9, backward 2*3 = 6."""
    x = scalar("x_sq")
    y = MySquare.apply(x)
    (gx,) = sg.grad(y, [x])
    f = sg.function([x], [y, gx], backend="numpy")
    value, grad = f(f64(3))
    assert (float(value), float(grad)) == (9.0, 6.0)


def _design_card() -> Path | None:
    """DESIGN.md where the workspace keeps it (beside the repository), if present."""
    here = Path(__file__).resolve()
    for candidate in (here.parents[2] / "DESIGN.md", here.parents[3] / "shared" / "DESIGN.md"):
        if candidate.exists():
            return candidate
    return None


def _design_snippet() -> str:
    """The API block of DESIGN.md (or its copy below), with backend="c" turned into "numpy"."""
    card = _design_card()
    if card is None:
        code = DESIGN_SNIPPET
    else:
        text = card.read_text()
        section = text[text.index("## The public API"):]
        code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
        assert code == DESIGN_SNIPPET, "DESIGN.md's API snippet changed: update the copy in this test"
    assert 'backend="c"' in code
    return code.replace('backend="c"', 'backend="numpy"')


# The snippet as DESIGN.md states it, kept here too so the test runs on a
# clone without the design card beside it; the two must stay the same.
DESIGN_SNIPPET = '''import numpy as np
import symgrad as sg

B = sg.Dim("B")                                   # symbolic size (a sympy Symbol inside)
x = sg.input("x", (B, 784))                       # float32 unless dtype= is given
y = sg.input("y", (B,), dtype="int64")            # class labels
W = sg.param("W", (784, 10), init="zeros")        # init: "zeros", "normal", "uniform", or an ndarray;
                                                  # dtype="float32" unless given (an ndarray is cast to it)
b = sg.param("b", (10,), init="zeros")

logits = x @ W + b                                # operators: + - * / ** @ unary -, comparisons
loss = sg.cross_entropy(logits, y)                # mean over the batch, as F.cross_entropy

gW, gb = sg.grad(loss, [W, b])                    # symbolic gradients: graph values, differentiable again

f = sg.function([x, y], [loss, gW, gb], backend="c")     # backend: "numpy" | "c" | "cuda"
loss_v, gW_v, gb_v = f(xb, yb)                    # numpy in (positional, in input order), numpy out

step = sg.train_step(loss, params=[W, b], optimizer=sg.optim.SGD(lr=0.1), backend="c")
loss_v = step(x=xb, y=yb)                         # inputs by name; forward + backward + update in one
                                                  # native call; returns the loss as a float
step.params["W"]                                  # numpy array of the current value
step.source                                       # the emitted C / CUDA text
step.module                                       # the imported generated module
'''


def test_design_snippet_runs_with_numpy_backend():
    code = _design_snippet()
    rng = np.random.default_rng(0)
    xb = rng.standard_normal((32, 784)).astype(np.float32)
    yb = rng.integers(0, 10, 32).astype(np.int64)
    namespace = {"xb": xb, "yb": yb}
    exec(compile(code, "DESIGN.md", "exec"), namespace)  # noqa: S102 - the contract, run as written
    # Zero weights: every class equally likely, loss = log(10); the step then moves W.
    assert abs(float(namespace["loss_v"]) - np.log(10)) < 1e-6
    assert namespace["gW_v"].shape == (784, 10) and namespace["gb_v"].shape == (10,)
    onehot = np.eye(10)[yb]
    np.testing.assert_allclose(namespace["gb_v"], (0.1 - onehot).mean(0), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(namespace["gW_v"], xb.T @ (0.1 - onehot) / 32, rtol=1e-4, atol=1e-6)
    step = namespace["step"]
    np.testing.assert_allclose(step.params["W"], -0.1 * namespace["gW_v"], rtol=1e-4, atol=1e-7)
    assert isinstance(step.source, str) and step.source
