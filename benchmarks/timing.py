"""Timing one runner: warm-up, then the median over blocks of several steps each.

A block runs `steps` training steps back to back and then reads the last
loss as a float, which waits for asynchronous systems (JAX) to finish; the
block's time divided by `steps` is one sample. The median of the samples is
the result, robust to the odd block that another process interrupts.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

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


FULL = Plan()
QUICK = Plan(blocks=7, block_s=0.01, min_steps=1, warmup_steps=2, warmup_s=0.02)


def measure(runner: Runner, plan: Plan) -> dict:
    """Time `runner` by `plan`; returns microseconds per step and the losses seen.

    Keys: us_per_step (median), us_min, us_max, blocks, steps_per_block,
    warmup_steps, first_s (the first call: where JIT compilers compile),
    loss_first (after the first step's forward), loss_last.
    """
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
    samples = []
    for _ in range(plan.blocks):
        t0 = time.perf_counter()
        for _ in range(steps):
            out = runner.step()
        loss_last = runner.to_float(out)
        samples.append((time.perf_counter() - t0) / steps * 1e6)
    return {
        "us_per_step": statistics.median(samples),
        "us_min": min(samples),
        "us_max": max(samples),
        "blocks": plan.blocks,
        "steps_per_block": steps,
        "warmup_steps": warm,
        "first_s": first_s,
        "loss_first": loss_first,
        "loss_last": loss_last,
    }
