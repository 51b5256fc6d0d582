"""Indexing, joining, gathering and batched matmul against torch, in float64, forward and gradient.

Each case is a symgrad function and the same function in torch on the same
arrays; a case's gradient is that of sum(out * weights) with fixed random
weights, so every output element's cotangent differs. The cases run on the
backend (NumPy reference, C, CUDA where there is a GPU): slicing is a view,
embed a zeroed buffer and a windowed store, take and scatter_add gather
kernels, batched matmul one GEMM per batch index.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import symgrad as sg

RNG = np.random.default_rng(7)
X = RNG.standard_normal((4, 5, 6))
Y = RNG.standard_normal((4, 2, 6))
TABLE = RNG.standard_normal((7, 3))
INDICES = np.array([[1, 6, 1], [0, 2, 1]])    # repeated rows: their gradients add
Q, K, V = (RNG.standard_normal((2, 3, 5, 4)) for _ in range(3))
A3 = RNG.standard_normal((2, 1, 4, 3))
B3 = RNG.standard_normal((5, 3, 2))


def _slices(x, y):
    return [x[1], x[:, 1:4], x[..., ::2], x[None, 2, :, -1], x[1:3, None, -9:3], x[:, 1:5:3, 4:],
            x.narrow(1, 2, 2) if hasattr(x, "narrow") else sg.narrow(x, 1, 2, 2)]


def _joins(x, y):
    cat = torch.cat if isinstance(x, torch.Tensor) else sg.cat
    stack = torch.stack if isinstance(x, torch.Tensor) else sg.stack
    split = torch.split if isinstance(x, torch.Tensor) else sg.split
    chunk = torch.chunk if isinstance(x, torch.Tensor) else sg.chunk
    a, b = split(x, [2, 3], 1)
    return [cat([x, y], 1), cat([y, x, y], 1), stack([x[:, 0], y[:, 1]], 1), a * 2, b,
            *chunk(x, 3, 2), *split(x, 2, 0), cat([b, a], 1)]


def _gathers(table, indices):
    if isinstance(table, torch.Tensor):
        return [torch.nn.functional.embedding(indices, table), table[:, [2, 0, 2]], table[indices[0]]]
    return [sg.nn.functional.embedding(indices, table), table[:, [2, 0, 2]], table[indices[0]]]


def _products(q, k, v, a, b):
    if isinstance(q, torch.Tensor):
        sdpa = torch.nn.functional.scaled_dot_product_attention
        mask = torch.tensor(np.tril(np.ones((5, 5), bool), 1))
    else:
        sdpa = sg.nn.functional.scaled_dot_product_attention
        mask = sg.constant(np.tril(np.ones((5, 5), bool), 1))
    return [q @ k.transpose(-1, -2) if isinstance(q, torch.Tensor) else q @ sg.swapaxes(k, -1, -2),
            a @ b, a @ b[0], q[0, 0] @ k[0, 0, 0], k[0, 0, :, 0] @ v,
            sdpa(q, k, v, is_causal=True), sdpa(q, k, v, attn_mask=mask), sdpa(q, k, v, scale=0.3)]


CASES = {
    "slices": (_slices, (X, Y)),
    "joins": (_joins, (X, Y)),
    "gathers": (_gathers, (TABLE, INDICES)),
    "products": (_products, (Q, K, V, A3, B3)),
}


def _torch(case):
    build, arrays = CASES[case]
    tensors = [torch.tensor(a, requires_grad=a.dtype.kind == "f") for a in arrays]
    outs = build(*tensors)
    weights = [torch.tensor(RNG_W(o.shape)) for o in outs]
    total = sum((o * w).sum() for o, w in zip(outs, weights))
    grads = torch.autograd.grad(total, [t for t in tensors if t.requires_grad], allow_unused=True)
    return [o.detach().numpy() for o in outs], [None if g is None else g.numpy() for g in grads], [w.numpy() for w in weights]


def RNG_W(shape):  # noqa: N802  (fixed weights per shape: the same in both systems)
    return np.random.default_rng(abs(hash(tuple(shape))) % 2**32).standard_normal(tuple(shape))


def _symgrad(case, backend, weights):
    build, arrays = CASES[case]
    inputs = [sg.input(f"a{k}", a.shape, dtype="float64" if a.dtype.kind == "f" else "int64")
              for k, a in enumerate(arrays)]
    outs = build(*inputs)
    total = sum(((o * sg.constant(w, "float64")).sum() for o, w in zip(outs, weights)), sg.constant(0.0, "float64"))
    floats = [v for v in inputs if v.dtype == "float64"]
    grads = sg.grad(total, floats)
    results = sg.function(inputs, outs + list(grads), backend=backend)(*arrays)
    return results[:len(outs)], results[len(outs):]


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_and_gradient_match_torch(case, backend):
    want_out, want_grad, weights = _torch(case)
    got_out, got_grad = _symgrad(case, backend, weights)
    assert len(got_out) == len(want_out)
    for k, (g, w) in enumerate(zip(got_out, want_out)):
        assert g.shape == w.shape, f"{case} output {k}: shape {g.shape}, torch {w.shape}"
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12, err_msg=f"{case} output {k}")
    for k, (g, w) in enumerate(zip(got_grad, want_grad)):
        if w is None:  # an input the case does not use: symgrad's gradient is zeros
            np.testing.assert_array_equal(g, 0)
            continue
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12, err_msg=f"{case} gradient {k}")


def test_basic_slicing_compiles_to_c_as_views():
    x = sg.input("x", X.shape, dtype="float64")
    outs = [o * 1.5 + 1 for o in _slices(x, None)]
    got = sg.function([x], outs, backend="c")(X)
    want = sg.function([x], outs, backend="numpy")(X)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("fn, inputs", [
    (lambda x: sg.cat([x[:, :2], x * x], 1), [X[0]]),
    (lambda x: (x[1:, ::2] ** 2).sum(axis=0), [X[0]]),
    (lambda t: sg.take(t, sg.constant(np.array([3, 3, 0])), axis=0) ** 2, [TABLE]),
    (lambda a, b: sg.tanh(a @ b), [A3, B3]),
    (lambda q, k, v: sg.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), [Q[0], K[0], V[0]]),
], ids=["cat", "strided-slice", "take", "batched-matmul", "attention"])
def test_gradients_match_finite_differences(fn, inputs):
    assert sg.gradcheck(fn, inputs)


def test_bad_indices_and_shapes_are_python_errors_naming_the_op():
    table = sg.input("table", (7, 3), dtype="float64")
    idx = sg.input("idx", (2,), dtype="int64")
    f = sg.function([table, idx], [sg.nn.functional.embedding(idx, table)], backend="numpy")
    with pytest.raises(ValueError, match=r"embedding: input .* holds 7 .* outside \[0, 7\): 'table' has 7 rows"):
        f(TABLE, np.array([0, 7]))
    with pytest.raises(ValueError, match=r"embedding: input .* holds -1"):
        f(TABLE, np.array([-1, 0]))
    x = sg.input("x", (4, 5, 6), dtype="float64")
    with pytest.raises(ValueError, match=r"cat: values\[1\] is float64 \[4,2,5\]"):
        sg.cat([x, sg.input("y", (4, 2, 5), dtype="float64")], 1)
    with pytest.raises(IndexError, match="index 4 is out of range for axis 0"):
        x[4]
    with pytest.raises(IndexError, match="too many indices"):
        x[0, 0, 0, 0]
    with pytest.raises(ValueError, match="positive integer steps"):
        x[::-1]
    with pytest.raises(ValueError, match="matmul: the batch dimensions of \\[2,4,3\\] and \\[3,3,2\\]"):
        sg.input("a", (2, 4, 3), dtype="float64") @ sg.input("b", (3, 3, 2), dtype="float64")
    with pytest.raises(TypeError, match="take: indices must be integers"):
        sg.take(table, sg.input("f", (2,), dtype="float64"))
    with pytest.raises(ValueError, match="split: sizes \\[2, 2\\] do not add up to 5"):
        sg.split(x, [2, 2], 1)


def test_symbolic_slices_and_cat_keep_the_dim():
    T = sg.Dim("T")
    x = sg.input("x", (T, 3), dtype="float64")
    head, tail = x[:-1], x[1:]
    joined = sg.cat([tail, head], 0)
    assert str(head.shape[0]) == "T - 1" and str(joined.shape[0]) == "2*T - 2"
    got = sg.function([x], [joined, sg.grad((joined * joined).sum(), [x])[0]], backend="numpy")(np.ascontiguousarray(X[0, :, :3]))
    xt = torch.tensor(X[0, :, :3], requires_grad=True)
    jt = torch.cat([xt[1:], xt[:-1]])
    (gt,) = torch.autograd.grad((jt * jt).sum(), [xt])
    np.testing.assert_allclose(got[0], jt.detach().numpy())
    np.testing.assert_allclose(got[1], gt.numpy())


def test_second_order_gradients_match_torch():
    """d/dx of (dL/dx . v): the VJPs' own VJPs (slice <-> embed, take <-> scatter_add, matmul)."""
    v = RNG_W(X.shape)

    def loss(lib, x, table, idx):
        if lib is torch:
            rows = torch.nn.functional.embedding(idx, table)
            joined = torch.cat([x[:, 1:], x[:, :1] ** 2], 1)
            return (torch.tanh(joined @ joined.transpose(-1, -2)).sum() + (rows * rows.sum()).sum()
                    + (x[..., ::2] ** 3).sum())
        rows = sg.embedding(table, idx)
        joined = sg.cat([x[:, 1:], x[:, :1] ** 2], 1)
        return (sg.tanh(joined @ sg.swapaxes(joined, -1, -2)).sum() + (rows * rows.sum()).sum()
                + (x[..., ::2] ** 3).sum())

    xt, tt = torch.tensor(X, requires_grad=True), torch.tensor(TABLE, requires_grad=True)
    it = torch.tensor(INDICES)
    gx, gt = torch.autograd.grad(loss(torch, xt, tt, it), [xt, tt], create_graph=True)
    want = torch.autograd.grad((gx * torch.tensor(v)).sum() + (gt * gt).sum(), [xt, tt])

    x, table = sg.input("x", X.shape, dtype="float64"), sg.input("t", TABLE.shape, dtype="float64")
    idx = sg.input("i", INDICES.shape, dtype="int64")
    sx, st = sg.grad(loss(sg, x, table, idx), [x, table])
    second = sg.grad((sx * sg.constant(v, "float64")).sum() + (st * st).sum(), [x, table])
    got = sg.function([x, table, idx], second, backend="numpy")(X, TABLE, INDICES)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-10, atol=1e-10)


def test_the_report_lists_gather_kernels_and_batched_products():
    table = sg.input("table", TABLE.shape)
    ids = sg.input("ids", INDICES.shape, dtype="int64")
    q = sg.input("q", (2, 3, 5, 4))
    rows = sg.embedding(table, ids)
    loss = (rows * rows).sum() + (q @ sg.swapaxes(q, -1, -2)).sum()
    report = sg.function([table, ids, q], [loss, *sg.grad(loss, [table, q])], backend="c").report()
    assert "take of 6 index(es)" in report and "scatter_add of 6 index(es)" in report
    assert "batched over 2 x 3" in report and "2 gathers)" in report


def test_batched_products_shared_over_the_team_match_numpy():
    """Products too small to split one by one (32 x 24 x 16) but many of them (a 6 x 8 batch,
    broadcast on one side): the C kernel hands batch indices out to the team's threads; each
    product lands at its own place, gradients (the transposed products) included."""
    rng = np.random.default_rng(3)
    a_data, b_data = rng.standard_normal((6, 8, 32, 16)), rng.standard_normal((8, 16, 24))
    a, b = sg.input("a", a_data.shape, dtype="float64"), sg.input("b", b_data.shape, dtype="float64")
    loss = (sg.tanh(a @ b) * sg.constant(rng.standard_normal((6, 8, 32, 24)))).sum()
    outputs = [a @ b, *sg.grad(loss, [a, b])]
    c_step = sg.function([a, b], outputs, backend="c")
    assert "if(share)" in c_step.source
    for got, want in zip(c_step(a_data, b_data), sg.function([a, b], outputs, backend="numpy")(a_data, b_data)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_scatter_add_of_rows_without_elements_matches_torch(backend):
    """Rows of no elements (a source [2, 0] along axis 0, [0, 3] along axis 1): zeros of the
    output's shape, as torch's index_add. The NumPy reference raised (its reshape to (-1, 0) cannot
    infer the -1; the fuzzer found it)."""
    from symgrad.api import functional as F
    cases = [((2, 0), 0, [1, 1], 3), ((0, 3), 1, [0, 2, 2], 4), ((0,), 0, [], 2)]
    values, outputs, wants = [], [], []
    for k, (shape, axis, indices, size) in enumerate(cases):
        x = sg.input(f"x{k}", shape, dtype="float64")
        values.append(x)
        outputs.append(F.scatter_add(x, sg.constant(np.array(indices, dtype=np.int64)), axis, size))
        out_shape = list(shape)
        out_shape[axis] = size
        wants.append(torch.zeros(out_shape, dtype=torch.float64).index_add(
            axis, torch.tensor(indices, dtype=torch.int64), torch.zeros(shape, dtype=torch.float64)).numpy())
    got = sg.function(values, outputs, backend=backend)(*(np.zeros(shape) for shape, *_ in cases))
    for g, w in zip(got, wants):
        assert g.shape == w.shape
        np.testing.assert_array_equal(g, w)


def test_cat_promotes_mixed_dtypes_as_torch(backend):
    """torch.cat promotes its tensors' dtypes (int64 with float64: float64; bool with int32: int32);
    symgrad refused any mix (the fuzzer found it). Values, dtypes and the float part's gradient."""
    i, f, b = np.array([[1, -2, 3]]), np.array([[0.5], [1.5]]).T, np.array([[True, False]])
    ti, tf, tb = torch.tensor(i), torch.tensor(f, requires_grad=True), torch.tensor(b)
    xi, xf, xb = sg.input("i", i.shape, dtype="int64"), sg.input("f", f.shape, dtype="float64"), \
        sg.input("b", b.shape, dtype="bool")
    ints = sg.input("j", i.shape, dtype="int32")
    want = [torch.cat([ti, tf, tb], 1), torch.cat([tb, torch.tensor(i, dtype=torch.int32)], 1)]
    (want_grad,) = torch.autograd.grad((want[0] * torch.arange(7.0)).sum(), [tf])
    got = sg.cat([xi, xf, xb], 1)
    outputs = [got, sg.cat([xb, ints], 1), *sg.grad(sg.sum(got * sg.constant(np.arange(7.0))), [xf])]
    results = sg.function([xi, xf, xb, ints], outputs, backend=backend)(i, f, b, i.astype(np.int32))
    for r, w in zip(results, [*want, want_grad]):
        assert r.dtype == w.detach().numpy().dtype
        np.testing.assert_array_equal(r, w.detach().numpy())
