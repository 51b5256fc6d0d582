"""Gradient buckets of a data-parallel step: which gradients travel together, and when each can go.

DistributedDataParallel's idea, decided once from the static program instead of
at run time: gradients are grouped, in the order the backward finishes them,
into buckets of at most `cap` bytes (the first one smaller, so that sending
starts early), one dtype per bucket. A bucket can be sent as soon as its last
gradient is final; where the compiled program says when that is
(the C program's gradients_final_after, beside its hook), the
bucket's allreduce starts there, while the rest of the backward runs.

`plan_buckets` is a pure function over plain data; `describe` is the report's text.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backends.report import format_bytes

#: DDP's defaults: buckets of 25 MiB, the first of 1 MiB.
DEFAULT_CAP_MB = 25.0
FIRST_CAP_MB = 1.0
MiB = 1 << 20


@dataclass(frozen=True)
class Gradient:
    """One gradient buffer: its variable name, the parameter it belongs to, dtype and size, and the
    kernel after which it is final in the call (position and name; None: only after the call)."""

    name: str
    param: str
    dtype: np.dtype
    numel: int
    final_after: int | None = None
    kernel: str | None = None

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class Bucket:
    """Gradients sent by one allreduce, packed in this order; `starts_after` is the kernel after
    which the last of them is final (None: after the call returns)."""

    index: int
    gradients: tuple[Gradient, ...]
    starts_after: int | None
    kernel: str | None

    @property
    def dtype(self) -> np.dtype:
        return self.gradients[0].dtype

    @property
    def numel(self) -> int:
        return sum(g.numel for g in self.gradients)

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.gradients)


def plan_buckets(gradients: list[Gradient], cap_bytes: int, first_cap_bytes: int | None = None) -> list[Bucket]:
    """Buckets over `gradients`, taken in the order they become final (those final only after the
    call last, in the order given): a new bucket starts where the next gradient would take the
    current one past its cap (`first_cap_bytes` for the first, default min(1 MiB, cap)) or has
    another dtype. A gradient larger than the cap is a bucket of its own."""
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be positive, got {cap_bytes} bytes")
    first_cap = min(FIRST_CAP_MB * MiB, cap_bytes) if first_cap_bytes is None else first_cap_bytes
    known = [g for g in gradients if g.final_after is not None]
    ordered = sorted(known, key=lambda g: g.final_after) + [g for g in gradients if g.final_after is None]
    groups: list[list[Gradient]] = []
    for g in ordered:
        current = groups[-1] if groups else None
        limit = first_cap if len(groups) == 1 else cap_bytes  # the current bucket's cap
        if current is None or current[0].dtype != g.dtype or sum(x.nbytes for x in current) + g.nbytes > limit:
            groups.append([g])
        else:
            current.append(g)
    buckets = []
    for k, members in enumerate(groups):
        afters = [g.final_after for g in members]
        if any(a is None for a in afters):
            starts, kernel = None, None
        else:
            last = max(members, key=lambda g: g.final_after)
            starts, kernel = last.final_after, last.kernel
        buckets.append(Bucket(k, tuple(members), starts, kernel))
    return buckets


def describe(buckets: list[Bucket], kernels: int | None, ranks: int) -> list[str]:
    """The report's lines: each bucket's gradients, bytes, and where its allreduce starts, and the
    bytes each rank sends and receives per step in a ring allreduce (2 (N - 1) / N of the total)."""
    total = sum(b.nbytes for b in buckets)
    lines = [f"{len(buckets)} gradient bucket(s), {format_bytes(total)} in all; a ring allreduce moves "
             f"2(N-1)/N of that per rank and step: {format_bytes(2 * (ranks - 1) / ranks * total)} at N = {ranks}"]
    for b in buckets:
        where = (f"after kernel {b.kernel} ({b.starts_after + 1} of {kernels}), during the backward"
                 if b.starts_after is not None else "after the call returns")
        names = ", ".join(g.param for g in b.gradients)
        lines.append(f"  bucket {b.index}: {len(b.gradients)} gradient(s), {format_bytes(b.nbytes)} {b.dtype.name} "
                     f"[{names}]; allreduce starts {where}")
    return lines

