"""CUDA's batched GEMM, convolutions and deterministic attention gradient (issue 33).

Without a GPU, from the source and the plan: a batched product is one launch of the GEMM, its
blocks walking the products; a convolution (grouped, or of one input channel as LeNet's first) is
decided a template GEMM over gathered patches, batched over images and groups; fused attention's
gradient adds without atomics (a thread per key row sums its dk and dv) and reads the buffers its
plan gives it: the softmax statistics its forward stored, and its scratch of per-row statistics.
On a GPU (skipped without one), against the NumPy reference: N-D matmul and its gradients (a Dim
batch, broadcast operands, more products than a launch has blocks along z), convolutions plain,
grouped and of one channel forward and backward, and the attention gradient run again giving the
same bits.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import symgrad as sg
from symgrad import passes
from symgrad.backends.languages import C_OPENMP, CUDA
from symgrad.backends.lowering import AttentionKernel, lower
from symgrad.ir.graph import Graph
from symgrad.ir.ops_attention import attention, attention_grad
import cuda_on_cpu
from test_backend_cuda import B, batched_matmul_ops, needs_gpu

RNG = np.random.default_rng(33)


def _attention_pair(dtype: str, causal: bool, T: int = 70):
    """(inputs, outputs): attention over 3 heads of T x 16, its gradient beside it (reading the
    forward's statistics) and one apart (the forward's output handed in: it sweeps for them)."""
    q, g, out = (sg.input(name, (3, T, 16), dtype=dtype) for name in ("q", "g", "out"))
    y = attention(q, q * 0.5, sg.tanh(q), causal, 0.3)
    beside = attention_grad(q, q * 0.5, sg.tanh(q), y, g, causal, 0.3)
    apart = attention_grad(q, q * 0.5, sg.tanh(q), out, g, causal, 0.3)
    return [q, g, out], [y, beside, apart]


def _attention_kernels(plan) -> dict:
    """"attention", "attention_grad" and "attention_grad apart" (the one without stored statistics)."""
    return {k.op + (" apart" if k.op == "attention_grad" and k.stats is None else ""): k
            for k in plan.kernels if isinstance(k, AttentionKernel)}


# ---- the source and the plan (no GPU) -----------------------------------------------------------

def test_batched_matmul_is_one_launch_walking_its_products():
    text = sg.cuda_source(batched_matmul_ops())
    assert "for (int64_t n0" not in text                     # no host loop over the batch
    batched = re.findall(r"const sg_batch batch = \{ (\d), ([^,]+), \{ ([^}]*) \},\s*\{ ([^}]*) \}, "
                         r"\{ ([^}]*) \},\s*\{ ([^}]*) \} \};", text)
    plain = text.count("const sg_batch batch = { 0, 1,")
    assert batched and len(batched) + plain == text.count("sg_gemm<float><<<")
    # y = a @ b: a (B, 3, 5, 7) moves 105 and 35 along its batch axes, b (3, 7, 4) is broadcast over B.
    assert ("2", "3*d0", "d0, 3", "105, 35", "0, 28", "60, 20") in batched
    assert "for (int64_t z = blockIdx.z; z < batch.count; z += gridDim.z)" in text


def test_convolutions_are_template_gemms_over_gathered_patches():
    """Grouped and one-channel convolutions and their gradients: decide chose the template GEMM for
    every product (no patch read in place: CUDA builds neither patch GEMM nor direct rows), and the
    grouped one's products walk images and groups."""
    graph = batched_matmul_ops()
    plan = lower(passes.optimize(graph), variables=graph.variables, implicit_gemm=True, language=CUDA)
    products = [k for k in plan.kernels if k.kind == "matmul"]
    assert {k.impl for k in products} == {"template gemm"} and "patches read in place: none" in plan.decisions
    assert any(len(k.batch) == 2 and k.batch[1][0] == 2 for k in products)   # (images, 2 groups)
    c_plan = lower(passes.optimize(graph), variables=graph.variables, implicit_gemm=True, language=C_OPENMP)
    assert "direct rows" in {k.impl for k in c_plan.kernels if k.kind == "matmul"}


@pytest.mark.parametrize("causal", [True, False])
def test_attention_gradient_uses_the_plans_buffers_and_no_atomics(causal):
    inputs, outputs = _attention_pair("float32", causal)
    plan = lower(passes.optimize(Graph(inputs, outputs)), language=CUDA)
    kernels = _attention_kernels(plan)
    forward, beside, apart = kernels["attention"], kernels["attention_grad"], kernels["attention_grad apart"]
    # The forward stores the softmax its gradient reads; the gradients' scratch: each row's D, and
    # where no forward stored them, m and 1 / l before it (3 heads x 70 rows each).
    assert forward.stats is beside.stats is not None and apart.stats is None and forward.scratch == ()
    assert [b.numel for b in beside.scratch] == [3 * 70] and [b.numel for b in apart.scratch] == [3 * 3 * 70]
    text = sg.cuda_source(Graph(inputs, outputs))
    assert "atomicAdd" not in text and "cudaMemsetAsync" not in text
    for grad in (beside, apart):
        assert f"{grad.name}_keys<<<" in text                # the key rows' pass, after the query rows'
    stats = forward.stats.name
    assert f"{stats}[h * T + i] = m;" in text and f"{stats}[(H + h) * T + i] = inverse;" in text
    assert f"const float m = {stats}[h * T + i];  /* stored by the forward */" in text
    assert f"for (int64_t i = {'first' if causal else '0'}; i < T; ++i) {{" in text
    assert ("if (i < j) {" in text) == causal                 # a key row sums only the rows that see it
    # C's kernel keeps its own walk: k and v transposed per head (3 x 16 x 70 each).
    c_kernels = _attention_kernels(lower(passes.optimize(Graph(inputs, outputs))))
    assert [b.numel for b in c_kernels["attention_grad"].scratch] == [3 * 16 * 70] * 2


@pytest.mark.skipif(cuda_on_cpu.CXX is None, reason="needs a host C++ compiler")
def test_batched_gemm_matches_numpy_run_on_the_cpu(tmp_path):
    """The CUDA GEMM, built for the CPU (a block's threads as host threads, cuda_on_cpu.py): 2 x 3
    products of 70 x 33 by 33 x 67 (no tile divides them), A read transposed, B broadcast over the
    outer axis, 4 blocks along z walking the 6 products."""
    M, N, K = 70, 67, 33
    a = RNG.standard_normal((2, 3, K, M)).astype(np.float32)       # each product's A stored transposed
    b = RNG.standard_normal((3, K, N)).astype(np.float32)
    batch = [(2, 3 * K * M, 0, 3 * M * N), (3, K * M, K * N, M * N)]
    got = cuda_on_cpu.gemm(M, N, K, a.ravel(), (1, M), b.ravel(), (N, 1), batch, 4, tmp_path)
    want = np.swapaxes(a, -1, -2).astype(np.float64) @ b
    np.testing.assert_allclose(got.reshape(2, 3, M, N), want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(cuda_on_cpu.CXX is None, reason="needs a host C++ compiler")
@pytest.mark.parametrize("causal", [True, False])
def test_attention_kernels_match_numpy_run_lane_by_lane_on_the_cpu(causal, tmp_path):
    """The CUDA attention kernels, built for the CPU and run one lane after another (cuda_on_cpu.py):
    the forward, its gradient beside it (reading the stored statistics) and one apart (sweeping for
    them) match NumPy, T = 70 (a Dim) past two key blocks, a warp of lanes starting its key rows together."""
    T = sg.Dim("T")
    q, k, v, g, out = (sg.input(name, (3, T, 16)) for name in ("q", "k", "v", "g", "out"))
    y = attention(q, k, v, causal, 0.3)
    outputs = [y, attention_grad(q, k, v, y, g, causal, 0.3), attention_grad(q, k, v, out, g, causal, 0.3)]
    graph = Graph([q, k, v, g, out], outputs)
    plan = lower(graph, language=CUDA)                        # three attention kernels, nothing else
    arrays = [RNG.standard_normal((3, 70, 16)).astype(np.float32) for _ in range(5)]
    got = cuda_on_cpu.run(plan, arrays, {T: 70}, tmp_path)
    for n, (have, want) in enumerate(zip(got, sg.function([q, k, v, g, out], outputs, backend="numpy")(*arrays))):
        np.testing.assert_allclose(have.reshape(want.shape), want, rtol=1e-4, atol=1e-5, err_msg=f"output {n}")


# ---- on a GPU, against the NumPy reference ------------------------------------------------------

def _compare(inputs, outputs, arrays, tol) -> list:
    """The CUDA results of `outputs`, checked against NumPy's."""
    got = sg.function(inputs, outputs, backend="cuda")(*arrays)
    for k, (g, w) in enumerate(zip(got, sg.function(inputs, outputs, backend="numpy")(*arrays))):
        np.testing.assert_allclose(g, w, err_msg=f"output {k}", **tol)
    return got


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_nd_matmul_and_gradients_match_numpy_on_gpu(dtype):
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == "float32" else dict(rtol=1e-10, atol=1e-10)
    a, b, c = sg.input("a", (2, 3, 67, 33), dtype=dtype), sg.input("b", (3, 33, 70), dtype=dtype), \
        sg.input("c", (2, 1, 70, 5), dtype=dtype)
    y = sg.matmul(sg.matmul(a, b), c)                         # b broadcast over the first axis, c over the second
    many, other = sg.input("many", (70000, 2, 3), dtype=dtype), sg.input("other", (70000, 3, 2), dtype=dtype)
    z = sg.matmul(many, other)                                # more products than blocks along z
    inputs = [a, b, c, many, other]
    outputs = [y, z, *sg.grad((y * y).sum() + (z * z).sum(), inputs)]
    arrays = [RNG.standard_normal(tuple(v.shape)).astype(dtype) for v in inputs]
    _compare(inputs, outputs, arrays, tol)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_batched_matmul_and_convolution_match_numpy_on_gpu(dtype):
    """Batched products with a broadcast operand and a Dim batch, and a convolution, forward and
    gradients, at sizes the 64 x 64 tiles do not divide."""
    rng = np.random.default_rng(3)
    a = sg.input("a", (B, 3, 67, 33), dtype=dtype)
    b = sg.input("b", (3, 33, 70), dtype=dtype)
    img = sg.input("img", (B, 2, 11, 9), dtype=dtype)
    w = sg.input("w", (5, 2, 3, 3), dtype=dtype)
    y = sg.matmul(a, b)
    z = sg.nn.functional.conv2d(img, w, padding=1)
    outs = [y, z, *sg.grad((y * y).sum() + (z * z).sum(), [a, b, img, w])]
    f = {bk: sg.function([a, b, img, w], outs, backend=bk) for bk in ("numpy", "cuda")}
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == "float32" else dict(rtol=1e-10, atol=1e-10)
    for batch in (1, 5):
        arrays = [rng.standard_normal(shape).astype(dtype) for shape in
                  ((batch, 3, 67, 33), (3, 33, 70), (batch, 2, 11, 9), (5, 2, 3, 3))]
        for got, want in zip(f["cuda"](*arrays), f["numpy"](*arrays)):
            np.testing.assert_allclose(got, want, **tol)


@pytest.mark.gpu
@needs_gpu
def test_grouped_and_one_channel_convolutions_match_numpy_on_gpu():
    img, wg, w1 = sg.input("img", (3, 4, 11, 9)), sg.input("wg", (6, 2, 3, 3)), sg.input("w1", (5, 1, 5, 5))
    zg = sg.nn.functional.conv2d(img, wg, padding=1, groups=2)
    z1 = sg.nn.functional.conv2d(img[:, :1], w1, padding=2)
    inputs = [img, wg, w1]
    outputs = [zg, z1, *sg.grad((zg * zg).sum() + (z1 * z1).sum(), inputs)]
    arrays = [RNG.standard_normal(tuple(v.shape)).astype(np.float32) for v in inputs]
    _compare(inputs, outputs, arrays, dict(rtol=1e-4, atol=1e-4))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("causal", [True, False])
def test_attention_gradient_is_the_same_every_run_on_gpu(causal):
    inputs, outputs = _attention_pair("float32", causal)
    arrays = [RNG.standard_normal((3, 70, 16)).astype(np.float32) for _ in range(2)]
    reference = sg.function(inputs, outputs, backend="numpy")
    arrays.append(reference(*arrays, np.zeros((3, 70, 16), np.float32))[0])   # the forward's output, handed in
    first = _compare(inputs, outputs, arrays, dict(rtol=1e-4, atol=1e-4))
    f = sg.function(inputs, outputs, backend="cuda")
    for _ in range(3):
        for k, (again, once) in enumerate(zip(f(*arrays), first)):
            np.testing.assert_array_equal(again, once, err_msg=f"output {k}")
