"""col2im as a gather (symgrad.passes.col2im): a convolution's input gradient computed as a
convolution of its output gradient instead of a scatter of a stored patch gradient.

Which convolutions it applies to (stride 1 and wide channels, not stride 2, not a few channels),
that the numbers are the scatter's (the NumPy reference runs the graph as built; the optimized
graph on NumPy and on C must agree with it), and that the C program then has no col2im scatter
and stores neither patch matrix of the backward."""

from __future__ import annotations

import numpy as np
import pytest

import symgrad as sg
from symgrad import passes
from symgrad.backends.lower.lowering import lower
from symgrad.backends.lower.memory import memory_plan
from symgrad.passes.col2im import col2im, inverse_taps
from symgrad.passes.patch_grid import grid
from symgrad.passes.pipeline import DEFAULT_PIPELINE

def _graph(N, C, H, W, O, k, stride, padding, dilation, dtype="float64"):
    x, w = sg.input("x", (N, C, H, W), dtype=dtype), sg.input("w", (O, C, k, k), dtype=dtype)
    y = sg.conv2d(x, w, stride=stride, padding=padding, dilation=dilation)
    weights = sg.constant(np.random.default_rng(0).standard_normal(y.shape[1:]).astype(dtype))
    loss = sg.sum(sg.relu(y) * weights)
    return sg.Graph([x, w], [loss, *sg.grad(loss, [x, w])])


def _fired(graph) -> int:
    counts: dict = {}
    col2im(passes.optimize(graph, passes=DEFAULT_PIPELINE[:3]), counts=counts)
    return counts.get("col2im_as_gather", 0)


def test_which_convolutions_are_rewritten():
    """Stride 1 with the padded image not much larger than the output and more than 16 input
    channels: rewritten. Stride 2 (four times the pixels per position), 16 channels or fewer
    (the product would not be the blocked GEMM's), or a small image whose padding is much of it
    (its product over the pixels half as large again as the one over the positions): not."""
    assert _fired(_graph(2, 24, 16, 16, 32, 3, 1, 1, 1)) == 1     # 18x18 pixels per 16x16 positions
    assert _fired(_graph(2, 24, 16, 16, 32, 3, 2, 1, 1)) == 0     # stride 2
    assert _fired(_graph(2, 16, 16, 16, 32, 3, 1, 1, 1)) == 0     # 16 input channels
    assert _fired(_graph(2, 24, 4, 4, 32, 3, 1, 1, 1)) == 0       # 6x6 pixels per 4x4 positions


def _gathered_map(graph) -> np.ndarray:
    """The index map of the col2im gather in `graph` after the pipeline up to col2im."""
    rewritten = col2im(passes.optimize(graph, passes=DEFAULT_PIPELINE[:3]))
    (take,) = [n for n in rewritten.nodes if n.op.name == "take" and n.attrs.get("purpose", "").startswith("col2im")]
    return take.inputs[1].attrs["value"]


def test_a_stride_1_gradient_is_gathered_from_its_padded_grid():
    """Stride 1, dilation 1 over the whole padded image: the output gradient padded by k - 1 on
    each side and read as a convolution with the flipped kernel (patch_grid.grid finds it: one
    output per pixel of the 18x18 padded image, rows of 20), which backends/winograd computes.
    With dilation 2 the taps are no such grid: a zero row stands for the taps outside."""
    g = grid(_gathered_map(_graph(2, 24, 16, 16, 32, 3, 1, 1, 1)))
    assert (g.k, g.Ho, g.Wo, g.Wp, g.origin) == (3, 18, 18, 20, 0)
    assert g.tap == tuple(reversed(range(9)))   # the forward's tap (ky, kx) reads (2 - ky, 2 - kx) here
    dilated = _gathered_map(_graph(2, 24, 24, 24, 32, 3, 1, 2, 2))
    assert grid(dilated) is None and dilated.max() == 24 * 24   # L: the zero row


def test_a_product_whose_rows_are_not_patch_rows_is_left_alone():
    """scatter_add of a (P*L*K2, C) product reshaped to (P, L, K2, C): the same size as a patch
    gradient, not its layout (rows are patch elements, not patch rows): not rewritten."""
    from symgrad.api import functional as F
    a, b = sg.input("a", (2 * 4 * 3, 5)), sg.input("b", (5, 20))
    idx = sg.constant(np.arange(4)[:, None] + np.arange(3)[None, :])   # each tap one to one, 6 pixels
    out = F.scatter_add(sg.reshape(a @ b, (2, 4, 3, 20)), idx, axis=1, size=6)
    counts: dict = {}
    col2im(sg.Graph([a, b], [sg.sum(out * out)]), counts=counts)
    assert counts == {}


def test_inverse_taps_needs_each_tap_one_to_one():
    idx = np.array([[0, 1], [1, 2], [2, 3]])
    inv = inverse_taps(idx, 4)
    assert inv.tolist() == [[0, 3], [1, 0], [2, 1], [3, 2]]     # 3: the zero row
    assert inverse_taps(np.array([[0, 1], [0, 2]]), 3) is None   # tap 0 reads pixel 0 twice
    assert inverse_taps(np.array([[0, 5]]), 4) is None            # outside the pixels


@pytest.fixture(scope="module")
def chain():
    """Two stride-1 convolutions in a row with 24 and 32 channels (so the second one's input
    gradient is rewritten after the first one's output gradient was), float64, and its inputs."""
    rng = np.random.default_rng(1)
    x = sg.input("x", (2, 24, 12, 12), dtype="float64")
    w1, w2 = sg.input("w1", (32, 24, 3, 3), dtype="float64"), sg.input("w2", (40, 32, 3, 3), dtype="float64")
    h = sg.relu(sg.conv2d(x, w1, padding=1))
    y = sg.conv2d(h, w2, padding=1, dilation=1)
    loss = sg.sum(y * sg.constant(rng.standard_normal(y.shape[1:])))
    inputs = [x, w1, w2]
    feed = [rng.standard_normal(v.shape) * 0.3 for v in inputs]
    return sg.Graph(inputs, [loss, *sg.grad(loss, inputs)]), inputs, feed


def test_the_numbers_are_the_scatters(chain):
    """The optimized graph (rewritten) on NumPy and on C gives the reference's loss and gradients
    to 1e-12: the same sums in another order."""
    graph, inputs, feed = chain
    counts: dict = {}
    col2im(graph, counts=counts)
    assert counts == {"col2im_as_gather": 2}
    reference = sg.function(inputs, list(graph.outputs), backend="numpy")(*feed)
    for backend, options in (("numpy", {"optimize": True}), ("c", {})):
        got = sg.function(inputs, list(graph.outputs), backend=backend, **options)(*feed)
        for g, r in zip(got, reference):
            assert np.abs(np.asarray(g) - r).max() <= 1e-12 * max(np.abs(r).max(), 1.0), backend


def test_the_c_program_stores_no_patch_gradient(chain):
    """On C no col2im scatter is left and each input gradient is a GEMM gathering its rows; the
    arena no longer holds the second convolution's patch gradient (2 x 144 positions x 288
    columns of float64): at least half of its bytes leave the plan's peak."""
    graph, inputs, feed = chain
    fn = sg.function(inputs, list(graph.outputs), backend="c")
    kernels = [k.name for k in fn.program.plan.kernels]
    assert not any("scatter_add" in line for line in kernels), kernels
    # 2 forward products, 2 weight gradients, 2 input gradients: 3x3 stride-1 convolutions, all by
    # Winograd's algorithm (backends/decide/winograd.py)
    assert fn.source.count("context->status = sg_conv_winograd_") == 6
    without = [entry for entry in DEFAULT_PIPELINE if entry[0] != "col2im"]
    scattered, gathered = (memory_plan(lower(passes.optimize(graph, passes=pipeline), matmul_epilogues=True,
                                             implicit_gemm=True)).arena_bytes
                           for pipeline in (without, DEFAULT_PIPELINE))
    patch_gradient = 2 * 144 * 288 * 8
    assert scattered >= patch_gradient and scattered - gathered >= patch_gradient // 2, (scattered, gathered)
