"""The seeds' softmax regression, step for step against PyTorch in float64.

torch: nn.Linear(784, 10) zero-initialised, F.cross_entropy, SGD(lr=0.1);
symgrad: W (784, 10) = weight.T, b (10,), sg.train_step with SGD(lr=0.1).
20 steps over a fixed random data set of 256 samples in batches of 64:
every step's loss and the final parameters agree within 1e-6 relative.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import symgrad as sg

N, D, C, BATCH, STEPS, LR = 256, 784, 10, 64, 20, 0.1


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(2024)
    # Class-dependent means, so the loss actually falls over 20 steps.
    labels = rng.integers(0, C, N).astype(np.int64)
    centers = rng.standard_normal((C, D)) * 0.5
    images = (centers[labels] + rng.standard_normal((N, D))).astype(np.float64)
    return images, labels


def batches():
    for step in range(STEPS):
        lo = (step * BATCH) % N
        yield step, slice(lo, lo + BATCH)


@pytest.fixture(scope="module")
def torch_run(data):
    images, labels = data
    model = torch.nn.Linear(D, C).double()
    torch.nn.init.zeros_(model.weight)
    torch.nn.init.zeros_(model.bias)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _, rows in batches():
        opt.zero_grad()
        loss = TF.cross_entropy(model(torch.from_numpy(images[rows])), torch.from_numpy(labels[rows]))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.weight.detach().numpy().T.copy(), model.bias.detach().numpy().copy()


def test_train_step_matches_pytorch(backend, data, torch_run):
    images, labels = data
    B = sg.Dim("B")
    x = sg.input("x", (B, D), dtype="float64")
    y = sg.input("y", (B,), dtype="int64")
    W = sg.param("W", (D, C), init="zeros", dtype="float64")
    b = sg.param("b", (C,), init="zeros", dtype="float64")
    loss = sg.cross_entropy(x @ W + b, y)
    step = sg.train_step(loss, params=[W, b], optimizer=sg.optim.SGD(lr=LR), backend=backend)

    losses = [step(x=np.ascontiguousarray(images[rows]), y=labels[rows]) for _, rows in batches()]
    want_losses, want_W, want_b = torch_run
    assert all(isinstance(v, float) for v in losses)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6, atol=0)
    np.testing.assert_allclose(step.params["W"], want_W, rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(step.params["b"], want_b, rtol=1e-6, atol=1e-12)
    # Training did something: the loss fell from log(10) and the weights moved.
    assert losses[0] == pytest.approx(np.log(10), rel=1e-12)
    assert losses[-1] < 0.5 * losses[0]
    assert np.abs(step.params["W"]).max() > 1e-3
