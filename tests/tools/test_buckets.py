"""Gradient buckets (symgrad.tools.buckets.plan_buckets): order, caps, dtypes, where each starts."""

from __future__ import annotations

import numpy as np
import pytest

from symgrad.tools.buckets import MiB, Gradient, describe, plan_buckets

F32, F64 = np.dtype(np.float32), np.dtype(np.float64)


def grad(name, numel, final_after=None, dtype=F32):
    return Gradient(f"{name}.grad", name, dtype, numel, final_after,
                    None if final_after is None else f"k{final_after}_add")


def test_buckets_follow_the_order_gradients_become_final_and_start_after_their_last_one():
    grads = [grad("W0", 100, 9), grad("b0", 10, 8), grad("W1", 100, 5), grad("b1", 10, 3)]
    (bucket,) = plan_buckets(grads, cap_bytes=MiB)
    assert [g.param for g in bucket.gradients] == ["b1", "W1", "b0", "W0"]
    assert (bucket.starts_after, bucket.kernel, bucket.nbytes) == (9, "k9_add", 880)


def test_the_first_bucket_is_capped_smaller_and_a_large_gradient_is_a_bucket_of_its_own():
    grads = [grad("a", 100, 1), grad("b", 100, 2), grad("c", 100, 3), grad("d", 1000, 4), grad("e", 50, 5)]
    buckets = plan_buckets(grads, cap_bytes=1200, first_cap_bytes=500)
    assert [[g.param for g in b.gradients] for b in buckets] == [["a"], ["b", "c"], ["d"], ["e"]]
    assert [b.starts_after for b in buckets] == [1, 3, 4, 5]
    assert all(b.nbytes <= 1200 or len(b.gradients) == 1 for b in buckets)


def test_a_bucket_holds_one_dtype_and_gradients_final_only_after_the_call_go_last():
    grads = [grad("late", 10), grad("x", 10, 1), grad("y", 10, 2, dtype=F64), grad("z", 10, 3)]
    buckets = plan_buckets(grads, cap_bytes=MiB)
    assert [[g.param for g in b.gradients] for b in buckets] == [["x"], ["y"], ["z", "late"]]
    assert buckets[-1].starts_after is None  # waits for the call to return
    lines = describe(buckets, kernels=4, ranks=2)
    assert "after kernel k2_add (3 of 4), during the backward" in lines[2]
    assert "after the call returns" in lines[3]


def test_a_cap_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match="bucket cap must be positive"):
        plan_buckets([grad("a", 1, 0)], cap_bytes=0)


def test_the_cost_model_hides_buckets_behind_the_backward_and_exposes_the_last():
    """benchmarks.ddp_cost: a ring allreduce moves 2(N-1)/N of the bytes; a bucket final early is
    hidden by the rest of the backward, the last one is not; without overlap every bucket adds."""
    from benchmarks.ddp_cost import predicted_step_s, ring_allreduce_s
    beta, alpha = 1e9, 0.0
    assert ring_allreduce_s(1e9, 1, beta, alpha) == 0.0
    assert ring_allreduce_s(1e9, 2, beta, alpha) == pytest.approx(1.0)
    assert ring_allreduce_s(1e9, 64, beta, alpha) == pytest.approx(2 * 63 / 64)
    assert ring_allreduce_s(0, 8, beta, 1e-6) == pytest.approx(14e-6)  # 2 (N - 1) latencies
    measured = {"backward_s": 1.0, "apply_s": 0.1, "buckets": [(0.2, 0.5e9), (1.0, 0.1e9)]}
    # N = 2: the first bucket's 0.5 s ends at 0.7, inside the backward; the last one's 0.1 s after it.
    assert predicted_step_s(measured, 2, beta, alpha) == pytest.approx(1.0 + 0.1 + 0.1)
    assert predicted_step_s(measured, 2, beta, alpha, overlap=False) == pytest.approx(1.0 + 0.6 + 0.1)
    assert predicted_step_s(measured, 1, beta, alpha) == pytest.approx(1.1)


@pytest.mark.parametrize("cap", [0, -1.0, float("nan"), float("inf"), "25", True])
def test_a_bucket_cap_that_is_not_a_positive_number_of_mib_is_refused_before_mpi_starts(cap):
    import sys
    import symgrad as sg
    x = sg.input("x", (4, 3))
    w = sg.param("w_cap", (3, 2), init=np.ones((3, 2), np.float32))
    started = "mpi4py.MPI" in sys.modules
    with pytest.raises(ValueError, match="bucket_cap_mb must be a positive number of MiB"):
        sg.distributed.train_step(sg.sum(x @ w), [w], sg.optim.SGD(lr=0.1), bucket_cap_mb=cap)
    assert ("mpi4py.MPI" in sys.modules) == started
