"""Forward semantics of every op against NumPy: values, dtypes and shapes.

All the ops of this file are outputs of one compiled function per backend
(one build); each test reads its own output. Inputs cover float32, float64,
int64 and bool, and a symbolic batch size B.
"""

import functools

import numpy as np
import pytest

import symgrad as sg
from helpers import float32_tolerance

B = sg.Dim("B")


def _inputs():
    return {
        "a": sg.input("a", (3, 4)),                       # float32
        "b": sg.input("b", (3, 4)),
        "i": sg.input("i", (3, 4), dtype="int64"),
        "m": sg.input("m", (3, 4), dtype="bool"),
        "z": sg.input("z", (2, 3, 4), dtype="float64"),
        "s": sg.input("s", (B, 4)),                       # symbolic batch
        "t": sg.input("t", (B,), dtype="int64"),
    }


def _arrays():
    rng = np.random.default_rng(42)
    return {
        "a": rng.standard_normal((3, 4)).astype(np.float32),
        "b": rng.uniform(0.5, 2, (3, 4)).astype(np.float32),
        "i": rng.integers(-5, 6, (3, 4)).astype(np.int64),
        "m": rng.random((3, 4)) < 0.5,
        "z": rng.standard_normal((2, 3, 4)),
        "s": rng.standard_normal((5, 4)).astype(np.float32),
        "t": rng.integers(0, 4, 5).astype(np.int64),
    }


# name: (symgrad builder over the inputs dict, numpy twin over the arrays dict)
OPS = {
    "add": (lambda v: v["a"] + v["b"], lambda n: n["a"] + n["b"]),
    "sub": (lambda v: v["a"] - v["b"], lambda n: n["a"] - n["b"]),
    "mul": (lambda v: v["a"] * v["b"], lambda n: n["a"] * n["b"]),
    "div": (lambda v: v["a"] / v["b"], lambda n: n["a"] / n["b"]),
    "pow": (lambda v: v["b"] ** v["a"], lambda n: n["b"] ** n["a"]),
    "neg": (lambda v: -v["a"], lambda n: -n["a"]),
    "pos": (lambda v: +v["a"], lambda n: +n["a"]),
    "exp": (lambda v: sg.exp(v["a"]), lambda n: np.exp(n["a"])),
    "log": (lambda v: sg.log(v["b"]), lambda n: np.log(n["b"])),
    "sin": (lambda v: sg.sin(v["a"]), lambda n: np.sin(n["a"])),
    "cos": (lambda v: sg.cos(v["a"]), lambda n: np.cos(n["a"])),
    "tanh": (lambda v: sg.tanh(v["a"]), lambda n: np.tanh(n["a"])),
    "sigmoid": (lambda v: sg.sigmoid(v["a"]), lambda n: 1 / (1 + np.exp(-n["a"]))),
    "relu": (lambda v: sg.relu(v["a"]), lambda n: np.maximum(n["a"], 0)),
    "sqrt": (lambda v: sg.sqrt(v["b"]), lambda n: np.sqrt(n["b"])),
    "abs": (lambda v: sg.abs(v["a"]), lambda n: np.abs(n["a"])),
    "maximum": (lambda v: sg.maximum(v["a"], v["b"]), lambda n: np.maximum(n["a"], n["b"])),
    "minimum": (lambda v: sg.minimum(v["a"], 0.0), lambda n: np.minimum(n["a"], np.float32(0))),
    "where": (lambda v: sg.where(v["m"], v["a"], v["b"]), lambda n: np.where(n["m"], n["a"], n["b"])),
    "less": (lambda v: v["a"] < v["b"], lambda n: n["a"] < n["b"]),
    "less_equal": (lambda v: v["a"] <= 0, lambda n: n["a"] <= 0),
    "greater": (lambda v: v["a"] > v["b"], lambda n: n["a"] > n["b"]),
    "greater_equal": (lambda v: v["i"] >= 0, lambda n: n["i"] >= 0),
    "equal": (lambda v: v["i"] == 2, lambda n: n["i"] == 2),
    "not_equal": (lambda v: v["i"] != v["i"] * 0, lambda n: n["i"] != 0),
    "int_add": (lambda v: v["i"] + 3, lambda n: n["i"] + 3),
    "int_mul": (lambda v: v["i"] * v["i"], lambda n: n["i"] * n["i"]),
    # torch's promotion: int64 with float32 is float32 (NumPy's would be float64)
    "int_plus_float": (lambda v: v["i"] + v["a"], lambda n: n["i"].astype(np.float32) + n["a"]),
    "int_times_float_scalar": (lambda v: v["i"] * 0.5, lambda n: (n["i"] * 0.5).astype(np.float32)),
    "int_div": (lambda v: v["i"] / 2, lambda n: (n["i"] / 2).astype(np.float32)),  # torch: int / int is float32
    "exp_of_int": (lambda v: sg.exp(v["i"]), lambda n: np.exp(n["i"]).astype(np.float32)),
    "f32_plus_f64": (lambda v: v["a"] + v["z"], lambda n: n["a"] + n["z"]),
    "cast_to_int": (lambda v: sg.cast(v["a"] * 3, "int64"), lambda n: (n["a"] * 3).astype(np.int64)),
    "cast_bool": (lambda v: sg.cast(v["m"], "float32"), lambda n: n["m"].astype(np.float32)),
    "sum_all": (lambda v: sg.sum(v["z"]), lambda n: np.sum(n["z"])),
    "sum_int": (lambda v: sg.sum(v["i"], axis=1), lambda n: np.sum(n["i"], axis=1)),
    "sum_bool": (lambda v: sg.sum(v["m"]), lambda n: np.sum(n["m"]).astype(np.int64)),
    "mean_neg_axis": (lambda v: sg.mean(v["z"], axis=-2, keepdims=True), lambda n: np.mean(n["z"], -2, keepdims=True)),
    "mean_int": (lambda v: sg.mean(v["i"]), lambda n: np.float32(np.mean(n["i"]))),
    "mean_symbolic": (lambda v: sg.mean(v["s"], axis=0), lambda n: n["s"].mean(0)),
    "mean_symbolic_all": (lambda v: v["s"].mean(), lambda n: n["s"].mean()),
    "max_tuple": (lambda v: sg.max(v["z"], axis=(0, 2)), lambda n: np.max(n["z"], axis=(0, 2))),
    "max_int": (lambda v: sg.max(v["i"], axis=0, keepdims=True), lambda n: np.max(n["i"], 0, keepdims=True)),
    "argmax_axis": (lambda v: sg.argmax(v["a"], axis=1), lambda n: np.argmax(n["a"], 1)),
    "argmax_axis0_keep": (lambda v: sg.argmax(v["z"], axis=0, keepdims=True), lambda n: np.argmax(n["z"], 0, keepdims=True)),
    "argmax_flat": (lambda v: sg.argmax(v["a"]), lambda n: np.argmax(n["a"])),
    "argmax_ties_first": (lambda v: sg.argmax(sg.cast(v["m"], "float32"), axis=1),
                          lambda n: np.argmax(n["m"].astype(np.float32), 1)),
    "reshape_symbolic": (lambda v: sg.reshape(v["s"], (-1,)), lambda n: n["s"].reshape(-1)),
    "reshape_symbolic2": (lambda v: sg.reshape(v["s"], (B, 2, 2)), lambda n: n["s"].reshape(-1, 2, 2)),
    "transpose": (lambda v: sg.transpose(v["z"], (2, 0, 1)), lambda n: np.transpose(n["z"], (2, 0, 1))),
    "transpose_neg_axes": (lambda v: v["z"].transpose(-1, 0, 1), lambda n: np.transpose(n["z"], (2, 0, 1))),
    "transpose_tuple": (lambda v: v["z"].transpose((1, 0, 2)), lambda n: n["z"].transpose((1, 0, 2))),
    "reshape_method_tuple": (lambda v: v["z"].reshape((4, 6)), lambda n: n["z"].reshape((4, 6))),
    "broadcast_symbolic": (lambda v: sg.broadcast_to(sg.sum(v["a"], 0), (B, 4)), None),
    "expand_dims": (lambda v: sg.expand_dims(v["t"], 0), lambda n: n["t"][None]),
    "squeeze": (lambda v: sg.squeeze(sg.sum(v["z"], axis=1, keepdims=True)), lambda n: n["z"].sum(1)),
    "matmul_symbolic": (lambda v: v["s"] @ v["a"].T, lambda n: n["s"] @ n["a"].T),
    "matmul_vec": (lambda v: sg.matmul(sg.sum(v["b"], 0), v["a"].T), lambda n: n["b"].sum(0) @ n["a"].T),
    "softmax": (lambda v: sg.softmax(v["s"]), None),
    "log_softmax": (lambda v: sg.log_softmax(v["a"], axis=0), None),
    "one_hot": (lambda v: sg.one_hot(v["t"], 4), lambda n: np.eye(4, dtype=np.float32)[n["t"]]),
    "cross_entropy": (lambda v: sg.cross_entropy(v["s"], v["t"]), None),
    "nll_loss_sum": (lambda v: sg.nll_loss(v["s"], v["t"], reduction="sum"),
                     lambda n: -n["s"][np.arange(5), n["t"]].sum()),
    "mse_loss": (lambda v: sg.mse_loss(v["a"], v["b"]), lambda n: ((n["a"] - n["b"]) ** 2).mean()),
    "constant_array": (lambda v: v["a"] + np.arange(4.0), lambda n: n["a"] + np.arange(4, dtype=np.float32)),
    "symbolic_constant": (lambda v: sg.sum(v["s"]) * 0 + sg.constant(1 / B, "float32") * 0 + sg.constant(1 / B),
                          lambda n: np.float32(1 / 5)),
    "stop_gradient": (lambda v: sg.stop_gradient(v["a"]), lambda n: n["a"]),
}


def _softmax(x, axis):
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def _fill_missing_references():
    OPS["broadcast_symbolic"] = (OPS["broadcast_symbolic"][0],
                                 lambda n: np.broadcast_to(n["a"].sum(0), (5, 4)))
    OPS["softmax"] = (OPS["softmax"][0], lambda n: _softmax(n["s"], -1))
    OPS["log_softmax"] = (OPS["log_softmax"][0], lambda n: np.log(_softmax(n["a"], 0)))
    OPS["cross_entropy"] = (OPS["cross_entropy"][0],
                            lambda n: -np.log(_softmax(n["s"], 1))[np.arange(5), n["t"]].mean())


_fill_missing_references()


@functools.lru_cache(maxsize=None)
def _compiled(backend):
    values = _inputs()
    outputs = [build(values) for build, _ in OPS.values()]
    f = sg.function(list(values.values()), outputs, backend=backend)
    return f, outputs


@functools.lru_cache(maxsize=None)
def _results(backend):
    f, outputs = _compiled(backend)
    arrays = _arrays()
    return dict(zip(OPS, f(*arrays.values()))), dict(zip(OPS, outputs)), arrays


@pytest.mark.parametrize("name", list(OPS))
def test_op_matches_numpy(backend, name):
    results, nodes, arrays = _results(backend)
    got, node = results[name], nodes[name]
    want = np.asarray(OPS[name][1](arrays))
    # The declared dtype is what comes back, and it is NumPy's (or torch's) choice.
    assert got.dtype == np.dtype(node.dtype), f"{name}: returned {got.dtype}, node says {node.dtype}"
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype}, numpy gives {want.dtype}"
    assert got.shape == want.shape, f"{name}: shape {got.shape}, numpy gives {want.shape}"
    if got.dtype.kind in "biu":
        np.testing.assert_array_equal(got, want, err_msg=name)
    else:
        rtol, atol = float32_tolerance(backend, 1e-6, 1e-6) if got.dtype == np.float32 else (1e-12, 1e-12)
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=name)


def test_symbolic_shapes_are_tracked():
    v = _inputs()
    assert (v["s"] @ v["a"].T).shape == (B, 3)
    assert sg.reshape(v["s"], (-1,)).shape == (4 * B,)
    assert sg.reshape(v["s"], (2, -1)).shape == (2, 2 * B)
    assert sg.mean(v["s"], axis=0).shape == (4,)
    assert sg.sum(v["s"], axis=0, keepdims=True).shape == (1, 4)
    assert (v["s"] + sg.sum(v["a"], 0)).shape == (B, 4)


def test_python_scalars_are_weakly_typed():
    a = sg.input("a32", (3,))
    i = sg.input("i64", (3,), dtype="int64")
    assert (a * 2).dtype == "float32" and (2.5 * a).dtype == "float32" and (a ** 2).dtype == "float32"
    assert (2 / a).dtype == "float32" and (1 + a).dtype == "float32" and (1 - a).dtype == "float32"
    assert (i + 1).dtype == "int64" and (i * 0.5).dtype == "float32" and (i / 2).dtype == "float32"
    assert (a > 0).dtype == "bool" and (a == i).dtype == "bool"
    m = sg.input("mask", (3,), dtype="bool")
    assert (m + 1).dtype == "int64" and (m * 1.5).dtype == "float32"
    assert sg.sum(i).dtype == "int64" and sg.mean(i).dtype == "float32" and sg.argmax(a).dtype == "int64"


def test_values_are_immutable_and_hashable():
    a = sg.input("imm", (3,))
    with pytest.raises(AttributeError):
        a.shape = (4,)
    with pytest.raises(TypeError):
        a.attrs["name"] = "other"
    assert {a: 1}[a] == 1
    assert len(a) == 3 and a.ndim == 1 and a.name == "imm"
    assert "f32[3]" in repr(a)


def test_dims_bind_at_call_time(backend):
    """One compiled function serves every batch size."""
    f, _ = _compiled(backend)
    arrays = _arrays()
    rng = np.random.default_rng(0)
    for size in (1, 7):
        arrays["s"] = rng.standard_normal((size, 4)).astype(np.float32)
        arrays["t"] = rng.integers(0, 4, size).astype(np.int64)
        results = dict(zip(OPS, f(*arrays.values())))
        rtol, atol = float32_tolerance(backend, 1e-6, 1e-7)
        np.testing.assert_allclose(results["mean_symbolic"], arrays["s"].mean(0), rtol=rtol, atol=atol)
        np.testing.assert_allclose(results["symbolic_constant"], 1 / size, rtol=rtol)
        assert results["reshape_symbolic"].shape == (4 * size,)


def test_gradients_come_back_in_each_input_dtype():
    """float32 beside float64 computes in float64; the float32 input's gradient is float32 again."""
    a = sg.input("a_mixed", (3, 4))
    z = sg.input("z_mixed", (2, 3, 4), dtype="float64")
    ga, gz = sg.grad(sg.sum(sg.exp(a + z)), [a, z])
    assert (ga.dtype, ga.shape) == ("float32", (3, 4)) and (gz.dtype, gz.shape) == ("float64", (2, 3, 4))
    rng = np.random.default_rng(1)
    av, zv = rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal((2, 3, 4))
    got_a, got_z = sg.function([a, z], [ga, gz], backend="numpy")(av, zv)
    np.testing.assert_allclose(got_z, np.exp(av + zv), rtol=1e-12)
    np.testing.assert_allclose(got_a, np.exp(av + zv).sum(0).astype(np.float32), rtol=1e-6)
    assert got_a.dtype == np.float32
