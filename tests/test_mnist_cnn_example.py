"""examples/mnist_cnn.py spells LeNet-5 out as a Module; it must stay the network the demo trains
(symgrad.tools.demo.lenet(), `symgrad demo --model cnn`), so the README's figures hold for both."""

import importlib.util
from pathlib import Path

import numpy as np

import symgrad as sg
from symgrad.tools import demo

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "mnist_cnn.py"


def _example():
    spec = importlib.util.spec_from_file_location("mnist_cnn_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_lenet_is_the_demos_network():
    """Same seed, same initial weights in the same order (the layers are built in one order), and
    the same logits on the reference backend: the same architecture, layer for layer."""
    example = _example()
    sg.manual_seed(3)
    ours = example.LeNet5()
    sg.manual_seed(3)
    theirs = demo.lenet()
    ours_params = [p for _, p in ours.state_dict().items()]
    theirs_params = [p for _, p in theirs.state_dict().items()]
    assert [p.shape for p in ours_params] == [p.shape for p in theirs_params]
    for a, b in zip(ours_params, theirs_params):
        np.testing.assert_array_equal(a, b)

    x = sg.input("x", (2, 1, 28, 28))
    images = np.random.default_rng(0).standard_normal((2, 1, 28, 28)).astype(np.float32)
    got = sg.function([x], [ours(x)], backend="numpy")(images)[0]
    want = sg.function([x], [theirs(x)], backend="numpy")(images)[0]
    assert got.shape == (2, 10)
    np.testing.assert_array_equal(got, want)
