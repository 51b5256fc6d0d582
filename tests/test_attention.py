"""Fused attention (symgrad.ir.ops_attention, symgrad.backends.kinds.attention): one op and its gradient.

Self-attention through `scaled_dot_product_attention` is one `attention` node whose VJP is one
`attention_grad` node; both match torch in float64 on every backend, with T past a key block and
a row tile, heads read in place through a transpose, and T a Dim. The compiled plan holds no
buffer of T x T elements, where the composite graph holds several.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import symgrad as sg
from helpers import c_build_options
from symgrad.backends.kinds.attention import AttentionKernel
from symgrad.backends.lower.lowering import lower
from symgrad.passes.pipeline import optimize

NF = sg.nn.functional
RNG = np.random.default_rng(11)
# (batch, T, heads, head dim): T = 70 crosses a key block (64) and ends inside a row tile (16).
X = RNG.standard_normal((2, 70, 3, 8))
W = RNG.standard_normal((2, 3, 70, 8))


def _torch(x, w, causal, scale):
    xt = torch.tensor(x, requires_grad=True)
    heads = xt.transpose(1, 2)
    y = torch.nn.functional.scaled_dot_product_attention(heads, heads * 2, torch.tanh(heads), is_causal=causal,
                                                         scale=scale)
    (gx,) = torch.autograd.grad((y * torch.tensor(w)).sum(), [xt])
    return y.detach().numpy(), gx.numpy()


def _symgrad(x_value, causal, scale):
    heads = sg.swapaxes(x_value, 1, 2)
    return NF.scaled_dot_product_attention(heads, heads * 2, sg.tanh(heads), is_causal=causal, scale=scale)


@pytest.fixture(scope="module")
def functions():
    """backend -> one compiled function of the four cases (causal or not, default or given scale)."""
    T = sg.Dim("T")
    x = sg.input("x", (2, T, 3, 8), dtype="float64")
    w = sg.input("w", (2, 3, T, 8), dtype="float64")
    outs = []
    for causal, scale in ((False, None), (True, None), (False, 0.3), (True, 0.3)):
        y = _symgrad(x, causal, scale)
        assert y.op.name == "attention"
        outs += [y, *sg.grad((y * w).sum(), [x])]
    outs += _heads_back(x, w)
    return {backend: sg.function([x, w], outs, backend=backend) for backend in ("numpy", "c")}


def _heads_back(x, w) -> list:
    """The transformer's way back, y.transpose(1, 2).reshape(B, T, H * E), causal, scale 0.2 (an
    attention of its own: the other cases' are outputs, which keep their order), and its gradient."""
    B, T = x.shape[0], x.shape[1]
    y = sg.reshape(sg.swapaxes(_symgrad(x, True, 0.2), 1, 2), (B, T, 24))
    return [y, *sg.grad((y * sg.reshape(sg.swapaxes(w, 1, 2), (B, T, 24))).sum(), [x])]


@pytest.mark.parametrize("backend", ["numpy", "c"])
@pytest.mark.parametrize("rows", [70, 5])
def test_fused_attention_and_its_gradient_match_torch(functions, backend, rows):
    got = functions[backend](np.ascontiguousarray(X[:, :rows]), np.ascontiguousarray(W[:, :, :rows]))
    for k, (causal, scale) in enumerate(((False, None), (True, None), (False, 0.3), (True, 0.3))):
        want_y, want_g = _torch(X[:, :rows], W[:, :, :rows], causal, scale)
        np.testing.assert_allclose(got[2 * k], want_y, rtol=1e-12, atol=1e-12, err_msg=f"case {k} output")
        np.testing.assert_allclose(got[2 * k + 1], want_g, rtol=1e-10, atol=1e-12, err_msg=f"case {k} gradient")
    xt = torch.tensor(X[:, :rows], requires_grad=True)
    heads = xt.transpose(1, 2)
    yt = torch.nn.functional.scaled_dot_product_attention(heads, heads * 2, torch.tanh(heads), is_causal=True,
                                                          scale=0.2)
    yt = yt.transpose(1, 2).reshape(2, rows, 24)
    (gx,) = torch.autograd.grad((yt * torch.tensor(W[:, :, :rows]).transpose(1, 2).reshape(2, rows, 24)).sum(), [xt])
    np.testing.assert_allclose(got[8], yt.detach().numpy(), rtol=1e-12, atol=1e-12, err_msg="heads back")
    np.testing.assert_allclose(got[9], gx.numpy(), rtol=1e-10, atol=1e-12, err_msg="heads back, gradient")


def test_an_output_read_through_a_transpose_is_written_heads_last_and_copied_by_no_kernel(functions):
    """`_heads_back`: the attention writes its rows in the order the transpose reads them (T, then H),
    so that the transpose is a view and the reshape after it copies nothing; its gradient reads them
    where they lie (the values against torch: test_fused_attention_and_its_gradient_match_torch)."""
    from symgrad.backends.report import kernel_reads
    f = functions["c"]
    assert f.decisions.count("attention outputs stored heads last: t") == 1
    kernels = f.program.plan.kernels
    forwards = [k for k in kernels if isinstance(k, AttentionKernel) and k.op == "attention"]
    # (H, T, E) read over storage (T, H, E): head h at 8 h, row i at 24 i; the other four contiguous
    stored = [k for k in forwards if k.written.strides[-3:] == (8, 24, 1)]
    assert len(forwards) == 5 and len(stored) == 1
    copies = [k for k in kernels if k.report_kind == "copy"]
    assert not any(stored[0].out in kernel_reads(k) for k in copies), [k.name for k in copies]


def test_float32_c_matches_the_numpy_reference():
    x = sg.input("x", (2, 70, 3, 8))
    y = _symgrad(x, True, None)
    outs = [y, *sg.grad((y * y).sum(), [x])]
    arrays = [X.astype("float32")]
    got = sg.function([x], outs, backend="c")(*arrays)
    want = sg.function([x], outs, backend="numpy")(*arrays)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("level", ["", "avx2", "sse2", "wide"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_register_tiles_match_the_numpy_reference_at_every_simd_level(level, dtype):
    """Head dimensions of whole register tiles (16, 32) and of none (12), T = 70 (a partial key
    block, a row tile of 6), causal and not, built for this machine, AVX2, SSE2 and in 64-byte
    vectors: the tiles' edges and their register paths at every tile height (8 rows on AVX-512, 4
    below) and width."""
    outs, inputs = [], []
    for E in (16, 32, 12):
        x = sg.input(f"x{E}", (1, 70, 2, E), dtype=dtype)
        heads = sg.swapaxes(x, 1, 2)
        for causal in (True, False):
            y = NF.scaled_dot_product_attention(heads, heads * 0.5, sg.tanh(heads), is_causal=causal)
            outs += [y, *sg.grad((y * y).sum(), [x])]
        inputs.append(x)
    arrays = [RNG.standard_normal(x.shape).astype(dtype) for x in inputs]
    got = sg.function(inputs, outs, backend="c", **c_build_options(level))(*arrays)
    want = sg.function(inputs, outs, backend="numpy")(*arrays)
    tolerance = 1e-12 if dtype == "float64" else 2e-5
    for k, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=tolerance, atol=tolerance, err_msg=f"output {k}")


@pytest.mark.parametrize("causal", [True, False])
def test_the_gradient_reads_the_forwards_softmax_or_sweeps_for_it(causal):
    """Computed beside its forward, the gradient reads the softmax statistics the forward stored
    (one buffer, written by one kernel and read by the other); given the forward's output as an
    input instead, it finds them by a sweep of its own. Both match the NumPy reference, T = 70."""
    from symgrad.ir.ops_attention import attention, attention_grad
    q, g = sg.input("q", (3, 70, 16), dtype="float64"), sg.input("g", (3, 70, 16), dtype="float64")
    out = sg.input("out", (3, 70, 16), dtype="float64")
    y = attention(q, q * 0.5, sg.tanh(q), causal, 0.3)
    beside = attention_grad(q, q * 0.5, sg.tanh(q), y, g, causal, 0.3)       # its forward in this plan
    apart = attention_grad(q, q * 0.5, sg.tanh(q), out, g, causal, 0.3)      # `out` handed in
    inputs, outputs = [q, g, out], [y, beside, apart]
    c = sg.function(inputs, outputs, backend="c")
    kernels = {k.name.split("_t")[0].split("_", 1)[1] + (" apart" if k.stats is None else ""): k
               for k in c.program.plan.kernels if isinstance(k, AttentionKernel)}
    assert sorted(kernels) == ["attention", "attention_grad", "attention_grad apart"]
    assert kernels["attention"].stats is kernels["attention_grad"].stats is not None
    arrays = [RNG.standard_normal((3, 70, 16)) for _ in range(2)]
    reference = sg.function(inputs, outputs, backend="numpy")
    arrays.append(reference(*arrays, np.zeros((3, 70, 16)))[0])  # the forward's output, handed in
    for k, (got, want) in enumerate(zip(c(*arrays), reference(*arrays))):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=f"output {k}")


def test_gradient_matches_finite_differences():
    def f(q, k, v):
        return NF.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert sg.gradcheck(f, [RNG.standard_normal((2, 6, 4)) for _ in range(3)])


def test_only_self_attention_without_mask_or_dropout_is_fused():
    q = sg.input("q", (2, 4, 6, 8), dtype="float64")
    kv = sg.input("kv", (2, 4, 9, 8), dtype="float64")
    assert NF.scaled_dot_product_attention(q, q, q).op.name == "attention"
    assert NF.scaled_dot_product_attention(q, kv, kv).op.name != "attention"       # cross-attention
    mask = sg.constant(np.tril(np.ones((6, 6), bool)))
    assert NF.scaled_dot_product_attention(q, q, q, attn_mask=mask).op.name != "attention"
    assert NF.scaled_dot_product_attention(q, q, q, dropout_p=0.1).op.name != "attention"
    (dq,) = sg.grad(NF.scaled_dot_product_attention(q, q, q).sum(), [q])
    graph = sg.Graph([q], [dq])
    assert [n.op.name for n in graph.nodes].count("attention_grad") == 1


def test_the_op_refuses_operands_of_another_shape_by_name():
    from symgrad.ir.ops_attention import attention
    q = sg.input("q", (2, 6, 8), dtype="float64")
    with pytest.raises(ValueError, match=r"attention: key f64\[2,9,8\] differs from query f64\[2,6,8\]"):
        attention(q, sg.input("k", (2, 9, 8), dtype="float64"), q, False, 1.0)
    with pytest.raises(ValueError, match="attention: query must be a float value of >= 2 axes"):
        attention(sg.input("i", (2, 6), dtype="int64"), q, q, False, 1.0)
    wide = sg.input("wide", (2, sg.Dim("E")), dtype="float64")
    with pytest.raises(ValueError, match="attention: the head dimension of query .* must be a fixed size"):
        attention(wide, wide, wide, False, 1.0)


@pytest.mark.parametrize("causal", [False, True])
def test_second_derivatives_through_fused_attention_match_torch(causal):
    """attention_grad has no VJP rule: autodiff goes through its decomposition, each input a leaf
    (its `out` input is itself a function of q, k and v, and self-attention passes one value as
    all three), and matches torch's double backward."""
    x = np.ascontiguousarray(X[0, :6, 0, :])
    w = np.random.default_rng(5).standard_normal((6, 8))

    def first(lib, v):
        if lib is torch:
            y = torch.nn.functional.scaled_dot_product_attention(v, v * 2, torch.tanh(v), is_causal=causal)
            return torch.autograd.grad((y * torch.tensor(w)).sum(), [v], create_graph=True)[0]
        y = NF.scaled_dot_product_attention(v, v * 2, sg.tanh(v), is_causal=causal)
        assert y.op.name == "attention"
        return sg.grad((y * sg.constant(w, "float64")).sum(), [v])[0]

    xt = torch.tensor(x, requires_grad=True)
    gt = first(torch, xt)
    (want,) = torch.autograd.grad((gt * gt).sum() + (gt ** 3).sum(), [xt])
    xs = sg.input("x", x.shape, dtype="float64")
    gs = first(sg, xs)
    (second,) = sg.grad((gs * gs).sum() + (gs ** 3).sum(), [xs])
    for backend in ("numpy", "c"):
        (got,) = sg.function([xs], [second], backend=backend)(x)
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-10, atol=1e-10, err_msg=backend)


def test_an_output_twice_gets_attention_in_both_when_t_equals_the_head_dimension():
    """The kernel's transposed keys (H x E x T) have the output's shape when T == E: they are a
    temporary of the workspace, never the second copy of the output."""
    q = sg.input("q", (3, 8, 8), dtype="float64")
    y = NF.scaled_dot_product_attention(q, q, q)
    got = sg.function([q], [y, y], backend="c")(X[0, :8, :, :8].transpose(1, 0, 2).copy())
    qt = torch.tensor(X[0, :8, :, :8].transpose(1, 0, 2).copy())
    want = torch.nn.functional.scaled_dot_product_attention(qt, qt, qt).numpy()
    for g in got:
        np.testing.assert_allclose(g, want, rtol=1e-12, atol=1e-12)


def _largest_buffer(loss, wrt) -> int:
    """Elements of the largest buffer in the C plan of the loss and its gradient."""
    graph = optimize(sg.Graph([wrt], [loss, *sg.grad(loss, [wrt])]))
    plan = lower(graph)
    return max(int(b.numel) for b in plan.workspace)


def test_the_plan_holds_no_t_by_t_buffer():
    B, T, H, E = 2, 256, 4, 16
    x = sg.input("x", (B, T, H, E))
    heads = sg.swapaxes(x, 1, 2)
    fused = NF.scaled_dot_product_attention(heads, heads, heads, is_causal=True)
    largest = _largest_buffer((fused * fused).sum(), x)
    assert largest <= 3 * B * H * T * E                  # dq, dk and dv: activations, never T x T
    mask = sg.constant(np.tril(np.ones((T, T), bool)))
    composite = NF.scaled_dot_product_attention(heads, heads, heads, attn_mask=mask)
    assert _largest_buffer((composite * composite).sum(), x) >= B * H * T * T   # what the check would catch


def test_the_step_report_names_the_fused_kernels():
    x = sg.input("x", (2, 16, 2, 8))
    y = sg.input("y", (2,), dtype="int64")
    w = sg.param("w", (8, 8), init="normal")
    heads = sg.swapaxes(x @ w, 1, 2)
    attended = NF.scaled_dot_product_attention(heads, heads, heads, is_causal=True)
    loss = sg.cross_entropy(sg.mean(attended, axis=(1, 2)), y)
    report = sg.train_step(loss, params=[w], optimizer=sg.optim.SGD(lr=0.1), backend="c").report()
    assert "2 fused attention)" in report
    assert "fused attention (causal), 4 head(s) of 16 x 8, no T x T buffer" in report
    assert "fused attention_grad (causal), 4 head(s) of 16 x 8, no T x T buffer" in report


def test_rows_with_every_key_masked_get_zero_weights_as_torch(backend):
    """torch's math attention takes a safe softmax: a query whose keys are all masked (a boolean
    mask's row of False, a float mask's row of -inf) attends to nothing, output and gradients 0;
    symgrad gave NaN (the fuzzer found it). Against torch's math backend in float64."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    rng = np.random.default_rng(5)
    q, k, v, cot = (rng.standard_normal(s) for s in ((2, 3, 2), (2, 4, 2), (2, 4, 3), (2, 3, 3)))
    keep = np.array([[True, True, False, False], [False, False, False, False], [True, False, True, False]])
    added = np.where(keep, 0.0, -np.inf)
    added[2] = [-np.inf, 0.5, -np.inf, -1.0]
    Q, K, V, C = (sg.input(n, a.shape, dtype="float64") for n, a in zip("qkvc", (q, k, v, cot)))
    B, A = sg.input("keep", keep.shape, dtype="bool"), sg.input("added", added.shape, dtype="float64")
    outputs = []
    for mask in (B, A):
        y = sg.scaled_dot_product_attention(Q, K, V, attn_mask=mask)
        outputs += [y, *sg.grad(sg.sum(y * C), [Q, K, V])]
    got = sg.function([Q, K, V, C, B, A], outputs, backend=backend)(q, k, v, cot, keep, added)
    want = []
    for mask in (torch.tensor(keep), torch.tensor(added)):
        tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
        with sdpa_kernel([SDPBackend.MATH]):
            y = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask)
        want += [y.detach(), *torch.autograd.grad(y, [tq, tk, tv], torch.tensor(cot))]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-12, atol=1e-14)
    assert not np.any(got[0][:, 1])   # the query that sees no key


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NumPy's inf * 0, meant
def test_a_cotangent_row_with_an_infinity_gives_nan_gradients_as_torch(backend):
    """The gradient reads D_i = g_i . out_i for sum_j p_ij dp_ij (the two agree while finite). With
    an infinity in g_i they part: torch's p_ij (dp_ij - D_i) is inf - inf, NaN for every key, where
    g_i . out_i, an infinity of the other sign, left dq and dk infinite (the fuzzer found it: inf
    against NaN). A D that is not finite is now NaN: the same gradients as torch's math attention,
    NaN where its are, in float64, fused (no mask) and causal or not.

    Causal, a key hidden from such a row gets NaN too: torch multiplies the hidden p_ij = 0 into
    dk_j and dv_j (0 * NaN, 0 * inf). 40 rows: more than the C kernel's tile of 32 query rows, whose
    later keys it visits only where a row's D is not finite (C gave finite dk for keys 32-39; CUDA,
    whose key rows skip the rows they are hidden from, for every key after the row)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    rng = np.random.default_rng(8)
    q, k, v, cot = (rng.standard_normal((2, 40, 3)) for _ in range(4))
    cot[0, 1, 0] = np.inf    # batch 0: one row infinite in one component
    cot[1, 2, 2] = -np.inf   # batch 1: another, of the other sign
    cot[1, 33, 1] = np.nan   # and a NaN in the second tile
    Q, K, V, C = (sg.input(n, a.shape, dtype="float64") for n, a in zip("qkvc", (q, k, v, cot)))
    outputs = []
    for causal in (False, True):
        y = sg.scaled_dot_product_attention(Q, K, V, is_causal=causal)
        assert y.op.name == "attention"
        outputs += sg.grad(sg.sum(y * C), [Q, K, V])
    got = sg.function([Q, K, V, C], outputs, backend=backend)(q, k, v, cot)
    want = []
    for causal in (False, True):
        tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
        with sdpa_kernel([SDPBackend.MATH]):
            y = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
        want += torch.autograd.grad(y, [tq, tk, tv], torch.tensor(cot))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-12, atol=1e-14)
    assert np.isnan(got[0][0, 1]).all() and np.isnan(got[1][0]).all()  # dq's row 1, all of dk: NaN
    assert np.isnan(got[4][0]).all() and np.isnan(got[5][0, 2:, 0]).all()  # causal: the hidden keys' too
    assert np.isfinite(got[3][0, 2:]).all()  # causal dq of the rows after row 1: finite


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_the_decomposed_gradient_takes_a_nonfinite_d_as_nan_too():
    """attention_grad's decomposition (what a second derivative differentiates) gives what the op
    gives, NaN where a cotangent row is infinite included: the same rule for D as the kernels."""
    from symgrad.ir.ops_attention import attention_grad
    rng = np.random.default_rng(9)
    q, k, v, cot = (rng.standard_normal((2, 4, 3)) for _ in range(4))
    cot[0, 1, 0] = np.inf
    Q, K, V, C = (sg.input(n, a.shape, dtype="float64") for n, a in zip("qkvc", (q, k, v, cot)))
    out = sg.scaled_dot_product_attention(Q, K, V)
    node = attention_grad(Q, K, V, out, C, causal=False, scale=1 / np.sqrt(3))
    fused, decomposed = sg.function([Q, K, V, C], [node, node.op.decompose(node)], backend="numpy")(q, k, v, cot)
    assert np.isnan(fused[1, 0]).all()  # dk of batch 0
    np.testing.assert_allclose(decomposed, fused, rtol=1e-12, atol=1e-14)
