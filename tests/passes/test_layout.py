"""Transposes sunk below the elementwise work that reads them (symgrad.passes.layout).

Each rule keeps the numbers (the graph evaluated before and after, float64: the same operations on
the same elements, a reduction's sums in NumPy's order for the other layout), the rules stop where a full-size operand is in the other
layout, and a convolution -> BatchNorm -> ReLU -> convolution chain, forward and backward, keeps
no transpose of an activation: the channels-last values meet the next convolution's transpose
and cancel."""

from __future__ import annotations

import numpy as np
import pytest

import symgrad as sg
from symgrad.api import functional as F
from symgrad import passes
from symgrad.passes.layout import layout

PERM = (0, 3, 1, 2)   # channels last -> channels first, as conv2d hands back its GEMM's output


def _fired(graph) -> dict:
    counts: dict = {}
    layout(graph, counts=counts)
    return counts


def _same_numbers(graph, inputs, feed):
    """The graph and its layout-rewritten copy give the same outputs on NumPy (to 1e-13: a sum over
    the other layout adds in another order)."""
    want = sg.function(inputs, list(graph.outputs), backend="numpy", optimize=False)(*feed)
    rewritten = layout(graph)
    got = sg.function(inputs, list(rewritten.outputs), backend="numpy", optimize=False)(*feed)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-13, atol=1e-13)
    return rewritten


def _transposes(graph, min_rank: int = 3) -> list:
    return [n for n in graph.nodes if n.op.name == "transpose" and n.ndim >= min_rank]


@pytest.fixture
def nhwc():
    rng = np.random.default_rng(0)
    x = sg.input("x", (2, 5, 6, 4), dtype="float64")             # (N, H, W, C)
    return x, [rng.standard_normal((2, 5, 6, 4))]


def test_elementwise_with_a_small_operand_and_reductions_compute_channels_last(nhwc):
    """relu(transpose(x) * scale + shift) and its per-channel sums over (N, H, W), with and without
    kept axes, and a max over one axis: each computed on x, no 4-axis transpose left before
    the outputs' own."""
    x, feed = nhwc
    t = sg.transpose(x, PERM)                                     # (N, C, H, W)
    scale = sg.constant(np.arange(1.0, 5.0).reshape(4, 1, 1))
    h = sg.relu(t * scale + sg.constant(0.5))
    outs = [sg.sum(h, axis=(0, 2, 3)), sg.sum(h, axis=(0, 2, 3), keepdims=True), sg.max(h, axis=1),
            sg.sum(h, axis=0), sg.argmax(h, axis=1)]
    graph = sg.Graph([x], [o for o in outs])
    fired = _fired(graph)
    assert fired.get("sink_through_elementwise", 0) >= 2 and fired.get("sink_through_reduce", 0) == 5, fired
    rewritten = _same_numbers(graph, [x], feed)
    # what is left transposed: the outputs that keep axes in the other order (small, or the output itself)
    assert all(not any(i.op.name == "transpose" for i in n.inputs) for n in rewritten.nodes
               if n.op.name in ("relu", "sum", "max", "argmax")), rewritten


def test_a_sum_whose_kept_axes_come_out_in_another_order_is_transposed_back():
    """sum over the batch of (N, C, H, W) keeps (C, H, W); from x it keeps (H, W, C): transposed
    (H = W = C, so that only the numbers tell them apart)."""
    x = sg.input("x", (2, 4, 4, 4), dtype="float64")
    feed = [np.random.default_rng(1).standard_normal((2, 4, 4, 4))]
    graph = sg.Graph([x], [sg.sum(sg.transpose(x, PERM), axis=0)])
    rewritten = _same_numbers(graph, [x], feed)
    (out,) = rewritten.outputs
    assert out.op.name == "transpose" and out.attrs["perm"] == (2, 0, 1) and out.inputs[0].op.name == "sum"


def test_padding_and_its_gradient_move_with_the_layout(nhwc):
    """embed (zero padding of H and W) and slice of a transposed value: padded channels last."""
    x, feed = nhwc
    t = sg.transpose(x, PERM)
    padded = sg.pad(t, (1, 2, 1, 0))
    graph = sg.Graph([x], [padded, t[:, 1:3, ::2, 1:]])
    fired = _fired(graph)
    assert fired.get("sink_through_window") == 2, fired
    rewritten = _same_numbers(graph, [x], feed)
    assert all(o.op.name == "transpose" and o.inputs[0].op.name in ("embed", "slice") for o in rewritten.outputs)


def test_a_full_size_operand_in_the_other_layout_stops_it(nhwc):
    """transpose(x) + y with y (N, C, H, W) not transposed: y would have to be transposed whole;
    nothing changes. A 2-D transpose (a weight's) is left to the GEMM's strides."""
    x, feed = nhwc
    y = sg.input("y", (2, 4, 5, 6), dtype="float64")
    graph = sg.Graph([x, y], [sg.transpose(x, PERM) + y])
    assert _fired(graph) == {}
    m = sg.input("m", (3, 4), dtype="float64")
    assert _fired(sg.Graph([m], [sg.exp(sg.transpose(m))])) == {}


def test_a_convolution_block_keeps_its_activations_channels_last():
    """conv -> BatchNorm -> ReLU -> conv, loss and every gradient: before the pass the activations
    are transposed between the two layouts; after optimize, no transpose of a full activation is
    left (only the input's, to channels last, and the weights'), and NumPy and C agree with the
    unoptimized graph."""
    rng = np.random.default_rng(2)
    x = sg.input("x", (2, 3, 8, 8), dtype="float64")
    w1, w2 = sg.input("w1", (24, 3, 3, 3), dtype="float64"), sg.input("w2", (20, 24, 3, 3), dtype="float64")
    gamma, beta = sg.input("g", (24,), dtype="float64"), sg.input("b", (24,), dtype="float64")
    h = sg.relu(sg.batch_norm(sg.conv2d(x, w1, padding=1), None, None, gamma, beta, training=True))
    y = sg.conv2d(h, w2, padding=1)
    loss = sg.sum(y * sg.constant(rng.standard_normal(y.shape[1:])))
    inputs = [x, w1, w2, gamma, beta]
    graph = sg.Graph(inputs, [loss, *sg.grad(loss, inputs)])
    feed = [rng.standard_normal(v.shape) for v in inputs]
    activation = 2 * 24 * 8 * 8
    optimized = passes.optimize(graph)
    without = passes.optimize(graph, passes=[p for p in passes.DEFAULT_PIPELINE if p[0] != "layout"])
    big = lambda g: [t for t in _transposes(g) if t.shape[0] == 2 and int(np.prod(t.shape)) >= activation]  # noqa: E731
    assert len(big(without)) >= 4 and not big(optimized), [t.type_str for t in big(optimized)]
    want = sg.function(inputs, list(graph.outputs), backend="numpy", optimize=False)(*feed)
    for backend in ("numpy", "c"):
        got = sg.function(inputs, list(graph.outputs), backend=backend)(*feed)
        for g, w in zip(got, want):
            assert np.abs(np.asarray(g) - w).max() <= 1e-12 * max(np.abs(w).max(), 1.0), backend


def test_a_dim_batch_sinks_as_a_fixed_one():
    """The same block over a Dim batch (as the examples build their steps): the BatchNorm's
    per-channel operands count as small against the known sizes, every transpose of the 24-channel
    activations cancels (the input's and its gradient's stay), and a call with 3 images matches the
    unoptimized graph on C."""
    rng = np.random.default_rng(3)
    B = sg.Dim("B")
    x = sg.input("x", (B, 3, 8, 8), dtype="float64")
    w1, w2 = sg.input("w1", (24, 3, 3, 3), dtype="float64"), sg.input("w2", (20, 24, 3, 3), dtype="float64")
    gamma, beta = sg.input("g", (24,), dtype="float64"), sg.input("b", (24,), dtype="float64")
    h = sg.relu(sg.batch_norm(sg.conv2d(x, w1, padding=1), None, None, gamma, beta, training=True))
    loss = sg.sum(sg.conv2d(h, w2, padding=1) ** 2)
    inputs = [x, w1, w2, gamma, beta]
    graph = sg.Graph(inputs, [loss, *sg.grad(loss, inputs)])
    activations = [t for t in _transposes(passes.optimize(graph)) if t.shape[0] == B and 24 in t.shape]
    assert not activations, [t.type_str for t in activations]
    feed = [rng.standard_normal((3, 3, 8, 8)), *(rng.standard_normal(v.shape) for v in inputs[1:])]
    want = sg.function(inputs, list(graph.outputs), backend="numpy", optimize=False)(*feed)
    got = sg.function(inputs, list(graph.outputs), backend="c")(*feed)
    for g, w in zip(got, want):
        assert np.abs(np.asarray(g) - w).max() <= 1e-12 * max(np.abs(w).max(), 1.0)


def test_a_chain_that_ends_in_a_gather_keeps_its_layout():
    """conv (channels-last GEMM) -> bias -> ReLU -> max_pool2d (a take of windows): the take would
    need a contiguous copy of a channels-last value, so nothing sinks (LeNet's second layer);
    the same chain ending in a second convolution does sink."""
    x = sg.input("x", (2, 6, 12, 12), dtype="float64")
    w, b = sg.input("w", (24, 6, 3, 3), dtype="float64"), sg.input("b", (24,), dtype="float64")
    h = sg.relu(sg.conv2d(x, w, b))
    before_layout = [p for p in passes.DEFAULT_PIPELINE if p[0] in ("dce", "fold", "simplify")]
    pooled = passes.optimize(sg.Graph([x, w, b], [sg.max_pool2d(h, 2)]), passes=before_layout)
    assert _fired(pooled) == {}
    v = sg.input("v", (8, 24, 3, 3), dtype="float64")
    convolved = passes.optimize(sg.Graph([x, w, b, v], [sg.conv2d(h, v)]), passes=before_layout)
    fired = _fired(convolved)
    assert fired.get("sink_through_elementwise", 0) >= 2 and fired.get("transpose_transpose", 0) >= 1, fired


def test_a_product_read_only_transposed_is_computed_transposed():
    """transpose(a @ b) -> b^T @ a^T when nothing else reads the product (a weight gradient handed
    back transposed, read by the optimizer's update): the numbers kept, no transpose of the product
    left; not when the product has another reader (it would be computed twice), nor for patches
    gathered by a take (the GEMM reads them in place only as its first operand)."""
    rng = np.random.default_rng(3)
    x, dy, w = (sg.input(name, shape, dtype="float64") for name, shape in (("x", (6, 4)), ("dy", (6, 5)), ("w", (5, 4))))
    feed = [rng.standard_normal((6, 4)), rng.standard_normal((6, 5)), rng.standard_normal((5, 4))]
    product = sg.swapaxes(x, 0, 1) @ dy                           # (4, 5): x^T dy
    step = sg.Graph([x, dy, w], [w - 0.1 * sg.swapaxes(product, 0, 1)])
    assert _fired(step).get("product_transposed") == 1
    rewritten = _same_numbers(step, [x, dy, w], feed)
    products = [n for n in rewritten.nodes if n.op.name == "matmul"]
    assert len(products) == 1 and products[0].shape == (5, 4)
    assert not any(n.op.name == "transpose" and n.inputs[0] is products[0] for n in rewritten.nodes)

    twice = sg.Graph([x, dy], [sg.swapaxes(product, 0, 1) * 2, product])
    assert "product_transposed" not in _fired(twice)

    patches = sg.take(x, sg.constant(np.array([0, 2, 4, 1]), "int64"), axis=0)  # (4, 4) rows gathered
    gathered = sg.Graph([x], [sg.swapaxes(sg.swapaxes(patches, 0, 1) @ x[:4], 0, 1) * 2])
    assert "product_transposed" not in _fired(gathered)


def test_a_product_read_transposed_through_casts_is_computed_transposed():
    """Under autocast a float32 weight's gradient is transpose(cast(x^T @ dy)), the product of
    bfloat16 operands cast back to float32: the product is computed transposed beneath the cast
    (AdamW then reads the gradient in order; it read it a row apart per element, 5-10 GB/s, in the
    bfloat16 GPT's step). Integer data: every bfloat16 sum is exact, in either layout."""
    rng = np.random.default_rng(5)
    x, dy, w = (sg.input(name, shape) for name, shape in (("x", (6, 4)), ("dy", (6, 5)), ("w", (5, 4))))
    feed = [rng.integers(-3, 4, shape).astype(np.float32) for shape in ((6, 4), (6, 5), (5, 4))]
    product = sg.swapaxes(x.astype("bfloat16"), 0, 1) @ dy.astype("bfloat16")  # (4, 5), bfloat16
    step = sg.Graph([x, dy, w], [w - 0.5 * sg.swapaxes(product.astype("float32"), 0, 1)])
    assert _fired(step).get("product_transposed") == 1
    rewritten = _same_numbers(step, [x, dy, w], feed)
    (matmul,) = [n for n in rewritten.nodes if n.op.name == "matmul"]
    assert matmul.shape == (5, 4) and matmul.dtype == "bfloat16"
    after = [n for n in rewritten.nodes if n.inputs and n.inputs[0] is matmul]  # the cast back, then w - ...
    assert [n.op.name for n in after] == ["cast"]
    assert not any(n.op.name == "transpose" and n.inputs[0] is after[0] for n in rewritten.nodes)
