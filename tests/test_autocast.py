"""Mixed precision (issue 39): the 16-bit float dtypes, their conversions in C against torch's,
and sg.autocast's policy against torch.autocast("cpu", dtype=torch.bfloat16).

Compiled programs are module-scoped: one C function holds every conversion and 16-bit graph,
one C train step the autocast training run.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import symgrad as sg
from symgrad.ir import dtypes as D
from symgrad.ir.autocast_graph import autocast_graph

from helpers import c_build_options

BF16 = ml_dtypes.bfloat16
# bfloat16 keeps 8 significant bits: a result rounded once is within 2^-8 of its value relative
# to it; a chain of a few rounded ops (and torch's own) within a few of those.
BF16_RTOL = 2.0 ** -8


def _close(ours, theirs, scale_ops: int = 4) -> None:
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    scale = max(1.0, float(np.abs(theirs).max()))
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=scale_ops * BF16_RTOL * scale)


# ---- dtypes ------------------------------------------------------------------------------

ALL = ("bool", "int32", "int64", "bfloat16", "float16", "float32", "float64")


def test_promote_types_as_torch():
    for a in ALL:
        for b in ALL:
            want = str(torch.promote_types(getattr(torch, a), getattr(torch, b))).removeprefix("torch.")
            assert D.promote_types(a, b) == want, (a, b)


def test_names_and_numpy_types():
    assert D.canonical(np.dtype(BF16)) == "bfloat16" and D.canonical(torch.bfloat16) == "bfloat16"
    assert D.to_numpy("bfloat16") == np.dtype(BF16) and D.to_numpy("float16") == np.float16
    x = sg.input("x", (2, 3), dtype=sg.bfloat16)
    assert repr(sg.exp(x)) == "<Value exp: bf16[2,3]>"
    with pytest.raises(ValueError, match="autocast: dtype must be one of bfloat16, float16, got 'float32'"):
        sg.autocast("float32")


# ---- conversions and 16-bit graphs: C against the reference and torch ----------------------

def _conversion_values() -> np.ndarray:
    """float32 values where rounding is decided: ties (to even, both ways), the top of each
    range (float32 max rounds to bfloat16 inf; 65520 to float16 inf), float16 subnormals and
    their ties, infinities and NaN, then ordinary values at several scales."""
    e = np.float32
    special = [1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -(1 + 2.0 ** -8), 1 + 2.0 ** -8 + 2.0 ** -20, 2.0 ** -8,
               3.4028235e38, 3.3961776e38, 65504.0, 65519.0, 65520.0, -65520.0, 2.0 ** -25, 3 * 2.0 ** -25,
               2.0 ** -24, 1e-30, -0.0, np.inf, -np.inf, np.nan, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 2049.0]
    rng = np.random.default_rng(39)
    ordinary = rng.standard_normal(42) * np.repeat([1e-6, 1e-2, 1.0, 1e3, 1e5, 1e30], 7)
    return np.concatenate([np.array(special, e), ordinary.astype(e)])


@pytest.fixture(scope="module")
def half_program():
    """One C function and its NumPy twin: conversions, and a bfloat16/float16 graph (matmul,
    sum, an elementwise chain, a softmax) with float32 inputs and outputs."""
    n = len(_conversion_values())
    v = sg.input("v", (n,))
    x, w = sg.input("x", (6, 8)), sg.input("w", (8, 5))
    xb, wb = x.astype("bfloat16"), w.astype("bfloat16")
    y = sg.exp(xb) @ wb
    outputs = [v.astype("bfloat16").astype("float32"), v.astype("float16").astype("float32"),
               y.astype("float32"), sg.sum(y, dim=1).astype("float32"),
               (xb * 1.1 + 0.3).astype("float16").astype("float32"),
               sg.softmax(y, dim=-1).astype("float32")]
    # A convolution and causal attention under autocast, with their gradients: the kernels read
    # bfloat16 operands held in floats (backends/decide/half.py).
    image, kernel, q = sg.input("image", (2, 3, 8, 8)), sg.input("kernel", (4, 3, 3, 3)), sg.input("q", (2, 2, 9, 8))
    with sg.autocast("bfloat16"):
        conv = sg.conv2d(image, kernel, padding=1)
        attention = sg.scaled_dot_product_attention(q, q * 0.5, q, is_causal=True)
        total = sg.sum(conv * conv) + sg.sum(attention * attention)
    outputs += [conv.astype("float32"), attention.astype("float32"), total, *sg.grad(total, [image, kernel, q])]
    inputs = [v, x, w, image, kernel, q]
    c = sg.function(inputs, outputs, backend="c")
    reference = sg.function(inputs, outputs, backend="numpy")
    rng = np.random.default_rng(0)
    arrays = (_conversion_values(), *(rng.standard_normal(s).astype(np.float32)
                                      for s in ((6, 8), (8, 5), (2, 3, 8, 8), (4, 3, 3, 3), (2, 2, 9, 8))))
    return c(*arrays), reference(*arrays), arrays, c.source


def test_conversions_round_to_nearest_even_as_torch(half_program):
    c, reference, (values, *_), _ = half_program
    t = torch.from_numpy(values)
    for k, dtype in enumerate((torch.bfloat16, torch.float16)):
        want = t.to(dtype).float().numpy()
        for got in (c[k], reference[k]):
            assert np.array_equal(got, want, equal_nan=True), (dtype, values[got != want], got[got != want])


def test_half_graph_c_matches_reference(half_program):
    c, reference, _, source = half_program
    assert "sg_gemm_bf16(" in source  # the bfloat16 GEMM (vdpbf16ps with AVX512_BF16)
    for k in (2, 3, 4, 6, 7):  # each op rounds once to 8 bits: the same bits whatever the order of sums
        np.testing.assert_array_equal(c[k], reference[k])
    for k in (8, 9, 10, 11):  # float32 sums of them (a rounding boundary may be crossed): bfloat16's tolerance
        _close(c[k], reference[k], scale_ops=1)
    assert c[5].dtype == np.float32
    np.testing.assert_allclose(c[5], reference[5], rtol=1e-6, atol=1e-7)  # softmax: float32 sums, reordered


def test_a_bfloat16_attention_shares_its_softmax_statistics_with_its_gradient():
    """Under autocast the attention kernel computes in float32 and its output is rounded by a cast
    (backends/decide/half.py); its gradient still reads the row statistics (m, 1 / l) the forward
    stored, instead of sweeping every key block once more to find them (one of its six products
    per block, and the exps), and agrees with the NumPy reference, which finds them afresh."""
    q = sg.input("q", (2, 2, 40, 8))
    with sg.autocast("bfloat16"):
        out = sg.scaled_dot_product_attention(q, q * 0.5, q * 2.0, is_causal=True)
        total = sg.sum(out * out)
    outputs = [total, *sg.grad(total, [q])]
    f = sg.function([q], outputs, backend="c")
    stored = [line for line in f.program.plan.decisions.splitlines() if line.startswith("attention statistics")]
    assert stored and " -> " in stored[0], stored
    values = np.random.default_rng(4).standard_normal((2, 2, 40, 8)).astype(np.float32)
    for ours, theirs in zip(f(values), sg.function([q], outputs, backend="numpy")(values)):
        _close(ours, theirs, scale_ops=1)


def test_c_refuses_half_leaves():
    x = sg.input("x16", (3,), dtype="bfloat16")
    with pytest.raises(TypeError, match=r"C backend: input 'x16' is bfloat16 \[3\]"):
        sg.function([x], [x.astype("float32") * 2], backend="c")


# ---- autocast against torch.autocast ---------------------------------------------------------

def _ops():
    """(name, build(sg values) -> sg value, run(torch tensors) -> tensor, input shapes, the
    dtype symgrad gives where torch's differs): each under its autocast."""
    return [
        ("linear", lambda x, w, b: sg.nn.functional.linear(x, w, b), lambda x, w, b: TF.linear(x, w, b),
         [(4, 16), (8, 16), (8,)], "float32"),  # torch casts the bias too; here it adds in float32
        ("matmul_batched", lambda a, b: a @ b, lambda a, b: a @ b, [(2, 3, 16, 8), (3, 8, 5)], None),
        ("gelu_of_matmul", lambda x, w: sg.gelu(x @ w), lambda x, w: TF.gelu(x @ w), [(4, 16), (16, 8)], None),
        ("attention", lambda q, k, v: sg.scaled_dot_product_attention(q, k, v, is_causal=True),
         lambda q, k, v: TF.scaled_dot_product_attention(q, k, v, is_causal=True),
         [(2, 2, 9, 8), (2, 2, 9, 8), (2, 2, 9, 8)], None),
        ("conv2d", lambda x, w: sg.conv2d(x, w, padding=1), lambda x, w: TF.conv2d(x, w, padding=1),
         [(2, 3, 6, 6), (4, 3, 3, 3)], None),
        ("softmax_of_matmul", lambda x, w: sg.softmax(x @ w, dim=-1), lambda x, w: TF.softmax(x @ w, -1),
         [(4, 16), (16, 8)], "float32"),  # torch rounds its float32 result to bfloat16
        ("layer_norm_of_matmul", lambda x, w: sg.layer_norm(x @ w, (8,)), lambda x, w: TF.layer_norm(x @ w, (8,)),
         [(4, 16), (16, 8)], "float32"),
        ("cross_entropy", lambda x, w: sg.cross_entropy(x @ w, sg.constant(np.arange(4) % 3)),
         lambda x, w: TF.cross_entropy(x @ w, torch.arange(4) % 3), [(4, 16), (16, 8)], None),
        ("mse_loss", lambda x, w: sg.mse_loss(x @ w, sg.constant(np.ones((4, 8), np.float32))),
         lambda x, w: TF.mse_loss(x @ w, torch.ones(4, 8)), [(4, 16), (16, 8)], None),
    ]


@pytest.mark.parametrize("name,build,run,shapes,dtype", _ops(), ids=[op[0] for op in _ops()])
def test_autocast_op_against_torch(name, build, run, shapes, dtype):
    rng = np.random.default_rng(len(name))
    arrays = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    values = [sg.input(f"a{k}", s) for k, s in enumerate(shapes)]
    with sg.autocast("bfloat16"):
        out = build(*values)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = run(*map(torch.from_numpy, arrays))
    assert out.dtype == (dtype or str(want.dtype).removeprefix("torch."))
    dots = [n for n in sg.Graph(values, [out]).nodes if n.op.name in ("matmul", "attention")]
    assert dots and all(i.dtype == "bfloat16" for n in dots for i in n.inputs), name  # the policy applied
    (got,) = sg.function(values, [out], backend="numpy")(*arrays)
    _close(got.astype(np.float32), want.float().numpy())
    plain = run(*map(torch.from_numpy, arrays)).numpy()
    if name in ("matmul_batched", "gelu_of_matmul"):  # rounded as torch's: not the float32 result
        assert not np.allclose(got.astype(np.float32), plain, rtol=1e-5, atol=1e-6)


def test_autocast_context_and_train_step_rewrite_agree():
    x, W = sg.input("x", (4, 16)), sg.input("W", (16, 8))
    plain = sg.sum(sg.softmax(sg.gelu(x @ W), dim=-1) * 3)
    with sg.autocast("bfloat16"):
        inside = sg.sum(sg.softmax(sg.gelu(x @ W), dim=-1) * 3)
    (rewritten,) = autocast_graph([plain], "bfloat16")
    assert str(sg.Graph([x, W], [rewritten])) == str(sg.Graph([x, W], [inside]))
    assert "bf16" not in str(sg.Graph([x, W], [plain]))
    with sg.autocast("bfloat16"), sg.autocast(enabled=False):
        assert (x @ W).dtype == "float32"


def test_train_step_autocast_keeps_layer_updates():
    """BatchNorm's running statistics (updates attached to its output) are computed from the
    autocast forward: updated, near the float32 step's, not equal to them."""
    means = {}
    for mixed in (None, "bfloat16"):
        sg.manual_seed(0)
        model = sg.nn.Sequential(sg.nn.Linear(6, 4), sg.nn.BatchNorm1d(4))
        x = sg.input("x", (8, 6))
        step = sg.train_step(sg.sum(model(x) ** 2), optimizer=sg.optim.SGD(model.parameters(), lr=0.01),
                             backend="numpy", autocast=mixed)
        step(x=np.random.default_rng(0).standard_normal((8, 6)).astype(np.float32))
        means[mixed] = step.state_dict()["1.running_mean"]
    assert np.all(means["bfloat16"] != 0) and not np.array_equal(means["bfloat16"], means[None])
    _close(means["bfloat16"], means[None], scale_ops=1)


# ---- a training step under autocast, C against torch ------------------------------------------

STEPS = 3


@pytest.fixture(scope="module")
def trained():
    """An MLP (Linear, LayerNorm, GELU, Linear, cross-entropy) trained STEPS SGD steps by a C step
    compiled with train_step(autocast="bfloat16") and by torch under torch.autocast, from the
    same weights and batches."""
    rng = np.random.default_rng(3)
    w1, w2 = (rng.standard_normal(s).astype(np.float32) * 0.3 for s in ((32, 16), (5, 32)))
    batches = [(rng.standard_normal((8, 16)).astype(np.float32), rng.integers(0, 5, 8))] * STEPS  # one batch: the loss falls
    x, y = sg.input("x", (8, 16)), sg.input("y", (8,), dtype="int64")
    W1, W2 = sg.param("W1", (32, 16), init=w1), sg.param("W2", (5, 32), init=w2)
    loss = sg.cross_entropy(sg.nn.functional.linear(sg.gelu(sg.layer_norm(
        sg.nn.functional.linear(x, W1), (32,))), W2), y)
    step = sg.train_step(loss, params=[W1, W2], optimizer=sg.optim.SGD(lr=0.5), backend="c",
                         autocast="bfloat16")
    ours = [step(x=xb, y=yb) for xb, yb in batches]
    t1, t2 = (torch.tensor(w, requires_grad=True) for w in (w1, w2))
    opt = torch.optim.SGD([t1, t2], lr=0.5)
    theirs = []
    for xb, yb in batches:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            tl = TF.cross_entropy(TF.linear(TF.gelu(TF.layer_norm(TF.linear(torch.from_numpy(xb), t1), (32,))), t2),
                                  torch.from_numpy(yb))
        tl.backward()
        opt.step()
        theirs.append(tl.item())
    return step, ours, theirs, (t1.detach().numpy(), t2.detach().numpy())


def test_train_step_autocast_against_torch(trained):
    step, ours, theirs, (t1, t2) = trained
    np.testing.assert_allclose(ours, theirs, rtol=4 * BF16_RTOL)
    assert ours[-1] < ours[0]
    for name, want in (("W1", t1), ("W2", t2)):
        assert step.params[name].dtype == np.float32  # master weights
        _close(step.params[name], want, scale_ops=8)


def test_train_step_autocast_casts_each_parameter_once(trained):
    """Each parameter is rounded to bfloat16 once a step: one cast, which its forward and backward
    products share, or none where only bfloat16 GEMMs read it (the cast folded into them: they read
    the float32 master weight and round it as they read it, backends/decide/half.py)."""
    step = trained[0]
    def leaf(v):  # through the copies a linear layer makes (W.T)
        return leaf(v.inputs[0]) if v.op.name in ("transpose", "reshape", "expand") else v

    nodes = step.optimized.nodes
    casts = [leaf(n.inputs[0]) for n in nodes if n.op.name == "cast" and n.dtype == "bfloat16"]
    cast = [v.name for v in casts if v.op.name == "variable"]
    folded = {leaf(i).name for n in nodes if n.op.kind == "matmul" and n.attrs.get("operands") == "bfloat16"
              for i in n.inputs if i.dtype == "float32" and leaf(i).op.name == "variable"}
    assert len(cast) == len(set(cast)) and not set(cast) & folded, (cast, folded)
    assert sorted(set(cast) | folded) == ["W1", "W2"]
    assert folded, "W1's products are blocked GEMMs: its cast is folded into them"
    summary = str(step.report().summary)
    assert "mixed precision: " in summary and " to bfloat16 casts" in summary


@pytest.fixture(scope="module", params=["", "avx2"])
def folded_products(request):
    """Products of operands cast to bfloat16 whose casts the C backend folds into the bfloat16 GEMM,
    built for this machine (vdpbf16ps or AMX where it has AVX512_BF16, which round as they pack) and
    for AVX2 (sg_gemm_f32, after rounding the float32 operands into scratch). A, B or both folded;
    B transposed (a weight), A transposed and A a column slice (neither contiguous way round).

    The operands are the integers +-1..3 moved by less than a quarter of bfloat16's ulp: rounded,
    they are integers again and every sum is exact in any order, so the products equal NumPy's of
    the integers bit for bit; read without rounding they would be off by about 1e-3."""
    M, K, N = 20, 24, 40  # N past NARROW_N: the blocked GEMM, not a narrow kernel
    rng = np.random.default_rng(7)

    def near_integers(shape):
        whole = rng.choice([-3.0, -2.0, -1.0, 1.0, 2.0, 3.0], size=shape)
        return (whole + rng.uniform(-1, 1, shape) * 2.0 ** -9).astype(np.float32)

    shapes = {"x1": (M, K), "w1": (N, K), "x2": (M, K), "w2": (N, K), "x3": (M, K), "w3": (N, K),
              "x4": (K, M), "x5": (M, K + 8), "w5": (K, N)}
    values = {name: near_integers(shape) for name, shape in shapes.items()}
    values["x1"][3, 5] = np.nan  # rounding keeps a NaN: row 3 of the product is NaN
    inputs = {name: sg.input(name, shape) for name, shape in shapes.items()}
    b16 = {name: v.astype("bfloat16") for name, v in inputs.items()}
    products = [b16["x1"] @ b16["w1"].T,             # both rounded
                b16["x2"] @ (b16["w2"] * 2).T,       # A only: B is a product's bfloat16 result
                (b16["x3"] * 2) @ b16["w3"].T,       # B only
                b16["x4"].T @ b16["w3"].T,           # A transposed (w3's cast feeds two products)
                b16["x5"][:, :K] @ b16["w5"]]        # A strided both ways
    function = sg.function(list(inputs.values()), [p.astype("float32") for p in products], backend="c",
                           **c_build_options(request.param))
    whole = {name: np.rint(v) for name, v in values.items()}
    expected = [whole["x1"] @ whole["w1"].T, whole["x2"] @ (2 * whole["w2"]).T, (2 * whole["x3"]) @ whole["w3"].T,
                whole["x4"].T @ whole["w3"].T, whole["x5"][:, :K] @ whole["w5"]]
    expected[0][3] = np.nan
    return function, function(*values.values()), expected


def test_casts_folded_into_bfloat16_products_round_as_the_casts_did(folded_products):
    function, got, expected = folded_products
    source = function.source
    for name in ("sg_gemm_bf16_round_ab(", "sg_gemm_bf16_round_a(", "sg_gemm_bf16_round_b("):
        assert name in source, name
    # The casts left are those an elementwise op reads too (x3 * 2, w2 * 2): the others were folded.
    cast = {n.inputs[0].name for n in function.optimized.nodes
            if n.op.name == "cast" and n.dtype == "bfloat16" and n.inputs[0].op.name == "input"}
    assert cast == {"x3", "w2"}, cast
    for k, (ours, theirs) in enumerate(zip(got, expected)):
        np.testing.assert_array_equal(ours, theirs.astype(np.float32), err_msg=f"product {k}")


# ---- checkpoints -------------------------------------------------------------------------------

def test_checkpoint_keeps_bfloat16(tmp_path):
    from safetensors.torch import load_file

    x = sg.input("x", (4, 3), dtype="bfloat16")
    W = sg.param("Wb", (3, 2), init=np.arange(6, dtype=np.float32).reshape(3, 2) / 7, dtype="bfloat16")
    step = sg.train_step(sg.sum((x @ W).astype("float32")), params=[W], optimizer=sg.optim.SGD(lr=0.1),
                         backend="numpy")
    step(x=np.ones((4, 3), BF16))
    saved = step.params["Wb"]
    assert saved.dtype == BF16
    step.save(tmp_path / "ck.safetensors")
    loaded = load_file(tmp_path / "ck.safetensors")["Wb"]
    assert loaded.dtype == torch.bfloat16
    np.testing.assert_array_equal(loaded.float().numpy(), saved.astype(np.float32))
    step(x=np.ones((4, 3), BF16))
    step.load(tmp_path / "ck.safetensors")
    np.testing.assert_array_equal(step.params["Wb"], saved)
