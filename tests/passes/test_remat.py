"""Recompute for the backward (symgrad.passes.remat): cheap forward values copied for the backward.

A GELU MLP of two hidden layers: each activation gelu(h) is read by the next matmul in the forward
and by its weight gradient in the backward, while GELU's derivative reads h, which the backward
holds anyway. After the pass the backward reads copies of the gelu(h), the forward's die with the
forward, the plan's peak holds fewer bytes (the first layer's activation is not held while the
second's backward runs), and every number is the same.
"""

from __future__ import annotations

import numpy as np
import pytest

import symgrad as sg
from symgrad.api.cells import current_value
from symgrad.backends.decide.decisions import decide
from symgrad.backends.lower.lowering import lower
from symgrad.backends.lower.memory import memory_plan
from symgrad.ir.graph import ancestors
from symgrad.passes import optimize
from symgrad.passes import remat as R
from symgrad.passes.pipeline import DEFAULT_PIPELINE

ROWS, IN, HIDDEN, OUT = 512, 64, 128, 10   # each hidden activation: 65536 elements, remat's minimum


@pytest.fixture(scope="module")
def mlp():
    rng = np.random.default_rng(0)
    x = sg.input("x", (ROWS, IN))
    y = sg.input("y", (ROWS,), dtype="int64")
    W1 = sg.param("W1", (IN, HIDDEN), init=(rng.standard_normal((IN, HIDDEN)) / 8).astype(np.float32))
    W2 = sg.param("W2", (HIDDEN, HIDDEN), init=(rng.standard_normal((HIDDEN, HIDDEN)) / 20).astype(np.float32))
    W3 = sg.param("W3", (HIDDEN, OUT), init=(rng.standard_normal((HIDDEN, OUT)) / 20).astype(np.float32))
    hidden = sg.gelu(sg.gelu(x @ W1, approximate="tanh") @ W2, approximate="tanh")
    loss = sg.cross_entropy(hidden @ W3, y)
    step = sg.train_step(loss, [W1, W2, W3], sg.optim.SGD(lr=0.1), backend="numpy")
    data = (rng.random((ROWS, IN), dtype=np.float32), rng.integers(0, OUT, ROWS))
    return step.graph, [W1, W2, W3], loss, data


def _without_remat(graph):
    return optimize(graph, passes=[p for p in DEFAULT_PIPELINE if p[0] != "remat"])


def test_the_backward_reads_its_own_copy_and_the_forward_copy_dies_with_the_forward(mlp):
    graph = mlp[0]
    report: dict = {}
    after = optimize(graph, report=report)
    assert report["passes"][-1]["pass"] == "remat" and report["passes"][-1]["rewrites"] == {"recomputed": 2}
    forward = ancestors(after.outputs)
    gelus = [n for n in after.nodes if n.op.name == "gelu_tanh"]
    assert len(gelus) == 4
    fwd = [g for g in gelus if id(g) in forward]
    bwd = [g for g in gelus if id(g) not in forward]
    assert sorted(id(g.inputs[0]) for g in fwd) == sorted(id(g.inputs[0]) for g in bwd)  # operands held anyway

    def readers(node):  # through views
        out = []
        for u in after.users[id(node)]:
            out += readers(u) if u.op.kind == "movement" else [u]
        return out
    for g in fwd:
        assert all(id(u) in forward for u in readers(g))
    for g in bwd:
        assert readers(g) and not any(id(u) in forward for u in readers(g))
    before = _without_remat(graph)
    assert R.recomputable(before) and not R.recomputable(after)  # a fixed point: nothing left to copy


def test_the_plans_peak_is_smaller_and_no_copy_is_made_of_small_or_random_values(mlp, monkeypatch):
    graph = mlp[0]
    with_copy = memory_plan(lower(optimize(graph))).lower_bound_bytes
    without = memory_plan(lower(_without_remat(graph))).lower_bound_bytes
    assert with_copy <= without - 3 * ROWS * HIDDEN, (with_copy, without)  # most of an activation (4 bytes each) less
    monkeypatch.setattr(R, "MIN_ELEMENTS", ROWS * HIDDEN + 1)
    assert not R.recomputable(_without_remat(graph))


@pytest.mark.parametrize("backend", ["numpy", "c"])
def test_the_numbers_are_the_same(mlp, backend):
    """The same step with and without the copy (NumPy runs the optimized graph here): the losses
    and parameters of 3 steps agree to the last bit on each backend."""
    if backend == "c":
        pytest.importorskip("symgrad.backends.c")
    graph, params, loss, (xb, yb) = mlp
    from symgrad.step.compiled import Compiled
    initial = {p.name: current_value(p) for p in params}
    runs = []
    for g in (optimize(graph), _without_remat(graph)):
        program = Compiled(g, backend, **({"optimize": False}))
        for p in params:  # the parameters are the graph's own, trained by each run: start both from these
            program._write_variable(p.name, initial[p.name])
        losses = [float(program._run([xb, yb])[0]) for _ in range(3)]
        runs.append((losses, {p.name: program._storage[p.name].copy() for p in params}))
    assert runs[0][0] == runs[1][0]
    for name in runs[0][1]:
        np.testing.assert_array_equal(runs[0][1][name], runs[1][1][name])


def test_the_report_names_each_copy_for_the_backward(mlp):
    pytest.importorskip("symgrad.backends.c")
    from symgrad.backends.c import CProgram
    program = CProgram(mlp[0])
    lines = [line for line in str(program.report().decisions).splitlines() if "computed again for the backward" in line]
    assert len(lines) == 2 and all("gelu_tanh" in line and "dies with the forward" in line for line in lines), lines


@pytest.fixture(scope="module")
def layer_norm_mlp():
    """Two residual blocks x + gelu(layer_norm(x) @ up) @ down (a transformer's MLP): each LayerNorm's output
    `xhat * weight + bias` is read by the next matmul and by its weight gradient, while the backward
    holds xhat for LayerNorm's own gradient."""
    rng = np.random.default_rng(1)
    x = sg.input("x", (ROWS, HIDDEN))
    y = sg.input("y", (ROWS,), dtype="int64")
    params, h = [], x
    for k in range(2):
        w = sg.param(f"ln{k}.weight", (HIDDEN,), init=(1 + rng.standard_normal(HIDDEN) / 10).astype(np.float32))
        b = sg.param(f"ln{k}.bias", (HIDDEN,), init=(rng.standard_normal(HIDDEN) / 10).astype(np.float32))
        up = sg.param(f"up{k}", (HIDDEN, 4 * HIDDEN), init=(rng.standard_normal((HIDDEN, 4 * HIDDEN)) / 12).astype(np.float32))
        down = sg.param(f"down{k}", (4 * HIDDEN, HIDDEN), init=(rng.standard_normal((4 * HIDDEN, HIDDEN)) / 24).astype(np.float32))
        h = h + sg.gelu(sg.nn.functional.layer_norm(h, (HIDDEN,), w, b) @ up, approximate="tanh") @ down
        params += [w, b, up, down]
    head = sg.param("head", (HIDDEN, OUT), init=(rng.standard_normal((HIDDEN, OUT)) / 12).astype(np.float32))
    loss = sg.cross_entropy(h @ head, y)
    step = sg.train_step(loss, [*params, head], sg.optim.SGD(lr=0.1), backend="numpy")
    return step.graph


def test_a_layer_norms_output_is_recomputed_late_and_the_peak_falls(layer_norm_mlp):
    """The LayerNorm outputs are copied for the backward with the product they are made of, and the
    kernel order runs each copy only once the weight gradient reading it could otherwise run (run at
    once, as a kernel that frees nothing is, the copy would be held through the forward and spare
    nothing): the plan's peak holds a LayerNorm output fewer than without the copies."""
    graph = layer_norm_mlp
    after = optimize(graph)
    forward = ancestors(after.outputs)
    outputs = [n for n in after.nodes if n.op.name == "add" and n.shape == (ROWS, HIDDEN)
               and any(i.op.name == "variable" and i.attrs["name"].endswith("bias") for i in n.inputs)]
    assert len([n for n in outputs if id(n) in forward]) == 2
    copies = [n for n in outputs if id(n) not in forward]
    assert len(copies) == 2 and all(c.inputs[0].op.name == "mul" for c in copies)  # the product recomputed too
    # Each copy runs after the loss, as late as the weight gradient reading it needs.
    position = {id(n): k for k, n in enumerate(decide(after).order)}
    loss_at = max(position[id(n)] for n in after.outputs)
    assert all(position[id(c)] > loss_at for c in copies), ([position[id(c)] for c in copies], loss_at)
    plan = lower(after)
    with_copies = memory_plan(plan).lower_bound_bytes
    without = memory_plan(lower(_without_remat(graph))).lower_bound_bytes
    assert with_copies <= without - 4 * ROWS * HIDDEN + 4 * ROWS * 2, (with_copies, without)


def test_a_value_reshaped_and_cast_for_its_products_is_recomputed_with_them():
    """Under autocast a transformer MLP's GELU output (float32: the bias is added in float32) is
    reshaped to the product's rows and cast to bfloat16, for the next product and for that
    product's weight gradient: the cast is copied for the backward with the reshape and the GELU
    beneath it (a reshape is made again for nothing), so the backward holds the GELU's input only,
    as it does in float32. Before, the reshape ended the chain and the output was held (the
    bfloat16 nanoGPT step planned 36.8 MiB more: six of them)."""
    rng = np.random.default_rng(2)
    x = sg.input("x", (8, ROWS // 8, IN))
    W1 = sg.param("W1", (HIDDEN, IN), init=(rng.standard_normal((HIDDEN, IN)) / 8).astype(np.float32))
    b1 = sg.param("b1", (HIDDEN,), init=np.zeros(HIDDEN, np.float32))
    W2 = sg.param("W2", (OUT, HIDDEN), init=(rng.standard_normal((OUT, HIDDEN)) / 20).astype(np.float32))
    h = sg.nn.functional.linear(sg.gelu(sg.nn.functional.linear(x, W1, b1), approximate="tanh"), W2)
    step = sg.train_step(sg.sum(h * h), [W1, b1, W2], sg.optim.SGD(lr=0.1), backend="numpy", autocast="bfloat16")
    after = optimize(step.graph)
    forward = ancestors(after.outputs)
    gelus = [n for n in after.nodes if n.op.name == "gelu_tanh"]
    (copy,) = [g for g in gelus if id(g) not in forward]  # the backward's own GELU, reshaped and cast
    (reshaped,) = after.users[id(copy)]
    (cast,) = after.users[id(reshaped)]
    assert (reshaped.op.name, cast.op.name, cast.dtype) == ("reshape", "cast", "bfloat16")
    assert [u.op.name for u in after.users[id(cast)]] in (["matmul"], ["transpose"])  # W2's gradient
