"""A process forked after a C program ran an OpenMP parallel region (multiprocessing's default
"fork" start method on Linux, what DataLoader workers use) runs its programs instead of hanging.

Everything runs in a child interpreter under a timeout, so that a regression fails the test
instead of hanging the test run: the interpreter forks its own worker and gives it a minute.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

FORKING_SCRIPT = textwrap.dedent("""\
    import json, multiprocessing, sys
    import numpy as np
    import symgrad as sg

    B = sg.Dim("B")
    x = sg.input("x", (B, 256))
    y = sg.input("y", (B,), dtype="int64")
    W = sg.param("W", (256, 256), init=np.random.default_rng(1).standard_normal((256, 256)).astype(np.float32) / 16)
    V = sg.param("V", (256, 10), init="zeros")
    hidden = sg.tanh(x @ W)
    f = sg.function([x], sg.sum(hidden, axis=1), backend="c")
    step = sg.train_step(sg.cross_entropy(hidden @ V, y), [W, V], sg.optim.SGD(lr=0.1), backend="c")
    rng = np.random.default_rng(0)
    xb = rng.standard_normal((512, 256)).astype(np.float32)
    yb = rng.integers(0, 10, 512)
    # In this process: a 512x256x256 GEMM and loops of 128K elements, on the OpenMP team.
    before = f(xb)
    loss = step(x=xb, y=yb)

    def worker(conn):
        conn.send({"f": f(xb).tolist(), "loss": step(x=xb, y=yb), "again": step(x=xb, y=yb)})

    if __name__ == "__main__":
        parent, child = multiprocessing.Pipe()
        process = multiprocessing.get_context("fork").Process(target=worker, args=(child,))
        process.start()
        if not parent.poll(60):
            process.kill()
            sys.exit("the forked worker hung")
        got = parent.recv()
        process.join()
        print(json.dumps({"f": before.tolist(), "loss": loss, "next": step(x=xb, y=yb), "worker": got}))
    """)


def test_a_forked_worker_runs_c_programs_after_the_parent_ran_parallel_regions():
    env = dict(os.environ, OMP_NUM_THREADS="4")  # a team even on a one-core machine
    done = subprocess.run([sys.executable, "-c", FORKING_SCRIPT], cwd=Path(__file__).resolve().parent.parent,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stderr[-3000:]}"
    result = json.loads(done.stdout.strip().splitlines()[-1])
    worker = result["worker"]
    # The worker computes what the parent does from the same state (on one thread, so the
    # sums may round differently), and its step trains its own copy of the parameters.
    np.testing.assert_allclose(worker["f"], result["f"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(worker["loss"], result["next"], rtol=1e-5)
    assert worker["again"] < worker["loss"]
