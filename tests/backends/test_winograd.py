"""Winograd convolution (symgrad.backends.decide.winograd, templates/matmul/winograd.c.j2): a 3x3 stride-1
convolution's forward product, its weight gradient, and its input gradient after passes/col2im,
computed by minimal filtering instead of the patch GEMM. The transforms against a plain correlation, the geometry read
back from index maps (passes/patch_grid), which products take it, the numbers against the NumPy
reference on every edge of the kernel and every SIMD level, and the report."""

from __future__ import annotations

import numpy as np
import pytest

import symgrad as sg
from helpers import assert_near_reference, compiled_beside_reference
from symgrad.backends.decide import winograd
from symgrad.passes.patch_grid import grid

pytest.importorskip("symgrad.backends.c")


def _correlation(d: np.ndarray, g: np.ndarray) -> np.ndarray:
    k = g.shape[0]
    return np.array([[(d[i:i + k, j:j + k] * g).sum() for j in range(d.shape[1] - k + 1)]
                     for i in range(d.shape[0] - k + 1)])


@pytest.mark.parametrize("m", sorted(winograd.MATRICES))
def test_the_transforms_compute_a_correlation(m):
    """A^T [(G g G^T) . (B^T d B)] A is the m x m correlation of an (m + 2)^2 tile with a 3x3 kernel."""
    rng = np.random.default_rng(m)
    chosen = {name: winograd.MATRICES[m][name] for name in ("BT", "G", "AT")}
    for _ in range(5):
        d, g = rng.standard_normal((m + 2, m + 2)), rng.standard_normal((3, 3))
        assert np.allclose(winograd.reference(d, g, **chosen), _correlation(d, g), rtol=0, atol=1e-12)


def _index_map(H, W, k, stride=1, padding=1, dilation=1, origin=(0, 0), Wp=None):
    """conv2d's patch index map (symgrad.api.convolution) of an H x W image padded by `padding`; the
    padded rows `Wp` pixels apart (default: exactly the padded width), the image at `origin`."""
    Hp, Wpad = H + 2 * padding, W + 2 * padding
    Wp = Wp or Wpad
    Ho, Wo = (Hp - dilation * (k - 1) - 1) // stride + 1, (Wpad - dilation * (k - 1) - 1) // stride + 1
    taps = (np.arange(k)[:, None] * dilation * Wp + np.arange(k)[None, :] * dilation).reshape(-1)
    starts = (np.arange(Ho)[:, None] * stride * Wp + np.arange(Wo)[None, :] * stride).reshape(-1)
    return origin[0] * Wp + origin[1] + starts[:, None] + taps[None, :]


def test_the_grid_of_a_stride_1_convolution():
    """grid() finds Ho, Wo, the row length and each tap's column block; taps in any order; the
    origin of a window inside a larger buffer; any k x k kernel."""
    g = grid(_index_map(7, 9, 3))
    assert (g.k, g.Ho, g.Wo, g.Wp, g.origin, g.tap) == (3, 7, 9, 11, 0, tuple(range(9)))
    order = np.random.default_rng(0).permutation(9)
    shuffled = grid(_index_map(7, 9, 3)[:, order])
    assert shuffled.tap == tuple(int(np.flatnonzero(order == t)[0]) for t in range(9))
    inside = grid(_index_map(5, 6, 3, padding=0, origin=(2, 3), Wp=20))
    assert (inside.Ho, inside.Wo, inside.Wp, inside.origin) == (3, 4, 20, 43)
    assert grid(_index_map(8, 8, 5, padding=2)).k == 5


@pytest.mark.parametrize("case", ["stride 2", "dilation 2", "one entry moved", "a 1x1 kernel", "3x2 kernel"])
def test_what_is_not_a_grid(case):
    """Index maps of other convolutions, or none, have no grid."""
    idx = {"stride 2": lambda: _index_map(8, 8, 3, stride=2),
           "dilation 2": lambda: _index_map(8, 8, 3, padding=2, dilation=2),
           "one entry moved": lambda: _index_map(8, 8, 3) + (np.arange(64 * 9).reshape(64, 9) == 100),
           "a 1x1 kernel": lambda: _index_map(8, 8, 1, padding=0),
           "3x2 kernel": lambda: _index_map(8, 8, 3)[:, :6]}[case]()
    assert grid(idx) is None


# (N, C, H, W, O, padding, bias): what each exercises in sg_conv_winograd.
CONVS = [
    (2, 32, 12, 12, 32, 1, False),  # whole 4x4 tiles; channels a multiple of every vector
    (3, 20, 7, 9, 19, 1, True),     # partial tiles at the last row and column; 4 channels past the vectors
                                    # (scalar channels), 19 outputs (lanes past N), a bias
    (1, 16, 13, 6, 24, "valid", False),   # no padding: 11x4 outputs, the taps' rows wider than the outputs
    (2, 24, 18, 18, 40, 1, False),  # 162 tiles: several blocks, the last one short
]


def _loss(dtype: str, seed: int = 0):
    """Every CONVS entry on an input of its own, as one loss (each output squared and weighted,
    so each gradient differs), with its inputs and their values."""
    rng = np.random.default_rng(seed)
    terms, inputs, feed = [], [], []
    for k, (N, C, H, W, O, padding, bias) in enumerate(CONVS):
        x, w = sg.input(f"x{k}", (N, C, H, W), dtype=dtype), sg.input(f"w{k}", (O, C, 3, 3), dtype=dtype)
        b = sg.input(f"b{k}", (O,), dtype=dtype) if bias else None
        y = sg.relu(sg.conv2d(x, w, b, padding=padding))
        terms.append(sg.sum(y * y * sg.constant(rng.standard_normal(y.shape[1:]).astype(dtype))))
        for v in (x, w, b):
            if v is not None:
                inputs.append(v)
                feed.append((rng.standard_normal(v.shape) * (0.2 if v is w else 1.0)).astype(dtype))
    loss = terms[0]
    for t in terms[1:]:
        loss = loss + t
    return loss, inputs, feed


@pytest.fixture(scope="module", params=["float64", "float32", "float32-sse2", "float32-avx2", "float32-wide"])
def compiled(request):
    """(dtype, C function, NumPy function, inputs) of the loss and its gradients in every input;
    "-sse2", "-avx2" and "-wide" build the program and its runtime for that level instead of this
    machine's (helpers.c_build_options)."""
    dtype, _, level = request.param.partition("-")
    loss, inputs, feed = _loss(dtype)
    return (dtype, *compiled_beside_reference(loss, inputs, level), feed)


def test_each_convolution_and_its_gradients_are_winograds(compiled):
    """Every forward product and weight gradient is a Winograd convolution, and so is each input
    gradient that col2im made a convolution of the padded output gradient (the first and last:
    the others' padded images are too large beside their outputs, passes/col2im)."""
    _, fn, _, _ = compiled
    assert fn.source.count("context->status = sg_conv_winograd_f") == len(CONVS) + 2
    assert fn.source.count("context->status = sg_conv_winograd_grad_") == len(CONVS)
    assert "sg_gemm_patches_" not in fn.source


def test_the_numbers_are_the_numpy_references(compiled):
    """Loss and every gradient agree with the NumPy reference (float64 to 1e-12, float32 to 2e-5
    of each array's largest element): tiles whole and cut, blocks whole and short, vector and
    scalar channels, output lanes past N."""
    dtype, fn, reference, feed = compiled
    assert_near_reference(fn(*feed), reference(*feed), dtype)


def test_the_report_names_the_algorithm():
    """step.report() lists each Winograd product (the forward's, the weight gradient's) with its
    output grid."""
    x = sg.input("x", (4, 32, 16, 16))
    conv = sg.nn.Conv2d(32, 32, 3, padding=1)
    step = sg.train_step(sg.sum(sg.relu(conv(x)) ** 2), conv.parameters(), sg.optim.SGD(lr=0.1), backend="c")
    lines = [line for line in str(step.report().kernels).splitlines() if "Winograd" in line]
    assert len(lines) == 2 and all(f"F({winograd.M}x{winograd.M}, 3x3)" in line for line in lines), lines
    assert "16x16 outputs" in lines[0] and "summed over 16x16 outputs" in lines[1] and "transposed" in lines[1], lines
