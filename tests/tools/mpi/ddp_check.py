"""Run under `mpiexec -n 2`: the checks of tests/tools/test_distributed.py, one mode per run.

    mpiexec -n 2 python tests/tools/mpi/ddp_check.py MODE BACKEND

Rank 0 prints one line of JSON with what it measured; every assertion runs on
every rank, so a failing check fails the run.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from mpi4py import MPI

import symgrad as sg
from symgrad import nn

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()
BATCH, STEPS = 8, 20
RNG = np.random.default_rng(21)
DATA = [(RNG.standard_normal((BATCH, 6)), RNG.integers(0, 4, BATCH)) for _ in range(STEPS)]


def _model(dropout: bool = False, dtype: str = "float64"):
    sg.manual_seed(RANK + 1)  # different initial weights per rank: the broadcast must fix them
    layers = [nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 4)]
    if dropout:
        layers.insert(2, nn.Dropout(0.5))
    model = nn.Sequential(*layers)
    return model.double() if dtype == "float64" else model


def _step(model, backend, distributed=True, timeout=120.0, dtype="float64", **options):
    x = sg.input("x", (sg.Dim("B"), 6), dtype=dtype)
    y = sg.input("y", (sg.Dim("B"),), dtype="int64")
    loss = sg.cross_entropy(model(x), y)
    if distributed:
        return sg.distributed.train_step(loss, model.parameters(), sg.optim.Adam(lr=1e-2), backend=backend,
                                         timeout=timeout, **options)
    return sg.train_step(loss, model.parameters(), sg.optim.Adam(lr=1e-2), backend=backend)


def _shard(xb, yb):
    rows = BATCH // SIZE
    return xb[RANK * rows:(RANK + 1) * rows], yb[RANK * rows:(RANK + 1) * rows]


def _identical_across_ranks(step) -> bool:
    mine = {name: step.params[name] for name in step.params}
    theirs = COMM.bcast(mine, root=0)
    return all(np.array_equal(mine[n], theirs[n]) for n in mine)


def equivalence(backend, dtype="float64", **options):
    step = _step(_model(dtype=dtype), backend, dtype=dtype, **options)
    single = None
    if RANK == 0:  # the same model, from rank 0's weights, on the whole batch in one process
        model = _model(dtype=dtype)
        model.load_state_dict(step.step.state_dict())
        single = _step(model, backend, distributed=False, dtype=dtype)
    worst_loss, worst_scaled = 0.0, 0.0
    for xb, yb in DATA:
        xb = xb.astype(dtype)
        loss = step(**dict(zip("xy", _shard(xb, yb))))
        assert _identical_across_ranks(step), "parameters differ across ranks"
        if RANK == 0:
            want = single(x=xb, y=yb)
            worst_loss = max(worst_loss, abs(loss - want) / abs(want))
            for name in single.params:
                got, ref = step.params[name], single.params[name]
                worst_scaled = max(worst_scaled, float(np.max(np.abs(got - ref)) / np.max(np.abs(ref))))
    started = [s is not None for s in step.started_s]
    return {"worst_loss_rel": worst_loss, "worst_param_scaled": worst_scaled, "steps": STEPS,
            "buckets": len(step.buckets), "overlapped": step.overlapped, "started": started,
            "during_call": [b.starts_after is not None for b in step.buckets], "report": step.report()}


def float32(backend):
    """Equivalence in float32: the sums over ranks and over rows differ in order only."""
    return equivalence(backend, dtype="float32", bucket_cap_mb=512 / 2**20)


def buckets(backend):
    """Equivalence with a bucket per gradient (a cap of 512 bytes): each bucket's allreduce starts
    from inside the backward on C, all after it on NumPy; the sums are the same either way."""
    return equivalence(backend, bucket_cap_mb=512 / 2**20)


def _bn_model(sync: bool):
    sg.manual_seed(RANK + 1)
    norm = nn.SyncBatchNorm(8) if sync else nn.BatchNorm1d(8)
    return nn.Sequential(nn.Linear(6, 8, bias=False), norm, nn.ReLU(), nn.Linear(8, 4)).double()  # no bias before a norm


def syncbn(backend):
    """SyncBatchNorm on 2 ranks of 4 rows each against BatchNorm1d in one process on all 8 rows:
    losses, parameters and running statistics after each of 20 Adam steps; and, with BatchNorm1d
    on the ranks (per-rank statistics, as DDP), losses that differ."""
    model = _bn_model(sync=True)
    step = _step(model, backend, bucket_cap_mb=512 / 2**20)
    local = _step(_bn_model(sync=False), backend)  # per-rank statistics
    single = None
    if RANK == 0:
        reference = _bn_model(sync=False)
        reference.load_state_dict(step.step.state_dict())
        single = _step(reference, backend, distributed=False)
    worst_loss = worst_param = worst_state = 0.0
    local_differs = False
    for xb, yb in DATA:
        loss = step(**dict(zip("xy", _shard(xb, yb))))
        local_loss = local(**dict(zip("xy", _shard(xb, yb))))
        assert _identical_across_ranks(step), "parameters differ across ranks"
        states = COMM.allgather({n: step.state[n] for n in step.state})
        assert all(np.array_equal(states[0][n], states[1][n]) for n in states[0]), "running statistics differ"
        if RANK == 0:
            want = single(x=xb, y=yb)
            worst_loss = max(worst_loss, abs(loss - want) / abs(want))
            local_differs |= abs(local_loss - want) / abs(want) > 1e-6
            for got, ref in ((step.params, single.params), (step.state, single.state)):
                for name in ref:
                    if name.startswith("1.") or got is step.params:
                        diff = float(np.max(np.abs(got[name] - ref[name]) / (np.abs(ref[name]) + 1e-300)))
                        if got is step.params:
                            worst_param = max(worst_param, diff)
                        else:
                            worst_state = max(worst_state, diff)
    return {"worst_loss_rel": worst_loss, "worst_param_rel": worst_param, "worst_state_rel": worst_state,
            "steps": STEPS, "local_differs": local_differs}


def stuck_inside(backend):
    """Rank 1 gets stuck inside the program, at its first SyncBatchNorm all_reduce; rank 0, waiting
    there inside the compiled step, raises DistributedError through the C code within the timeout.
    (A rank that exits outright makes mpiexec end the others at once: test_a_rank_that_dies...)"""
    import time
    step = _step(_bn_model(sync=True), backend, timeout=5.0)
    if RANK == 1:
        step._accumulate.program.on_collective(lambda values: time.sleep(20))
    start = time.monotonic()
    try:
        step(**dict(zip("xy", _shard(*DATA[0]))))
    except sg.distributed.DistributedError as exc:
        # Rank 0's error is the one checked; rank 1, once it wakes, fails too (at the loss's
        # allreduce) and must not report, or the test would read whichever rank printed last.
        # The seconds are the call's alone: building the step first can take a minute on a busy machine.
        if RANK == 0:
            print("RESULT " + json.dumps({"message": str(exc), "seconds": time.monotonic() - start}), flush=True)
        os._exit(0)  # MPI_Finalize would wait for the dead rank
    raise AssertionError("the step went on without rank 1")


def dropout(backend):
    step = _step(_model(dropout=True), backend)
    seeds = COMM.allgather(int(step.state["rng.seed"]))
    for xb, yb in DATA[:3]:
        step(**dict(zip("xy", _shard(xb, yb))))
        assert _identical_across_ranks(step)
    return {"seeds": seeds}


def refusal(backend):
    step = _step(_model(), backend)
    before = {n: step.params[n] for n in step.params}
    xb, yb = _shard(*DATA[0])
    if RANK == 1:
        xb = xb[:, :5]  # a wrong shape on one rank only
    try:
        step(x=xb, y=yb)
    except sg.distributed.DistributedError as exc:
        message = str(exc)
    else:
        raise AssertionError("the bad input was not refused")
    unchanged = all(np.array_equal(step.params[n], v) for n, v in before.items())
    step(**dict(zip("xy", _shard(*DATA[1]))))  # the ranks go on together after a refusal
    return {"messages": COMM.allgather(message), "unchanged": COMM.allgather(unchanged)}


def death(backend):
    step = _step(_model(), backend, timeout=5.0)
    if RANK == 1:
        os._exit(3)  # a rank that dies between steps
    step(**dict(zip("xy", _shard(*DATA[0]))))
    return {"survived": True}


if __name__ == "__main__":
    mode, backend = sys.argv[1], sys.argv[2]
    result = globals()[mode](backend)
    if RANK == 0:
        print("RESULT " + json.dumps(result), flush=True)
