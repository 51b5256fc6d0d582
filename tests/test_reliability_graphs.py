"""Graph shapes that broke the compiled backends: 0-d reductions beside elementwise ops, two row
groups that read each other's results, and chains deeper than Python's recursion limit.

Compiled results are compared with the NumPy reference backend (and torch where it says more).
"""

import io
import sys

import numpy as np
import pytest
import torch

import symgrad as sg
from symgrad import passes
from symgrad.backends.c import ENTRY, render_source
from symgrad.backends.lower.lowering import RowKernel, lower
from symgrad.ir.fingerprint import fingerprint
from symgrad.ir.graph import Graph

from conftest import BACKENDS

COMPILED = [b for b in BACKENDS if b != "numpy"]
RNG = np.random.default_rng(15)


def _reference(inputs, outputs, values):
    return sg.function(inputs, outputs, backend="numpy")(*values)


@pytest.mark.parametrize("backend", COMPILED)
def test_reduction_without_a_reduced_loop_beside_elementwise_ops(backend):
    """A reduction left with no loop over reduced elements (a 0-d input; reduced axes of size 1) runs
    its fused prologue and epilogue in one C scope: their locals must not share names."""
    x0 = sg.input("x0", ())
    x1 = sg.input("x1", (3, 1))
    x2 = sg.input("x2", (1,))
    outputs = [sg.sum(sg.exp(x0)) * 2,                        # the "redefinition of 'v0'"
               sg.sum(sg.exp(x1) + 1, axis=1) * 2 - sg.reshape(x1, (3,)),  # rows, no reduced loop
               sg.max(sg.tanh(x2) * 3) + 1]
    values = [np.array(0.5, np.float32), RNG.standard_normal((3, 1)).astype(np.float32),
              RNG.standard_normal((1,)).astype(np.float32)]
    got = sg.function([x0, x1, x2], outputs, backend=backend)(*values)
    for g, want in zip(got, _reference([x0, x1, x2], outputs, values)):
        np.testing.assert_allclose(g, want, rtol=1e-6)
    np.testing.assert_allclose(got[0], 2 * np.exp(0.5), rtol=1e-6)


def _two_row_groups():
    """loss = sum(rowsum(exp(x)) * m) * sum(m): the row group of exp and its row sums reads, in the
    gradient, sum(m) * m, which the second row group (over m's one row) computes from those row
    sums. Each group alone is convex; both as kernels would wait for each other."""
    x = sg.input("x", (3, 4))
    m = sg.input("m", (3,))
    loss = sg.sum(sg.sum(sg.exp(x), axis=1) * m) * sg.sum(m)
    (dx,) = sg.grad(loss, [x])
    return [x, m], [loss, dx]


def test_row_groups_that_read_each_other_are_not_both_kept():
    """The lowering keeps no two row groups that each read what the other computes (KeyError)."""
    inputs, outputs = _two_row_groups()
    plan = lower(passes.optimize(Graph(inputs, outputs)), matmul_epilogues=True)
    assert sum(isinstance(k, RowKernel) for k in plan.kernels) == 1


@pytest.mark.parametrize("backend", COMPILED)
def test_loss_and_gradient_of_two_dependent_row_groups(backend):
    inputs, outputs = _two_row_groups()
    values = [RNG.standard_normal((3, 4)).astype(np.float32), RNG.standard_normal(3).astype(np.float32)]
    got = sg.function(inputs, outputs, backend=backend)(*values)
    want = _reference(inputs, outputs, values)
    xt = torch.tensor(values[0], dtype=torch.float64, requires_grad=True)
    mt = torch.tensor(values[1], dtype=torch.float64)
    loss_t = (torch.exp(xt).sum(1) * mt).sum() * mt.sum()
    loss_t.backward()
    for g, w, t in zip(got, want, [loss_t.detach().numpy(), xt.grad.numpy()]):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(g, t, rtol=1e-5, atol=1e-6)


# ---- deep graphs ------------------------------------------------------------------------------------

DEPTH = 1200  # elementwise ops in a row: deeper than Python's default recursion limit (1000)


def _deep_chain():
    """A chain of DEPTH elementwise ops (tanh, then an affine map, in turn) between a parameter
    and a cross-entropy loss, and the same computation in torch."""
    x = sg.input("x", (4, 5))
    y = sg.input("y", (4,), dtype="int64")
    W = sg.param("W", (5,), init=np.linspace(-0.5, 0.5, 5).astype(np.float32))
    h = x + W
    for k in range(DEPTH):
        h = h * 0.999 + 0.001 if k % 2 else sg.tanh(h)
    loss = sg.cross_entropy(h, y)

    def torch_loss(xv, yv):
        Wt = torch.tensor(np.linspace(-0.5, 0.5, 5), dtype=torch.float64, requires_grad=True)
        ht = torch.tensor(xv, dtype=torch.float64) + Wt
        for k in range(DEPTH):
            ht = ht * 0.999 + 0.001 if k % 2 else torch.tanh(ht)
        lt = torch.nn.functional.cross_entropy(ht, torch.tensor(yv))
        lt.backward()
        return lt.item(), Wt.grad.numpy()
    return x, y, W, loss, torch_loss


def test_a_chain_deeper_than_the_recursion_limit_compiles():
    """Autodiff, printing, fingerprinting, the passes, the lowering and the C rendering walk the
    graph without recursion: a chain deeper than the recursion limit goes all the way to C source,
    and the reference backend's loss and gradient match torch's."""
    assert DEPTH > sys.getrecursionlimit()
    x, y, W, loss, torch_loss = _deep_chain()
    (gW,) = sg.grad(loss, [W])
    graph = Graph([x, y], [loss, gW])
    assert fingerprint(graph) is not None

    chain = sg.backward_chain(loss)
    lines = chain.splitlines()
    assert lines[:2] == ["DivBackward", "  SumBackward"]  # the mean over the targets not ignored
    assert sum("TanhBackward" in line for line in lines) == DEPTH // 2
    assert any(line.lstrip().startswith(f"[{DEPTH}]") for line in lines)  # deep lines carry their depth
    assert max(len(line) for line in lines) < 200                          # and no quadratic indentation
    out = io.StringIO()
    sg.print_graph(loss, file=out)
    assert out.getvalue() == chain + "\n"

    source = render_source(lower(passes.optimize(graph), variables=graph.variables, matmul_epilogues=True))
    assert f"int {ENTRY}(" in source and source.count("tanh") >= DEPTH // 2

    xv = RNG.standard_normal((4, 5)).astype(np.float32)
    yv = np.array([0, 1, 2, 4])
    loss_v, gW_v = sg.function([x, y], [loss, gW], backend="numpy")(xv, yv)
    want_loss, want_gW = torch_loss(xv, yv)
    np.testing.assert_allclose(loss_v, want_loss, rtol=1e-4)
    np.testing.assert_allclose(gW_v, want_gW, rtol=1e-3, atol=1e-6)
