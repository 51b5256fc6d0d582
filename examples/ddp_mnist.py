"""Data-parallel training on MPI: the MNIST MLP on every rank, each on its share of each batch.

    mpiexec -n 2 python examples/ddp_mnist.py [--backend numpy] [--epochs 5]

Every rank builds the same model and step (sg.distributed.train_step); the
parameters come from rank 0, each global batch of 64 rows is split between the
ranks, gradients are averaged by allreduce, and every rank applies the same
Adam update. Rank 0 prints the loss and test accuracy.
"""

from __future__ import annotations

import argparse

import numpy as np
from mpi4py import MPI

import symgrad as sg
from symgrad import nn
from symgrad.tools.data import mnist_split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--backend", default="c", choices=["numpy", "c"],
                        help="compile the step to C (OpenMP), or run the numpy reference")
    parser.add_argument("--epochs", type=int, default=5, help="passes over the training digits")
    parser.add_argument("--batch", type=int, default=64, help="global batch, split between the ranks")
    parser.add_argument("--bucket-mb", type=float, default=0.25,
                        help="gradient bucket cap in MiB (two buckets for this MLP)")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if args.batch % size:
        raise SystemExit(f"--batch {args.batch} must divide by the {size} ranks")

    sg.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Dropout(0.2), nn.Linear(256, 10))
    x, y = sg.input("x", (sg.Dim("B"), 784)), sg.input("y", (sg.Dim("B"),), dtype="int64")
    model.train()
    loss = nn.functional.cross_entropy(model(x), y)
    model.eval()
    step = sg.distributed.train_step(loss, model.parameters(), sg.optim.Adam(lr=2e-3), backend=args.backend,
                                     predict=model(x), comm=comm, bucket_cap_mb=args.bucket_mb)
    if rank == 0:
        print(step.bucket_report(), flush=True)
    data = mnist_split()
    rng = np.random.default_rng(0)  # the same shuffle on every rank: each takes its rows of each batch
    share = args.batch // size
    for epoch in range(args.epochs):
        order = rng.permutation(len(data.y_train))
        for start in range(0, len(order) - args.batch + 1, args.batch):
            rows = order[start + rank * share:start + (rank + 1) * share]
            value = step(x=data.x_train[rows], y=data.y_train[rows])
        if rank == 0:
            accuracy = float((step.step.predict(x=data.x_test).argmax(axis=1) == data.y_test).mean())
            print(f"epoch {epoch + 1}: loss {value:.4f}  test accuracy {accuracy:.4f}  ({size} ranks)", flush=True)


if __name__ == "__main__":
    main()
