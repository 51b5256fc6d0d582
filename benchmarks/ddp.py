"""Data-parallel steps on MPI against one process: 2 ranks x 1 thread vs 1 rank x 2 threads.

    python -m benchmarks.ddp [--models B128,C512] [--rounds 3] [--steps 20] [--bucket-mb 25]

Each round runs, in turn, one process with 2 OpenMP threads on the whole batch
(sg.train_step), then `mpiexec -n 2` with 1 thread per rank on half the batch
each (sg.distributed.train_step) twice: with each gradient bucket's allreduce
started from inside the backward as soon as the bucket is final (overlap), and
with every bucket started after the backward returns; all on the C backend from
the same weights. It reports the median ms per step of each (the median step of each run, then the median over rounds), the share of a
rank's step spent waiting on the other rank (the allreduces, and any imbalance
between the ranks) and the time from the backward's return to the averaged
gradients: what overlapping saves is there.
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


def _worker(model_key: str, steps: int, distributed: bool, overlap: bool = True, bucket_mb: float = 25.0) -> None:
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
    loss, params = model.symgrad_loss(sg, model.batch // size)
    optimizer = sg.optim.SGD(lr=LR)
    if distributed:
        step = sg.distributed.train_step(loss, params, optimizer, backend="c", comm=comm, overlap=overlap,
                                         bucket_cap_mb=bucket_mb)
    else:
        step = sg.train_step(loss, params, optimizer, backend="c")
    xb, yb = model.data()
    rows = model.batch // size
    xb, yb = np.ascontiguousarray(xb[rank * rows:(rank + 1) * rows]), yb[rank * rows:(rank + 1) * rows]
    for _ in range(3):
        step(x=xb, y=yb)
    # Per step, medians: with both vCPUs busy, a shared VM stalls a process now and then for tens of
    # ms (measured: 0.49 ms median, 56 ms worst for one rank's backward), which a mean would report.
    times, waits, afters = [], [], []
    for _ in range(steps):
        waited, after = getattr(step, "waited_s", 0.0), getattr(step, "after_call_s", 0.0)
        start = time.perf_counter()
        step(x=xb, y=yb)
        times.append(time.perf_counter() - start)
        waits.append(getattr(step, "waited_s", 0.0) - waited)
        afters.append(getattr(step, "after_call_s", 0.0) - after)
    if rank == 0:
        seconds = statistics.median(times)
        print(_MARK + json.dumps({"ms_per_step": 1e3 * seconds, "waiting_share": statistics.median(waits) / seconds,
                                  "after_backward_ms": 1e3 * statistics.median(afters),
                                  "buckets": len(getattr(step, "buckets", ()))}), flush=True)


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
    parser.add_argument("--bucket-mb", type=float, default=25.0,
                        help="gradient bucket cap in MiB (DDP's bucket_cap_mb; default %(default)s)")
    parser.add_argument("--worker", choices=["single", "overlap", "after"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.model, args.steps, args.worker != "single", args.worker == "overlap", args.bucket_mb)
        return 0
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        raise SystemExit("no mpiexec: pip install -e '.[mpi]'")
    me = [sys.executable, "-m", "benchmarks.ddp", "--steps", str(args.steps), "--bucket-mb", str(args.bucket_mb)]
    print(f"2 ranks x 1 thread against 1 rank x 2 threads, C backend, median of {args.rounds} alternating rounds; "
          f"buckets of at most {args.bucket_mb:g} MiB (the first 1 MiB). \"overlap\": each bucket's allreduce "
          f"starts inside the backward when its gradients are final; \"after\": all start when the backward "
          f"returns. Waiting: rank 0's time in MPI waits; after backward: from the backward's return to the "
          f"averaged gradients, per step.\n")
    print("| model | buckets | 1x2 (ms) | 2x1 overlap (ms) | 2x1 after (ms) | overlap / 1x2 | waiting, overlap "
          "| waiting, after | after backward, overlap (ms) | after backward, after (ms) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for key in args.models.split(","):
        runs: dict[str, list] = {"single": [], "overlap": [], "after": []}
        for _ in range(args.rounds):
            runs["single"].append(_run(me + ["--worker", "single", "--model", key], threads=2))
            for mode in ("overlap", "after"):
                runs[mode].append(_run([mpiexec, "-n", "2"] + me + ["--worker", mode, "--model", key], threads=1))

        def median(mode, field):
            return statistics.median(r[field] for r in runs[mode])
        one, both, late = (median(m, "ms_per_step") for m in ("single", "overlap", "after"))
        print(f"| {key} | {runs['overlap'][0]['buckets']} | {one:.2f} | {both:.2f} | {late:.2f} | {both / one:.2f} "
              f"| {median('overlap', 'waiting_share'):.0%} | {median('after', 'waiting_share'):.0%} "
              f"| {median('overlap', 'after_backward_ms'):.2f} | {median('after', 'after_backward_ms'):.2f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
