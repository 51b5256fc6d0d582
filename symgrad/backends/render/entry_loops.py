"""Which runs of an entry point's calls become loops: depth costs a loop's rounds, not lines.

    fold(keys, slots) -> list[Loop]          the loops, in run order
    arguments(slots, loop) -> list[list]     each body call's arguments: fixed, or stepping per round

A deep model's entry point calls the same functions layer after layer (kernel_functions gives the
layers' kernels one function each): the same sequence of calls, each round on buffers further on.
Where `period` consecutive calls repeat `rounds` times, and every argument that changes from round
to round moves by the same number of slots each time (the k-th layer's weight is variables[4 +
12 k], its temporaries further on in the workspace), the calls are one C loop over the rounds
whose arguments are computed from its counter. A 12-layer GPT's entry then has about as many
lines as a 4-layer one's.

`keys[i]`: what must be equal for kernel i to stand in for another's place in a later round (its
function, its status check, which storages its arguments come from, and the arguments that are no
buffer), None for a kernel never folded (one whose call the caller must see alone). `slots[i]`:
kernel i's arguments, each a (storage, index) pair for a buffer or a string for anything else.
Pure functions over plain data.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# A loop is made where it spares at least this many lines of calls: a loop's comment, its `for`
# line and its closing brace cost four, and a short one is easier to read unrolled.
MIN_SAVED = 8
# Candidates rejected (their arguments do not step evenly) before the search gives up.
MAX_REJECTED = 64


@dataclass(frozen=True)
class Loop:
    """Kernels first .. first + period * rounds - 1: `rounds` times the same `period` calls."""

    first: int
    period: int
    rounds: int

    @property
    def end(self) -> int:
        return self.first + self.period * self.rounds


def fold(keys: list, slots: list[list], lines: list[int] | None = None, min_saved: int = MIN_SAVED) -> list[Loop]:
    """The loops of an entry point whose kernels have `keys` and `slots` (the module's docstring),
    in run order, none overlapping: greedily the one sparing the most lines, then the same in what
    is left on either side of it. `lines`: each call's lines in the entry (1 each if not given)."""
    codes = _codes(keys)
    # before[i]: the lines of calls 0 .. i - 1, so a run's lines are a difference
    before = np.concatenate(([0], np.cumsum(np.ones(len(keys), np.int64) if lines is None else lines)))
    loops, rejected = [], set()
    best = {(0, len(keys)): None}   # per stretch of calls not in a loop: its best repeat, once found
    while best and len(rejected) < MAX_REJECTED:
        for segment, found in best.items():
            if found is None:
                best[segment] = _longest_repeat(codes, before, *segment, rejected) or (0, None)
        segment = max(best, key=lambda s: best[s][0])
        saved, candidate = best[segment]
        if saved < min_saved:
            break
        loop = _stepping(slots, candidate)
        if loop.rounds < 2 or before[loop.end] - before[loop.first + loop.period] < min_saved:
            rejected.add(candidate)
            best[segment] = None   # look again, without it
            continue
        loops.append(loop)
        del best[segment]
        best.update({s: None for s in ((segment[0], loop.first), (loop.end, segment[1])) if s[1] - s[0] > 1})
    return sorted(loops, key=lambda loop: loop.first)


def arguments(slots: list[list], loop: Loop) -> list[list]:
    """For each call of the loop's body (its first round's kernels), its arguments: the string
    itself where it is no buffer, ("fixed", storage, index) for a buffer every round shares, or
    ("step", storage, index, step): round l's is storage[index + step * l]."""
    body = []
    for j in range(loop.period):
        first, second = slots[loop.first + j], slots[loop.first + loop.period + j]
        row = []
        for a, b in zip(first, second):
            if isinstance(a, str):
                row.append(a)
            elif a == b:
                row.append(("fixed", *a))
            else:
                row.append(("step", a[0], a[1], b[1] - a[1]))
        body.append(row)
    return body


def _codes(keys: list) -> np.ndarray:
    """Each key as an integer, equal keys equal; None (never folded) a number of its own."""
    numbers: dict = {}
    return np.array([-1 - i if key is None else numbers.setdefault(key, len(numbers))
                     for i, key in enumerate(keys)], dtype=np.int64)


def _longest_repeat(codes: np.ndarray, before: np.ndarray, lo: int, hi: int, rejected: set):
    """(lines spared, Loop) of the repeat in codes[lo:hi] that spares the most lines (`before`:
    fold's prefix sums): a period p whose calls equal those p later, for as many rounds as they
    do; None where nothing repeats."""
    best = None
    for period in range(1, (hi - lo) // 2 + 1):
        equal = codes[lo:hi - period] == codes[lo + period:hi]
        if not equal.any():
            continue
        edges = np.flatnonzero(np.diff(np.concatenate(([0], equal.view(np.int8), [0]))))
        starts, lengths = edges[0::2], edges[1::2] - edges[0::2]
        rounds = lengths // period + 1
        first = lo + starts
        spared = before[first + rounds * period] - before[first + period]  # all rounds' lines but the first's
        for k in np.argsort(-spared, kind="stable")[:4]:   # the best few: one may be rejected
            if rounds[k] < 2:
                break
            loop = Loop(int(first[k]), period, int(rounds[k]))
            if loop not in rejected and (best is None or spared[k] > best[0]):
                best = (int(spared[k]), loop)
                break
    return best


def _stepping(slots: list[list], loop: Loop) -> Loop:
    """The loop's longest stretch of rounds whose arguments step evenly: from each round to the
    next, every buffer argument moves by the same number of slots on the same storage, and every
    other argument stays. Rounds outside it (a model's first or last layer, a parameter of a
    layer's own) are left to the calls around."""
    calls = [[slots[loop.first + j + loop.period * r] for j in range(loop.period)] for r in range(loop.rounds)]
    moves = [_move(calls[r], calls[r + 1]) for r in range(loop.rounds - 1)]
    best, run = (0, 0), 0   # (moves, first round) of the longest stretch of equal moves; the current one's length
    for r, move in enumerate(moves):
        run = run + 1 if move is not None and run and move == moves[r - 1] else int(move is not None)
        if run > best[0]:
            best = (run, r - run + 1)
    run, start = best
    return Loop(loop.first + loop.period * start, loop.period, run + 1 if run else 0)


def _move(calls: list[list], following: list[list]):
    """How each argument moves from one round's calls to the next's: a tuple of slot steps, None
    where an argument changes storage or a non-buffer argument changes."""
    steps = []
    for call, then in zip(calls, following):
        for a, b in zip(call, then):
            if isinstance(a, str) or isinstance(b, str):
                if a != b:
                    return None
            elif a[0] != b[0]:
                return None
            else:
                steps.append(b[1] - a[1])
    return tuple(steps)
