"""CUDA's batched GEMM, convolutions and deterministic attention gradient (issue 33).

From the source and the plan: a batched product is one launch of the GEMM, its blocks walking the
products; a convolution (grouped, or of one input channel as LeNet's first) is decided a template
GEMM over gathered patches, batched over images and groups; fused attention's gradient adds
without atomics (a thread per key row sums its dk and dv) and reads the buffers its plan gives it:
the softmax statistics its forward stored, and its scratch of per-row statistics.

What the kernels compute, against the NumPy reference, on a GPU (skipped without one) and on the
CPU stand-in of tests/backends/cuda_on_cpu.py (the same source built by g++, a block's threads as
fibers meeting at its barriers): N-D matmul and its gradients (a Dim batch, broadcast operands; on a GPU also more
products than a launch has blocks along z), convolutions plain, grouped and of one channel forward
and backward, the attention gradient beside its forward and apart from it, giving the same bits
every run, and the LeNet and GPT train steps.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import symgrad as sg
from symgrad import passes
from symgrad.backends.render.languages import C_OPENMP, CUDA
from symgrad.backends.lower.lowering import AttentionKernel, lower
from symgrad.ir import shapes as S
from symgrad.ir.graph import Graph
from symgrad.backends.kinds.attention import WARP_BYTES
from symgrad.ir.ops_attention import attention, attention_grad
import cuda_on_cpu
from test_backend_cuda import HAS_GPU, B, batched_matmul_ops

RNG = np.random.default_rng(33)


def _attention_pair(dtype: str, causal: bool, T: int = 70, suffix: str = "", E: int = 16):
    """(inputs, outputs): attention over 3 heads of T x E, its gradient beside it (reading the
    forward's statistics) and one apart (the forward's output handed in: it sweeps for them)."""
    q, g, out = (sg.input(name + suffix, (3, T, E), dtype=dtype) for name in ("q", "g", "out"))
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
    assert f"{stats}[h * T + i] = M;" in text and f"{stats}[(H + h) * T + i] = inverse;" in text
    assert f"const float mi = {stats}[h * T + i];  /* stored by the forward */" in text
    # The warp walk (E = 16): a block of 32 threads per row, each lane a key (or query row) in 32.
    assert text.count("<<<sg_blocks_for_rows(n), 32>>>") == 5 and "__shared__ float sh[32][E + 1]" in text
    assert "for (int64_t j = lane; j < visible; j += 32) {" in text
    assert f"for (int64_t i = {'j - j % 32 + lane' if causal else 'lane'}; i < T; i += 32) {{" in text
    assert ("if (i < j) {" in text) == causal                 # a key row sums only the rows that see it
    # C's kernel keeps its own walk: k and v transposed per head (3 x 16 x 70 each).
    c_kernels = _attention_kernels(lower(passes.optimize(Graph(inputs, outputs))))
    assert [b.numel for b in c_kernels["attention_grad"].scratch] == [3 * 16 * 70] * 2


# ---- what the kernels compute: on a GPU, or on the CPU stand-in -------------------------------

@pytest.fixture(params=[pytest.param("gpu", marks=pytest.mark.gpu), "cpu"])
def device(request, monkeypatch, tmp_path):
    """Where backend="cuda" runs: the GPU (skipped without one), or the CPU (cuda_on_cpu.py: skipped
    without g++, and on a machine with a GPU, which runs the same tests for real)."""
    if request.param == "gpu" and not HAS_GPU:
        pytest.skip("needs an NVIDIA GPU")
    if request.param == "cpu":
        if cuda_on_cpu.CXX is None or HAS_GPU:
            pytest.skip("needs g++, and no GPU (which runs these tests itself)")
        cuda_on_cpu.use(monkeypatch, tmp_path)
    return request.param


def _compare(f, reference, arrays, tol) -> list:
    """The results of compiled function `f`, checked against those of `reference` (NumPy's), `tol`'s
    atol scaled by each output's largest magnitude (sums of thousands cancel to small numbers in
    another order)."""
    got = f(*arrays)
    for k, (g, w) in enumerate(zip(got, reference(*arrays))):
        scale = max(1.0, float(np.abs(w).max(initial=0)))
        np.testing.assert_allclose(g, w, rtol=tol["rtol"], atol=tol["atol"] * scale, err_msg=f"output {k}")
    return got


def _functions(inputs, outputs) -> tuple:
    """`outputs` of `inputs` compiled for CUDA, and NumPy's."""
    return tuple(sg.function(inputs, outputs, backend=backend) for backend in ("cuda", "numpy"))


@pytest.mark.parametrize("dtype", ["float32", pytest.param("float64", marks=pytest.mark.gpu)])
def test_nd_matmul_and_gradients_match_numpy(device, dtype):
    if dtype == "float64" and device == "cpu":
        pytest.skip("float64 runs on a GPU (on the CPU the float32 program shows the same kernels)")
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == "float32" else dict(rtol=1e-10, atol=1e-10)
    a, b, c = sg.input("a", (B, 3, 67, 33), dtype=dtype), sg.input("b", (3, 33, 70), dtype=dtype), \
        sg.input("c", (B, 1, 70, 5), dtype=dtype)
    y = sg.matmul(sg.matmul(a, b), c)                         # b broadcast over B, c over the second axis
    f, reference = _functions([a, b, c], [y, *sg.grad((y * y).sum(), [a, b, c])])
    for batch in (1, 5) if device == "gpu" else (2,):
        shapes = ((batch, 3, 67, 33), (3, 33, 70), (batch, 1, 70, 5))
        _compare(f, reference, [RNG.standard_normal(shape).astype(dtype) for shape in shapes], tol)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU")
def test_more_products_than_blocks_along_z_on_gpu():
    many, other = sg.input("many", (70000, 2, 3)), sg.input("other", (70000, 3, 2))
    z = sg.matmul(many, other)
    arrays = [RNG.standard_normal(shape).astype(np.float32) for shape in ((70000, 2, 3), (70000, 3, 2))]
    f, reference = _functions([many, other], [z, *sg.grad((z * z).sum(), [many, other])])
    _compare(f, reference, arrays, dict(rtol=1e-4, atol=1e-4))


def test_convolutions_match_numpy(device):
    """Plain, grouped and one-channel convolutions (batched_matmul_ops), forward and gradients, at
    sizes the 64 x 64 tiles do not divide; and the products beside them."""
    graph = batched_matmul_ops()
    arrays = [RNG.standard_normal(tuple(S.evaluate(s, {B: 2}) for s in v.shape)).astype(np.float32)
              for v in graph.inputs]
    _compare(*_functions(graph.inputs, graph.outputs), arrays, dict(rtol=1e-4, atol=1e-4))


@pytest.mark.parametrize("E", [16, 130])
def test_attention_gradient_matches_numpy_and_is_the_same_every_run(device, E):
    """Causal and not: the forward, its gradient beside it and one apart; run again, the same bits.
    E = 16 takes the warp walk (E in registers), 130 the row walk (more than WARP_BYTES)."""
    pairs = [_attention_pair("float32", causal, suffix=f"_{causal}", E=E) for causal in (True, False)]
    inputs, outputs = [v for ins, _ in pairs for v in ins], [v for _, outs in pairs for v in outs]
    grids = re.findall(r"_attention\w*<<<([^>]*)>>>", sg.cuda_source(Graph(inputs, outputs)))
    assert grids == ["sg_blocks_for_rows(n), 32" if 4 * E <= WARP_BYTES else "sg_blocks(n), SG_THREADS"] * 10
    f, reference = _functions(inputs, outputs)
    arrays = [RNG.standard_normal((3, 70, E)).astype(np.float32) for _ in inputs]
    forwards = reference(*arrays)
    for k in range(len(pairs)):  # each pair's `out`: its forward's output, handed in
        arrays[3 * k + 2] = forwards[3 * k]
    first = _compare(f, reference, arrays, dict(rtol=1e-4, atol=1e-4))
    for _ in range(2 if device == "gpu" else 1):
        for k, (again, once) in enumerate(zip(f(*arrays), first)):
            np.testing.assert_array_equal(again, once, err_msg=f"output {k}")


def _nan_where_numpy_s_is(got, want) -> None:
    for n, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=f"output {n}: NaN where NumPy's is")
        np.testing.assert_allclose(a[np.isfinite(b)], b[np.isfinite(b)], rtol=1e-4, atol=1e-4, err_msg=f"output {n}")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NumPy's inf * 0, meant
@pytest.mark.parametrize("E", [8, 130])
def test_attention_gradient_of_an_infinite_cotangent_is_nan_where_numpy_s_is(device, E):
    """An infinity in a cotangent row makes its D NaN; the keys hidden from it (causal) get NaN in dk,
    and in dv where the row is infinite, as NumPy's (and torch's math attention) p = 0 times it gives.
    The key rows skip the query rows hidden from them: they add those products where some D is not
    finite (the H200 run found CUDA's dk finite there). E = 8: the warp walk; 130: the row walk."""
    inputs, outputs = [], []
    for causal in (True, False):
        q, k, v, g = (sg.input(f"{name}_{causal}", (2, 40, E)) for name in "qkvg")
        y = sg.scaled_dot_product_attention(q, k, v, is_causal=causal)
        inputs += [q, k, v, g]
        outputs += sg.grad(sg.sum(y * g), [q, k, v])
    arrays = [RNG.standard_normal((2, 40, E)).astype(np.float32) for _ in inputs]
    for at in (3, 7):  # each g
        arrays[at][0, 1, 0] = np.inf
        arrays[at][1, 35, 2] = -np.inf
    f, reference = _functions(inputs, outputs)
    got = f(*arrays)
    _nan_where_numpy_s_is(got, reference(*arrays))
    assert np.isnan(got[1][0]).all() and np.isnan(got[2][0, 2:, 0]).all()  # causal dk, dv of the hidden keys


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # NumPy's 1e20 * -1e20, meant
@pytest.mark.parametrize("E", [8, 130])
def test_attention_with_a_score_of_minus_infinity_is_finite_as_numpy_s(device, E):
    """Finite q and k whose product overflows to -inf in float32 (1e20 * -1e20) at key 5, the first key
    of a lane in the warp walk, or at key 33, its second: p = 0 there, the rows stay finite (a lane
    whose running max was still -inf took exp(-inf + inf) = NaN and made every row that sees the key
    NaN). The forward, its gradient beside it and one apart (which finds the softmax again)."""
    inputs, outputs = [], []
    for causal in (True, False):
        q, k, v, g, out = (sg.input(f"{name}_{causal}", (2, 40, E)) for name in ("q", "k", "v", "g", "out"))
        y = attention(q, k, v, causal, 0.3)
        inputs += [q, k, v, g, out]
        outputs += [y, attention_grad(q, k, v, y, g, causal, 0.3), attention_grad(q, k, v, out, g, causal, 0.3)]
    f, reference = _functions(inputs, outputs)
    for key in (5, 33):
        arrays = [RNG.standard_normal((2, 40, E)).astype(np.float32) for _ in inputs]
        for q, k in ((arrays[0], arrays[1]), (arrays[5], arrays[6])):
            q[..., 0] = 1e20
            k[..., 0] = 0
            k[:, key, 0] = -1e20
        for at in (4, 9):  # each `out`: its forward's output
            arrays[at] = reference(*arrays)[0 if at == 4 else 3]
        got, want = f(*arrays), reference(*arrays)
        for n, (a, b) in enumerate(zip(got, want)):
            assert np.isfinite(a).all() and np.isfinite(b).all(), f"output {n}"
            kept = np.ones(b.shape, bool)
            if n % 3:  # a gradient: dk's first column sums ds times q's 1e20 (1e16, cancelling: ill-conditioned)
                kept[1, ..., 0] = False
            np.testing.assert_allclose(a[kept], b[kept], rtol=1e-4, atol=1e-4, err_msg=f"output {n}")


def test_lenet_step_matches_numpy(device):
    """benchmarks.cnn's LeNet, an SGD step at batch 2 (two on a GPU): the losses and the trained weights."""
    from dataclasses import replace
    from benchmarks import cnn
    bench = replace(cnn.CONFIGS["lenet"], batch=2)
    _, state, names, x, y = cnn.setup(bench)
    steps = {backend: cnn.symgrad_step(bench, state, x, y, backend) for backend in ("numpy", "cuda")}
    for _ in range(2 if device == "gpu" else 1):
        losses = {backend: step(x=x, y=y) for backend, step in steps.items()}
        assert losses["cuda"] == pytest.approx(losses["numpy"], rel=1e-4)
    for name in names:
        np.testing.assert_allclose(steps["cuda"].params[name], steps["numpy"].params[name], rtol=1e-4, atol=1e-5)


def test_gpt_step_matches_numpy(device):
    """benchmarks.gpt's model (attention, LayerNorm, AdamW), a step: the loss and the trained weights.
    On the CPU its tiny config (one block of 2 heads, 2 x 8 tokens; the small one takes half a minute),
    on a GPU the small config cut to one block."""
    from dataclasses import replace
    from benchmarks import gpt
    bench = replace(gpt.CONFIGS["small"], layers=1) if device == "gpu" else gpt.CONFIGS["tiny"]
    _, state, x, y = gpt.setup(bench)
    steps = {backend: gpt.symgrad_step(bench, state, backend) for backend in ("numpy", "cuda")}
    losses = {backend: step(idx=x, targets=y) for backend, step in steps.items()}
    assert losses["cuda"] == pytest.approx(losses["numpy"], rel=1e-4)
    for name, value in steps["numpy"].params.items():
        np.testing.assert_allclose(steps["cuda"].params[name], value, rtol=1e-3, atol=1e-5, err_msg=name)
