"""sg.distributed on 2 MPI ranks (mpiexec -n 2, tests/tools/mpi/ddp_check.py), on every backend.

Each check is one mpiexec run of two Python processes (one thread each, so two
ranks share this machine's two cores); the run's own assertions cover every
rank, and rank 0 reports what it measured.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import BACKENDS

pytest.importorskip("mpi4py", reason="sg.distributed needs mpi4py (pip install -e '.[test]' installs it)")
MPIEXEC = shutil.which("mpiexec")
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "tools" / "mpi" / "ddp_check.py"
pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install mpich)")


def _run(mode: str, backend: str, timeout: float = 240.0) -> tuple[int, dict | None, str, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    done = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(SCRIPT), mode, backend], env=env,
                          capture_output=True, text=True, timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    result = json.loads(lines[-1][len("RESULT "):]) if lines else None
    return done.returncode, result, done.stdout + done.stderr, time.monotonic() - start


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "cuda"])
def test_two_ranks_with_half_batches_equal_one_process_with_the_whole_batch(backend):
    """20 Adam steps in float64: parameters identical across ranks after every step (checked in the
    run) and equal to one process's to 1e-12 of each tensor's largest element. Not elementwise: the
    two sum the batch's gradients in different orders, and an element near 0 makes one ulp of that
    sum a large relative difference (1.5e-11 at one weight of a model drawn in float32, 3e-16 of
    its tensor's largest)."""
    code, result, output, _ = _run("equivalence", backend)
    assert code == 0, output
    assert result["steps"] == 20
    assert result["worst_loss_rel"] < 1e-12 and result["worst_param_scaled"] < 1e-12, result


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "cuda"])
def test_two_ranks_equal_one_process_in_float32_to_summation_order(backend):
    """The same in float32 (two buckets): the sums over ranks and rows differ only in order, so losses
    agree to a few ulp and parameters to a few ulp of their tensor's largest element after 20 steps."""
    code, result, output, _ = _run("float32", backend)
    assert code == 0, output
    assert result["steps"] == 20 and result["buckets"] == 2
    assert result["worst_loss_rel"] < 1e-6 and result["worst_param_scaled"] < 1e-6, result


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "cuda"])
def test_gradient_buckets_start_inside_the_backward_on_c_and_the_sums_are_unchanged(backend):
    """A bucket per gradient (512-byte cap): on C each allreduce starts from the program's hook
    after the kernel that finishes its gradient; on NumPy all start after the backward. Either way
    20 Adam steps equal one process's to 1e-12 (of each tensor's largest element, as above), the
    parameters identical across ranks."""
    code, result, output, _ = _run("buckets", backend)
    assert code == 0, output
    assert result["worst_loss_rel"] < 1e-12 and result["worst_param_scaled"] < 1e-12, result
    assert result["buckets"] == 4 and all(result["started"]), result
    assert result["overlapped"] == (backend == "c")
    assert all(result["during_call"]) if backend == "c" else not any(result["during_call"])
    report = result["report"]
    assert "4 gradient bucket(s)" in report
    lines = [line for line in report.splitlines() if line.startswith("  bucket ")]
    where = "during the backward" if backend == "c" else "after the call returns"
    assert len(lines) == 4 and all(where in line for line in lines), report


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "cuda"])
def test_sync_batch_norm_on_two_ranks_equals_batch_norm_on_the_whole_batch(backend):
    """SyncBatchNorm (all_reduce of its sums inside the program, forward and backward) on 2 ranks x 4
    rows against BatchNorm1d on 8 rows in one process: 20 Adam steps in float64 within 1e-12 (loss,
    parameters, running statistics), running statistics identical across ranks; BatchNorm1d on the
    ranks (per-rank statistics, as DDP) gives other losses."""
    code, result, output, _ = _run("syncbn", backend)
    assert code == 0, output
    assert result["steps"] == 20
    assert max(result["worst_loss_rel"], result["worst_param_rel"], result["worst_state_rel"]) < 1e-12, result
    assert result["local_differs"], result


def test_dropout_masks_are_keyed_by_rank_and_parameters_stay_identical():
    code, result, output, _ = _run("dropout", "numpy")
    assert code == 0, output
    seeds = result["seeds"]
    assert len(set(seeds)) == 2 and seeds[1] - seeds[0] == 1 << 32


def test_bad_input_on_one_rank_is_refused_on_every_rank_before_any_update():
    code, result, output, _ = _run("refusal", "numpy")
    assert code == 0, output
    assert result["unchanged"] == [True, True]
    assert all("refused by rank(s) [1]" in m for m in result["messages"])
    assert "input 'x'" in result["messages"][1]  # the refusing rank says why


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "cuda"])
def test_a_rank_stuck_inside_the_program_ends_the_others_call_with_a_clear_error(backend):
    """Rank 1 stalls at its first SyncBatchNorm all_reduce: rank 0, waiting there inside the compiled
    step (C: in the program's collective hook), raises DistributedError within its 5 s timeout."""
    code, result, output, _ = _run("stuck_inside", backend, timeout=240.0)
    assert result is not None, output
    assert "an all_reduce inside the step did not complete within 5 s" in result["message"], result
    # The call ends soon after the timeout, well before rank 1 wakes (20 s): it did not wait for it.
    assert result["seconds"] < 15, result


def test_a_rank_that_dies_ends_the_run_instead_of_hanging():
    code, _, output, seconds = _run("death", "numpy", timeout=120.0)
    assert code != 0, output
    assert seconds < 60, f"took {seconds:.0f} s"
