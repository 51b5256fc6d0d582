"""One benchmark step of two or more checkouts of symgrad, timed in turns in live processes.

    python -m benchmarks.checkouts gpt:small --base ../symgrad-8b8a5c1
    python -m benchmarks.checkouts cnn:lenet mlp:A64 --base DIR --rounds 30 --march x86-64-v3

Whether a change made a step slower: each checkout (this one and every `--base`, a `git worktree
add DIR REV` of another commit) builds the step of its own `benchmarks` module in a process of its
own (its symgrad, its cache directory), which stays alive; the parent then asks each in turn for a
block of steps (0.1 s of them), round after round, reversing the order every other round, each
block after the harness's settle pause (benchmarks.timing.FULL.settle_s) and one untimed step. A
model is `family:config`: `gpt:small`, `cnn:resnet`, `cnn:lenet`, `mlp:A64` (benchmarks.gpt,
benchmarks.cnn, benchmarks.models). The table gives each checkout's median ms per step and its
ratio to the first checkout (the base), as the median of the per-round ratios; a base given twice
measures the noise.

bench_step's `--base` runs two checkouts' MLP steps in one process; the GPT and CNN benchmarks
build their models through each checkout's own code, hence processes. The machine's drift over
seconds reaches every checkout alike when they take turns; fresh processes one after another
(one build, one timing each) differed by 5-15% on the same commit.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SETTLE_S = 0.3   # as benchmarks.timing.FULL.settle_s: the last block's OpenMP threads go idle
BLOCK_S = 0.1    # a block's length: enough steps that waking the threads is noise


def _worker(model: str, steps: int | None) -> None:
    """In a checkout (the working directory): build its step of `model`, say "ready", then time
    a block of `steps` steps (default: as many as take BLOCK_S) for each line read, writing one
    line of ms per step."""
    sys.path.insert(0, os.getcwd())
    family, config = model.split(":")
    if family == "mlp":
        from benchmarks import models, systems
        step = systems.symgrad_step(models.MODELS[config], "c").step
    elif family in ("gpt", "cnn"):
        import importlib
        bench_module = importlib.import_module(f"benchmarks.{family}")
        bench = bench_module.CONFIGS[config]
        step = bench_module.symgrad_runner("c")(bench, *bench_module.setup(bench)).step
    else:
        raise SystemExit(f"unknown family {family!r}: gpt, cnn or mlp")
    for _ in range(3):
        step()
    started = time.perf_counter()
    for _ in range(3):
        step()
    count = steps or max(1, round(BLOCK_S / ((time.perf_counter() - started) / 3)))
    print("ready", flush=True)
    for _ in sys.stdin:
        time.sleep(SETTLE_S)
        step()  # wakes this process's threads, untimed
        started = time.perf_counter()
        for _ in range(count):
            step()
        print((time.perf_counter() - started) / count * 1e3, flush=True)


def _start(checkout: Path, model: str, steps: int | None) -> subprocess.Popen:
    # Each checkout its own cache: a program cache keyed by one checkout's code is no use to another.
    cache = os.environ.get("SYMGRAD_CACHE_DIR", str(Path.home() / ".cache" / "symgrad"))
    env = dict(os.environ, SYMGRAD_QUIET="1", PYTHONPATH=str(checkout),
               SYMGRAD_CACHE_DIR=f"{cache}-checkout-{checkout.name}")
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", model,
               *(["--steps", str(steps)] if steps else [])]
    process = subprocess.Popen(command, cwd=checkout, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    if process.stdout.readline().strip() != "ready":
        process.kill()
        raise RuntimeError(f"{checkout}: the {model} step did not build (run its benchmark alone to see why)")
    return process


def compare(model: str, checkouts: list[Path], rounds: int, steps: int | None = None) -> list[list[float]]:
    """ms per step of each checkout's `model`, one sample per round, taken in turns."""
    processes = [_start(checkout, model, steps) for checkout in checkouts]
    samples: list[list[float]] = [[] for _ in checkouts]
    try:
        for round_ in range(rounds):
            order = range(len(checkouts)) if round_ % 2 == 0 else reversed(range(len(checkouts)))
            for k in order:
                processes[k].stdin.write("block\n")
                processes[k].stdin.flush()
                samples[k].append(float(processes[k].stdout.readline()))
    finally:
        for process in processes:
            process.stdin.close()
            process.wait()
    return samples


def table(model: str, checkouts: list[Path], samples: list[list[float]]) -> str:
    """Markdown rows: checkout, median ms per step, the median of its per-round ratios to the first."""
    rows = []
    for checkout, times in zip(checkouts, samples):
        ratio = statistics.median(t / b for t, b in zip(times, samples[0]))
        rows.append(f"| {model} | {checkout} | {statistics.median(times):.3f} | {ratio:.3f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", help="family:config, e.g. gpt:small cnn:lenet mlp:A64")
    parser.add_argument("--base", action="append", default=[], type=Path,
                        help="another checkout (repeatable); the first is the base of the ratios")
    parser.add_argument("--rounds", type=int, default=21, help="blocks per checkout (default 21)")
    parser.add_argument("--steps", type=int, help=f"steps per block (default: as many as take {BLOCK_S} s)")
    parser.add_argument("--march", help="build every checkout for this gcc -march (sets SYMGRAD_CFLAGS)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.steps)
        return 0
    if not args.base or not args.models:
        parser.error("give at least one model and one --base checkout")
    if args.march:  # inherited by every checkout's process
        from .bench_step import march_flags
        os.environ["SYMGRAD_CFLAGS"] = " ".join(march_flags(args.march))
    checkouts = [path.resolve() for path in args.base] + [REPO]
    print("| model | checkout | ms per step | ratio to the first |\n| --- | --- | --- | --- |")
    for model in args.models:
        print(table(model, checkouts, compare(model, checkouts, args.rounds, args.steps)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
