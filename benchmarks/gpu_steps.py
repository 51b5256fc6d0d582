"""A few training steps of small models on backend="cuda", each beside the same steps on the NumPy
reference: the program compute-sanitizer watches in benchmarks/gpu_check.sh.

    python benchmarks/gpu_steps.py                       # models A, B, the small GPT, LeNet, a ResNet; 3 steps
    python benchmarks/gpu_steps.py --models A,gpt --steps 2 --backend numpy   # a dry run without a GPU

Prints one line per model (the largest relative loss difference over the steps and the largest
relative difference of any parameter at the end) and exits 1 if one exceeds the float32 tolerance
(1e-4, issue 7's CUDA tolerance). Imports no torch: the process under the sanitizer stays small.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import symgrad as sg  # noqa: E402
from symgrad import nn  # noqa: E402

from benchmarks.cnn_models import lenet, resnet  # noqa: E402
from benchmarks.gpt_models import load_example  # noqa: E402
from benchmarks.models import MODELS  # noqa: E402

RTOL = 1e-4


def mlp(key: str, backend: str, steps: int):
    """Model A/B/C of benchmarks/models.py: SGD on its fixed batch."""
    model = MODELS[key]
    loss, params = model.symgrad_loss(sg)
    step = sg.train_step(loss, params, sg.optim.SGD(lr=0.1), backend=backend)
    x, y = model.data()
    return step, [step(x=x, y=y) for _ in range(steps)]


def gpt(backend: str, steps: int):
    """The small GPT of tests/nn/test_gpt.py: AdamW with clipping, batch 3, context 8."""
    example = load_example()
    config = example.GPTConfig(vocab_size=256, block_size=8, n_layer=2, n_head=2, n_embd=16)
    sg.manual_seed(0)
    model = example.GPT(config, dtype="float32")
    step = example.build_step(model, sg.Dim("B"), config.block_size, lr=3e-3, backend=backend, dtype="float32")
    text = np.frombuffer(Path(example.__file__).read_bytes(), dtype=np.uint8)
    batches = example.batches(text, 3, config.block_size, np.random.default_rng(3))
    losses = []
    for _ in range(steps):
        x, y = next(batches)
        losses.append(step(idx=x, targets=y))
    return step, losses


def lenet_step(backend: str, steps: int):
    """LeNet-5 with Adam on batches of 4 (tests/nn/test_lenet.py's network)."""
    sg.manual_seed(0)
    model = lenet(nn)
    x = sg.input("x", (sg.Dim("B"), 1, 28, 28))
    y = sg.input("y", (sg.Dim("B"),), dtype="int64")
    step = sg.train_step(sg.cross_entropy(model(x), y), model.parameters(), sg.optim.Adam(lr=2e-3), backend=backend)
    rng = np.random.default_rng(21)
    losses = []
    for _ in range(steps):
        losses.append(step(x=rng.random((4, 1, 28, 28), dtype=np.float32), y=rng.integers(0, 10, 4)))
    return step, losses


def resnet_step(backend: str, steps: int):
    """benchmarks/cnn_models.py's residual network at 16 channels (BatchNorm2d, SGD with momentum) on
    batches of 4 images of 3x12x12."""
    sg.manual_seed(0)
    model = resnet(nn, channels=16)
    x = sg.input("x", (4, 3, 12, 12))
    y = sg.input("y", (4,), dtype="int64")
    step = sg.train_step(sg.cross_entropy(model(x), y), model.parameters(), sg.optim.SGD(lr=0.02, momentum=0.9),
                         backend=backend)
    rng = np.random.default_rng(5)
    losses = []
    for _ in range(steps):
        losses.append(step(x=rng.standard_normal((4, 3, 12, 12), dtype=np.float32), y=rng.integers(0, 10, 4)))
    return step, losses


RUNS = {"A": lambda b, n: mlp("A64", b, n), "B": lambda b, n: mlp("B128", b, n), "C": lambda b, n: mlp("C512", b, n),
        "gpt": gpt, "lenet": lenet_step,
        "resnet": resnet_step}


def relative(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(1.0, float(np.max(np.abs(want)))))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="A,B,gpt,lenet,resnet", help=f"comma list of {sorted(RUNS)}")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--no-reference", action="store_true", help="skip the NumPy reference run")
    args = parser.parse_args(argv)
    failed = 0
    for name in args.models.split(","):
        started = time.perf_counter()
        step, losses = RUNS[name](args.backend, args.steps)
        elapsed = time.perf_counter() - started
        params = {k: np.array(v) for k, v in step.params.items()}
        line = f"{name:6s} {args.backend}: losses {' '.join(f'{v:.6f}' for v in losses)} ({elapsed:.1f} s)"
        if not args.no_reference:
            ref_step, ref_losses = RUNS[name]("numpy", args.steps)
            loss_err = relative(losses, ref_losses)
            param_err = max(relative(params[k], v) for k, v in ref_step.params.items())
            ok = loss_err <= RTOL and param_err <= RTOL and all(np.isfinite(losses))
            failed += not ok
            line += f"  vs numpy: loss {loss_err:.2e} params {param_err:.2e} {'ok' if ok else 'FAIL'}"
        close = getattr(step, "close", None)
        if close is not None:
            close()
        print(line, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
