"""Compile latency in fresh processes: symgrad cold/warm against torch.compile cold/warm.

Each measurement is a new Python process (`--worker`), so nothing is cached
in memory. What one measurement times, imports excluded (both are reported
separately as import_s):

- symgrad: from building model B's graph (sg.input, ..., sg.train_step) to
  the loaded native module (`compile_s`), and on to the end of the first
  training step (`first_step_s`, the number compared with torch); and the
  compile proper, the seconds inside `sg.train_step` alone (`train_step_s`:
  from the loss graph to the returned step, its program loaded and its
  variables allocated, without building the model or running a step);
- torch.compile: from building the nn.Module, optimizer and
  torch.compile(step) to the end of the first call of the compiled step,
  which is where torch compiles (`first_step_s`).

Cold: an empty cache directory (SYMGRAD_CACHE_DIR, or TORCHINDUCTOR_CACHE_DIR),
except for symgrad's C runtime (the GEMMs, built once per compiler and flags, not
per model), which an untimed process builds first and whose build time is reported
on its own; warm: the next process given the same directory. Every repeat gets fresh
directories. Run alone with `python -m benchmarks.compile_latency`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import THREADS

REPO = Path(__file__).resolve().parent.parent
MODEL = "B128"
COLD_TARGET = 0.2      # symgrad cold <= 1/5 of torch.compile cold
WARM_TARGET_S = 0.05   # symgrad warm <= 50 ms
_MARK = "LATENCY-JSON "


# The worker: one measurement, in its own process ----------------------------------------------


# The real models (issue 34): the GPT configs of benchmarks.gpt (and the small one 12 layers deep:
# depth should cost calls, not compile time) and the residual network of benchmarks.cnn, each
# timed from building the model to the end of its first step.
GPT_MODELS = {"gpt-small": ("small", None), "gpt-small-12": ("small", 12), "gpt-nanogpt": ("nanogpt", None)}
CNN_MODELS = {"cnn-resnet": "resnet", "cnn-lenet": "lenet"}


def _time_train_step() -> list:
    """Have every `sg.train_step` call add its seconds to the list returned (the compile proper:
    a benchmark's runner calls it through the module, as users do)."""
    import symgrad
    spent: list = []
    real = symgrad.train_step

    def train_step(*args, **kwargs):
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)
    symgrad.train_step = train_step
    return spent


def _real_model(system: str, backend: str, model_key: str) -> dict:
    """One first-step measurement of a GPT or CNN config (symgrad, torch = torch.compile, or jax)."""
    import dataclasses

    if model_key in GPT_MODELS:
        from . import gpt as bench_module
        config, layers = GPT_MODELS[model_key]
        bench = bench_module.CONFIGS[config]
        bench = dataclasses.replace(bench, layers=layers) if layers else bench
    else:
        from . import cnn as bench_module
        bench = bench_module.CONFIGS[CNN_MODELS[model_key]]
    t0 = time.perf_counter()
    spent = None
    if system == "symgrad":
        spent = _time_train_step()
        build = bench_module.symgrad_runner(backend)
    elif system == "torch":
        import torch  # noqa: F401
        build = bench_module.torch_runner(compiled=True)
    else:
        import jax  # noqa: F401
        build = bench_module.jax_runner
    t1 = time.perf_counter()
    made = bench_module.setup(bench)   # the model, its initial state and a batch: part of the time
    runner = build(bench, *made)
    t2 = time.perf_counter()
    loss = runner.to_float(runner.step())
    t3 = time.perf_counter()
    return {"status": "ok", "import_s": t1 - t0, "compile_s": t2 - t1, "first_step_s": t3 - t1, "loss": loss,
            **({"train_step_s": sum(spent)} if spent else {})}


def _worker(system: str, backend: str, model_key: str) -> dict:
    from .models import MODELS, SMOKE
    from . import systems

    if system != "runtime" and (model_key in GPT_MODELS or model_key in CNN_MODELS):
        return _real_model(system, backend, model_key)
    if system == "jax":
        return {"status": "unavailable", "reason": "jax is timed on the GPT and CNN models only"}
    model = None if system == "runtime" else {**MODELS, **SMOKE}[model_key]
    t0 = time.perf_counter()
    if system == "runtime":
        # The C runtime (GEMMs, once per compiler and flags): built into the cache before a cold
        # model compile, which it is not part of, and timed on its own.
        from symgrad.backends.build import runtime
        t1 = time.perf_counter()
        runtime.build()
        return {"status": "ok", "import_s": t1 - t0, "compile_s": time.perf_counter() - t1,
                "first_step_s": time.perf_counter() - t1}
    spent = None
    if system == "symgrad":
        spent = _time_train_step()
        if backend == "c" and not _has_c_backend():
            return {"status": "unavailable",
                    "reason": "symgrad/backends/c.py does not exist yet (the C backend is not built)"}
        t1 = time.perf_counter()
        runner = systems.symgrad_step(model, backend)
    else:
        import torch  # noqa: F401
        t1 = time.perf_counter()
        runner = systems.build_torch_compile(model)
    t2 = time.perf_counter()
    loss = runner.to_float(runner.step())
    t3 = time.perf_counter()
    return {"status": "ok", "import_s": t1 - t0, "compile_s": t2 - t1, "first_step_s": t3 - t1,
            "loss": loss, **({"train_step_s": sum(spent)} if spent else {})}


def _has_c_backend() -> bool:
    import importlib.util
    return importlib.util.find_spec("symgrad.backends.c") is not None


# The driver -------------------------------------------------------------------------------


def run_once(system: str, cache_dir: str, backend: str = "c", model: str = MODEL,
             timeout: float = 600) -> dict:
    """One fresh-process measurement of `system` ("symgrad", "torch", or "runtime": symgrad's C runtime
    alone) with `cache_dir` as its cache."""
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), PYTHONPATH=os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    if system in ("symgrad", "runtime"):
        env["SYMGRAD_CACHE_DIR"] = cache_dir
    elif system == "jax":
        env["JAX_COMPILATION_CACHE_DIR"] = cache_dir   # jax's persistent cache, if it is enabled
    else:
        # Both of torch's on-disk caches (FX graphs, AOT autograd) live in this directory.
        env.update(TORCHINDUCTOR_CACHE_DIR=cache_dir, TORCHINDUCTOR_FX_GRAPH_CACHE="1",
                   TORCHINDUCTOR_AUTOGRAD_CACHE="1")
    cmd = [sys.executable, "-m", "benchmarks.compile_latency", "--worker", system,
           "--backend", backend, "--model", model]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "error", "reason": f"timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
    return {"status": "error", "reason": f"worker exited {proc.returncode}: " + " | ".join(tail)}


def _median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get("status") == "ok" and r.get(key) is not None]
    return statistics.median(values) if values else None


def measure(systems=("symgrad", "torch"), repeats: int = 1, backend: str = "c",
            model: str = MODEL) -> dict:
    """Cold and warm latency for each system, median over `repeats`, plus the ratios and targets."""
    out: dict = {"model": model, "repeats": repeats, "symgrad_backend": backend,
                 "measures": "seconds from graph/model construction to the end of the first "
                             "training step, imports excluded (symgrad compile_s: to the loaded module)"}
    runtime_runs = []
    for system in systems:
        cold_runs, warm_runs = [], []
        for _ in range(repeats):
            with tempfile.TemporaryDirectory(prefix=f"latency-{system}-") as cache:
                if system == "symgrad" and backend == "c":  # cold: a new model, the runtime built
                    runtime_runs.append(run_once("runtime", cache, backend, model))
                cold_runs.append(run_once(system, cache, backend, model))
                warm_runs.append(run_once(system, cache, backend, model))
        failed = next((r for r in cold_runs + warm_runs if r.get("status") != "ok"), None)
        out[system] = {
            "status": "ok" if failed is None else failed["status"],
            "reason": None if failed is None else failed["reason"],
            "cold": cold_runs, "warm": warm_runs,
            "cold_s": _median(cold_runs, "first_step_s"), "warm_s": _median(warm_runs, "first_step_s"),
            "cold_compile_s": _median(cold_runs, "compile_s"),
            "warm_compile_s": _median(warm_runs, "compile_s"),
            "cold_train_step_s": _median(cold_runs, "train_step_s"),
            "warm_train_step_s": _median(warm_runs, "train_step_s"),
        }
    if runtime_runs:
        out["runtime_build_s"] = _median(runtime_runs, "compile_s")
    sg, tc = out.get("symgrad", {}), out.get("torch", {})
    if sg.get("cold_s") and tc.get("cold_s"):
        out["cold_ratio"] = sg["cold_s"] / tc["cold_s"]
        out["cold_meets_target"] = out["cold_ratio"] <= COLD_TARGET
    if sg.get("warm_s") is not None:
        out["warm_meets_target"] = sg["warm_s"] <= WARM_TARGET_S
        if tc.get("warm_s"):
            out["warm_ratio"] = sg["warm_s"] / tc["warm_s"]
    return out


def render(result: dict) -> str:
    """A Markdown table of the latencies, with the issue's targets."""
    def cell(system: str, key: str) -> str:
        entry = result.get(system)
        if entry is None:
            return "not run"
        if entry.get(key) is None:
            return "n/a" if entry.get("status") == "ok" else f"{entry['status']}: {entry.get('reason')}"
        return f"{entry[key]:.3f} s"

    sg_name = f"symgrad ({result['symgrad_backend']})"
    lines = [
        f"Compile latency, model {result['model']}, fresh processes (median of {result['repeats']}); "
        f"{result['measures']}:",
        "",
        "| system | cold | warm |",
        "| --- | --- | --- |",
        f"| {sg_name}, first step | {cell('symgrad', 'cold_s')} | {cell('symgrad', 'warm_s')} |",
        f"| {sg_name}, to loaded module | {cell('symgrad', 'cold_compile_s')} "
        f"| {cell('symgrad', 'warm_compile_s')} |",
        f"| {sg_name}, sg.train_step alone | {cell('symgrad', 'cold_train_step_s')} "
        f"| {cell('symgrad', 'warm_train_step_s')} |",
        f"| torch.compile, first call | {cell('torch', 'cold_s')} | {cell('torch', 'warm_s')} |",
    ]
    if "jax" in result:
        lines.append(f"| jax.jit, first call | {cell('jax', 'cold_s')} | {cell('jax', 'warm_s')} |")
    cold = f"{result['cold_ratio']:.3f}" if "cold_ratio" in result else "n/a"
    warm = f"{result['symgrad']['warm_s'] * 1e3:.1f} ms" \
        if result.get("symgrad", {}).get("warm_s") is not None else "n/a"
    verdict = lambda key: "" if key not in result else (" met" if result[key] else " MISSED")  # noqa: E731
    lines += [
        f"| symgrad / torch.compile | {cold} (target <= {COLD_TARGET}){verdict('cold_meets_target')} "
        f"| {warm} (target <= {WARM_TARGET_S * 1e3:.0f} ms){verdict('warm_meets_target')} |",
    ]
    if result.get("runtime_build_s") is not None:
        lines += ["", f"Cold means a new model: the C runtime (the GEMMs), built once per compiler and flags, "
                      f"was in the cache; building it took {result['runtime_build_s']:.2f} s."]
    return "\n".join(lines)


def main(argv=None) -> int:
    """CLI: the full latency measurement, or (--worker) one measurement in this process."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=["symgrad", "torch", "jax", "runtime"], help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="c", help="symgrad backend to time (default c)")
    parser.add_argument("--model", default=MODEL, help=f"model key (default {MODEL}; also "
                                                       f"{', '.join([*GPT_MODELS, *CNN_MODELS])})")
    parser.add_argument("--systems", default="symgrad,torch", help="comma list of symgrad, torch, jax")
    parser.add_argument("--repeats", type=int, default=1, help="cold/warm pairs per system (median)")
    args = parser.parse_args(argv)
    if args.worker:
        try:
            result = _worker(args.worker, args.backend, args.model)
        except Exception as exc:  # reported by the driver as the table cell
            result = {"status": "error", "reason": f"{type(exc).__name__}: {exc}"}
        print(_MARK + json.dumps(result), flush=True)
        return 0
    result = measure(tuple(s.strip() for s in args.systems.split(",") if s.strip()),
                     args.repeats, args.backend, args.model)
    print(render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
