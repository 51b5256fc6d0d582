"""The direct convolution (symgrad.backends.decide.patches.Columns, templates/matmul/conv_rows.c.j2): a
convolution lowered per image (few output channels over short patches, or groups) whose taps run
along whole output rows reads each image's patch columns where they lie, in its forward product and
its weight's gradient. Which takes are read that way, the numbers against the NumPy reference on
every path of the kernel and every SIMD level, the report, and the bytes no longer stored."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

import symgrad as sg
from asm_loops import LEVELS
from helpers import assert_near_reference, compiled_beside_reference
from symgrad import passes
from symgrad.backends.lower.lowering import lower
from symgrad.backends.lower.memory import memory_plan
from symgrad.backends.decide.patches import COLUMN_ROWS, patch_takes, row_length

pytest.importorskip("symgrad.backends.c")

# (N, C, H, W, O, kernel, stride, padding, dilation, groups, direct): what each exercises. Output row
# widths against the vectors (f32: 8 lanes with AVX, 4 with SSE2; f64: 4 and 2).
CONVS = [
    (2, 1, 28, 28, 6, 5, 1, 2, 1, 1, True),    # LeNet's first layer: rows of 28, a last vector overlapping
    (2, 3, 10, 13, 4, 3, 1, 0, 1, 1, True),    # 3 channels, 4 outputs (a short block of channels), rows of 11
    (2, 2, 9, 9, 7, 3, 1, 1, 2, 1, True),      # dilation 2: rows of 7, narrower than an f32 AVX vector (the plain loops)
    (2, 4, 12, 20, 8, 3, 1, 1, 1, 4, True),    # depthwise: 4 groups of one channel, 2 outputs each
    (1, 6, 8, 18, 6, 3, 1, 1, 1, 2, True),     # 2 groups of 3 channels
    (1, 2, 6, 20, 13, 3, 1, 1, 1, 1, True),    # 13 outputs: two blocks of 6 and one of 1
    (1, 1, 12, 12, 4, 3, 2, 1, 1, 1, False),   # stride 2: taps not along whole rows, the take stays
    (1, 4, 6, 6, 80, 3, 1, 1, 1, 2, False),    # 40 outputs per group (> COLUMN_ROWS): the GEMM's
]
CONV1D = (2, 3, 40, 5, 5)   # conv1d (N, C, L, O, kernel): a height of one, rows of 36


def _loss(dtype: str, seed: int = 0):
    """Every CONVS entry and CONV1D on an input of its own, as one loss (each output squared and
    weighted, so each gradient differs), with its inputs and their values."""
    rng = np.random.default_rng(seed)
    terms, inputs, feed = [], [], {}

    def add(x, w, y, xshape, wshape):
        terms.append(sg.sum(y * y * sg.constant(rng.standard_normal(y.shape[1:]).astype(dtype))))
        inputs.extend([x, w])
        feed[x.name] = rng.standard_normal(xshape).astype(dtype)
        feed[w.name] = (rng.standard_normal(wshape) * 0.3).astype(dtype)

    for k, (N, C, H, W, O, kk, s, p, d, g, _) in enumerate(CONVS):
        x, w = sg.input(f"x{k}", (N, C, H, W), dtype=dtype), sg.input(f"w{k}", (O, C // g, kk, kk), dtype=dtype)
        add(x, w, sg.conv2d(x, w, stride=s, padding=p, dilation=d, groups=g), (N, C, H, W), (O, C // g, kk, kk))
    N, C, L, O, kk = CONV1D
    x, w = sg.input("x1d", (N, C, L), dtype=dtype), sg.input("w1d", (O, C, kk), dtype=dtype)
    add(x, w, sg.conv1d(x, w), (N, C, L), (O, C, kk))
    loss = terms[0]
    for t in terms[1:]:
        loss = loss + t
    return loss, inputs, [feed[v.name] for v in inputs]


@pytest.fixture(scope="module", params=["float64", "float32", "float32-sse2", "float32-avx2", "float32-wide"])
def compiled(request):
    """(dtype, C function, NumPy function, inputs) of the loss and its gradients in every input;
    "-sse2", "-avx2" and "-wide" build the program and its runtime for that level instead of this
    machine's (helpers.c_build_options)."""
    dtype, _, level = request.param.partition("-")
    loss, inputs, feed = _loss(dtype)
    return (dtype, *compiled_beside_reference(loss, inputs, level), feed)


def test_each_row_wise_convolution_reads_its_images_in_place(compiled):
    """Every convolution marked direct calls the direct convolution twice (its product and its
    weight's gradient) and stores no patch columns; the stride-2 one and the wide one keep theirs."""
    _, fn, _, _ = compiled
    direct = sum(c[-1] for c in CONVS) + 1
    assert fn.source.count("context->status = sg_conv_rows_") == 2 * direct
    kernels = [k.name for k in fn.program.plan.kernels]
    assert sum("_take_" in line for line in kernels) == len(CONVS) - direct + 1, kernels


def test_the_numbers_are_the_numpy_references(compiled):
    """Loss and every gradient agree with the NumPy reference (float64 to 1e-12, float32 to 2e-5 of
    each array's largest element) on every path: vectors with an overlapping last one, rows narrower
    than a vector, short blocks of channels and patch rows, groups."""
    dtype, fn, reference, feed = compiled
    assert_near_reference(fn(*feed), reference(*feed), dtype)


def test_row_length_finds_whole_output_rows():
    """A stride-1 index map runs in steps of one along rows of the output's width; stride 2 and a
    shuffled map do not."""
    taps = np.array([0, 1, 10, 11])[:, None]                  # 2x2 taps of an image 10 wide
    rows = (np.arange(3)[:, None] * 10 + np.arange(8)[None, :]).reshape(-1)
    assert row_length(taps + rows[None, :]) == 8
    assert row_length(taps + 2 * rows[None, :]) is None
    assert row_length(taps + np.arange(5)[None, :]) == 5      # one row
    shuffled = taps + rows[None, :]
    shuffled[:, [3, 4]] = shuffled[:, [4, 3]]
    assert row_length(shuffled) is None


def test_which_takes_are_read_in_place():
    """Chosen: a per-image convolution of at most COLUMN_ROWS outputs per group along whole rows, when
    nothing but its two products reads its patch columns; not one with another reader."""
    x = sg.input("x", (2, 1, 12, 12))
    w = sg.input("w", (6, 1, 5, 5))
    loss = sg.sum(sg.conv2d(x, w, padding=2) ** 2)
    graph = passes.optimize(sg.Graph([x, w], [loss, *sg.grad(loss, [w])]))
    assert len(patch_takes(graph)) == 1
    wide = sg.input("v", (2 * (COLUMN_ROWS + 1), 1, 3, 3))
    loss = sg.sum(sg.conv2d(sg.input("y", (1, 2, 8, 8)), wide, groups=2) ** 2)
    assert not patch_takes(passes.optimize(sg.Graph([wide], [loss, *sg.grad(loss, [wide])])))
    flat = sg.reshape(x, (2, 1, 144))
    cols = sg.take(flat, sg.constant(np.arange(12).reshape(1, 12)), axis=2)        # (2, 1, 1, 12)
    product = sg.matmul(sg.input("m", (1, 3, 1)), cols)
    assert len(patch_takes(passes.optimize(sg.Graph([x], [sg.sum(product)])))) == 1
    assert not patch_takes(passes.optimize(sg.Graph([x], [sg.sum(product), sg.sum(cols)])))


def test_the_report_and_the_memory_plan():
    """step.report() names each product that reads the columns in place; the arena no longer holds
    them (LeNet's first layer on 64 images: 4.8 MiB of columns)."""
    x, w = sg.input("x", (64, 1, 28, 28)), sg.input("w", (6, 1, 5, 5))
    loss = sg.sum(sg.relu(sg.conv2d(x, w, padding=2)))
    fn = sg.function([x, w], [loss, *sg.grad(loss, [w])], backend="c")
    lines = [line for line in str(fn.report().kernels).splitlines() if "direct convolution" in line]
    assert len(lines) == 2 and sum("read transposed from" in line for line in lines) == 1, lines
    assert all("4.79 MiB never stored" in line for line in lines), lines
    graph = passes.optimize(sg.Graph([x, w], [loss, *sg.grad(loss, [w])]))
    stored, direct = (memory_plan(lower(graph, matmul_epilogues=True, implicit_gemm=flag)).arena_bytes
                      for flag in (False, True))
    columns = 64 * 25 * 784 * 4
    assert direct < columns <= stored, (stored, direct)


@pytest.mark.parametrize("march", LEVELS)
def test_the_tiles_keep_their_vectors_in_registers(march):
    """The inner loops of the direct convolution (forward and weight gradient, both dtypes) never move
    a vector to or from the stack on any x86-64 level: the tile of CONV_ROWS channels by the target's
    vectors fits its registers. (A few pointers may be reloaded there on AVX-512, where the 24-vector
    tile leaves too few general registers: a load beside 24 multiply-adds.)"""
    from asm_loops import assembly, kernel_loops
    from symgrad.backends.build import runtime
    loops = kernel_loops(assembly(runtime.source(), march), "sg_conv_rows")
    # each dtype's forward (two inner loops) and weight gradient (one: its row's last, masked vector
    # is peeled off it; with the masks inside, the loop was not found here at all), in their tile's
    # function or, where gcc inlined that, in the OpenMP region calling it
    kinds = Counter((kind, loop.function.split(".")[0][-3:]) for loop in loops
                    for kind in ("forward", "gradient") if loop.function.startswith(f"sg_conv_rows_{kind}_"))
    assert kinds == {("forward", "f32"): 2, ("forward", "f64"): 2, ("gradient", "f32"): 1, ("gradient", "f64"): 1}, \
        sorted(loop.function for loop in loops)
    spills = {loop.function: [a for a in loop.stack_accesses if "mm" in a] for loop in loops}
    assert not any(spills.values()), spills


def test_a_tile_too_big_for_the_registers_is_caught():
    """The check above catches a spilled tile: 8 vectors beside 6 channels on AVX2's 16 registers."""
    from asm_loops import assembly, kernel_loops
    from symgrad.backends.build.runtime import Target, source as runtime_source
    source = runtime_source(targets=(Target("too big", "", 32, 6, 1, 8, 4),))
    loops = kernel_loops(assembly(source, "x86-64-v3"), "sg_conv_rows")
    assert loops and all(any("mm" in a for a in loop.stack_accesses) for loop in loops)


def test_the_weight_gradient_keeps_an_infinite_pixel_infinite():
    """The weight gradient's last vector of a row overlaps the one before; its overlap's lanes were
    zeroed by a multiply, 0 * inf = NaN where an infinite pixel lies in the overlap: dW was NaN
    where torch and the NumPy reference give +-inf (the fuzzer found it). Rows of 7 and 9 positions
    (one overlap at every vector width), float64 and float32."""
    import torch
    rng = np.random.default_rng(4)
    for dtype, length in (("float64", 7), ("float64", 9), ("float32", 9), ("float32", 13)):
        x = rng.standard_normal((2, 3, length)).astype(dtype)
        x[0, 1, length - 3], x[1, 0, length - 2] = np.inf, -np.inf
        w, g = rng.standard_normal((2, 3, 3)).astype(dtype), rng.standard_normal((2, 2, length - 2)).astype(dtype)
        X, W, G = (sg.input(n, a.shape, dtype=dtype) for n, a in zip("xwg", (x, w, g)))
        (got,) = sg.function([X, W, G], sg.grad(sg.sum(sg.conv1d(X, W) * G), [W]), backend="c")(x, w, g)
        tx, tw = torch.tensor(x), torch.tensor(w, requires_grad=True)
        (want,) = torch.autograd.grad(torch.nn.functional.conv1d(tx, tw), [tw], torch.tensor(g))
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want.numpy()), err_msg=f"{dtype} {length}")
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-4 if dtype == "float32" else 1e-12,
                                   err_msg=f"{dtype} {length}")
