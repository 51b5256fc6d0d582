"""Rounded division, remainders, bitwise ops, shifts and the inverse trigonometric functions
against torch (issue 32, defect 4).

Every case is an output of ONE graph per backend (one C build): integer operands of both
signs, zeros, -1 and the extremes of int32 and int64 divided as a broadcast grid (every
dividend by every divisor), shifts by negative, in-range and too-large amounts, bools,
Python scalars on either side, floats with +-0, +-inf and NaN, and the float64 gradients of
the differentiable ops against torch.autograd (first and second order).

Where torch has no value the test says what symgrad defines instead (symgrad/ir/integer.py):
integer division by zero gives 0 (quotient and remainder, as NumPy; torch raises), and
INT_MIN / -1 wraps (torch's floor_divide and remainder give that; its fmod and truncating
division trap, so their expected values come from floor_divide and remainder, equal there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import torch

import symgrad as sg

NAN, INF = float("nan"), float("inf")
INTS = ("int32", "int64")


def _int_values(dtype: str) -> np.ndarray:
    info = np.iinfo(dtype)
    return np.array([info.min, info.min + 1, -13, -7, -2, -1, 0, 1, 2, 7, 13, info.max - 1, info.max], dtype)


def _int_divisors(dtype: str) -> np.ndarray:
    info = np.iinfo(dtype)
    return np.array([info.min, -7, -3, -2, -1, 0, 1, 2, 3, 7, info.max], dtype)


SHIFTS = np.array([-65, -1, 0, 1, 3, 30, 31, 32, 33, 62, 63, 64, 100])
FLOATS = np.array([-INF, -7.5, -2.0, -1.0, -0.3, -0.0, 0.0, 0.3, 1.0, 2.5, 7.5, 1e30, INF, NAN])
FLOAT_DIVISORS = np.array([-INF, -2.0, -0.5, -0.0, 0.0, 0.1, 0.5, 2.0, 3.0, 1e-30, INF, NAN])
UNIT = np.array([-INF, -2.0, -1.0, -0.999, -0.5, -0.0, 0.0, 0.3, 0.999, 1.0, 2.0, INF, NAN])
BOOLS = np.array([False, True])

ARRAYS: dict[str, np.ndarray] = {}
for _dt in INTS:
    ARRAYS[f"a_{_dt}"] = _int_values(_dt)[None, :]          # a row of dividends ...
    ARRAYS[f"b_{_dt}"] = _int_divisors(_dt)[:, None]        # ... by a column of divisors: every pair
    ARRAYS[f"s_{_dt}"] = SHIFTS.astype(_dt)[:, None]        # shift amounts
for _dt in ("float32", "float64"):
    ARRAYS[f"f_{_dt}"] = FLOATS.astype(_dt)[None, :]
    ARRAYS[f"g_{_dt}"] = FLOAT_DIVISORS.astype(_dt)[:, None]
    ARRAYS[f"u_{_dt}"] = UNIT.astype(_dt)
ARRAYS["p"], ARRAYS["q"] = BOOLS[None, :], BOOLS[:, None]
ARRAYS["small"] = np.array([-9, -5, -1, 1, 4, 9], np.int32)   # no zero: a divisor of Python scalars
ARRAYS["amounts"] = np.array([0, 1, 5, 31], np.int64)


@dataclass(frozen=True)
class Case:
    """One output: symgrad on graph values and torch on tensors of the same named arrays.

    exact: the values must be equal (division, bits); otherwise within a few ulp (libm).
    """

    name: str
    sg_fn: Callable
    torch_fn: Callable
    args: tuple
    exact: bool = True


def _safe_divisor(a: torch.Tensor, b: torch.Tensor, also_minus_one: bool):
    """torch's integer kernels raise at b == 0 and trap (SIGFPE) at INT_MIN / -1 for fmod and
    truncating division: the divisor with those entries replaced by 1, and where they were."""
    dtype = torch.result_type(a, b)  # INT32_MIN / -1 in int64 is 2**31, not a wrap
    a, b = torch.broadcast_tensors(a.to(dtype), b.to(dtype))
    zero = b == 0
    minus_one = (b == -1) if also_minus_one else torch.zeros_like(zero)
    return a, torch.where(zero | minus_one, torch.ones_like(b), b), zero, minus_one


def _torch_int_division(kind: str):
    """torch's value of an integer division op, with symgrad's defined values where torch has none:
    0 at a zero divisor (NumPy's choice: np.floor_divide(7, 0) == 0), and at a divisor of -1 the
    exact quotient (-a, wrapping) and remainder (0) that torch's floor_divide and remainder give."""
    def fn(a, b):
        if not (a.dtype.is_floating_point or b.dtype.is_floating_point):
            a, safe, zero, minus_one = _safe_divisor(a, b, also_minus_one=kind in ("trunc", "fmod"))
            out = {"floor": torch.floor_divide, "remainder": torch.remainder,
                   "trunc": lambda x, y: torch.div(x, y, rounding_mode="trunc"), "fmod": torch.fmod}[kind](a, safe)
            exact = {"trunc": torch.floor_divide, "fmod": torch.remainder}.get(kind)
            if exact is not None:
                out = torch.where(minus_one, exact(a, torch.full_like(a, -1)), out)
            return torch.where(zero, torch.zeros_like(out), out)
        return {"floor": torch.floor_divide, "remainder": torch.remainder, "fmod": torch.fmod,
                "trunc": lambda x, y: torch.div(x, y, rounding_mode="trunc")}[kind](a, b)
    return fn


def _cases() -> list[Case]:
    cases = []
    division = (("floor_divide", lambda a, b: a // b, "floor"),
                ("div_floor", lambda a, b: sg.div(a, b, rounding_mode="floor"), "floor"),
                ("remainder", lambda a, b: a % b, "remainder"),
                ("fmod", sg.fmod, "fmod"),
                ("div_trunc", lambda a, b: a.div(b, rounding_mode="trunc"), "trunc"))
    for da, db in (("int32", "int32"), ("int64", "int64"), ("int32", "int64"), ("int64", "int32")):
        for name, fn, kind in division:
            cases.append(Case(f"{name}_{da}_{db}", fn, _torch_int_division(kind), (f"a_{da}", f"b_{db}")))
        for name, fn, tfn in (("and", lambda a, b: a & b, torch.bitwise_and),
                              ("or", lambda a, b: a | b, torch.bitwise_or),
                              ("xor", sg.bitwise_xor, torch.bitwise_xor)):
            cases.append(Case(f"{name}_{da}_{db}", fn, tfn, (f"a_{da}", f"b_{db}")))
        cases.append(Case(f"left_shift_{da}_{db}", lambda a, s: a << s, lambda a, s: a << s, (f"a_{da}", f"s_{db}")))
        cases.append(Case(f"right_shift_{da}_{db}", lambda a, s: a.bitwise_right_shift(s), lambda a, s: a >> s,
                          (f"a_{da}", f"s_{db}")))
    for dt in INTS:
        cases.append(Case(f"not_{dt}", lambda a: ~a, torch.bitwise_not, (f"a_{dt}",)))
    for dt in ("float32", "float64"):
        for name, fn, kind in division:
            cases.append(Case(f"{name}_{dt}", fn, _torch_int_division(kind), (f"f_{dt}", f"g_{dt}")))
        cases.append(Case(f"atan2_{dt}", sg.atan2, torch.atan2, (f"f_{dt}", f"g_{dt}"), exact=False))
        cases.append(Case(f"atan2_method_{dt}", lambda y, x: y.arctan2(x), torch.atan2, (f"g_{dt}", f"f_{dt}"),
                          exact=False))
        for name, fn, tfn in (("asin", sg.asin, torch.asin), ("acos", lambda u: u.acos(), torch.acos),
                              ("atan", sg.arctan, torch.atan)):
            cases.append(Case(f"{name}_{dt}", fn, tfn, (f"u_{dt}",), exact=False))
    # bools: logic, and arithmetic beside an integer (promoted, as torch)
    for name, fn, tfn in (("and", lambda p, q: p & q, torch.bitwise_and), ("or", lambda p, q: p | q, torch.bitwise_or),
                          ("xor", lambda p, q: p ^ q, torch.bitwise_xor)):
        cases.append(Case(f"{name}_bool", fn, tfn, ("p", "q")))
    cases += [Case("not_bool", lambda p: ~p, torch.bitwise_not, ("p",)),
              Case("and_bool_int32", lambda p, a: p & a, torch.bitwise_and, ("q", "a_int32")),
              Case("xor_bool_scalar", lambda p: p ^ 3, lambda p: p ^ 3, ("p",)),
              Case("or_bool_true", lambda p: p | True, lambda p: p | True, ("p",))]
    # Python scalars on either side (the scalar takes the tensor's dtype; a float makes it float32)
    scalars = (("floordiv_3", lambda x: x // 3), ("floordiv_m3", lambda x: x // -3), ("rfloordiv", lambda x: 7 // x),
               ("mod_3", lambda x: x % 3), ("rmod", lambda x: -7 % x), ("fmod_m3", lambda x: x.fmod(-3)),
               ("floor_2", lambda x: x.div(2, rounding_mode="floor")),
               ("trunc_m2", lambda x: x.div(-2, rounding_mode="trunc")),
               ("and_6", lambda x: x & 6), ("ror", lambda x: 5 | x), ("xor_m1", lambda x: x ^ -1),
               ("lshift_3", lambda x: x << 3), ("rlshift", lambda x: 1 << x), ("rshift_1", lambda x: x >> 1),
               ("rrshift", lambda x: -1024 >> x), ("floordiv_float", lambda x: x // 2.5),
               ("mod_float", lambda x: x % 2.5))
    for name, fn in scalars:
        source = "amounts" if name in ("rlshift", "rrshift") else "small"
        cases.append(Case(f"scalar_{name}", fn, fn, (source,)))
    return cases


CASES = _cases()


@dataclass(frozen=True)
class GradCase:
    """A differentiable op in float64: value and gradients of sum(op(a, b) * cot) against torch."""

    name: str
    sg_fn: Callable
    torch_fn: Callable
    arity: int


def _pairs(first: np.ndarray, second: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.meshgrid(first, second)
    return a.reshape(-1), b.reshape(-1)


# Every pair of a grid, one element each (a gradient entry is one pair's, not a sum over a row):
# zeros (atan2's origin, remainder's zero divisor), signs, the edges of asin's domain.
GRAD_A, GRAD_B = _pairs(np.array([-7.5, -2.0, -1.0, -0.3, -0.0, 0.0, 0.3, 1.0, 2.5, 7.5]),
                        np.array([-2.0, -0.5, -0.0, 0.0, 0.5, 2.0, 3.0]))
GRAD_COT = np.random.default_rng(0).standard_normal(GRAD_A.shape)
GRAD_CASES = [
    GradCase("asin", sg.asin, torch.asin, 1), GradCase("acos", sg.acos, torch.acos, 1),
    GradCase("atan", sg.atan, torch.atan, 1), GradCase("atan2", sg.atan2, torch.atan2, 2),
    GradCase("remainder", lambda a, b: a % b, torch.remainder, 2), GradCase("fmod", sg.fmod, torch.fmod, 2),
    GradCase("div_floor", lambda a, b: sg.div(a, b, rounding_mode="floor"),
             lambda a, b: torch.div(a, b, rounding_mode="floor"), 2),
    GradCase("div_trunc", lambda a, b: sg.divide(a, b, rounding_mode="trunc"),
             lambda a, b: torch.div(a, b, rounding_mode="trunc"), 2),
]
UNIT_GRID = np.linspace(-1.5, 1.5, GRAD_A.size)  # asin and acos: inside, at and outside [-1, 1]
# atan2 broadcast (its gradients summed back to each operand's shape) and second order, away from 0
BROAD_Y, BROAD_X = np.array([[-1.5], [0.4], [2.0]]), np.array([[-2.0, -0.7, 0.5, 3.0]])
HVP_V, HVP_W = np.random.default_rng(1).standard_normal((2, 3, 4))
# first to third derivatives of the unary ones (sympy differentiates its own derivatives)
HIGHER = {"asin": (sg.asin, torch.asin), "acos": (sg.acos, torch.acos), "atan": (sg.atan, torch.atan)}
HIGHER_X = np.array([-0.95, -0.6, -0.1, 0.0, 0.2, 0.7, 0.9])


def _unary_input(case: GradCase) -> np.ndarray:
    return UNIT_GRID if case.name in ("asin", "acos") else GRAD_A


def build_graph() -> tuple[list, list, list]:
    """(inputs, their arrays, outputs) of every case: the value cases, then per GradCase its value
    and gradients, then atan2 broadcast with its gradients and a Hessian-vector product."""
    inputs = {name: sg.input(name, array.shape, dtype=str(array.dtype)) for name, array in ARRAYS.items()}
    outputs = [case.sg_fn(*(inputs[n] for n in case.args)) for case in CASES]
    arrays = [ARRAYS[n] for n in inputs]
    inputs = list(inputs.values())
    cot = sg.input("cot", GRAD_COT.shape, dtype="float64")
    inputs.append(cot)
    arrays.append(GRAD_COT)
    for case in GRAD_CASES:
        values = (_unary_input(case),) if case.arity == 1 else (GRAD_A, GRAD_B)
        operands = [sg.input(f"{case.name}_{k}", v.shape, dtype="float64") for k, v in enumerate(values)]
        y = case.sg_fn(*operands)
        outputs += [y, *sg.grad(sg.sum(y * cot), operands)]
        inputs += operands
        arrays += list(values)
    y, x = sg.input("by", BROAD_Y.shape, dtype="float64"), sg.input("bx", BROAD_X.shape, dtype="float64")
    angle = sg.atan2(y, x)
    gy, gx = sg.grad(sg.sum(angle * sg.constant(HVP_V, "float64")), [y, x])
    second = sg.grad(sg.sum(sg.broadcast_to(gy, (3, 4)) * sg.constant(HVP_W, "float64")) + sg.sum(gx), [y, x])
    outputs += [angle, gy, gx, *second]
    inputs += [y, x]
    arrays += [BROAD_Y, BROAD_X]
    for name, (fn, _) in HIGHER.items():
        x = sg.input(f"higher_{name}", HIGHER_X.shape, dtype="float64")
        d = fn(x)
        for _ in range(3):
            (d,) = sg.grad(sg.sum(d), [x])
            outputs.append(d)
        inputs.append(x)
        arrays.append(HIGHER_X)
    return inputs, arrays, outputs


def cuda_graph() -> sg.Graph:
    """The whole suite as one graph, for tests/backends/test_backend_cuda.py's nvcc check."""
    inputs, _, outputs = build_graph()
    return sg.Graph(inputs, outputs)


@pytest.fixture(scope="module")
def results():
    cache = {}

    def get(backend: str) -> list:
        if backend not in cache:
            inputs, arrays, outputs = build_graph()
            cache[backend] = list(sg.function(inputs, outputs, backend=backend)(*arrays))
        return cache[backend]
    return get


def _tensor(name: str) -> torch.Tensor:
    return torch.from_numpy(ARRAYS[name].copy())


@pytest.mark.parametrize("k, name", list(enumerate(case.name for case in CASES)))
def test_values_and_dtypes_match_torch(results, backend, k, name):
    case = CASES[k]
    got = results(backend)[k]
    want = case.torch_fn(*(_tensor(n) for n in case.args)).numpy()
    assert got.dtype == want.dtype, f"{name}: {got.dtype} vs torch's {want.dtype}"
    assert got.shape == want.shape, name
    if case.exact:
        np.testing.assert_array_equal(got, want, err_msg=name)
    else:
        tol = 1e-6 if got.dtype == np.float32 else 1e-15
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol, equal_nan=True, err_msg=name)


def _grad_offset(index: int) -> int:
    offset = len(CASES)
    for case in GRAD_CASES[:index]:
        offset += 1 + case.arity
    return offset


@pytest.mark.parametrize("k, name", list(enumerate(case.name for case in GRAD_CASES)))
def test_float64_gradients_match_torch_autograd(results, backend, k, name):
    case = GRAD_CASES[k]
    values = (_unary_input(case),) if case.arity == 1 else (GRAD_A, GRAD_B)
    tensors = [torch.tensor(v, requires_grad=True) for v in values]
    y = case.torch_fn(*tensors)
    grads = torch.autograd.grad(y, tensors, torch.from_numpy(GRAD_COT))
    got = results(backend)[_grad_offset(k): _grad_offset(k) + 1 + case.arity]
    for label, g, w in zip(("value", "d/da", "d/db"), got, (y.detach(), *grads)):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-13, atol=1e-15, equal_nan=True, err_msg=f"{name} {label}")


def test_atan2_broadcast_gradient_and_second_order_match_torch(results, backend):
    got = results(backend)[_grad_offset(len(GRAD_CASES)):_grad_offset(len(GRAD_CASES)) + 5]
    y, x = torch.tensor(BROAD_Y, requires_grad=True), torch.tensor(BROAD_X, requires_grad=True)
    angle = torch.atan2(y, x)
    gy, gx = torch.autograd.grad((angle * torch.from_numpy(HVP_V)).sum(), [y, x], create_graph=True)
    second = torch.autograd.grad((gy.expand(3, 4) * torch.from_numpy(HVP_W)).sum() + gx.sum(), [y, x])
    for label, g, w in zip(("atan2", "d/dy", "d/dx", "d2/dy", "d2/dx"), got, (angle, gy, gx, *second)):
        np.testing.assert_allclose(g, w.detach().numpy(), rtol=1e-13, atol=1e-15, err_msg=label)


def test_integer_division_by_zero_is_zero_and_int_min_by_minus_one_wraps(results, backend):
    """The values torch does not give (it raises, or traps), checked where the grid holds them."""
    by_name = {case.name: out for case, out in zip(CASES, results(backend))}
    for dt in INTS:
        zero = ARRAYS[f"b_{dt}"][:, 0] == 0
        minus_one = ARRAYS[f"b_{dt}"][:, 0] == -1
        lowest = ARRAYS[f"a_{dt}"][0] == np.iinfo(dt).min
        for name in ("floor_divide", "div_floor", "div_trunc", "remainder", "fmod"):
            out = by_name[f"{name}_{dt}_{dt}"]
            assert (out[zero] == 0).all(), name
            wraps = out[minus_one][:, lowest]
            assert (wraps == (0 if name in ("remainder", "fmod") else np.iinfo(dt).min)).all(), name


def test_grad_through_floor_divide_is_refused_as_torch_refuses_it():
    a = torch.tensor([3.5], requires_grad=True)
    with pytest.raises(RuntimeError, match="floor_divide"):
        torch.floor_divide(a, 2.0).sum().backward()
    x = sg.input("x", (3,), dtype="float64")
    with pytest.raises(NotImplementedError, match="grad: op 'floor_divide' has no VJP rule"):
        sg.grad(sg.sum(x // 2.0), [x])


def test_operand_dtypes_torch_refuses_are_refused_naming_the_op_and_dtypes():
    f, i, b = sg.input("f", (3,)), sg.input("i", (3,), dtype="int32"), sg.input("b", (3,), dtype="bool")
    ft, it, bt = torch.ones(3), torch.ones(3, dtype=torch.int32), torch.ones(3, dtype=torch.bool)
    refused = [
        (lambda x, y: x & y, "bitwise_and", (f, i), (ft, it), r"got float32 and int32 \(f32\[3\], i32\[3\]\)"),
        (lambda x, y: x | y, "bitwise_or", (i, f), (it, ft), "got int32 and float32"),
        (lambda x, y: x ^ y, "bitwise_xor", (f, f), (ft, ft), "got float32 and float32"),
        (lambda x, y: x << y, "bitwise_left_shift", (i, f), (it, ft), "got int32 and float32"),
        (lambda x, y: x >> y, "bitwise_right_shift", (b, b), (bt, bt), "got bool and bool"),
        (lambda x, y: x // y, "floor_divide", (b, b), (bt, bt), "got bool and bool"),
        (lambda x, y: x % y, "remainder", (b, b), (bt, bt), "got bool and bool"),
        (lambda x, y: sg.fmod(x, y) if isinstance(x, sg.Value) else torch.fmod(x, y), "fmod", (b, b), (bt, bt),
         "got bool and bool"),
    ]
    for fn, op, operands, tensors, message in refused:
        with pytest.raises(RuntimeError):
            fn(*tensors)  # torch refuses the same operands
        with pytest.raises(TypeError, match=f"{op}: {message}"):
            fn(*operands)
    with pytest.raises(TypeError, match="bitwise_not: got float32"):
        ~f
    with pytest.raises(ValueError, match="div: rounding_mode must be None, 'trunc' or 'floor', got 'round'"):
        sg.div(f, f, rounding_mode="round")
    assert sg.div(i, i).dtype == "float32"  # true division, as torch.div(int, int)


def test_float_floor_division_is_exact_where_floor_of_the_quotient_is_not(results, backend):
    """1 // 0.1 is 9 (0.1 is a little above 1/10), while floor(1 / 0.1) = floor(10.0) = 10."""
    by_name = {case.name: out for case, out in zip(CASES, results(backend))}
    column = list(FLOAT_DIVISORS).index(0.1)
    row = list(FLOATS).index(1.0)
    assert by_name["floor_divide_float64"][column, row] == 9.0 == torch.floor_divide(
        torch.tensor(1.0, dtype=torch.float64), 0.1).item()


@pytest.mark.parametrize("k, name", list(enumerate(HIGHER)))
def test_first_to_third_derivatives_match_torch(results, backend, k, name):
    start = _grad_offset(len(GRAD_CASES)) + 5 + 3 * k
    t = torch.tensor(HIGHER_X, requires_grad=True)
    d = HIGHER[name][1](t)
    for order, got in enumerate(results(backend)[start:start + 3], 1):
        (d,) = torch.autograd.grad(d.sum(), [t], create_graph=True)
        np.testing.assert_allclose(got, d.detach().numpy(), rtol=1e-12, atol=1e-14, err_msg=f"{name} order {order}")


def test_gradients_match_finite_differences_at_smooth_points():
    """Away from the quotient's jumps and asin's edges, the derived gradients are the slopes."""
    a = np.array([-3.7, -1.2, 0.45, 2.3, 5.1])
    b = np.array([1.3, -0.8, 2.2, -1.9, 0.7])
    sg.gradcheck(lambda x, y: (sg.atan2(x, y), x % y, sg.fmod(x, y), sg.asin(x / 8), sg.acos(y / 3), sg.atan(x)),
                 [a, b])
