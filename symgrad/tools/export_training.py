"""What an exported train_main does beside the library, in Python: its dataset file, shuffle and schedule.

`write_dataset` writes the file train_main reads, `shuffle_order(rows, seed, epoch)` is its
per-epoch shuffle and `learning_rate` its schedule, so Python can write its data and reproduce its
run (the export back end, symgrad/backends/export/, writes train_main.c; its formats module holds the
magic and dtype codes both read). The dataset layout (all integers int64 little-endian):

    "SGDATA01"                          8 bytes of magic
    rows, arrays                        the row count, the number of arrays (the step's inputs)
    arrays x (dtype code, per_row)      DTYPE_CODES[dtype], elements per row
    the arrays, in input order          each rows x per_row elements, C order, little-endian
"""

from __future__ import annotations

import math

import numpy as np

from ..backends.export.formats import DTYPE_CODES, MAGIC
_MIX = 0x9E3779B97F4A7C15  # splitmix64's increment: the shuffle's generator (train_main.c's too)
_MASK = (1 << 64) - 1


def learning_rate(step: int, peak: float, warmup: int, total: int, schedule: str = "cosine",
                  floor_ratio: float = 0.1) -> float:
    """train_main's learning rate at `step` (from 0): linear warmup to `peak` over `warmup` steps,
    then `peak` ("constant"), or a cosine decay to floor_ratio * peak at `total` ("cosine"):
    examples/gpt.py's schedule, computed as train_main computes it (in double)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    if schedule == "constant":
        return peak
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor_ratio + (1 - floor_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def write_dataset(path, arrays) -> None:
    """Write arrays (the step's inputs, in input order; one row per example) as train_main reads them."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    if not arrays or any(a.ndim == 0 for a in arrays):
        raise ValueError("write_dataset: give one or more arrays of at least one axis (rows first)")
    rows = arrays[0].shape[0]
    header = [rows, len(arrays)]
    for k, a in enumerate(arrays):
        dtype = a.dtype.name
        if a.shape[0] != rows or dtype not in DTYPE_CODES:
            raise ValueError(f"write_dataset: array {k} is {dtype}{list(a.shape)}; expected {rows} rows of "
                             f"one of {sorted(DTYPE_CODES)}")
        header += [DTYPE_CODES[dtype], int(np.prod(a.shape[1:], dtype=np.int64))]
    with open(path, "wb") as f:
        f.write(MAGIC + np.asarray(header, dtype="<i8").tobytes())
        for a in arrays:
            f.write(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes())


def shuffle_order(rows: int, seed: int, epoch: int) -> np.ndarray:
    """The row order of epoch `epoch` as train_main shuffles it: Fisher-Yates driven by splitmix64
    seeded with seed + (epoch + 1) * 0x9E3779B97F4A7C15 (mod 2**64)."""
    state = (seed + (epoch + 1) * _MIX) & _MASK
    order = list(range(rows))
    for i in range(rows - 1, 0, -1):
        state = (state + _MIX) & _MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        z ^= z >> 31
        j = z % (i + 1)
        order[i], order[j] = order[j], order[i]
    return np.asarray(order, dtype=np.int64)

