"""symgrad's GEMM beside NumPy's BLAS and torch.mm, on the products the models compute.

    python -m benchmarks.gemm [--threads 1,2] [--march x86-64-v3] [--autocast bfloat16 | --gpt] [--quick] [--json PATH]

For each thread count, a fresh process (thread pools read their size once, at load) builds one
`sg.function` per product, then times symgrad, `numpy.matmul` (its BLAS) and `torch.mm` side by
side, their blocks in turns (benchmarks/timing.py). The products are each model's forward
layer (X @ W) and the two products of its backward with their transposed operands, as the
step computes them: dX = dY @ W^T (W read transposed, no copy) and dW = X^T @ dY (X read
transposed), plus the square 1024 product. Each is reported in GFLOP/s (2·M·N·K per product)
and as a fraction of the FMA peak measured in the same process: a loop of independent vector
multiply-adds, compiled with the flags symgrad uses, run on every thread.

`--autocast bfloat16`: the GPT benchmark's layers instead (384 channels, as benchmarks.gpt's
nanoGPT config, and 768, as GPT-2 small), each product of float32 operands taken in bfloat16 with
float32 sums and its result rounded to bfloat16: symgrad's built under `sg.autocast`, torch.mm
under `torch.autocast("cpu")`. NumPy has no bfloat16 product; the ratio is symgrad's to torch's.
`--gpt`: the same GPT layers' products in float32, beside NumPy and torch.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from . import THREADS
from .timing import FULL, QUICK, Plan, measure_side_by_side
from .systems import Runner

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Product:
    """C[M x N] = A[M x K] @ B[K x N]; `a_t` / `b_t`: the operand is stored transposed."""
    label: str
    M: int
    K: int
    N: int
    a_t: bool = False
    b_t: bool = False

    @property
    def flops(self) -> float:
        return 2.0 * self.M * self.N * self.K


def _layer(name: str, batch: int, fan_in: int, fan_out: int) -> list[Product]:
    """A linear layer's three products: forward, input gradient, weight gradient."""
    return [Product(f"{name} X@W", batch, fan_in, fan_out),
            Product(f"{name} dY@W^T", batch, fan_out, fan_in, b_t=True),
            Product(f"{name} X^T@dY", fan_in, batch, fan_out, a_t=True)]


PRODUCTS = [*_layer("B", 128, 784, 256), *_layer("C", 512, 1024, 1024), Product("1024^3", 1024, 1024, 1024)]
# --autocast: a GPT block's widest layer (C -> 4C) at two widths, 1024 and 4096 tokens a step
GPT_PRODUCTS = [*_layer("GPT 384", 1024, 384, 1536), *_layer("GPT 768", 4096, 768, 3072)]

#: Independent vector FMA chains per thread: more than latency x throughput (4 x 2 on Zen), so the
#: loop runs at the FMA units' rate. Vectors as wide as symgrad's kernels use on the target
#: (64 bytes where the build chose them: symgrad.backends.build.vector_width).
PEAK_SOURCE = """
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#pragma GCC optimize ("fp-contract=fast")
#if SG_VECTOR_BYTES == 64
typedef float vec __attribute__((vector_size(64)));
#elif defined(__AVX__)
typedef float vec __attribute__((vector_size(32)));
#else
typedef float vec __attribute__((vector_size(16)));
#endif
int lanes(void) { return sizeof(vec) / sizeof(float); }
float fma_loop(int64_t iterations)
{
    float total = 0;
    #pragma omp parallel reduction(+:total)
    {
        vec m = {0}, a = {0};
        m += 0.999999f; a += 1e-7f;
        /* distinct starts: equal chains would be merged into one by the compiler */
        vec c0 = m + 1, c1 = m + 2, c2 = m + 3, c3 = m + 4, c4 = m + 5, c5 = m + 6, c6 = m + 7, c7 = m + 8,
            c8 = m + 9, c9 = m + 10, c10 = m + 11, c11 = m + 12;
        for (int64_t i = 0; i < iterations; ++i) {
            c0 = c0 * m + a; c1 = c1 * m + a; c2 = c2 * m + a; c3 = c3 * m + a;
            c4 = c4 * m + a; c5 = c5 * m + a; c6 = c6 * m + a; c7 = c7 * m + a;
            c8 = c8 * m + a; c9 = c9 * m + a; c10 = c10 * m + a; c11 = c11 * m + a;
        }
        vec s = c0 + c1 + c2 + c3 + c4 + c5 + c6 + c7 + c8 + c9 + c10 + c11;
        for (int l = 0; l < (int)(sizeof(vec) / sizeof(float)); ++l)
            total += s[l];
    }
    return total;
}
"""
PEAK_CDEF = "int lanes(void); float fma_loop(int64_t iterations);"


def fma_peak(flags: list[str] | None = None) -> float:
    """GFLOP/s of vector multiply-adds on all threads of this process (best of 5 runs)."""
    from symgrad.backends.build import cache, runtime
    lib = cache.build(PEAK_SOURCE, PEAK_CDEF, flags=flags or runtime.default_flags()).module.lib
    threads = int(os.environ["OMP_NUM_THREADS"])  # set from THREADS by the package, before OpenMP loaded
    iterations = 1 << 23  # ~0.1 s
    lib.fma_loop(iterations)  # wake the team
    best = 0.0
    for _ in range(5):
        start = time.perf_counter()
        lib.fma_loop(iterations)
        seconds = time.perf_counter() - start
        best = max(best, 12 * lib.lanes() * 2 * iterations * threads / seconds / 1e9)
    return best


def _operands(p: Product, rng):
    import numpy as np
    a = rng.standard_normal((p.K, p.M) if p.a_t else (p.M, p.K), dtype=np.float32)
    b = rng.standard_normal((p.N, p.K) if p.b_t else (p.K, p.N), dtype=np.float32)
    return a, b


def _sg_product(p: Product, A, B):
    """Product `p` of symgrad inputs A and B as stored (a transposed one read in place)."""
    import symgrad as sg
    return sg.matmul(sg.transpose(A) if p.a_t else A, sg.transpose(B) if p.b_t else B)


def _torch_operands(p: Product, a, b):
    """torch views of the stored operands in product order (transposed ones read in place)."""
    import torch
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    return (ta.t() if p.a_t else ta), (tb.t() if p.b_t else tb)


def runners(p: Product, rng) -> dict[str, Runner]:
    """symgrad, NumPy and torch computing product `p` from the same operands."""
    import numpy as np
    import torch
    import symgrad as sg
    a, b = _operands(p, rng)
    A, B = sg.input("a", a.shape), sg.input("b", b.shape)
    fn = sg.function([A, B], [_sg_product(p, A, B)], backend="c")
    na, nb = (a.T if p.a_t else a), (b.T if p.b_t else b)   # views: the BLAS reads them transposed
    ta, tb = _torch_operands(p, a, b)
    first = lambda out: float(out.reshape(-1)[0])
    expected = na.astype(np.float64) @ nb
    got = fn(a, b)[0]
    if not np.allclose(got, expected, rtol=1e-3, atol=1e-2 * np.sqrt(p.K)):
        raise AssertionError(f"{p.label}: symgrad's product differs from NumPy's")
    return {"symgrad": Runner(lambda: fn(a, b)[0], first),
            "numpy": Runner(lambda: np.matmul(na, nb), first),
            "torch": Runner(lambda: torch.mm(ta, tb), lambda out: float(out[0, 0]))}


def autocast_runners(p: Product, rng, dtype: str) -> dict[str, Runner]:
    """symgrad and torch computing product `p` of float32 operands under autocast to `dtype`."""
    import ml_dtypes
    import numpy as np
    import torch
    import symgrad as sg
    a, b = _operands(p, rng)
    A, B = sg.input("a", a.shape), sg.input("b", b.shape)
    with sg.autocast(dtype):
        product = _sg_product(p, A, B)
    fn = sg.function([A, B], [sg.cast(product, "float32")], backend="c")  # a compiled output is float32
    ta, tb = _torch_operands(p, a, b)

    def torch_product():
        with torch.autocast("cpu", dtype=getattr(torch, dtype)):
            return torch.mm(ta, tb)
    rounded = [x.astype(getattr(ml_dtypes, dtype)).astype(np.float64) for x in (a, b)]
    expected = (rounded[0].T if p.a_t else rounded[0]) @ (rounded[1].T if p.b_t else rounded[1])
    if not np.allclose(fn(a, b)[0], expected, rtol=1e-2, atol=1e-2 * np.sqrt(p.K)):
        raise AssertionError(f"{p.label}: symgrad's {dtype} product differs from the exact one")
    return {"symgrad": Runner(lambda: fn(a, b)[0], lambda out: float(out.reshape(-1)[0])),
            "torch": Runner(torch_product, lambda out: float(out[0, 0]))}


def worker(products: list[Product], plan: Plan, autocast: str | None = None) -> dict:
    """Measure in this process (its thread count set at import): the peak, then each product
    (`autocast`: under autocast to that dtype, symgrad and torch only)."""
    import numpy as np
    import torch
    torch.set_num_threads(THREADS)
    from symgrad.backends.build.runtime import default_flags
    rng = np.random.default_rng(0)
    out = {"threads": THREADS, "flags": default_flags(), "peak_gflops": fma_peak(), "autocast": autocast,
           "products": []}
    for p in products:
        timed = measure_side_by_side(autocast_runners(p, rng, autocast) if autocast else runners(p, rng), plan)
        row = {"label": p.label, "M": p.M, "K": p.K, "N": p.N}
        for name, result in timed.items():
            row[name] = p.flops / result["us_per_step"] / 1e3   # GFLOP/s
        out["products"].append(row)
        print(f"  {THREADS} thread(s) {p.label:12s} " + "  ".join(
            f"{name} {row[name]:6.1f}" for name in timed) + " GFLOP/s", file=sys.stderr, flush=True)
    return out


def render(runs: list[dict]) -> str:
    """Markdown tables, one per thread count."""
    lines = []
    for run in runs:
        peak = run["peak_gflops"]
        if run.get("autocast"):
            lines += [f"{run['threads']} thread(s), flags {' '.join(run['flags'])}, under autocast to "
                      f"{run['autocast']} (float32 FMA peak {peak:.1f} GFLOP/s)", "",
                      "| product | M x K x N | symgrad | torch.mm | symgrad / torch |", "| --- | --- | --- | --- | --- |"]
            lines += [f"| {row['label']} | {row['M']}x{row['K']}x{row['N']} | {row['symgrad']:.1f} | "
                      f"{row['torch']:.1f} | {row['symgrad'] / row['torch']:.2f} |" for row in run["products"]]
            lines.append("")
            continue
        lines += [f"{run['threads']} thread(s), flags {' '.join(run['flags'])}, measured FMA peak "
                  f"{peak:.1f} GFLOP/s", "",
                  "| product | M x K x N | symgrad | numpy (BLAS) | torch.mm | symgrad / numpy | symgrad / peak |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for row in run["products"]:
            lines.append(f"| {row['label']} | {row['M']}x{row['K']}x{row['N']} | {row['symgrad']:.1f} | "
                         f"{row['numpy']:.1f} | {row['torch']:.1f} | {row['symgrad'] / row['numpy']:.2f} | "
                         f"{row['symgrad'] / peak:.0%} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Run the benchmark for each thread count in a fresh process; print the tables, write JSON."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gemm", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2", help="comma list of thread counts (default 1,2)")
    parser.add_argument("--march", help="build symgrad and the peak loop for this -march (e.g. x86-64-v3) "
                                        "instead of the default flags")
    parser.add_argument("--autocast", choices=["bfloat16"], help="the GPT layers' products under autocast to "
                                                                 "this dtype, beside torch's")
    parser.add_argument("--gpt", action="store_true", help="the GPT layers' products (as --autocast) in float32")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK.blocks} short blocks: a look, not a result")
    parser.add_argument("--json", type=Path, help="where to write the results (default results/gemm-<time>.json)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.worker:
        print(json.dumps(worker(GPT_PRODUCTS if args.autocast or args.gpt else PRODUCTS, plan, args.autocast)))
        return 0
    env = dict(os.environ)
    if args.march:
        from .bench_step import march_flags
        env["SYMGRAD_CFLAGS"] = " ".join(march_flags(args.march))
    runs = []
    for threads in [int(t) for t in args.threads.split(",")]:
        command = [sys.executable, "-m", "benchmarks.gemm", "--worker", *(["--quick"] if args.quick else []),
                   *(["--gpt"] if args.gpt else []),
                   *(["--autocast", args.autocast] if args.autocast else [])]
        done = subprocess.run(command, env={**env, "SYMGRAD_BENCH_THREADS": str(threads)}, stdout=subprocess.PIPE,
                              text=True, cwd=Path(__file__).resolve().parent.parent)
        if done.returncode != 0:
            print(f"the {threads}-thread run failed (exit {done.returncode})", file=sys.stderr)
            return done.returncode
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    text = render(runs)
    path = args.json or RESULTS / f"gemm-{datetime.datetime.now():%Y%m%d-%H%M%S}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"cpu": _cpu(), "runs": runs}, indent=2) + "\n")
    print(f"CPU: {_cpu()}\n\n{text}\nJSON: {path}")
    return 0


def _cpu() -> str:
    from .bench_step import _cpu as cpu
    return cpu()


if __name__ == "__main__":
    sys.exit(main())
