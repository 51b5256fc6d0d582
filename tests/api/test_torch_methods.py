"""torch's spelling and meaning on graph values (issue 35): Value methods as torch names them,
`dim=` / `keepdim=` beside `axis=` / `keepdims=` on every reduction, torch.max / torch.min with a
dim returning (values, indices), and the factories (ones, zeros, full, *_like, eye, arange).

Each case is written twice, once on a graph value and once on a torch tensor, and compared:
values, and in float64 the gradient of sum(out * R) (R fixed, random) against torch autograd.
All cases of a backend are outputs of one sg.function (one C build), shared by the module.
"""

from __future__ import annotations

import importlib.util
import inspect

import numpy as np
import pytest
import torch

import symgrad as sg

#: numpy, and c where its backend imports (the same rule as conftest's `backend` fixture).
BACKENDS = ["numpy"] + (["c"] if importlib.util.find_spec("symgrad.backends.c") else [])

X = np.random.default_rng(35).standard_normal((3, 4, 5))
X[0, 0, 0] = 0.75  # a value clamp's bounds cut, and the mask below keeps

# name -> (on a graph value, on a torch tensor); each maps x (3, 4, 5) float64 to one result.
CASES = {
    # shapes and movement
    "view": (lambda x: x.view(-1, 5), lambda t: t.view(-1, 5)),
    "view_tuple": (lambda x: x.view((12, 5)), lambda t: t.view((12, 5))),
    "view_as": (lambda x: x.view_as(x.reshape(12, 5)), lambda t: t.view_as(t.reshape(12, 5))),
    "reshape": (lambda x: x.reshape(3, 20), lambda t: t.reshape(3, 20)),
    "reshape_tuple": (lambda x: x.reshape((5, -1)), lambda t: t.reshape((5, -1))),
    "permute": (lambda x: x.permute(2, 0, 1), lambda t: t.permute(2, 0, 1)),
    "permute_tuple": (lambda x: x.permute((1, 2, 0)), lambda t: t.permute((1, 2, 0))),
    "sg_permute": (lambda x: sg.permute(x, (2, 1, 0)), lambda t: torch.permute(t, (2, 1, 0))),
    "transpose_swap": (lambda x: x.transpose(0, 2), lambda t: t.transpose(0, 2)),
    "transpose_negative": (lambda x: x.transpose(1, -1), lambda t: t.transpose(1, -1)),
    "transpose_2d_01": (lambda x: x[0].transpose(0, 1), lambda t: t[0].transpose(0, 1)),
    "sg_transpose_swap": (lambda x: sg.transpose(x, 0, 1), lambda t: torch.transpose(t, 0, 1)),
    "transpose_permutation": (lambda x: x.transpose(2, 0, 1), lambda t: t.permute(2, 0, 1)),
    "mT": (lambda x: x.mT, lambda t: t.mT),
    "T_2d": (lambda x: x[1].T, lambda t: t[1].T),
    "t": (lambda x: x[1].t(), lambda t: t[1].t()),
    "contiguous": (lambda x: x.transpose(0, 1).contiguous(), lambda t: t.transpose(0, 1).contiguous()),
    "unsqueeze": (lambda x: x.unsqueeze(1), lambda t: t.unsqueeze(1)),
    "unsqueeze_last": (lambda x: x.unsqueeze(-1), lambda t: t.unsqueeze(-1)),
    "sg_unsqueeze": (lambda x: sg.unsqueeze(x, 0), lambda t: torch.unsqueeze(t, 0)),
    "squeeze_all": (lambda x: x[:, :1].squeeze(), lambda t: t[:, :1].squeeze()),
    "squeeze_dim": (lambda x: x[:, :1].squeeze(1), lambda t: t[:, :1].squeeze(1)),
    "squeeze_kept": (lambda x: x.squeeze(0), lambda t: t.squeeze(0)),  # size 3: kept, as torch
    "squeeze_dim_kw": (lambda x: sg.squeeze(x[:1], dim=0), lambda t: torch.squeeze(t[:1], dim=0)),
    "flatten": (lambda x: x.flatten(), lambda t: t.flatten()),
    "flatten_1": (lambda x: x.flatten(1), lambda t: t.flatten(1)),
    "flatten_01": (lambda x: x.flatten(0, 1), lambda t: t.flatten(0, 1)),
    "expand": (lambda x: x[:, :1].expand(3, 4, 5), lambda t: t[:, :1].expand(3, 4, 5)),
    "expand_minus_one": (lambda x: x[:, :1].expand(2, -1, 4, -1), lambda t: t[:, :1].expand(2, -1, 4, -1)),
    "expand_tuple": (lambda x: x[:1].expand((3, 4, 5)), lambda t: t[:1].expand((3, 4, 5))),
    "expand_as": (lambda x: x[:1].expand_as(x), lambda t: t[:1].expand_as(t)),
    "split_size": (lambda x: sg.cat([p * (k + 1) for k, p in enumerate(x.split(2, dim=2))], dim=2),
                   lambda t: torch.cat([p * (k + 1) for k, p in enumerate(t.split(2, dim=2))], dim=2)),
    "split_sizes": (lambda x: sg.cat([p * (k + 1) for k, p in enumerate(x.split([1, 3], 1))], 1),
                    lambda t: torch.cat([p * (k + 1) for k, p in enumerate(t.split([1, 3], 1))], 1)),
    "chunk": (lambda x: sg.cat([p * (k + 1) for k, p in enumerate(x.chunk(2, dim=-1))], dim=-1),
              lambda t: torch.cat([p * (k + 1) for k, p in enumerate(t.chunk(2, dim=-1))], dim=-1)),
    "stack_dim": (lambda x: sg.stack([x, x * 2], dim=1), lambda t: torch.stack([t, t * 2], dim=1)),
    "narrow": (lambda x: x.narrow(2, 1, 3), lambda t: t.narrow(2, 1, 3)),
    "masked_fill": (lambda x: x.masked_fill(x > 0.5, -1.5), lambda t: t.masked_fill(t > 0.5, -1.5)),
    "masked_fill_softmax": (lambda x: x.masked_fill(x.tril().eq(0), float("-inf")).softmax(-1),
                            lambda t: t.masked_fill(t.tril().eq(0), float("-inf")).softmax(-1)),
    "where_method": (lambda x: x.where(x > 0, x * 3), lambda t: t.where(t > 0, t * 3)),
    "tril": (lambda x: x.tril(), lambda t: t.tril()),
    "triu_1": (lambda x: x.triu(1), lambda t: t.triu(1)),
    "tril_negative": (lambda x: x.tril(diagonal=-1), lambda t: t.tril(diagonal=-1)),
    "matmul_method": (lambda x: x.matmul(x.mT), lambda t: t.matmul(t.mT)),
    # dtypes
    "float": (lambda x: x.float(), lambda t: t.float()),
    "double_of_float": (lambda x: x.float().double(), lambda t: t.float().double()),
    "long": (lambda x: (x * 3).long(), lambda t: (t * 3).long()),
    "int": (lambda x: (x * 3).int(), lambda t: (t * 3).int()),
    "bool": (lambda x: (x * 0 + (x > 0)).bool(), lambda t: (t * 0 + (t > 0)).bool()),
    "to_name": (lambda x: x.to("float32"), lambda t: t.to(torch.float32)),
    "to_torch_dtype": (lambda x: x.to(torch.float32), lambda t: t.to(torch.float32)),
    "to_device_dtype": (lambda x: x.to("cpu", torch.float32), lambda t: t.to("cpu", torch.float32)),
    "to_dtype_kw": (lambda x: x.float().to(dtype=torch.float64), lambda t: t.float().to(dtype=torch.float64)),
    "to_other": (lambda x: x.to((x * 2).long()), lambda t: t.to((t * 2).long())),
    "type_as": (lambda x: x.type_as(x.float()), lambda t: t.type_as(t.float())),
    # elementwise methods
    "exp": (lambda x: x.exp(), lambda t: t.exp()),
    "log": (lambda x: (x.abs() + 0.5).log(), lambda t: (t.abs() + 0.5).log()),
    "log1p": (lambda x: x.abs().log1p(), lambda t: t.abs().log1p()),
    "sqrt": (lambda x: (x * x + 0.1).sqrt(), lambda t: (t * t + 0.1).sqrt()),
    "rsqrt": (lambda x: (x * x + 0.1).rsqrt(), lambda t: (t * t + 0.1).rsqrt()),
    "square": (lambda x: x.square(), lambda t: t.square()),
    "reciprocal": (lambda x: (x.abs() + 1).reciprocal(), lambda t: (t.abs() + 1).reciprocal()),
    "pow_2": (lambda x: x.pow(2), lambda t: t.pow(2)),
    "pow_half": (lambda x: x.abs().pow(0.5), lambda t: t.abs().pow(0.5)),
    "pow_value": (lambda x: (x.abs() + 1).pow(x), lambda t: (t.abs() + 1).pow(t)),
    "clamp": (lambda x: x.clamp(-0.5, 0.75), lambda t: t.clamp(-0.5, 0.75)),
    "clamp_min": (lambda x: x.clamp(min=0.1), lambda t: t.clamp(min=0.1)),
    "clamp_max": (lambda x: x.clamp(max=0.1), lambda t: t.clamp(max=0.1)),
    "clip": (lambda x: x.clip(-0.2, 0.2), lambda t: t.clip(-0.2, 0.2)),
    "sg_clamp": (lambda x: sg.clamp(x, min=-0.3), lambda t: torch.clamp(t, min=-0.3)),
    "abs": (lambda x: x.abs(), lambda t: t.abs()),
    "neg": (lambda x: x.neg(), lambda t: t.neg()),
    "sin_cos": (lambda x: x.sin() * x.cos(), lambda t: t.sin() * t.cos()),
    "tanh": (lambda x: x.tanh(), lambda t: t.tanh()),
    "sigmoid": (lambda x: x.sigmoid(), lambda t: t.sigmoid()),
    "relu": (lambda x: x.relu(), lambda t: t.relu()),
    "erf": (lambda x: x.erf(), lambda t: t.erf()),
    "sign_floor_ceil": (lambda x: x.sign() + (x * 3).floor() + (x * 3).ceil() + (x * 3).round() + (x * 3).trunc(),
                        lambda t: t.sign() + (t * 3).floor() + (t * 3).ceil() + (t * 3).round() + (t * 3).trunc()),
    "maximum_minimum": (lambda x: x.maximum(x * 0.5) + x.minimum(-x), lambda t: t.maximum(t * 0.5) + t.minimum(-t)),
    "add_sub_mul": (lambda x: x.add(x.mul(2), alpha=3).sub(x, alpha=0.5),
                    lambda t: t.add(t.mul(2), alpha=3).sub(t, alpha=0.5)),
    "comparisons": (lambda x: x.gt(0).long() + x.ge(0.1).long() + x.lt(0).long() + x.le(0.2).long()
                    + x.eq(x).long() + x.ne(x * 2).long(),
                    lambda t: t.gt(0).long() + t.ge(0.1).long() + t.lt(0).long() + t.le(0.2).long()
                    + t.eq(t).long() + t.ne(t * 2).long()),
    "detach": (lambda x: x * x.detach(), lambda t: t * t.detach()),
    # reductions: torch's spelling, on methods and functions
    "sum_dim": (lambda x: x.sum(dim=1), lambda t: t.sum(dim=1)),
    "sum_dims_keepdim": (lambda x: x.sum(dim=(0, 2), keepdim=True), lambda t: t.sum(dim=(0, 2), keepdim=True)),
    "sum_positional": (lambda x: x.sum(-1, True), lambda t: t.sum(-1, True)),
    "sg_sum_dim": (lambda x: sg.sum(x, dim=2, keepdim=True), lambda t: torch.sum(t, dim=2, keepdim=True)),
    "sum_numpy_spelling": (lambda x: x.sum(axis=1, keepdims=True), lambda t: t.sum(dim=1, keepdim=True)),
    "mean_dim": (lambda x: x.mean(dim=-1, keepdim=True), lambda t: t.mean(dim=-1, keepdim=True)),
    "sg_mean_dim": (lambda x: sg.mean(x, dim=(1, 2)), lambda t: torch.mean(t, dim=(1, 2))),
    "mean_all": (lambda x: x.mean(), lambda t: t.mean()),
    "max_all": (lambda x: x.max(), lambda t: t.max()),
    "min_all": (lambda x: x.min(), lambda t: t.min()),
    "max_dim_values": (lambda x: x.max(dim=1).values, lambda t: t.max(dim=1).values),
    "max_dim_indices": (lambda x: x.max(dim=1).indices, lambda t: t.max(dim=1).indices),
    "max_positional_keepdim": (lambda x: x.max(2, keepdim=True)[0], lambda t: t.max(2, keepdim=True)[0]),
    "max_positional_indices": (lambda x: x.max(2, True)[1], lambda t: t.max(2, True)[1]),
    "min_dim_values": (lambda x: x.min(dim=0).values, lambda t: t.min(dim=0).values),
    "min_dim_indices": (lambda x: x.min(dim=-1).indices, lambda t: t.min(dim=-1).indices),
    "sg_max_dim": (lambda x: sg.max(x, dim=0).values, lambda t: torch.max(t, dim=0).values),
    "sg_min_dim_keepdim": (lambda x: sg.min(x, dim=1, keepdim=True).values,
                           lambda t: torch.min(t, dim=1, keepdim=True).values),
    "max_other": (lambda x: x.max(x * -1), lambda t: t.max(t * -1)),
    "sg_min_other": (lambda x: sg.min(x, x * 0.5), lambda t: torch.min(t, t * 0.5)),
    "amax": (lambda x: x.amax(dim=(0, 2)), lambda t: t.amax(dim=(0, 2))),
    "amin_keepdim": (lambda x: sg.amin(x, dim=1, keepdim=True), lambda t: torch.amin(t, dim=1, keepdim=True)),
    "amin_int": (lambda x: (x * 10).long().amin(dim=2), lambda t: (t * 10).long().amin(dim=2)),
    "min_dim_int": (lambda x: (x * 10).long().min(dim=1).values, lambda t: (t * 10).long().min(dim=1).values),
    "argmax_dim": (lambda x: x.argmax(dim=2), lambda t: t.argmax(dim=2)),
    "argmax_all": (lambda x: sg.argmax(x), lambda t: torch.argmax(t)),
    "argmin_dim_keepdim": (lambda x: x.argmin(dim=1, keepdim=True), lambda t: t.argmin(dim=1, keepdim=True)),
    "sg_argmin": (lambda x: sg.argmin(x, dim=0), lambda t: torch.argmin(t, dim=0)),
    "var_dim": (lambda x: x.var(dim=1), lambda t: t.var(dim=1)),
    "var_unbiased_false": (lambda x: x.var(-1, unbiased=False, keepdim=True),
                           lambda t: t.var(-1, unbiased=False, keepdim=True)),
    "var_correction": (lambda x: sg.var(x, dim=(0, 2), correction=0), lambda t: torch.var(t, dim=(0, 2), correction=0)),
    "std_dim": (lambda x: x.std(dim=0, keepdim=True), lambda t: t.std(dim=0, keepdim=True)),
    "prod_dim": (lambda x: x.prod(dim=2), lambda t: t.prod(dim=2)),
    "prod_keepdim": (lambda x: sg.prod(x, dim=1, keepdim=True), lambda t: torch.prod(t, dim=1, keepdim=True)),
    "logsumexp_dim": (lambda x: x.logsumexp(dim=1), lambda t: t.logsumexp(dim=1)),
    "sg_logsumexp": (lambda x: sg.logsumexp(x, dim=-1, keepdim=True), lambda t: torch.logsumexp(t, dim=-1, keepdim=True)),
    "softmax_method": (lambda x: x.softmax(1), lambda t: t.softmax(1)),
    "softmax_dim": (lambda x: sg.softmax(x, dim=0), lambda t: torch.softmax(t, dim=0)),
    "log_softmax_method": (lambda x: x.log_softmax(dim=-1), lambda t: t.log_softmax(dim=-1)),
    "sg_log_softmax_dim": (lambda x: sg.log_softmax(x, dim=1), lambda t: torch.log_softmax(t, dim=1)),
    "cat_dim": (lambda x: sg.cat([x, x * 2], dim=-1), lambda t: torch.cat([t, t * 2], dim=-1)),
    # factories beside a graph value
    "ones": (lambda x: x + sg.ones(3, 4, 5, dtype="float64"), lambda t: t + torch.ones(3, 4, 5, dtype=torch.float64)),
    "zeros_tuple": (lambda x: x * 2 + sg.zeros((4, 5), dtype=torch.float64),
                    lambda t: t * 2 + torch.zeros((4, 5), dtype=torch.float64)),
    "zeros_default_dtype": (lambda x: x.float() + sg.zeros(5), lambda t: t.float() + torch.zeros(5)),
    "full_float": (lambda x: x * sg.full((4, 5), 1.5, dtype=torch.float64),
                   lambda t: t * torch.full((4, 5), 1.5, dtype=torch.float64)),
    "full_int": (lambda x: sg.full((3, 4), 7) + (x[:, :, 0] * 4).long(),
                 lambda t: torch.full((3, 4), 7) + (t[:, :, 0] * 4).long()),
    "full_bool": (lambda x: sg.full((5,), True) & (x > 0), lambda t: torch.full((5,), True) & (t > 0)),
    "ones_like": (lambda x: x * 3 + sg.ones_like(x), lambda t: t * 3 + torch.ones_like(t)),
    "zeros_like_dtype": (lambda x: sg.zeros_like(x, dtype="int64") + (x * 3).long(),
                         lambda t: torch.zeros_like(t, dtype=torch.int64) + (t * 3).long()),
    "full_like": (lambda x: x - sg.full_like(x, 0.25), lambda t: t - torch.full_like(t, 0.25)),
    "eye": (lambda x: x[0] @ sg.eye(5, dtype="float64"), lambda t: t[0] @ torch.eye(5, dtype=torch.float64)),
    "eye_rect": (lambda x: x[0] + sg.eye(4, 5, dtype=torch.float64), lambda t: t[0] + torch.eye(4, 5, dtype=torch.float64)),
    "eye_default": (lambda x: x[0].float() + sg.eye(4, 5), lambda t: t[0].float() + torch.eye(4, 5)),
    "arange": (lambda x: x * sg.arange(5, dtype=torch.float64),
               lambda t: t * torch.arange(5, dtype=torch.float64)),
    "arange_long": (lambda x: (x * 2).long() + sg.arange(0, 5, dtype=torch.long, device="cpu"),
                    lambda t: (t * 2).long() + torch.arange(0, 5, dtype=torch.long, device="cpu")),
    "arange_end": (lambda x: x * sg.arange(end=5), lambda t: t * torch.arange(end=5)),
}

# On C every value is checked, and the gradients of the cases that build something new for a
# backend (where-sum selections, flipped orders, index sources, swaps, broadcasts, masks); the
# other cases' gradients are graphs of ops that C's own tests cover, checked here on numpy. (One
# C build of every gradient takes twice as long, and the suite has ten minutes on two cores.)
GRADIENTS_ON_C = {
    "transpose_swap", "transpose_2d_01", "mT", "squeeze_kept", "expand_minus_one", "split_sizes", "chunk",
    "stack_dim", "masked_fill_softmax", "where_method", "triu_1", "float", "to_torch_dtype", "rsqrt",
    "clamp", "add_sub_mul", "detach", "sum_dims_keepdim", "mean_dim", "max_all", "min_all", "max_dim_values",
    "min_dim_values", "sg_min_dim_keepdim", "max_other", "amax", "amin_keepdim", "var_unbiased_false",
    "std_dim", "prod_keepdim", "logsumexp_dim", "softmax_dim", "log_softmax_method", "cat_dim", "ones",
    "full_float", "full_like", "eye", "eye_rect", "arange",
}

R = {}  # name -> the fixed random weights of its gradient check


def _weights(name: str, shape) -> np.ndarray:
    if name not in R:
        R[name] = np.random.default_rng(len(R)).standard_normal(shape)
    return R[name]


@pytest.fixture(scope="module", params=BACKENDS)
def built(request):
    """Every case's symgrad result and, for float results, its gradient to x, in one function."""
    x = sg.input("x", X.shape, dtype="float64")
    values, grads = [], {}
    for name, (build, _) in CASES.items():
        out = build(x)
        values.append(out)
        if sg.ir.dtypes.is_float(out.dtype) and (request.param == "numpy" or name in GRADIENTS_ON_C):
            grads[name] = sg.grad(sg.sum(out.double() * _weights(name, out.shape)), [x])[0]
    results = sg.function([x], values + list(grads.values()), backend=request.param)(X)
    return dict(zip(CASES, results[:len(CASES)])), dict(zip(grads, results[len(CASES):]))


def _torch_case(name: str):
    t = torch.tensor(X, requires_grad=True)
    out = CASES[name][1](t)
    grad = None
    if out.is_floating_point():
        w = torch.tensor(_weights(name, tuple(out.shape)))
        grad = torch.autograd.grad((out.double() * w).sum(), [t], allow_unused=True)[0]
        grad = torch.zeros_like(t) if grad is None else grad
    return out.detach(), grad


@pytest.mark.parametrize("name", list(CASES))
def test_method_against_torch(built, name):
    values, grads = built
    expected, expected_grad = _torch_case(name)
    got = np.asarray(values[name])
    assert got.shape == tuple(expected.shape), (name, got.shape, tuple(expected.shape))
    assert str(got.dtype) == str(expected.dtype).replace("torch.", ""), (name, got.dtype, expected.dtype)
    tol = 1e-6 if expected.dtype == torch.float32 else 1e-12
    np.testing.assert_allclose(got, expected.numpy(), rtol=tol, atol=tol, err_msg=name)
    if expected_grad is not None and name in grads:
        np.testing.assert_allclose(grads[name], expected_grad.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)


# ---- descriptions and results that are not arrays ------------------------------------------

def test_size_dim_numel_as_torch():
    x, t = sg.input("x", (3, 4, 5)), torch.zeros(3, 4, 5)
    assert x.size() == tuple(t.size()) and x.size(1) == t.size(1) and x.size(-1) == t.size(-1)
    assert x.dim() == t.dim() == 3 and x.numel() == t.numel() == 60
    B = sg.Dim("B")
    y = sg.input("y", (B, 4))
    assert y.size(0) is B and y.numel() == 4 * B
    with pytest.raises(IndexError, match=r"size: dim 3 .*\[3,4,5\]"):
        x.size(3)


def test_max_and_min_with_dim_are_named_tuples():
    x = sg.input("x", (3, 4))
    for op in ("max", "min"):
        result = getattr(x, op)(dim=1)
        assert type(result).__name__ == op and result._fields == ("values", "indices")
        values, indices = result
        assert values is result.values and indices is result.indices
        assert values.shape == (3,) and indices.dtype == "int64"
        assert getattr(sg, op)(x, 0, keepdim=True).values.shape == (1, 4)
    # without a dim: the full reduction, a value; NumPy's axis=: the maxima alone (amax)
    assert isinstance(x.max(), sg.Value) and x.max().shape == ()
    assert isinstance(sg.max(x, axis=1), sg.Value) and sg.max(x, axis=(0, 1), keepdims=True).shape == (1, 1)
    with pytest.raises(TypeError, match="max: dim must be an int"):
        x.max(dim=(0, 1))


def test_split_and_chunk_pieces_as_torch():
    x, t = sg.input("x", (3, 7)), torch.zeros(3, 7)
    for args in ((2, 1), ([3, 4], 1), (3, 0)):
        assert [p.shape for p in x.split(*args)] == [tuple(p.shape) for p in t.split(*args)]
    assert [p.shape for p in x.chunk(3, dim=1)] == [tuple(p.shape) for p in t.chunk(3, dim=1)]
    assert [p.shape for p in x.chunk(2)] == [tuple(p.shape) for p in t.chunk(2)]


@pytest.mark.parametrize("build", [
    lambda x: sg.sum(x, dim=1, axis=1),
    lambda x: x.sum(1, dim=1),
    lambda x: x.mean(keepdim=True, keepdims=True),
    lambda x: sg.max(x, dim=1, axis=1),
    lambda x: x.min(1, keepdim=True, keepdims=True),
    lambda x: sg.softmax(x, dim=1, axis=1),
    lambda x: sg.log_softmax(x, 0, dim=1),
    lambda x: x.var(dim=0, axis=0),
    lambda x: sg.std(x, 0, dim=0),
    lambda x: sg.prod(x, dim=0, axis=1),
    lambda x: sg.logsumexp(x, dim=0, axis=1),
    lambda x: sg.argmax(x, dim=0, axis=0),
    lambda x: sg.amax(x, dim=0, axis=0),
    lambda x: sg.cat([x, x], dim=0, axis=0),
    lambda x: sg.squeeze(x, dim=0, axis=0),
])
def test_both_spellings_of_one_argument_are_refused(build):
    with pytest.raises(TypeError, match="both"):
        build(sg.input("x", (3, 4)))


def test_torch_spellings_show_in_signatures():
    for fn in (sg.sum, sg.mean, sg.amax, sg.argmax, sg.softmax, sg.var, sg.logsumexp, sg.cat):
        assert "dim" in inspect.signature(fn).parameters, fn.__name__


def test_movement_errors_name_op_and_shape():
    x = sg.input("x", (3, 4))
    with pytest.raises(ValueError, match=r"transpose: dim 2 .*\[3,4\]"):
        x.transpose(0, 2)
    with pytest.raises(ValueError, match=r"expand: axis 1 .*size 4.*cannot grow"):
        x.expand(3, 8)
    with pytest.raises(ValueError, match=r"expand: -1 .*leading"):
        x.expand(-1, 3, 4)
    with pytest.raises(ValueError, match=r"mT: .*\[5\]"):
        sg.input("v", (5,)).mT
    with pytest.raises(TypeError, match="view: .*dtype"):
        x.view("float64")


def test_factories_take_sizes_as_torch_and_dims():
    B = sg.Dim("B")
    assert sg.zeros(B, 3).shape == (B, 3) and sg.ones((2, B)).dtype == "float32"
    assert sg.full((2,), 3).dtype == "int64" and sg.full((2,), True).dtype == "bool"
    assert sg.full((2,), 2.5).dtype == "float32" and sg.ones(2, dtype=torch.float64).dtype == "float64"
    assert sg.eye(3).shape == (3, 3) and sg.zeros(()).shape == ()
    with pytest.raises(ValueError, match="zeros: negative size -1"):
        sg.zeros(2, -1)
    with pytest.raises(TypeError, match="ones: sizes must be ints"):
        sg.ones(2.5)
    with pytest.raises(TypeError, match="full: fill_value must be a number"):
        sg.full((2,), "a")


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_factories_of_symbolic_sizes_follow_the_call(backend_name):
    B = sg.Dim("B")
    x = sg.input("x", (B, 3), dtype="float64")
    fn = sg.function([x], [x + sg.ones(B, 3, dtype="float64"), sg.zeros_like(x) + sg.eye(B, 3, dtype="float64"),
                           sg.full((B,), 2) + sg.arange(B)], backend=backend_name)
    a = np.arange(12.0).reshape(4, 3)
    ones, eye, full = fn(a)
    np.testing.assert_array_equal(ones, a + 1)
    np.testing.assert_array_equal(eye, torch.eye(4, 3, dtype=torch.float64).numpy())
    np.testing.assert_array_equal(full, (torch.full((4,), 2) + torch.arange(4)).numpy())
