"""What a data-parallel step would take on N machines: ring allreduce cost over measured buckets.

    python -m benchmarks.ddp_cost [--models B128,C512,small,nanogpt] [--steps 10] [--bucket-mb 25]

For each model this process runs sg.distributed.train_step alone (one rank, C,
its threads as set) and measures, per step (medians): the forward and backward
(`backward_s`), the moment inside the backward at which each gradient bucket
became final and its allreduce started (`started_s`, the C program's hooks),
and the optimizer's update (`apply_s`). A ring allreduce of n bytes over N
machines costs

    t(n, N) = 2 (N - 1) alpha + 2 (N - 1) / N * n / beta

(N - 1 reduce-scatter and N - 1 allgather rounds, each a latency alpha and 1/N
of the bytes at bandwidth beta). Buckets go out one after another, each when it
is final and the previous one is through, so the step on N machines, each with
this process's batch (weak scaling), is

    finish_b = max(start_b, finish_{b-1}) + t(bytes_b, N)
    step(N)  = max(backward, finish_last) + t(8 bytes, N) + apply

beside the step without overlap: backward + sum of t(bytes_b, N) + apply.
Efficiency: step(1) / step(N), the share of N times one machine's throughput.
The networks: 10 Gb/s Ethernet (beta 1.25 GB/s, alpha 20 us) and 100 Gb/s
InfiniBand (beta 12.5 GB/s, alpha 2 us); compute as measured on this machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys

NETWORKS = {"10 Gb/s Ethernet": (1.25e9, 20e-6), "100 Gb/s InfiniBand": (12.5e9, 2e-6)}
RANKS = (2, 8, 64)


def ring_allreduce_s(nbytes: float, ranks: int, beta: float, alpha: float) -> float:
    """Seconds for a ring allreduce of `nbytes` over `ranks` processes."""
    if ranks < 2:
        return 0.0
    return 2 * (ranks - 1) * alpha + 2 * (ranks - 1) / ranks * nbytes / beta


def predicted_step_s(measured: dict, ranks: int, beta: float, alpha: float, overlap: bool = True) -> float:
    """The step on `ranks` machines from one rank's measured timeline (see the module docstring)."""
    buckets = measured["buckets"]
    loss = ring_allreduce_s(8, ranks, beta, alpha)
    if not overlap:
        return measured["backward_s"] + sum(ring_allreduce_s(b, ranks, beta, alpha) for _, b in buckets) \
            + loss + measured["apply_s"]
    finish = 0.0
    for start, nbytes in buckets:
        finish = max(start, finish) + ring_allreduce_s(nbytes, ranks, beta, alpha)
    return max(measured["backward_s"], finish) + loss + measured["apply_s"]


def _mlp_step(key: str, sg, bucket_mb: float):
    from .models import LR, select
    model = select(key)[0]
    loss, params = model.symgrad_loss(sg)
    step = sg.distributed.train_step(loss, params, sg.optim.SGD(lr=LR), backend="c", bucket_cap_mb=bucket_mb)
    xb, yb = model.data()
    return lambda: step(x=xb, y=yb), step


def _gpt_step(key: str, sg, bucket_mb: float):
    from .gpt import BETAS, CONFIGS, LR, setup
    bench = CONFIGS[key]
    model, _, xb, yb = setup(bench)
    idx = sg.input("idx", (bench.batch, bench.context), dtype="int64")
    targets = sg.input("targets", (bench.batch, bench.context), dtype="int64")
    V = model.config.vocab_size
    loss = sg.cross_entropy(sg.reshape(model(idx), (-1, V)), sg.reshape(targets, (-1,)))
    step = sg.distributed.train_step(loss, optimizer=model.configure_optimizers(0.0, LR, BETAS),
                                     backend="c", bucket_cap_mb=bucket_mb)
    return lambda: step(idx=xb, targets=yb), step


def measure(key: str, steps: int, bucket_mb: float) -> dict:
    """One rank's timeline of `key`'s step: medians of backward, apply and each bucket's start."""
    import symgrad as sg
    run, step = (_gpt_step if key in ("small", "nanogpt") else _mlp_step)(key, sg, bucket_mb)
    for _ in range(2):
        run()
    backward, apply, starts = [], [], []
    for _ in range(steps):
        run()
        backward.append(step.backward_s)
        apply.append(step.apply_s)
        starts.append(step.started_s)
    return {"model": key, "backward_s": statistics.median(backward), "apply_s": statistics.median(apply),
            "buckets": [(statistics.median(s[b] for s in starts), bucket.nbytes) for b, bucket in enumerate(step.buckets)]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ddp_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="B128,C512,small,nanogpt")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    args = parser.parse_args(argv)
    rows = [measure(key, args.steps, args.bucket_mb) for key in args.models.split(",")]
    print("One rank, measured here (ms): forward + backward, update, and each bucket's start in the backward "
          f"(buckets of at most {args.bucket_mb:g} MiB, the first 1 MiB):\n")
    print("| model | gradients (MiB) | forward + backward | update | buckets: start ms (MiB) |")
    print("| --- | --- | --- | --- | --- |")
    for m in rows:
        total = sum(b for _, b in m["buckets"]) / 2**20
        buckets = ", ".join(f"{1e3 * s:.2f} ({b / 2**20:.2f})" for s, b in m["buckets"])
        print(f"| {m['model']} | {total:.2f} | {1e3 * m['backward_s']:.2f} | {1e3 * m['apply_s']:.2f} | {buckets} |")
    for network, (beta, alpha) in NETWORKS.items():
        print(f"\nPredicted step on N machines, {network} (ms; efficiency = step(1) / step(N); without overlap "
              f"in brackets):\n")
        print("| model | step(1) | " + " | ".join(f"N = {n}" for n in RANKS) + " |")
        print("| --- | --- | " + " | ".join("---" for _ in RANKS) + " |")
        for m in rows:
            one = predicted_step_s(m, 1, beta, alpha)
            cells = []
            for n in RANKS:
                t, flat = predicted_step_s(m, n, beta, alpha), predicted_step_s(m, n, beta, alpha, overlap=False)
                cells.append(f"{1e3 * t:.2f} ({one / t:.0%}) [{1e3 * flat:.2f}]")
            print(f"| {m['model']} | {1e3 * one:.2f} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
