"""A LeNet-5-style CNN trained beside the same network in torch, from the same weights on the same batches.

conv 5x5 (6) - ReLU - max-pool 2 - conv 5x5 (16) - ReLU - max-pool 2 - 3 Linear layers with ReLU, Adam:
20 steps' losses agree within 1e-10 relative in float64 and 1e-4 in float32, and so do the weights.
On every backend.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import symgrad as sg
from helpers import train_beside_torch
from symgrad import nn

STEPS, BATCH, LR = 20, 4, 2e-3
RNG = np.random.default_rng(21)
BATCHES = [(RNG.random((BATCH, 1, 28, 28)), RNG.integers(0, 10, BATCH)) for _ in range(STEPS)]


def lenet(lib):
    """The same network in symgrad's nn or torch.nn (torch's parameter names in both)."""
    return lib.Sequential(lib.Conv2d(1, 6, 5, padding=2), lib.ReLU(), lib.MaxPool2d(2),
                          lib.Conv2d(6, 16, 5), lib.ReLU(), lib.MaxPool2d(2), lib.Flatten(),
                          lib.Linear(16 * 5 * 5, 120), lib.ReLU(), lib.Linear(120, 84), lib.ReLU(),
                          lib.Linear(84, 10))


@pytest.mark.parametrize("dtype, rtol", [("float64", 1e-10), ("float32", 1e-4)])
def test_lenet_trains_as_torch(dtype, rtol, backend):
    sg.manual_seed(0)
    model = lenet(nn).to(dtype)
    twin = lenet(torch.nn).to(getattr(torch, dtype))
    twin.load_state_dict({k: torch.from_numpy(v) for k, v in model.state_dict().items()})  # strict
    x = sg.input("x", (sg.Dim("B"), 1, 28, 28), dtype=dtype)
    y = sg.input("y", (sg.Dim("B"),), dtype="int64")
    step = sg.train_step(sg.cross_entropy(model(x), y), model.parameters(), sg.optim.Adam(lr=LR), backend=backend)
    train_beside_torch(step, twin, torch.optim.Adam(twin.parameters(), lr=LR), BATCHES, dtype, rtol)
