"""embed's lowering (symgrad.backends.kinds.gather._embed): a window of steps 1 (padding, a convolution's
zero row) has only its border zeroed before the window is stored, box by box; a strided window (the
gradient of a strided slice) zeroes the whole array first. Same numbers as NumPy either way."""

from __future__ import annotations

import numpy as np
import pytest

import symgrad as sg
from symgrad.backends.kinds.gather import _borders

pytest.importorskip("symgrad.backends.c")


def _boxes(x, padding):
    padded = sg.pad(x, padding)
    return padded, _borders(padded)


def test_the_border_boxes_cover_exactly_the_outside_of_the_window():
    """Marking the boxes and the window on a grid covers every element once (a concrete shape, and
    one with a Dim batch whose axis the window covers whole)."""
    for batch in (3, sg.Dim("B")):
        x = sg.input("x", (batch, 2, 4, 5))
        padded, boxes = _boxes(x, (1, 2, 1, 0))                  # W: 1 left, 2 right; H: 1 top
        assert len(boxes) == 3, boxes
        grid = np.zeros((3,) + tuple(padded.shape[1:]), dtype=int)
        for starts, shape in boxes:
            shape = tuple(3 if not isinstance(n, int) else n for n in shape)
            grid[tuple(slice(s, s + n) for s, n in zip(starts, shape))] += 1
        grid[:, :, 1:5, 1:6] += 1                                # the window
        assert (grid == 1).all()


def test_padding_zeroes_only_its_border_and_a_strided_window_zeroes_all():
    rng = np.random.default_rng(0)
    x = sg.input("x", (sg.Dim("B"), 2, 4, 5), dtype="float64")
    y = sg.input("y", (3, 8), dtype="float64")
    strided = sg.sum(y[:, ::2] ** 2)
    outputs = [sg.pad(x, (1, 2, 1, 0)) * 2.0, sg.grad(strided, [y])[0]]
    fn = sg.function([x, y], outputs, backend="c")
    kernels = [line for line in fn.source.splitlines() if line.startswith("/* zero ")]  # each kernel's heading
    assert sum("zero embed's border outside its window" in line for line in kernels) == 3, kernels
    assert sum("zero the array embed writes into" in line for line in kernels) == 1, kernels   # the strided one
    feed = [rng.standard_normal((3, 2, 4, 5)), rng.standard_normal((3, 8))]
    reference = sg.function([x, y], outputs, backend="numpy")
    for got, want in zip(fn(*feed), reference(*feed)):
        np.testing.assert_array_equal(got, want)
