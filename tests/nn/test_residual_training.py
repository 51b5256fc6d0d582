"""A small residual network trained beside the same network in torch, from the same weights on the
same batches: 3x3 convolutions of 24 channels (on C, Winograd's: backends/decide/winograd.py) with
BatchNorm2d and ReLU, a residual block, global average pooling, SGD with momentum, two
batches in turn. 20 steps'
losses agree within 1e-10 relative in float64 and 1e-4 in float32, and so do the weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import symgrad as sg
from helpers import train_beside_torch
from symgrad import nn

STEPS, BATCH, LR, CHANNELS = 20, 8, 0.02, 24
RNG = np.random.default_rng(5)
SEEN = [(RNG.standard_normal((BATCH, 3, 12, 12)), RNG.integers(0, 10, BATCH)) for _ in range(2)]
BATCHES = [SEEN[k % 2] for k in range(STEPS)]   # two batches in turn: the loss on them must fall


def residual(lib):
    """The same network in symgrad's nn or torch.nn (torch's parameter names in both)."""

    class Block(lib.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = lib.Conv2d(CHANNELS, CHANNELS, 3, padding=1, bias=False)
            self.bn1 = lib.BatchNorm2d(CHANNELS)
            self.relu = lib.ReLU()
            self.conv2 = lib.Conv2d(CHANNELS, CHANNELS, 3, padding=1)
            self.bn2 = lib.BatchNorm2d(CHANNELS)

        def forward(self, x):
            return self.relu(self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x))))) + x)

    return lib.Sequential(lib.Conv2d(3, CHANNELS, 3, padding=1), lib.BatchNorm2d(CHANNELS), lib.ReLU(), Block(),
                          lib.AdaptiveAvgPool2d(1), lib.Flatten(), lib.Linear(CHANNELS, 10))


@pytest.mark.parametrize("dtype, rtol", [("float64", 1e-10), ("float32", 1e-4)])
def test_a_residual_network_trains_as_torch(dtype, rtol, backend):
    sg.manual_seed(0)
    model = residual(nn).to(dtype)
    twin = residual(torch.nn).to(getattr(torch, dtype))
    twin.load_state_dict({k: torch.from_numpy(v) for k, v in model.state_dict().items()})  # strict
    x = sg.input("x", (BATCH, 3, 12, 12), dtype=dtype)
    y = sg.input("y", (BATCH,), dtype="int64")
    step = sg.train_step(sg.cross_entropy(model(x), y), model.parameters(), sg.optim.SGD(lr=LR, momentum=0.9),
                         backend=backend)
    if backend == "c":   # the block's convolutions and their input gradients are Winograd's
        assert step.source.count("= sg_conv_winograd_") >= 2
    train_beside_torch(step, twin, torch.optim.SGD(twin.parameters(), lr=LR, momentum=0.9), BATCHES, dtype, rtol)
