"""Type promotion as torch's (torch.result_type), under every pair of operand kinds and dtypes.

Each of bool, int32, int64, float32 and float64 as a tensor with dimensions, a 0-d tensor or a
Python scalar (bool, int, float), beside each other: add, sub, mul, div, maximum, where, the
comparisons less and equal, and pow. Each result's dtype is checked against torch.result_type
and the op's own result in torch, its values against torch's (which show where the arithmetic
ran: int64 16777217 == float32 16777216 holds in float32, not in float64), and where torch
refuses a pair (bool - bool, bool ** bool) symgrad refuses it while the graph is built, naming
the op. Gradients of the float operands keep their dtypes and torch's values.

All the pairs of a backend are outputs of one sg.function (one C build).
"""

from __future__ import annotations

import itertools
import operator

import numpy as np
import pytest
import torch

import symgrad as sg

DTYPES = ("bool", "int32", "int64", "float32", "float64")
SCALAR_TYPES = ("bool", "int", "float")  # what a Python scalar can be
KINDS = ("tensor", "0-d", "scalar")
KIND_PAIRS = [(a, b) for a, b in itertools.product(KINDS, KINDS) if (a, b) != ("scalar", "scalar")]

# Values by side and category. Where an int meets a float, one holds 16777217 and the other
# 16777216.0: float32 rounds the int onto the float, float64 does not. Products stay in int32.
VALUES = {
    "left": {"bool": [True, False, True, False, True], "int": [-3, 0, 16777217, 2, 7],
             "float": [-1.5, 0.0, 0.1, 16777216.0, 2.25]},
    "right": {"bool": [True, True, False, False, True], "int": [4, -2, 1, 16777217, 0],
              "float": [0.5, 2.0, 16777216.0, 0.1, -3.5]},
}
ZERO_D = {"bool": True, "int": -2, "float": 0.1}
SCALARS = {"bool": True, "int": -2, "float": 0.1}
# pow's: small integers (no wrapping) and negative exponents, which integers give as 1, -1 or 0
POW_VALUES = {
    "left": {"bool": [True, False, True, False, True], "int": [-2, 0, 1, 3, 2], "float": [-2.0, 0.0, 1.5, 3.0, 0.5]},
    "right": {"bool": [True, True, False, False, True], "int": [2, -1, 5, 3, 0], "float": [2.0, -1.0, 0.5, 3.0, 0.0]},
}
POW_ZERO_D = {"bool": True, "int": -1, "float": 1.5}
POW_SCALARS = {"bool": True, "int": 2, "float": 0.5}  # a negative int exponent: test_negative_int_exponents
COND = np.array([True, False, False, True, True])


def _category(dtype: str) -> str:
    return "bool" if dtype == "bool" else "int" if dtype.startswith("int") else "float"


def _maximum_torch(a, b):
    """torch.maximum takes tensors only: a Python scalar goes in as the 0-d tensor of the pair's
    result type (what torch.clamp(t, min=s) does, which has no bool kernel)."""
    if not isinstance(a, torch.Tensor):
        a = torch.tensor(a, dtype=torch.result_type(b, a))
    if not isinstance(b, torch.Tensor):
        b = torch.tensor(b, dtype=torch.result_type(a, b))
    return torch.maximum(a, b)


# name -> (symgrad, torch, pow's values); where's condition is COND
OPS = {
    "add": (operator.add, operator.add),
    "sub": (operator.sub, operator.sub),
    "mul": (operator.mul, operator.mul),
    "div": (operator.truediv, operator.truediv),
    "maximum": (sg.maximum, _maximum_torch),
    "where": (lambda a, b, cond: sg.where(cond, a, b), lambda a, b, cond: torch.where(cond, a, b)),
    "less": (operator.lt, operator.lt),
    "equal": (operator.eq, operator.eq),
    "pow": (operator.pow, operator.pow),
}


def _types(kind: str):
    return SCALAR_TYPES if kind == "scalar" else DTYPES


def _operand_value(op: str, side: str, kind: str, dtype: str):
    """The operand's value: a NumPy array for a tensor (0-d or not), a Python scalar otherwise."""
    category = _category(dtype)
    if kind == "scalar":
        return (POW_SCALARS if op == "pow" else SCALARS)[category]
    if kind == "0-d":
        return np.array((POW_ZERO_D if op == "pow" else ZERO_D)[category], dtype=dtype)
    return np.array((POW_VALUES if op == "pow" else VALUES)[side][category], dtype=dtype)


CASES = [(op, ka, da, kb, db) for op in OPS for ka, kb in KIND_PAIRS for da in _types(ka) for db in _types(kb)]


def _torch_operand(value):
    return torch.tensor(value) if isinstance(value, np.ndarray) else value


def _run_torch(op, ka, da, kb, db):
    """torch's result (a tensor) and the gradients of sum(result * 0.75) to the float tensors,
    or the exception torch raises."""
    left, right = (_torch_operand(_operand_value(op, side, k, d)) for side, k, d in (("left", ka, da), ("right", kb, db)))
    wants = [t for t in (left, right) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    for t in wants:
        t.requires_grad_(True)
    args = (left, right, torch.tensor(COND)) if op == "where" else (left, right)
    try:
        out = OPS[op][1](*args)
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        return exc, None, None
    grads = None
    if out.is_floating_point() and wants:
        try:
            grads = torch.autograd.grad((out * 0.75).sum(), wants)
        except RuntimeError:
            # torch's pow backward fails on bools (`exponent - 1` of a bool tensor; an internal
            # assert for a Python bool base) though the forward works: the same derivative, with
            # the bools as the result's floats.
            assert op == "pow" and "bool" in (da, db), (op, da, db)
            as_float = [t.to(out.dtype) if isinstance(t, torch.Tensor) and t.dtype == torch.bool
                        else float(t) if isinstance(t, bool) else t for t in (left, right)]
            grads = torch.autograd.grad((OPS[op][1](*as_float) * 0.75).sum(), wants)
    if op == "div" and not isinstance(left, torch.Tensor):
        # torch divides a Python scalar by a tensor as reciprocal(tensor) * scalar, rounding twice;
        # the correctly rounded quotient (symgrad's, NumPy's) is torch's own division of the two.
        out = torch.div(torch.tensor(left, dtype=out.dtype), right.detach())
    return None, out.detach(), (left, right, grads)


def _build(backend: str):
    """Every pair's symgrad result (and its float operands' gradients) in one function: the
    outputs' positions per case, the function, its arguments; cases symgrad refuses map to the
    exception it raised."""
    inputs, arrays, built = {}, [], {}

    def operand(op, side, kind, dtype):
        value = _operand_value(op, side, kind, dtype)
        if kind == "scalar":
            return value
        key = ("pow" if op == "pow" else "", side, kind, dtype)
        if key not in inputs:
            inputs[key] = sg.input("_".join(filter(None, key)).replace("-", ""), value.shape, dtype=dtype)
            arrays.append(value)
        return inputs[key]

    cond = sg.input("cond", COND.shape, dtype="bool")
    outs = []
    for case in CASES:
        op, ka, da, kb, db = case
        left, right = operand(op, "left", ka, da), operand(op, "right", kb, db)
        try:
            out = OPS[op][0](left, right, cond) if op == "where" else OPS[op][0](left, right)
        except (TypeError, ValueError) as exc:
            built[case] = exc
            continue
        wants = [v for v in (left, right) if isinstance(v, sg.Value) and v.dtype.startswith("float")]
        grads = sg.grad(sg.sum(out * 0.75), wants) if out.dtype.startswith("float") and wants else []
        built[case] = (len(outs), out.dtype, len(grads))
        outs += [out, *grads]
    # C at -O0: some 2000 outputs take gcc a minute at -O3, and what is tested (dtypes, where the
    # arithmetic rounds) is the same at every level, as no flag here lets gcc reassociate or
    # contract floating-point arithmetic.
    options = {"flags": ["-O0", "-fopenmp", "-std=c11"]} if backend == "c" else {}
    function = sg.function([cond, *inputs.values()], outs, backend=backend, **options)
    return built, function(COND, *arrays)


@pytest.fixture(scope="module")
def results():
    cache = {}

    def get(backend):
        if backend not in cache:
            cache[backend] = _build(backend)
        return cache[backend]
    return get


def _check(case, built, outputs) -> list[str]:
    """What differs from torch for one case: empty when nothing does."""
    op, ka, da, kb, db = case
    error, want, torch_parts = _run_torch(*case)
    got = built[case]
    if error is not None:
        if not isinstance(got, Exception):
            return [f"torch refuses ({error}), symgrad gives {got[1]}"]
        return [] if op in str(got) else [f"the refusal does not name {op}: {got}"]
    if isinstance(got, Exception):
        return [f"symgrad refuses ({got}), torch gives {want.dtype}"]
    start, dtype, n_grads = got
    left, right, torch_grads = torch_parts
    problems = []
    want_dtype = str(want.dtype).replace("torch.", "")
    promoted = str(torch.result_type(left, right)).replace("torch.", "")
    # The op's own rule over the promoted dtype: div floats an integer type, comparisons give bool.
    rule = {"div": promoted if promoted.startswith("float") else "float32", "less": "bool", "equal": "bool"}
    if dtype != want_dtype or dtype != rule.get(op, promoted):
        problems.append(f"dtype {dtype}, torch gives {want_dtype} (result_type {promoted})")
    value = outputs[start]
    if value.dtype != np.dtype(dtype):
        problems.append(f"returned {value.dtype}, the node says {dtype}")
    want_value = want.numpy()
    # Exact: +, -, *, /, max, where and comparisons round once in the result's dtype, as torch's;
    # pow goes through the C library's pow, which may differ in the last place.
    tol = 1e-6 if op == "pow" and dtype == "float32" else 1e-14 if op == "pow" else 0
    if value.shape != want_value.shape or not np.allclose(value, want_value, rtol=tol, atol=0, equal_nan=True):
        problems.append(f"values {value.tolist()}, torch gives {want_value.tolist()}")
    if torch_grads is not None:
        got_grads = outputs[start + 1: start + 1 + n_grads]
        if len(got_grads) != len(torch_grads):
            problems.append(f"{len(got_grads)} gradients, torch has {len(torch_grads)}")
        for g, w in zip(got_grads, torch_grads):
            w = w.numpy()
            # float32 arithmetic (a float32 result) sums its float64 operand's gradient in float32 too
            if g.dtype != w.dtype or not np.allclose(g, w, rtol=1e-6 if dtype == "float32" else 1e-12,
                                                     atol=0, equal_nan=True):
                problems.append(f"gradient {g.dtype} {g.tolist()}, torch gives {w.dtype} {w.tolist()}")
    return problems


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("kinds", KIND_PAIRS, ids=[f"{a}-{b}" for a, b in KIND_PAIRS])
def test_every_dtype_pair_promotes_as_torch(results, backend, op, kinds):
    built, outputs = results(backend)
    failures = []
    for case in CASES:
        if case[0] == op and (case[1], case[3]) == kinds:
            failures += [f"{case[2]} {case[1]} {op} {case[4]} {case[3]}: {p}" for p in _check(case, built, outputs)]
    assert not failures, "\n".join(failures)


def test_every_pair_is_covered():
    """Each kind pair and dtype pair is a case under every op, refused or computed."""
    per_op = sum(len(_types(a)) * len(_types(b)) for a, b in KIND_PAIRS)
    assert per_op == 4 * 25 + 4 * 15 and len(CASES) == len(OPS) * per_op


@pytest.mark.parametrize("kind", ["tensor", "0-d"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_int_exponents_refused_as_torch(kind, dtype):
    """A Python int exponent below 0: torch refuses it for an integer or bool base (the result
    is no integer), computes it for a float base; a tensor of such exponents it computes."""
    base = np.array([1, 2, 3] if kind == "tensor" else 2).astype(dtype)
    x = sg.input("x", base.shape, dtype=dtype)
    try:
        want = torch.tensor(base) ** -2
    except RuntimeError:
        with pytest.raises(ValueError, match="pow: integers to negative integer powers"):
            x ** -2
        return
    (got,) = sg.function([x], [x ** -2], backend="numpy")(base)
    assert got.dtype == want.numpy().dtype
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES)
def test_negation_of_bool_refused_as_torch(dtype):
    values = np.array([True, False]).astype(dtype)
    x = sg.input("x", values.shape, dtype=dtype)
    try:
        want = -torch.tensor(values)
    except RuntimeError:
        with pytest.raises(TypeError, match="neg: .*bool"):
            -x
        return
    (got,) = sg.function([x], [-x], backend="numpy")(values)
    assert got.dtype == want.numpy().dtype
    np.testing.assert_array_equal(got, want.numpy())


@pytest.mark.parametrize("dtype", ["bool", "int32", "int64"])
def test_float_arrays_and_dim_ratios_beside_integers_are_float32(dtype, backend):
    """A NumPy float array is a float32 constant (symgrad's default float) and `1 / B` is the
    Python float it stands for: beside an integer tensor both give float32, as torch's
    int_tensor * float32_tensor and int_tensor * (1 / size). (The array was cast to the
    integer dtype, the ratio too: both truncated to 0.)"""
    B = sg.Dim("B")
    values = np.array([[3, 0, 16777217, 2], [1, 5, 7, 16777217]]).astype(dtype)
    x = sg.input("x", (B, 4), dtype=dtype)
    weights = np.array([0.5, -1.25, 1.0, 0.1])
    got = sg.function([x], [x * weights, x * (1 / B)], backend=backend)(values)
    t = torch.tensor(values)
    for out, want in zip(got, (t * torch.tensor(weights, dtype=torch.float32), t * (1 / len(values)))):
        assert out.dtype == want.numpy().dtype
        np.testing.assert_array_equal(out, want.numpy())
