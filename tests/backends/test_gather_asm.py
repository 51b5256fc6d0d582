"""Without timing: a take whose rows are single elements (an im2col of one channel, as LeNet's first
layer had before it became a direct convolution; here of stride 2, whose patches a take still
stores) walks its positions in a loop of its own, in gcc's assembly.

Its two loops (batch, position) used to be collapsed into one for OpenMP: each element then paid
two index products (imul) and a wrap test, 21 instructions against 10 now (LeNet's step ~8% slower
on the AVX-512 EPYC, ~3% in the AVX2 build).
"""

from __future__ import annotations

import numpy as np
import pytest

import symgrad as sg
from asm_loops import LEVELS

pytest.importorskip("symgrad.backends.c")


@pytest.fixture(scope="module")
def conv_one_channel():
    """LeNet's first convolution at stride 2: 6 outputs over patches of 25, per-image products after
    a take of one-element rows, large enough that the take runs on the OpenMP team (an outlined loop)."""
    x = sg.input("x", (64, 1, 56, 56))
    w = sg.param("w", (6, 1, 5, 5), init="normal")
    return sg.function([x], sg.conv2d(x, w, stride=2), backend="c"), w


def test_it_computes_the_convolution(conv_one_channel):
    import torch
    f, w = conv_one_channel
    x = np.random.default_rng(0).random((64, 1, 56, 56), dtype=np.float32)
    want = torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(f._storage[w.name].copy()), stride=2).numpy()
    np.testing.assert_allclose(f(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("march", LEVELS)
def test_single_element_rows_cost_no_index_product_per_element(conv_one_channel, march):
    from asm_loops import assembly, innermost_loops
    f, _ = conv_one_channel
    kernel = next(k.name for k in f.program.plan.kernels if "_take_" in k.name)
    loops = [loop for loop in innermost_loops(assembly(f.source, march)) if loop.function.startswith(kernel)]
    assert loops, f"{march}: no loop in {kernel}"
    for loop in loops:
        products = [line.strip() for line in loop.lines if line.lstrip().startswith("imul")]
        assert not products, f"{march}: {kernel}'s element loop multiplies indices: {products}"
