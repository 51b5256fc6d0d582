"""A quick GPU timing: symgrad's CUDA training step beside PyTorch eager on the same GPU.

    python benchmarks/gpu_bench.py [--models A64,B128,C512,gpt-small,gpt-nanogpt,lenet,resnet] [--steps 50] [--compile]

Models A, B, C of benchmarks/models.py (SGD, cross-entropy, the same weights and batch); the GPT
configs of benchmarks/gpt.py (AdamW) and the CNNs of benchmarks/cnn.py (SGD), each system from
the same initial weights on the same batch as those CPU benchmarks build them. Each system's
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


def model_steps(key: str, compile_: bool) -> tuple[str, dict]:
    """(label, system -> (step, loss to float)) for a GPT or CNN row: the CPU benchmarks' builders
    with backend "cuda" and torch on the device."""
    import torch
    from benchmarks import cnn, gpt
    module, bench = (gpt, gpt.CONFIGS[key[4:]]) if key.startswith("gpt-") else (cnn, cnn.CONFIGS[key])
    builders = {"symgrad": module.symgrad_runner("cuda"), "eager": module.torch_runner(False, device="cuda")}
    if compile_:
        builders["compile"] = module.torch_runner(True, device="cuda")
    setup = module.setup(bench)
    runners = {}
    for name, build in builders.items():
        runner = build(bench, *setup)
        runners[name] = (runner.step, runner.to_float)
    torch.cuda.synchronize()
    return key, runners


def _compile_failed(key: str, exc: Exception) -> float:
    """A failed torch.compile is a cell of its own (NaN), not the end of the row."""
    print(f"  torch.compile failed on {key}: {str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__}")
    return float("nan")


def time_model(key: str, steps: int, compile_: bool) -> tuple[str, dict, dict]:
    """(label, system -> ms per step, system -> first loss) for one row."""
    import torch
    if key in MODELS:
        model = MODELS[key]
        times = {"symgrad": symgrad_cuda(model, steps), "eager": torch_cuda(model, steps)}
        if compile_:
            try:
                times["compile"] = torch_cuda(model, steps, compile_=True)
            except Exception as exc:  # noqa: BLE001
                times["compile"] = _compile_failed(key, exc)
        return model.label, times, {}
    label, runners = model_steps(key, compile_)
    times, first = {}, {}
    for name, (step, to_float) in runners.items():
        try:
            first[name] = to_float(step())
            times[name] = median_ms(lambda: to_float(step()), steps, torch.cuda.synchronize)
        except Exception as exc:  # noqa: BLE001
            if name != "compile":
                raise
            times[name] = _compile_failed(key, exc)
    return label, times, first


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
        try:
            label, times, first = time_model(key, args.steps, args.compile)
        except Exception as exc:  # noqa: BLE001  (a failed system is a line, not the end of the table)
            print(f"  {key} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}",
                  flush=True)
            continue
        others = min(v for k, v in times.items() if k != "symgrad" and v == v)
        row = f"{label:8s} {times['symgrad']:16.3f} {times['eager']:15.3f}"
        if args.compile:
            row += f" {times.get('compile', float('nan')):17.3f}"
        losses = "  first losses " + " ".join(f"{k} {v:.6f}" for k, v in first.items()) if first else ""
        print(row + f" {times['symgrad'] / others:17.2f}" + losses, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
