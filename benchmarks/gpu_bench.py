"""A quick GPU timing: symgrad's CUDA training step beside PyTorch eager on the same GPU.

    python benchmarks/gpu_bench.py [--models A64,B128,C512] [--steps 50] [--compile]

Models A, B, C of benchmarks/models.py (SGD, cross-entropy, the same weights and batch). Each system's
step is warmed up, then timed as the median of 5 blocks of --steps steps, wall clock, the device
synchronised at each block's end. symgrad's step takes host (NumPy) arrays, so every step copies the
batch to the device and the loss back; torch's batch stays on the device (its most favourable use)
and its loss is read with .item() every step, as symgrad's is. --compile adds torch.compile of the
same step function (its compile costs tens of seconds per model).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import symgrad as sg  # noqa: E402

from benchmarks.models import LR, MODELS  # noqa: E402


def median_ms(step, steps: int, sync=lambda: None, blocks: int = 5) -> float:
    for _ in range(3):
        step()
    sync()
    times = []
    for _ in range(blocks):
        started = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        times.append((time.perf_counter() - started) / steps * 1e3)
    return statistics.median(times)


def symgrad_cuda(model, steps: int) -> float:
    loss, params = model.symgrad_loss(sg)
    step = sg.train_step(loss, params, sg.optim.SGD(lr=LR), backend="cuda")
    x, y = model.data()
    try:
        return median_ms(lambda: step(x=x, y=y), steps)
    finally:
        step.close()


def torch_cuda(model, steps: int, compile_: bool = False) -> float:
    import torch
    layers = []
    for k, (W, b) in enumerate(model.weights()):
        linear = torch.nn.Linear(*W.shape)
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(W.T.copy()))
            linear.bias.copy_(torch.from_numpy(b))
        layers.append(linear)
        if k < len(model.layers) - 1:
            layers.append(torch.nn.ReLU())
    net = torch.nn.Sequential(*layers).cuda()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    x, y = (torch.from_numpy(a).cuda() for a in model.data())

    def step_fn():
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        optimizer.step()
        return loss

    fn = torch.compile(step_fn) if compile_ else step_fn
    return median_ms(lambda: fn().item(), steps, torch.cuda.synchronize)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="A64,B128,C512")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile")
    args = parser.parse_args(argv)
    import torch
    print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    header = f"{'model':8s} {'symgrad-cuda ms':>16s} {'torch-eager ms':>15s}"
    if args.compile:
        header += f" {'torch-compile ms':>17s}"
    print(header + f" {'ratio to fastest':>17s}")
    for key in args.models.split(","):
        model = MODELS[key]
        times = {"symgrad": symgrad_cuda(model, args.steps), "eager": torch_cuda(model, args.steps)}
        if args.compile:
            try:
                times["compile"] = torch_cuda(model, args.steps, compile_=True)
            except Exception as exc:  # noqa: BLE001  (a failed compile is a cell, not the end)
                print(f"  torch.compile failed on {key}: {str(exc).splitlines()[0][:200]}")
        others = min(v for k, v in times.items() if k != "symgrad")
        row = f"{model.label:8s} {times['symgrad']:16.3f} {times['eager']:15.3f}"
        if args.compile:
            row += f" {times.get('compile', float('nan')):17.3f}"
        print(row + f" {times['symgrad'] / others:17.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
