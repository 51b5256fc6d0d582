"""Implicit GEMM (symgrad.backends.decide.patches): a convolution's patch matrix gathered by the GEMM as it
packs it, never stored. Which takes are read that way, the numbers against the NumPy reference on
every path the packing takes, and the bytes the memory plan no longer holds."""

from __future__ import annotations

import numpy as np
import pytest

import symgrad as sg
from helpers import assert_near_reference, compiled_beside_reference
from symgrad import passes
from symgrad.backends.decide.decisions import decide
from symgrad.backends.lower.lowering import lower
from symgrad.backends.lower.memory import memory_plan

pytest.importorskip("symgrad.backends.c")

# (N, C, H, W, O, kernel, stride, padding, dilation): what each exercises in sg_pack_patches.
CONVS = [
    (2, 8, 9, 7, 32, 3, 1, 1, 1),    # channels a whole number of the AVX-512 tile's rows (8): one-run slivers
    (3, 5, 11, 10, 20, 3, 2, 1, 1),  # 5 channels: slivers across taps, stride 2, 45-element patch rows
    (2, 4, 12, 12, 24, 3, 1, 2, 2),  # dilation 2
    (1, 16, 6, 6, 17, 1, 1, 0, 1),   # a 1x1 convolution, 17 outputs (a ragged column sliver)
    (2, 6, 14, 14, 16, 5, 1, 0, 1),  # LeNet's second layer: 16 outputs, the fewest the patch GEMM takes;
                                     # 6 channels, each kernel row's 5 taps one run of 30 in the image
    (1, 8, 4, 4, 64, 3, 1, 1, 1),    # 16 patch rows, 72 patch columns: the GEMM splits columns, A packed whole
    (2, 40, 20, 20, 48, 5, 1, 2, 1), # patch rows of 1000 floats: K in four chunks, boundaries inside taps
    (2, 20, 32, 32, 24, 2, 1, 1, 1), # 2178 patch rows: the weight's gradient a tall product, K split over
                                     # threads (a 2x2 kernel: a 3x3 one would be Winograd's, test_winograd.py)
]


def _convs(dtype: str, seed: int = 0):
    """Every CONVS entry on an input of its own, as one loss (each convolution's output squared
    and weighted, so each gradient differs), with the inputs, weights and their values."""
    rng = np.random.default_rng(seed)
    loss, xs, ws, feed, values = None, [], [], {}, {}
    for k, (N, C, H, W, O, kk, s, p, d) in enumerate(CONVS):
        x = sg.input(f"x{k}", (N, C, H, W), dtype=dtype)
        w = sg.input(f"w{k}", (O, C, kk, kk), dtype=dtype)
        y = sg.conv2d(x, w, stride=s, padding=p, dilation=d)
        term = sg.sum(y * y * sg.constant(rng.standard_normal(y.shape[1:]).astype(dtype)))
        loss = term if loss is None else loss + term
        xs.append(x)
        ws.append(w)
        feed[f"x{k}"] = rng.standard_normal((N, C, H, W)).astype(dtype)
        feed[f"w{k}"] = (rng.standard_normal((O, C, kk, kk)) * 0.2).astype(dtype)
    return loss, xs, ws, feed


@pytest.fixture(scope="module", params=["float64", "float32", "float32-avx2", "float32-wide"])
def compiled(request):
    """(dtype, C function, NumPy function, inputs) of the loss and its gradients in every input;
    "-avx2" builds the program and its runtime for AVX2 (a register tile of 6 rows, not 8), "-wide"
    in 64-byte vectors (helpers.c_build_options)."""
    dtype, _, level = request.param.partition("-")
    loss, xs, ws, feed = _convs(dtype)
    inputs = [v for pair in zip(xs, ws) for v in pair]
    return (dtype, *compiled_beside_reference(loss, inputs, level), [feed[v.name] for v in inputs])


def test_every_convolution_gathers_its_patches_in_the_gemm(compiled):
    """Each convolution's forward product and its weight's gradient call the patch GEMM (so do
    the 40- and 20-channel ones' input gradients, gathers after passes/col2im), and no take stores
    the patch matrix."""
    _, fn, _, _ = compiled
    calls = fn.source.count("context->status = sg_gemm_patches_")
    assert calls == 2 * len(CONVS) + 2, calls   # and the 40- and 20-channel inputs' gradients (passes/col2im)
    assert "sg_conv_winograd_" not in fn.source
    kernels = [k.name for k in fn.program.plan.kernels]
    assert kernels and not any("_take_" in line for line in kernels), kernels


def test_the_numbers_are_the_numpy_references(compiled):
    """Loss and the gradients of every input and weight agree with the NumPy reference (float64
    to 1e-12, float32 to 2e-5 of each array's largest element): every path of the packing, plain
    and transposed, one-run and ragged slivers, K chunks that cut a tap, the column-split GEMM."""
    dtype, fn, reference, feed = compiled
    assert_near_reference(fn(*feed), reference(*feed), dtype)


def _patch_takes(graph):
    """The takes of patch rows (axis 1) read in place; a per-image convolution's patch columns
    (axis 2) are tests/backends/test_conv_rows.py's."""
    return [n for n in graph.nodes if n.op.name == "take" and n.attrs["axis"] == 1
            and id(n) in decide(graph, implicit_gemm=True).patches]


def test_which_takes_are_read_in_place():
    """A wide convolution's patches are read in place (16 output channels are wide enough); not with
    the option off, not for a few output channels (the narrow kernels read A through strides), and
    not when anything else reads them."""
    x = sg.input("x", (2, 6, 8, 8))
    wide, narrow = sg.input("w", (32, 6, 3, 3)), sg.input("n", (8, 6, 3, 3))
    loss = sg.sum(sg.conv2d(x, wide, padding=1) ** 2)
    graph = passes.optimize(sg.Graph([x, wide], [loss, *sg.grad(loss, [x, wide])]))
    assert len(_patch_takes(graph)) == 1
    assert not decide(graph).patches
    sixteen = sg.input("s", (16, 6, 5, 5))     # a whole sliver of columns: the patch GEMM's
    loss = sg.sum(sg.conv2d(x, sixteen, padding=2) ** 2)
    assert len(_patch_takes(passes.optimize(sg.Graph([x, sixteen], [loss, *sg.grad(loss, [sixteen])])))) == 1
    loss = sg.sum(sg.conv2d(x, narrow, padding=1) ** 2)
    assert not _patch_takes(passes.optimize(sg.Graph([x, narrow], [loss, *sg.grad(loss, [narrow])])))
    pixels = sg.reshape(sg.transpose(x, (0, 2, 3, 1)), (2, 64, 6))
    taps = sg.take(pixels, sg.constant(np.arange(18).reshape(9, 2)), axis=1)       # (2, 9, 2, 6)
    product = sg.reshape(taps, (18, 12)) @ sg.input("m", (12, 32))
    also_summed = sg.Graph([x], [sg.sum(product), sg.sum(taps)])
    assert not _patch_takes(passes.optimize(also_summed))
    assert len(_patch_takes(passes.optimize(sg.Graph([x], [sg.sum(product)])))) == 1


def test_the_memory_plan_no_longer_holds_the_patches():
    """A convolution's arena holds its patch matrix when a take stores it, and is smaller than that
    matrix when the GEMMs gather it (32 images of 16x16 with 32 channels: a 9 MiB matrix of a
    1 MiB image)."""
    x, w = sg.input("x", (32, 32, 16, 16)), sg.input("w", (32, 32, 3, 3))
    loss = sg.sum(sg.relu(sg.conv2d(x, w, padding=1)))
    graph = passes.optimize(sg.Graph([x, w], [loss, *sg.grad(loss, [w])]))
    stored, gathered = (memory_plan(lower(graph, matmul_epilogues=True, implicit_gemm=flag)).arena_bytes
                        for flag in (False, True))
    patch_bytes = 32 * 16 * 16 * 9 * 32 * 4
    assert gathered < patch_bytes <= stored, (stored, gathered)


def test_a_patch_index_map_follows_its_buffer_through_memory_planning():
    """A convolution's patch GEMM reads its index map through the patches view; memory planning
    swaps buffers for arena slots, and the map's buffer inside the view was not swapped: the
    kernel read (and C declared) the slot of another buffer, here the product's own output
    ("conflicting types for ws3"; in other arrangements a segfault). The fuzzer found it with a
    1-pixel conv1d beside an avg_pool2d. Checked: C compiles and matches the NumPy reference."""
    rng = np.random.default_rng(3)
    image = sg.input("image", (3, 3, 3, 4), dtype="float64")
    pooled = sg.avg_pool2d(image, kernel_size=(2, 3), count_include_pad=False)
    x, w = sg.input("x", (1, 4, 1), dtype="float64"), sg.input("w", (1, 4, 1), dtype="float64")
    y = sg.log1p(sg.squeeze(sg.conv1d(x, w, dilation=2, padding="valid"), 1))
    cot = sg.input("cot", y.shape, dtype="float64")
    inputs = [image, x, w, cot]
    outputs = [pooled, *sg.grad(sg.sum(pooled), [image]), y, *sg.grad(sg.sum(y * cot), [x, w])]
    arrays = [rng.standard_normal(v.shape) for v in inputs]
    got = sg.function(inputs, outputs, backend="c")(*arrays)
    want = sg.function(inputs, outputs, backend="numpy")(*arrays)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-12, atol=1e-12)
