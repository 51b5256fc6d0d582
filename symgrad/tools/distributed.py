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
statistics; nn.SyncBatchNorm's all_reduce sums them over the ranks from inside
the program). Every wait on another rank is bounded by `timeout`: a rank that
died or raised makes the others raise DistributedError, never hang.

Gradients travel in buckets (symgrad.tools.buckets; `bucket_cap_mb`, as DDP's): on
C, the program calls back as soon as each gradient buffer is final, and a
bucket's non-blocking allreduce starts there, while the rest of the backward
runs; `report()` lists the buckets and the kernel after which each starts.
"""

from __future__ import annotations

import os
import time

import numpy as np

from ..step.call_checks import (arrays_by_name, bind_inputs, check_label_ranges, computed_label_ranges,
                                gradient_buffer_name, host_array)
from ..step.training import TrainStep
from ..step.training import train_step as local_train_step
from .buckets import DEFAULT_CAP_MB, MiB, Gradient, describe, plan_buckets
from ..ir import dtypes as D
from ..ir.ops import check_labels, label_checks
from ..ir.ops_collective import all_reduce  # noqa: F401  (sg.distributed.all_reduce: a value summed over the ranks)
from ..ir import shapes as S

__all__ = ["train_step", "DistributedStep", "DistributedError", "all_reduce"]

#: Added to each rank's generator seeds, times the rank: keys that never collide across ranks.
RANK_SEED_STRIDE = 1 << 32
#: Seconds a wait polls MPI without sleeping (see DistributedStep._wait).
SPIN_S = 0.05


class DistributedError(RuntimeError):
    """Another rank failed, refused its input, or did not answer within the timeout."""


def _check_bucket_cap(bucket_cap_mb) -> None:
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) \
            or not 0 < bucket_cap_mb < float("inf"):
        raise ValueError(f"distributed train step: bucket_cap_mb must be a positive number of MiB, "
                         f"got {bucket_cap_mb!r}")


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError(f"sg.distributed needs mpi4py and an MPI library: pip install 'symgrad[mpi]' ({exc})") from None
    return MPI


class DistributedStep:
    """A TrainStep on every rank of `comm`, kept identical by broadcast and gradient averaging."""

    def __init__(self, step: TrainStep, comm=None, timeout: float = 120.0, bucket_cap_mb: float = DEFAULT_CAP_MB,
                 overlap: bool = True):
        _check_bucket_cap(bucket_cap_mb)
        MPI = _mpi()
        self.step, self.comm, self.timeout = step, comm if comm is not None else MPI.COMM_WORLD, float(timeout)
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.waited_s = 0.0  # seconds this rank has spent waiting on the others (communication)
        self.after_call_s = 0.0  # seconds from the backward's return to the averaged gradients (all of it)
        self._params = list(step._param_values)
        self._shapes = {gradient_buffer_name(p): tuple(p.shape) for p in self._params}
        self._accumulate = step.program_for("accumulate")
        self._label_checks = label_checks(self._accumulate.graph)
        self._label_ranges = computed_label_ranges(self._accumulate.graph)
        self._plan_buckets(bucket_cap_mb, overlap)
        collectives = getattr(self._accumulate.program, "on_collective", None)  # CUDA: none (refused when built)
        if collectives is not None:
            collectives(self._sum_over_ranks)  # SyncBatchNorm's all_reduce
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
        """Complete a non-blocking MPI request, or raise DistributedError after `timeout` seconds.

        MPI moves a collective forward only inside MPI calls (no progress thread by default), so
        the wait polls: without sleeping for the first SPIN_S (yielding the core to any other
        runnable thread), as the other ranks are usually that close, then with growing sleeps. A
        sleep between polls from the start made each round of a 1 MiB allreduce cost a sleep."""
        start = time.monotonic()
        deadline, pause = start + self.timeout, 1e-5
        while not request.Test():
            now = time.monotonic()
            if now > deadline:
                raise DistributedError(f"rank {self.rank} of {self.size}: {what} did not complete within "
                                       f"{self.timeout:g} s: another rank failed, died or is stuck")
            if now - start < SPIN_S:
                os.sched_yield()
            else:
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
        self.waited_s += time.monotonic() - start

    def _sum_over_ranks(self, values: np.ndarray) -> None:
        """all_reduce's hook inside the program (SyncBatchNorm's sums): `values` summed over the ranks
        in place, every rank reaching its collectives in the program's one order."""
        MPI = _mpi()
        self._wait(self.comm.Iallreduce(MPI.IN_PLACE, values, op=MPI.SUM), "an all_reduce inside the step")

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
            arrays = [host_array(f"input {node.name!r}", a)  # a torch CPU tensor: its memory, as a step reads it
                      for node, a in zip(graph.inputs, arrays_by_name(graph, batch, "distributed train step"))]
            bindings = bind_inputs(graph.inputs, arrays)
            check_label_ranges(self._label_ranges, bindings)
            for position, node in self._label_checks:
                check_labels(arrays[position], S.evaluate(node.attrs["num_classes"], bindings), node,
                             f"input {graph.inputs[position].name!r}")
        except (TypeError, ValueError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
        self._agree(problem)
        self._begin_buckets()
        try:
            loss = self.step.accumulate(**batch)  # the C program starts buckets as their gradients finish
        finally:
            self._in_call = False
        self.backward_s = time.monotonic() - self._call_start  # forward and backward of the last call
        self._finish_buckets(loss)
        applied = time.monotonic()
        self.step.apply()
        self.apply_s = time.monotonic() - applied  # the optimizer's update of the last call
        return self._loss

    # ---- gradient buckets: planned once, sent as soon as they are final --------------------
    def _plan_buckets(self, cap_mb: float, overlap: bool) -> None:
        program = self._accumulate.program
        slots = {v.name: k for k, v in enumerate(self._accumulate.graph.variables)}
        plan = getattr(program, "plan", None)
        hooks = overlap and hasattr(program, "on_gradient_final") and plan is not None
        final = {slot: position for position, group in program.gradients_final_after().items() for slot in group} \
            if hooks else {}
        grads = []
        for p in reversed(self._params):  # DDP's order where the program does not say: the last layer first
            name = gradient_buffer_name(p)
            position = final.get(slots[name])
            grads.append(Gradient(name, p.name, np.dtype(D.to_numpy(p.dtype)), int(np.prod(p.shape, dtype=np.int64)),
                                  position, plan.kernels[position].name if position is not None else None))
        self.buckets = plan_buckets(grads, max(1, int(cap_mb * MiB)))
        self._kernels = len(plan.kernels) if plan is not None else None
        self._bucket_of = {g.name: b.index for b in self.buckets for g in b.gradients}
        self._slot_names = {slots[g.name]: g.name for b in self.buckets for g in b.gradients}
        self.overlapped = hooks and any(b.starts_after is not None for b in self.buckets)
        self._in_call = False
        if self.overlapped:
            program.on_gradient_final(self._gradient_final)

    def _begin_buckets(self) -> None:
        self._pending = [len(b.gradients) for b in self.buckets]
        self._requests: list = [None] * len(self.buckets)
        self._packs: list = [None] * len(self.buckets)
        self._hook_error: BaseException | None = None
        self._call_start = time.monotonic()
        self.started_s = [None] * len(self.buckets)  # seconds into the call at which each bucket went
        self._in_call = True

    def _gradient_final(self, slot: int) -> None:
        """The C program's hook: gradient `slot` is final; start its bucket's allreduce once the
        bucket is complete, and let MPI progress the ones already sent."""
        if not self._in_call:
            return  # a call of the accumulate program outside this step's __call__
        try:
            b = self._bucket_of.get(self._slot_names.get(slot))
            if b is not None:
                self._pending[b] -= 1
                if self._pending[b] == 0:
                    self._start(b)
            for request in self._requests:
                if request is not None:
                    request.Test()
        except BaseException as exc:  # cannot cross the C code: raised after the call
            self._hook_error = self._hook_error or exc

    def _start(self, b: int) -> None:
        """Pack bucket b's gradients (a copy: the buffers stay the program's) and start its allreduce.
        Host storage is read in place (inside the call the step's lock is held: no _read_variable);
        a backend keeping variables in its own memory (CUDA) copies them out."""
        MPI = _mpi()
        names = [g.name for g in self.buckets[b].gradients]
        reader = getattr(self._accumulate.program, "read_variable", None)
        parts = [reader(n) if reader is not None else self.step._storage[n] for n in names]
        self._packs[b] = np.concatenate([np.ravel(a) for a in parts])
        self._requests[b] = self.comm.Iallreduce(MPI.IN_PLACE, self._packs[b], op=MPI.SUM)
        self.started_s[b] = time.monotonic() - self._call_start

    def _finish_buckets(self, loss: float) -> None:
        """Start the buckets the call did not, sum the loss, wait for every allreduce, and write the
        averaged gradients back."""
        MPI = _mpi()
        if self._hook_error is not None:
            raise DistributedError(f"rank {self.rank}: starting a gradient allreduce failed: "
                                   f"{type(self._hook_error).__name__}: {self._hook_error}") from self._hook_error
        returned = time.monotonic()
        for b in range(len(self.buckets)):
            if self._requests[b] is None:
                self._start(b)
        losses = np.array([loss], np.float64)
        self._wait(self.comm.Iallreduce(MPI.IN_PLACE, losses, op=MPI.SUM), "the loss allreduce")
        for b, request in enumerate(self._requests):
            self._wait(request, f"the allreduce of gradient bucket {b}")
        for bucket, pack in zip(self.buckets, self._packs):
            flat, offset = pack / bucket.dtype.type(self.size), 0
            for g in bucket.gradients:
                self.step._write_variable(g.name, flat[offset:offset + g.numel].reshape(self._shapes[g.name]))
                offset += g.numel
        self.after_call_s += time.monotonic() - returned
        self._loss = float(losses[0] / self.size)

    def report(self) -> str:
        """The report of the program each step runs (accumulate: forward and backward into the gradient
        buffers), then the buckets: what each holds and after which of its kernels its allreduce starts."""
        return self._accumulate.report() + "\n\n" + self.bucket_report()

    def bucket_report(self) -> str:
        """The buckets alone: what each holds, its bytes, and where its allreduce starts."""
        how = ("started by the C program's hooks during the backward" if self.overlapped else
               "started after the backward returns (this backend reports no final points, or overlap=False)")
        return "\n".join([f"data-parallel step: rank {self.rank} of {self.size}; gradient allreduces {how}",
                          *describe(self.buckets, self._kernels, self.size)])

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


def train_step(loss, params=None, optimizer=None, backend: str | None = None, comm=None, timeout: float = 120.0,
               bucket_cap_mb: float = DEFAULT_CAP_MB, overlap: bool = True, **options) -> DistributedStep:
    """sg.train_step on every rank of `comm` (default MPI.COMM_WORLD); see the module docstring.
    `params` / `optimizer` as sg.train_step's (an optimizer constructed as torch's holds them).

    bucket_cap_mb: the most MiB of gradients one allreduce sends (the first bucket at most 1 MiB), as
    DDP's argument of that name; overlap: start each bucket's allreduce from inside the backward
    as soon as it is final (C), instead of all after it."""
    _check_bucket_cap(bucket_cap_mb)  # before MPI starts or anything compiles
    _mpi()
    return DistributedStep(local_train_step(loss, params, optimizer, backend=backend, **options), comm, timeout,
                           bucket_cap_mb, overlap)
