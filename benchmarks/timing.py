"""Timing runners: warm-up, then the median over blocks of several steps each.

A block runs `steps` training steps back to back and then reads the last
loss as a float, which waits for asynchronous systems (JAX) to finish; the
block's time divided by `steps` is one sample. The median of the samples is
the result, robust to the odd block that another process interrupts.

The systems compared on one model are timed side by side (`measure_side_by_side`):
round after round, each runs one block, in an order that rotates every
round. A shared machine's speed drifts over seconds (other tenants, clock
changes); measured one after the other, one system could get a fast minute
and the next a slow one, and their ratio would measure the machine. Taken
in turns, every system sees the same drift, so the ratio of medians is a
comparison of the systems. A pause before each block lets the thread
pools of the system that ran before it go idle (OpenMP, MKL and XLA workers
spin for a while after their last task), so no block shares the cores
with another system's spinning threads. 20 ms was too short beside torch
(2026-11-26, 2 vCPUs): a LeNet step measured 4.8-4.9 ms in blocks that
followed torch.compile's and 2.1 ms with a 0.5 s pause or alone, and GPT
small's systems all ran 10-40% slower (symgrad 30.7 against 22.1 ms,
torch.compile 32.3 against 25.3); 0.3 s leaves them idle. After the pause each system runs
one untimed step before its block: threads that went to sleep cost a
wake-up of 1 to 7 ms on the project's 2-vCPU VMs after 20 ms idle (a
halted vCPU; 2 us after 1 ms), which a training loop that never pauses
does not pay, and which would otherwise land on the first step of every
block of every system that uses a thread pool.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

from .systems import Runner


@dataclass(frozen=True)
class Plan:
    """How long to measure: `blocks` samples of `steps` steps (or enough steps for `block_s`)."""

    blocks: int = 21               # at least 20, odd so the median is one sample
    block_s: float = 0.05          # aim for blocks this long when `steps` is not fixed
    min_steps: int = 3             # "each block several steps"
    steps: int | None = None       # fixed steps per block (overrides block_s / min_steps)
    warmup_steps: int = 3          # at least this many warm-up steps...
    warmup_s: float = 0.3          # ...and at least this long, so caches and JITs settle
    settle_s: float = 0.3          # pause before each block (untimed): other systems' threads go idle;
                                   # then one untimed step wakes this system's own (see the module doc)


FULL = Plan()
QUICK = Plan(blocks=7, block_s=0.01, min_steps=1, warmup_steps=2, warmup_s=0.02, settle_s=0.0)


@dataclass
class _Timed:
    """One runner being measured: what its warm-up found, and its samples so far."""

    runner: Runner
    steps: int
    result: dict
    samples: list


def _warm_up(runner: Runner, plan: Plan) -> _Timed:
    """The first call (timed apart: JIT compilers compile there), then the warm-up; sizes the blocks."""
    start = time.perf_counter()
    loss_first = runner.to_float(runner.step())
    first_s = time.perf_counter() - start

    warm, warm_start = 1, time.perf_counter()
    while warm < plan.warmup_steps or time.perf_counter() - warm_start < plan.warmup_s:
        out = runner.step()
        warm += 1
    if warm > 1:
        runner.to_float(out)
        per_step = (time.perf_counter() - warm_start) / (warm - 1)
    else:
        per_step = first_s   # no warm-up asked for: the first call is the only estimate

    steps = plan.steps or max(plan.min_steps, math.ceil(plan.block_s / max(per_step, 1e-9)))
    result = {"blocks": plan.blocks, "steps_per_block": steps, "warmup_steps": warm,
              "first_s": first_s, "loss_first": loss_first}
    return _Timed(runner, steps, result, [])


def _block(timed: _Timed, wake: bool) -> None:
    """One sample: `steps` steps, then wait for the last loss. `wake`: one untimed step first."""
    runner = timed.runner
    if wake:
        runner.to_float(runner.step())
    t0 = time.perf_counter()
    for _ in range(timed.steps):
        out = runner.step()
    timed.result["loss_last"] = runner.to_float(out)
    timed.samples.append((time.perf_counter() - t0) / timed.steps * 1e6)


def _summary(timed: _Timed) -> dict:
    samples = timed.samples
    return {"us_per_step": statistics.median(samples), "us_min": min(samples), "us_max": max(samples),
            **timed.result}


def measure_side_by_side(runners: dict[str, Runner], plan: Plan,
                         on_error: Callable[[str, Exception], None] | None = None) -> dict[str, dict]:
    """Time every runner by `plan`, taking their blocks in turns; returns name -> result.

    Each result holds us_per_step (median), us_min, us_max, blocks, steps_per_block,
    warmup_steps, first_s (the first call: where JIT compilers compile), loss_first
    (after the first step's forward) and loss_last. A runner that raises is dropped
    from the rounds and reported to `on_error(name, exception)` (re-raised without one);
    the others go on.
    """
    timed: dict[str, _Timed] = {}

    def attempt(name: str, action: Callable[[], object]):
        try:
            return action()
        except Exception as exc:
            timed.pop(name, None)
            if on_error is None:
                raise
            on_error(name, exc)
            return None

    for name, runner in runners.items():
        warmed = attempt(name, lambda: _warm_up(runner, plan))
        if warmed is not None:
            timed[name] = warmed
    for round_ in range(plan.blocks):
        names = list(timed)
        shift = round_ % len(names) if names else 0
        for name in names[shift:] + names[:shift]:   # who goes first rotates
            if plan.settle_s:
                time.sleep(plan.settle_s)
            attempt(name, lambda: _block(timed[name], wake=bool(plan.settle_s)))
    return {name: _summary(t) for name, t in timed.items()}

