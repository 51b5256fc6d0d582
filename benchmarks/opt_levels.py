"""-O2 against -O3 for a step's kernels, per kind of kernel, and the build time each costs.

    python -m benchmarks.opt_levels                       # GPT small and the CNN, native build
    python -m benchmarks.opt_levels --march x86-64-v3     # the AVX2 build
    python -m benchmarks.opt_levels --models gpt-small --rounds 6 --steps 10

Each model's step is compiled twice, its program with `-O2` and with `-O3` (the runtime
library, the GEMMs, keeps its default flags in both: only the generated kernels differ), each
in a fresh cache so the build time is a compile. The two steps are then profiled in alternating
rounds (`step.profile`, the clock read around each kernel call by the generated code itself) and
the median per kind of kernel (loops, reductions, row kernels, fused matmuls, attention, ...) is
compared: a kind whose -O3 time is not below its -O2 time gains nothing from -O3. The step's
wall time and the build's seconds are compared the same way.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager

from . import THREADS

LEVELS = ("-O2", "-O3")


def _with_march(flags: list[str], march: str | None) -> list[str]:
    return [f"-march={march}" if march and f.startswith("-march=") else f for f in flags]


@contextmanager
def _program_flags(level: str, march: str | None):
    """Compile programs with `level` (and `-march`), the runtime library with its defaults."""
    import os

    from symgrad.backends.build import cache, runtime
    from symgrad.backends.build.vector_width import vector_flags
    build, defaults = runtime.build, _with_march(cache.default_flags(), march)
    defaults += vector_flags(defaults)  # the width programs get with these flags (runtime.default_flags)
    # Asked while SYMGRAD_CFLAGS below holds the program's flags: the runtime's are fixed first.
    runtime.build = lambda _flags=None: build(defaults)
    os.environ["SYMGRAD_CFLAGS"] = " ".join(_with_march([level if f.startswith("-O") else f
                                                         for f in cache.default_flags()], march))
    try:
        yield
    finally:
        runtime.build = build
        del os.environ["SYMGRAD_CFLAGS"]


def _step(model: str):
    """A fresh train step of `model` (gpt-small, gpt-nanogpt, cnn-resnet, cnn-lenet), as the
    benchmarks.gpt / benchmarks.cnn runners build it, and its inputs by name."""
    from . import cnn, gpt
    if model.startswith("gpt-"):
        bench = gpt.CONFIGS[model[4:]]
        _, state, x, y = gpt.setup(bench)
        return gpt.symgrad_step(bench, state, "c"), {"idx": x, "targets": y}
    bench = cnn.CONFIGS[model[4:]]
    _, state, _, x, y = cnn.setup(bench)
    return cnn.symgrad_step(bench, state, x, y, "c"), {"x": x, "y": y}


def _kinds(profile) -> dict:
    """Seconds per step by kind of kernel."""
    kinds: dict[str, float] = {}
    for row in profile.rows:
        kinds[row.kind] = kinds.get(row.kind, 0.0) + row.seconds
    return kinds


def measure(model: str, rounds: int, steps_per_profile: int, march: str | None) -> dict:
    """Build times, and per round the profile of each level's step, alternating."""
    import os

    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
    steps, built = {}, {}
    for level in LEVELS:
        with tempfile.TemporaryDirectory(prefix="opt-levels-") as directory, _program_flags(level, march):
            os.environ["SYMGRAD_CACHE_DIR"] = directory
            from symgrad.backends.build import runtime
            runtime.build(None)     # not part of the timed build
            start = time.perf_counter()
            steps[level] = _step(model)
            built[level] = time.perf_counter() - start
            step, inputs = steps[level]
            step.profile(steps=1, **inputs)   # its profiling build, at this level too
    samples = {level: [] for level in LEVELS}
    for _ in range(rounds):
        for level in LEVELS:
            step, inputs = steps[level]
            samples[level].append(step.profile(steps=steps_per_profile, **inputs))
    return {"model": model, "build_s": built, "samples": samples}


def render(result: dict) -> str:
    """A Markdown table: per kind, ms per step at -O2 and -O3 (medians over the rounds) and their ratio."""
    samples = result["samples"]
    kinds = sorted({kind for level in LEVELS for p in samples[level] for kind in _kinds(p)})
    lines = [f"{result['model']}: build {result['build_s']['-O2']:.2f} s at -O2, {result['build_s']['-O3']:.2f} s "
             f"at -O3; ms per step, median of {len(samples['-O2'])} alternating rounds:", "",
             "| kernels | -O2 | -O3 | -O3 / -O2 |", "| --- | --- | --- | --- |"]
    for kind in [*kinds, "step (wall)"]:
        values = {}
        for level in LEVELS:
            values[level] = statistics.median(p.wall if kind == "step (wall)" else _kinds(p).get(kind, 0.0)
                                              for p in samples[level]) * 1e3
        ratio = values["-O3"] / values["-O2"] if values["-O2"] else float("nan")
        lines.append(f"| {kind} | {values['-O2']:.3f} | {values['-O3']:.3f} | {ratio:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt-small,cnn-resnet", help="comma list: gpt-small, gpt-nanogpt, "
                                                                        "cnn-resnet, cnn-lenet")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="steps per profile")
    parser.add_argument("--march", default=None, help="e.g. x86-64-v3: the AVX2 build")
    args = parser.parse_args(argv)
    for model in args.models.split(","):
        print(render(measure(model.strip(), args.rounds, args.steps, args.march)), flush=True)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
