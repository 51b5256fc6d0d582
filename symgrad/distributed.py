"""Data-parallel training on MPI: one train step on every rank of a communicator.

The role of torch's DistributedDataParallel, on MPI (mpi4py over MPICH or Open
MPI; `pip install symgrad[mpi]`). Every rank builds the same step from the same
graph and calls it on its own shard of each batch:

    step = sg.distributed.train_step(loss, model.parameters(), sg.optim.AdamW(lr=3e-4), backend="c")
    for xb, yb in shards:            # this rank's rows of each batch
        loss = step(x=xb, y=yb)      # the loss of the whole batch, averaged over ranks

At creation, every variable (parameters, buffers, optimizer state, the learning
rate) is broadcast from rank 0, and each rank's dropout generators are keyed by
its rank, so masks differ per rank and are reproducible. A call checks its
inputs on every rank first and all ranks refuse together if one refuses, before
any gradient moves. It then runs forward and backward into the gradient
buffers (`accumulate`), averages them over the ranks with one allreduce, and
applies the optimizer, the same update everywhere: the parameters stay
identical across ranks, and N ranks with B/N rows each compute what one process
computes with B rows (BatchNorm aside: like DDP, it uses each rank's own batch
statistics). Every wait on another rank is bounded by `timeout`: a rank that
died or raised makes the others raise DistributedError, never hang.
"""

from __future__ import annotations

import time

import numpy as np

from .call_checks import arrays_by_name, bind_inputs, gradient_buffer_name
from .training import TrainStep
from .training import train_step as local_train_step
from .ir.ops import check_labels, label_checks
from .ir import shapes as S

__all__ = ["train_step", "DistributedStep", "DistributedError"]

#: Added to each rank's generator seeds, times the rank: keys that never collide across ranks.
RANK_SEED_STRIDE = 1 << 32


class DistributedError(RuntimeError):
    """Another rank failed, refused its input, or did not answer within the timeout."""


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError(f"sg.distributed needs mpi4py and an MPI library: pip install 'symgrad[mpi]' ({exc})") from None
    return MPI


class DistributedStep:
    """A TrainStep on every rank of `comm`, kept identical by broadcast and gradient averaging."""

    def __init__(self, step: TrainStep, comm=None, timeout: float = 120.0):
        MPI = _mpi()
        self.step, self.comm, self.timeout = step, comm if comm is not None else MPI.COMM_WORLD, float(timeout)
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.waited_s = 0.0  # seconds this rank has spent waiting on the others (communication)
        self._params = list(step._param_values)
        self._accumulate = step.program_for("accumulate")
        self._label_checks = label_checks(self._accumulate.graph)
        self._broadcast_state()
        self._key_generators()

    # ---- creation ------------------------------------------------------------------------
    def _broadcast_state(self) -> None:
        """Every variable as rank 0 holds it (parameters, buffers, optimizer state, lr), in name order."""
        names = sorted(self.step._storage)
        values = [np.array(self.step._read_variable(name), order="C") for name in names]  # 0-d stays 0-d
        for name, value in zip(names, values):
            self._wait(self.comm.Ibcast(value, root=0), f"broadcast of {name!r} from rank 0")
            self.step._write_variable(name, value)

    def _key_generators(self) -> None:
        for name, node in self.step._variables.items():
            if node.attrs["role"] == "rng" and name.endswith(".seed"):
                seed = int(self.step._read_variable(name))
                self.step._write_variable(name, np.array(seed + self.rank * RANK_SEED_STRIDE, np.int64))

    # ---- waiting, bounded ---------------------------------------------------------------
    def _wait(self, request, what: str) -> None:
        """Complete a non-blocking MPI request, or raise DistributedError after `timeout` seconds."""
        start = time.monotonic()
        deadline, pause = start + self.timeout, 1e-5
        while not request.Test():
            if time.monotonic() > deadline:
                raise DistributedError(f"rank {self.rank} of {self.size}: {what} did not complete within "
                                       f"{self.timeout:g} s: another rank failed, died or is stuck")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        self.waited_s += time.monotonic() - start

    def _agree(self, problem: str | None) -> None:
        """Raise on every rank if any rank has a problem (its own text where it is this rank's)."""
        MPI = _mpi()
        flags = np.zeros(self.size, np.int32)
        flags[self.rank] = problem is not None
        self._wait(self.comm.Iallreduce(MPI.IN_PLACE, flags, op=MPI.SUM), "the input check")
        if flags.any():
            failed = [int(r) for r in np.flatnonzero(flags)]
            raise DistributedError(f"rank {self.rank}: refused by rank(s) {failed}"
                                   + (f": {problem}" if problem else "") + "; no rank ran the step")

    # ---- the step -----------------------------------------------------------------------
    def __call__(self, **batch) -> float:
        """One step on this rank's shard; returns the loss averaged over the ranks."""
        graph = self._accumulate.graph
        problem = None
        try:
            arrays = arrays_by_name(graph, batch, "distributed train step")
            bindings = bind_inputs(graph.inputs, arrays)
            for position, node in self._label_checks:
                check_labels(arrays[position], S.evaluate(node.attrs["num_classes"], bindings), node,
                             f"input {graph.inputs[position].name!r}")
        except (TypeError, ValueError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
        self._agree(problem)
        loss = self.step.accumulate(**batch)
        self._average_gradients(loss)
        self.step.apply()
        return self._loss

    def _average_gradients(self, loss: float) -> None:
        """One allreduce per dtype over every gradient buffer (and the loss), then divide by N."""
        MPI = _mpi()
        names = [gradient_buffer_name(p) for p in self._params]
        grads = [self.step._read_variable(name) for name in names]
        by_dtype: dict = {}
        for k, g in enumerate(grads):
            by_dtype.setdefault(g.dtype, []).append(k)
        losses = np.array([loss], np.float64)
        requests = [self.comm.Iallreduce(MPI.IN_PLACE, losses, op=MPI.SUM)]
        packed = {}
        for dtype, members in by_dtype.items():
            packed[dtype] = np.concatenate([grads[k].ravel() for k in members])
            requests.append(self.comm.Iallreduce(MPI.IN_PLACE, packed[dtype], op=MPI.SUM))
        for request in requests:
            self._wait(request, "the gradient allreduce")
        for dtype, members in by_dtype.items():
            flat, offset = packed[dtype] / dtype.type(self.size), 0
            for k in members:
                n = grads[k].size
                self.step._write_variable(names[k], flat[offset:offset + n].reshape(grads[k].shape))
                offset += n
        self._loss = float(losses[0] / self.size)

    # ---- what a step offers, on this rank --------------------------------------------------
    @property
    def params(self):
        """The current parameters (the same on every rank)."""
        return self.step.params

    @property
    def state(self):
        return self.step.state

    @property
    def lr(self) -> float:
        return self.step.lr

    @lr.setter
    def lr(self, value: float) -> None:
        """Set on every rank alike (each rank calls it), as every rank runs the same loop."""
        self.step.lr = value

    def save(self, path) -> None:
        """Rank 0 writes the checkpoint (all ranks hold the same state); the others wait for it."""
        if self.rank == 0:
            self.step.save(path)
        self._wait(self.comm.Ibarrier(), "the checkpoint barrier")


def train_step(loss, params, optimizer, backend: str = "numpy", comm=None, timeout: float = 120.0,
               **options) -> DistributedStep:
    """sg.train_step on every rank of `comm` (default MPI.COMM_WORLD); see the module docstring."""
    _mpi()
    return DistributedStep(local_train_step(loss, params, optimizer, backend=backend, **options), comm, timeout)
