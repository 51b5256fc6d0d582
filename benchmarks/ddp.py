"""Data-parallel steps on MPI against one process: 2 ranks x 1 thread vs 1 rank x 2 threads.

    python -m benchmarks.ddp [--models B128,C512] [--rounds 3] [--steps 20]

Each round runs, in turn, one process with 2 OpenMP threads on the whole batch
(sg.train_step) and `mpiexec -n 2` with 1 thread per rank on half the batch each
(sg.distributed.train_step), both on the C backend from the same weights. It
reports the median ms per step of each and the share of a rank's step spent
waiting on the other rank (the allreduces, and any imbalance between them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_MARK = "DDP-JSON "


def _worker(model_key: str, steps: int, distributed: bool) -> None:
    import numpy as np

    import symgrad as sg
    from benchmarks import models as M
    from benchmarks.models import LR

    model = M.select(model_key)[0]
    rank, size, comm = 0, 1, None
    if distributed:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        rank, size = comm.Get_rank(), comm.Get_size()
    x = sg.input("x", (model.batch // size, model.widths[0]))
    y = sg.input("y", (model.batch // size,), dtype="int64")
    h, params = x, []
    for k, (W0, b0) in enumerate(model.weights()):
        W, b = sg.param(f"W{k}", W0.shape, init=W0), sg.param(f"b{k}", b0.shape, init=b0)
        params += [W, b]
        h = sg.matmul(h, W) + b
        if k < len(model.layers) - 1:
            h = sg.relu(h)
    loss = sg.cross_entropy(h, y)
    optimizer = sg.optim.SGD(lr=LR)
    if distributed:
        step = sg.distributed.train_step(loss, params, optimizer, backend="c", comm=comm)
    else:
        step = sg.train_step(loss, params, optimizer, backend="c")
    xb, yb = model.data()
    rows = model.batch // size
    xb, yb = np.ascontiguousarray(xb[rank * rows:(rank + 1) * rows]), yb[rank * rows:(rank + 1) * rows]
    for _ in range(3):
        step(x=xb, y=yb)
    waited = getattr(step, "waited_s", 0.0)
    start = time.perf_counter()
    for _ in range(steps):
        step(x=xb, y=yb)
    seconds = time.perf_counter() - start
    waited = getattr(step, "waited_s", 0.0) - waited
    if rank == 0:
        print(_MARK + json.dumps({"ms_per_step": 1e3 * seconds / steps, "waiting_share": waited / seconds}),
              flush=True)


def _run(command: list[str], threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "SYMGRAD_BENCH_THREADS": str(threads),
           "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith(_MARK)]
    if done.returncode or not lines:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")
    return json.loads(lines[-1][len(_MARK):])


def main(argv=None) -> int:
    """Alternate the two configurations for each model; print the table."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ddp", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="B128,C512")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--worker", choices=["single", "distributed"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.model, args.steps, args.worker == "distributed")
        return 0
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        raise SystemExit("no mpiexec: pip install -e '.[mpi]'")
    me = [sys.executable, "-m", "benchmarks.ddp", "--steps", str(args.steps)]
    print("| model | 1 rank x 2 threads (ms) | 2 ranks x 1 thread (ms) | 2x1 / 1x2 | waiting share (rank 0) |")
    print("| --- | --- | --- | --- | --- |")
    for key in args.models.split(","):
        single, ranks = [], []
        for _ in range(args.rounds):
            single.append(_run(me + ["--worker", "single", "--model", key], threads=2))
            ranks.append(_run([mpiexec, "-n", "2"] + me + ["--worker", "distributed", "--model", key], threads=1))
        one = statistics.median(r["ms_per_step"] for r in single)
        two = statistics.median(r["ms_per_step"] for r in ranks)
        waiting = statistics.median(r["waiting_share"] for r in ranks)
        print(f"| {key} | {one:.2f} | {two:.2f} | {two / one:.2f} | {waiting:.0%} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
