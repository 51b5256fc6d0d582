"""Side-by-side training-step benchmarks: symgrad against PyTorch, torch.compile and JAX.

`python -m benchmarks.bench_step` is the one command (see docs/performance.md). The
package pins every library to the same thread count here, at import, because
NumPy's BLAS, PyTorch and OpenMP read their thread settings once, when they
load; `python -m benchmarks.<module>` imports this file before any of them.
"""

import os

#: Threads for every system; the issue's anchors were measured on 2 cores. A benchmark that
#: compares thread counts runs each in a fresh process with SYMGRAD_BENCH_THREADS set.
THREADS = int(os.environ.get("SYMGRAD_BENCH_THREADS", "2"))

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_var] = str(THREADS)
