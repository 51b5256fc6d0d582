"""Row kernels: softmax, log-softmax and cross-entropy (forward and backward) as one kernel per row group.

Every compiled result is compared with the NumPy reference (or torch for extreme logits). C builds
are shared: one graph per (dtype, C) holds all the outputs checked at that size.
"""

import numpy as np
import pytest
import torch

import symgrad as sg
from symgrad.backends import cuda
from symgrad.backends.lower.lowering import LoopKernel, ReduceKernel, RowKernel, lower
from symgrad.backends.lower.memory import liveness
from symgrad.ir.graph import Graph

RNG = np.random.default_rng(11)
B = sg.Dim("B")
HAS_GPU = cuda.device_count()[0] > 0


def kinds(plan) -> list[str]:
    return [type(k).__name__ for k in plan.kernels]


def softmax_graph(C=10, dtype="float32"):
    x = sg.input("x", (B, C), dtype=dtype)
    return [x], [sg.softmax(x, axis=1)]


def log_softmax_graph(C=10, dtype="float32"):
    x = sg.input("x", (B, C), dtype=dtype)
    return [x], [sg.log_softmax(x, axis=1)]


def everything_graph(C, dtype):
    """softmax, log_softmax, the mean cross-entropy and its gradient with respect to the logits."""
    x = sg.input("x", (B, C), dtype=dtype)
    y = sg.input("y", (B,), dtype="int64")
    loss = sg.cross_entropy(x, y)
    (dx,) = sg.grad(loss, [x])
    return [x, y], [sg.softmax(x, axis=1), sg.log_softmax(x, axis=1), loss, dx]


def rows_3d_graph():
    """Softmax over the last axis of a 3-D value: its two row axes run as one loop."""
    x = sg.input("x", (B, 3, 7), dtype="float64")
    return [x], [sg.softmax(x, axis=-1), sg.sum(sg.log_softmax(x, axis=-1))]


def separated_graph():
    """Two softmaxes of one shape with a matmul between them: two row kernels, never one."""
    x = sg.input("x", (B, 6), dtype="float64")
    W = sg.param("W", (6, 6), init=np.eye(6) * 0.5, dtype="float64")
    return [x], [sg.softmax(sg.softmax(x, axis=1) @ W, axis=1)]


def softmax_regression_graph():
    x, y = sg.input("x", (B, 784)), sg.input("y", (B,), dtype="int64")
    W = sg.param("W", (784, 10), init="zeros")
    b = sg.param("b", (10,), init="zeros")
    return sg.train_step(sg.cross_entropy(x @ W + b, y), params=[W, b], optimizer=sg.optim.SGD(lr=0.1),
                         backend="numpy").graph


# Every graph here, for test_backend_cuda's nvcc check (the CUDA source of each must compile).
ROW_GRAPHS = {
    "rows_softmax": lambda: Graph(*softmax_graph()),
    "rows_log_softmax_f64": lambda: Graph(*log_softmax_graph(dtype="float64")),
    "rows_everything_c1": lambda: Graph(*everything_graph(1, "float32")),
    "rows_everything_c1000_f64": lambda: Graph(*everything_graph(1000, "float64")),
    "rows_3d": lambda: Graph(*rows_3d_graph()),
    "rows_separated": lambda: Graph(*separated_graph()),
    "rows_softmax_regression": softmax_regression_graph,
}


def reference(inputs, outputs, *arrays):
    return sg.function(inputs, outputs, backend="numpy")(*arrays)


# ---- the kernels ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def regression_step():
    def step(backend):  # parameters of its own: two steps of one W would train the same W
        x, y = sg.input("x", (B, 784)), sg.input("y", (B,), dtype="int64")
        W = sg.param("W", (784, 10), init="zeros")
        b = sg.param("b", (10,), init="zeros")
        return sg.train_step(sg.cross_entropy(x @ W + b, y), params=[W, b], optimizer=sg.optim.SGD(lr=0.1),
                             backend=backend)
    return [step(name) for name in ("c", "numpy")]


def test_softmax_regression_step_has_one_row_kernel(regression_step):
    """Softmax + cross-entropy forward and backward in one row kernel: 8 kernels, down from 13. The
    first counts the targets that are not ignore_index (torch's mean divides by that count)."""
    step, ref = regression_step
    plan = step.program.plan
    assert kinds(plan) == ["ReduceKernel", "MatmulKernel", "RowKernel", "ReduceKernel", "ReduceKernel", "LoopKernel",
                           "MatmulKernel", "LoopKernel"]
    (row,) = [k for k in plan.kernels if isinstance(k, RowKernel)]
    assert [[r.op for r in p.reductions] for p in row.passes] == [["max", "sum"], ["sum"], ["sum"]]
    assert [st.node.op.name for st in row.passes[1].after] == ["log"]  # log(sum) once per row
    # dz = (softmax - onehot) / B is stored for the weight and bias gradients, the loss as per-row parts
    stored = {st.label for p in row.passes for st in [*p.stores, *p.row_stores]}
    grad = plan.kernels[-2].b.buffer  # x^T @ dz reads dz
    assert grad in row.outs and any(st.view.buffer.dtype == "float64" for st in row.passes[-1].row_stores)
    assert len(stored) == 4  # (the 4th: the loss gradient's per-element scale, -1/count where selected)
    # the cross-row sum of the per-row parts finishes the mean loss into the output
    cross = plan.kernels[3]
    assert cross.input.buffer in row.outs and cross.out is plan.outputs[0] and cross.epilogue_statements
    assert "row kernel: max, sum, sum, sum (3 passes), 4 outputs" in step.report()
    assert "1 row kernels" in step.report()
    unfused = lower(step.program.optimized, fuse_reduce=False)
    assert not any(isinstance(k, RowKernel) for k in unfused.kernels) and len(unfused.kernels) > 8
    for _ in range(3):
        x = RNG.standard_normal((37, 784)).astype("f4")
        y = RNG.integers(0, 10, 37)
        np.testing.assert_allclose(step(x=x, y=y), ref(x=x, y=y), rtol=1e-5)
    for name in ("W", "b"):
        np.testing.assert_allclose(step.params[name], ref.params[name], rtol=1e-4, atol=1e-6)


def test_row_kernel_buffers_are_live_where_it_runs(regression_step):
    """The memory plan's liveness covers every buffer the row kernel reads or writes."""
    plan = regression_step[0].program.plan
    live = liveness(plan)
    k = next(i for i, kernel in enumerate(plan.kernels) if isinstance(kernel, RowKernel))
    row = plan.kernels[k]
    touched = [o.view.buffer for o in [*row.operands, *(o for p in row.passes for o in p.operands)]]
    touched += row.outs
    for buf in touched:
        if buf is not None and buf.storage == "workspace":
            lo, hi = live[plan.workspace.index(buf)]
            assert lo <= k <= hi, buf.name


@pytest.mark.parametrize("build", [softmax_graph, log_softmax_graph], ids=["softmax", "log_softmax"])
def test_softmax_and_log_softmax_alone_are_one_row_kernel(build):
    inputs, outputs = build()
    f = sg.function(inputs, outputs, backend="c")
    (kernel,) = f.program.plan.kernels
    assert isinstance(kernel, RowKernel) and kernel.outs[-1] is f.program.plan.outputs[0]
    assert [[r.op for r in p.reductions] for p in kernel.passes][:2] == [["max"], ["sum"]]
    a = RNG.standard_normal((13, 10)).astype("f4") * 5
    np.testing.assert_allclose(f(a), reference(inputs, outputs, a), rtol=1e-5, atol=1e-7)


@pytest.fixture(scope="module", params=[(1, "float32"), (10, "float32"), (1000, "float32"), (1, "float64"),
                                        (10, "float64"), (1000, "float64")], ids=lambda p: f"C{p[0]}-{p[1]}")
def everything(request):
    C, dtype = request.param
    inputs, outputs = everything_graph(C, dtype)
    return C, dtype, inputs, outputs, sg.function(inputs, outputs, backend="c")


@pytest.mark.parametrize("rows", [1, 7, 1001])
def test_row_kernels_match_the_reference(everything, rows):
    """softmax, log_softmax, the loss and its gradient at awkward sizes (1001 rows of 1000: threads)."""
    C, dtype, inputs, outputs, f = everything
    # Rows of one element are no row reduction: those nodes lower one by one (rows._row_key).
    assert any(isinstance(k, RowKernel) for k in f.program.plan.kernels) == (C > 1)
    x = (RNG.standard_normal((rows, C)) * 4).astype(dtype)
    y = RNG.integers(0, C, rows)
    tol = dict(rtol=2e-5, atol=1e-6) if dtype == "float32" else dict(rtol=1e-12, atol=1e-14)
    for got, want in zip(f(x, y), reference(inputs, outputs, x, y)):
        np.testing.assert_allclose(got, want, **tol)


@pytest.fixture(scope="module")
def everything_c6():
    inputs, outputs = everything_graph(6, "float32")
    return sg.function(inputs, outputs, backend="c")


def _torch_everything(x, y):
    t = torch.tensor(x, requires_grad=True)
    loss = torch.nn.functional.cross_entropy(t, torch.tensor(y))
    loss.backward()
    return [v.detach().numpy() for v in (torch.softmax(t, 1), torch.log_softmax(t, 1), loss, t.grad)]


def _agree(got, want):
    assert (np.isfinite(got) == np.isfinite(want)).all(), (got, want)
    np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=1e-5, atol=1e-6)


def test_extreme_logits_stay_finite_where_torchs_do(everything_c6):
    """The max shift keeps softmax, log_softmax and the gradient finite where torch's are."""
    x = np.array([[0, -np.inf, 1, 2, -np.inf, 3],       # some -inf: probability 0, log-probability -inf
                  [1e30, -1e30, 3e38, 0, 1, -3e38],      # huge, of both signs
                  [88, 89, 90, -100, 104, 50],           # exp would overflow without the max shift
                  [-1e4, -1e4, -1e4, -1e4, -1e4, -1e4]], dtype="f4")
    y = np.array([0, 2, 4, 1])
    got = everything_c6(x, y)
    want = _torch_everything(x, y)
    for k in (0, 1, 3):  # softmax, log_softmax, the gradient
        _agree(got[k], want[k])
    assert np.isfinite(got[0]).all() and np.isfinite(got[3]).all()


@pytest.mark.parametrize("C", [6, 40])
def test_a_nan_logit_makes_its_row_max_and_softmax_nan(C):
    """The row max vectorizes as a plain `>` max plus a "saw a NaN" flag: a NaN anywhere in a row
    (first, last, mid-vector) still makes that row's max NaN, as NumPy's is, and only that row's."""
    x_in = sg.input("x", (B, C))
    inputs, outputs = [x_in], [sg.softmax(x_in, axis=1), sg.max(x_in, axis=1, keepdims=True)]
    f = sg.function(inputs, outputs, backend="c")
    assert kinds(f.program.plan) == ["RowKernel"]  # the max is the softmax's own, in the row kernel
    x = RNG.standard_normal((5, C)).astype("f4")
    x[0, 0] = x[1, C - 1] = x[2, C // 2 + 1] = np.nan
    x[3, 2] = np.inf
    with np.errstate(invalid="ignore"):
        want, got = reference(inputs, outputs, x), f(x)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        np.testing.assert_allclose(g[~np.isnan(w)], w[~np.isnan(w)], rtol=1e-6)
    assert np.isnan(got[1][:3]).all() and got[1][3, 0] == np.inf and not np.isnan(got[0][4]).any()


def test_large_logits_give_torchs_loss(everything_c6):
    """The loss at huge logits (every log-probability finite: nll_loss multiplies them by the
    one-hot rows, so a -inf one would make the graph's own value NaN, as in the NumPy reference)."""
    x = np.array([[3e38, 1e38, 0, 2e37, 2e38, 3e38],
                  [88, 89, 90, -100, 104, 50],
                  [-1e4, -1e4, -1e4, -1e4, -1e4, -1e4]], dtype="f4")
    y = np.array([1, 4, 2])
    got = everything_c6(x, y)
    want = _torch_everything(x, y)
    for g, w in zip(got, want):
        _agree(g, w)
    assert np.isfinite(got[2])


def test_row_axes_merge_and_match_the_reference():
    inputs, outputs = rows_3d_graph()
    f = sg.function(inputs, outputs, backend="c")
    rows = [k for k in f.program.plan.kernels if isinstance(k, RowKernel)]
    assert len(rows) == 1 and len(rows[0].rows) == 1  # (B, 3) rows: one loop
    x = RNG.standard_normal((5, 3, 7))
    for got, want in zip(f(x), reference(inputs, outputs, x)):
        np.testing.assert_allclose(got, want, rtol=1e-12)


def test_a_kernel_between_two_row_groups_keeps_them_apart():
    inputs, outputs = separated_graph()
    f = sg.function(inputs, outputs, backend="c")
    assert kinds(f.program.plan) == ["RowKernel", "MatmulKernel", "RowKernel"]
    x = RNG.standard_normal((9, 6))
    np.testing.assert_allclose(f(x), reference(inputs, outputs, x), rtol=1e-12)


def test_a_lone_reduction_keeps_its_reduce_kernel():
    """One row reduction and its per-row epilogue is already one kernel: no row kernel for it."""
    x = sg.input("x", (B, 12))
    plan = lower(Graph([x], [sg.log(sg.sum(sg.exp(x), axis=1))]))
    assert [type(k) for k in plan.kernels] == [ReduceKernel]
    plan = lower(Graph([x], [sg.exp(x) * 2]))
    assert [type(k) for k in plan.kernels] == [LoopKernel]


# ---- CUDA: the same kernels as one block per row --------------------------------------------

def test_cuda_row_kernel_is_one_block_per_row():
    src = sg.cuda_source(softmax_regression_graph())
    body = src.split("row kernel: max, sum, sum, sum (3 passes), 4 outputs")[1].split("\n}\n")[0]
    assert "for (int64_t o = blockIdx.x; o < n_rows; o += gridDim.x)" in body
    assert "for (int64_t c = threadIdx.x; c < 10; c += blockDim.x)" in body
    assert "sg_block_max<float>((a0_nan ? NAN : a0), s_float)" in body and "sg_block_sum<double>" in body
    assert "atomicAdd" not in src


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("C,dtype", [(1, "float32"), (10, "float32"), (1000, "float32"), (1000, "float64")])
def test_cuda_row_kernels_match_the_reference_on_gpu(C, dtype):
    inputs, outputs = everything_graph(C, dtype)
    f = sg.function(inputs, outputs, backend="cuda")
    tol = dict(rtol=1e-4, atol=1e-6) if dtype == "float32" else dict(rtol=1e-12, atol=1e-14)
    for rows in (1, 7, 1001):
        x = (RNG.standard_normal((rows, C)) * 4).astype(dtype)
        y = RNG.integers(0, C, rows)
        first = f(x, y)
        for got, want in zip(first, reference(inputs, outputs, x, y)):
            np.testing.assert_allclose(got, want, **tol)
        for got, again in zip(first, f(x, y)):  # deterministic: the same bits every run
            np.testing.assert_array_equal(got, again)


def test_unscheduled_lowering_runs_a_group_after_all_it_reads():
    x = sg.input("x", (B, 6), dtype="float64")
    W = sg.param("W", (5, 6), init="zeros", dtype="float64")
    late = sg.exp(x @ sg.transpose(W) @ W)  # read by the group's last pass only, computed late in graph order
    p = sg.softmax(x, axis=1)
    out = p * sg.sum(p * late, axis=1, keepdims=True)
    plan = lower(Graph([x], [out]), schedule=False)
    names = kinds(plan)
    assert names.count("RowKernel") == 1 and names.index("RowKernel") > names.index("MatmulKernel")


def test_softmax_over_rows_of_one_element_compiles_and_matches_torch():
    """Found by the differential fuzzer: a row group over rows of C = 1 could not tell per-row
    values (rows, 1) from full-row ones (rows, C) and the lowering raised KeyError."""
    x = sg.input("x", (3, 1), dtype="float64")
    cot = sg.input("cot", (3, 2), dtype="float64")
    out = sg.broadcast_to(sg.tanh(sg.log_softmax(x, axis=1)), (3, 2))
    (dx,) = sg.grad(sg.sum(out * cot), [x])
    f = sg.function([x, cot], [out, dx], backend="c")
    xv, cv = RNG.standard_normal((3, 1)), RNG.standard_normal((3, 2))
    xt = torch.tensor(xv, requires_grad=True)
    want = torch.tanh(torch.log_softmax(xt, dim=1)).expand(3, 2)
    (want_dx,) = torch.autograd.grad(want, [xt], grad_outputs=torch.tensor(cv))
    got, got_dx = f(xv, cv)
    np.testing.assert_allclose(got, want.detach().numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(got_dx, want_dx.numpy(), rtol=1e-12, atol=1e-14)
