"""all_reduce (symgrad.ir.ops_collective) and SyncBatchNorm in one process.

The program hands each all_reduce to the caller's hook (sg.distributed's sums
over the ranks, tests/tools/test_distributed.py); here a hook that scales by N stands
for N ranks holding the same values, which fixes what forward and backward
must compute. Without a hook the op is the value itself.
"""

from __future__ import annotations

import numpy as np
import pytest

import symgrad as sg
from symgrad import nn
from symgrad.tools.distributed import all_reduce  # the public name (symgrad.ir.ops_collective's op)
from tests.conftest import BACKENDS

HOST = [b for b in BACKENDS if b != "cuda"]
RANKS = 3


def _ranks_alike(values):
    values *= RANKS  # the sum over RANKS processes holding these same values


@pytest.fixture(scope="module")
def programs():
    """y = sum(all_reduce(x * x)) + all_reduce(2) and its gradient, on each host backend."""
    x = sg.input("x", (4,), dtype="float64")
    y = sg.sum(all_reduce(x * x)) + all_reduce(sg.constant(2.0, "float64"))
    (g,) = sg.grad(y, [x])
    return {backend: sg.function([x], [y, g], backend=backend) for backend in HOST}


@pytest.mark.parametrize("backend", HOST)
def test_all_reduce_is_the_value_itself_without_a_hook_and_the_sum_over_ranks_with_one(programs, backend):
    f = programs[backend]
    xs = np.array([1.0, -2.0, 0.5, 3.0])
    f.program.on_collective(None)
    value, grad = f(xs)
    assert float(value) == np.sum(xs * xs) + 2 and np.array_equal(grad, 2 * xs)
    f.program.on_collective(_ranks_alike)
    try:
        value, grad = f(xs)
    finally:
        f.program.on_collective(None)
    # Forward: every rank's x*x summed, and the constant too (never folded as a constant). Backward:
    # each rank's gradient sums every rank's cotangent, all_reduce of the ones.
    assert float(value) == RANKS * np.sum(xs * xs) + RANKS * 2
    np.testing.assert_array_equal(grad, RANKS * 2 * xs)


@pytest.mark.parametrize("backend", HOST)
def test_an_exception_in_the_hook_ends_the_call_and_is_raised(programs, backend):
    f = programs[backend]

    def failing(values):
        raise ConnectionError("rank 1 is gone")
    f.program.on_collective(failing)
    try:
        with pytest.raises(ConnectionError, match="rank 1 is gone"):
            f(np.ones(4))
    finally:
        f.program.on_collective(None)
    assert float(f(np.ones(4))[0]) == 6.0  # the program is usable after


def test_all_reduce_refuses_integers_and_cuda_says_it_has_no_collectives():
    with pytest.raises(TypeError, match="all_reduce: expects a float value"):
        all_reduce(sg.input("i", (3,), dtype="int64"))
    from symgrad.backends.cuda import cuda_source
    from symgrad.ir.graph import Graph
    x = sg.input("x", (3,))
    with pytest.raises(NotImplementedError, match="all_reduce .*CUDA backend has no collectives"):
        cuda_source(Graph([x], [all_reduce(x)]))


def _classifier(norm):
    sg.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3, bias=False), norm, nn.ReLU(), nn.Flatten(), nn.Linear(48, 4)).double()


@pytest.mark.parametrize("backend", HOST)
def test_sync_batch_norm_in_one_process_is_batch_norm(backend):
    rng = np.random.default_rng(0)
    xb, yb = rng.standard_normal((5, 2, 6, 6)), rng.integers(0, 4, 5)
    results = []
    for model in (_classifier(nn.BatchNorm2d(3)), nn.SyncBatchNorm.convert_sync_batchnorm(_classifier(nn.BatchNorm2d(3)))):
        x, y = sg.input("x", (5, 2, 6, 6), dtype="float64"), sg.input("y", (5,), dtype="int64")
        step = sg.train_step(sg.cross_entropy(model(x), y), model.parameters(), sg.optim.Adam(lr=0.1), backend=backend)
        losses = [step(x=xb, y=yb) for _ in range(3)]
        results.append((model, losses, dict(step.state)))
    (plain, want, want_state), (synced, got, got_state) = results
    assert isinstance(synced[1], nn.SyncBatchNorm) and list(synced.state_dict()) == list(plain.state_dict())
    np.testing.assert_allclose(got, want, rtol=1e-14)
    for name in want_state:
        np.testing.assert_allclose(got_state[name], want_state[name], rtol=1e-12, atol=1e-300)


def test_sync_batch_norm_takes_no_process_group_and_checks_its_input():
    with pytest.raises(ValueError, match="process_group must be None"):
        nn.SyncBatchNorm(3, process_group=object())
    with pytest.raises(ValueError, match=r"SyncBatchNorm\(3\): expected input \[N, 3, ...\]"):
        nn.SyncBatchNorm(3)(sg.input("x", (4, 5)))


def test_the_entry_statuses_are_distinct():
    """A failed collective must not read as a refused label (the entry's own status) or the GEMM's."""
    from symgrad.backends.render import languages
    from symgrad.backends.status import Status  # one enum: @unique refuses two names of one code
    statuses = [Status.OK, Status.OUT_OF_MEMORY, Status.COLLECTIVE_FAILED, languages.C_BAD_LABEL]
    assert len(set(statuses)) == len(statuses) and languages.C_BAD_LABEL is Status.BAD_LABEL
