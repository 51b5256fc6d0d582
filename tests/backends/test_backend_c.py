"""The C backend against the NumPy reference: every op kind, one compiled module per graph.

Each module-scoped fixture compiles one graph holding many cases, so the
file pays for a handful of C builds; every case is then checked at two
batch sizes on that one module (a symbolic Dim is a runtime argument).
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import sympy

import symgrad as sg
from symgrad.api.cells import current_value
from symgrad.backends import c as cbackend
from symgrad.backends.render.c_printer import CPrintError, KernelPrinter
from symgrad.backends.lower.lowering import LoopKernel, MatmulKernel, lower
from symgrad.backends.numpy_backend import evaluate
from symgrad.ir.graph import Graph

TOL = {"float32": dict(rtol=1e-5, atol=1e-6), "float64": dict(rtol=1e-10, atol=1e-12)}


def assert_matches(got, ref, dtype, what=""):
    """Compiled vs reference: same shape and dtype, values within the dtype's tolerance."""
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    assert got.dtype == ref.dtype, f"{what}: dtype {got.dtype} != {ref.dtype}"
    if got.dtype.kind in "biu":
        np.testing.assert_array_equal(got, ref, err_msg=what)
    else:
        tol = TOL[dtype]
        scale = max(1.0, float(np.max(np.abs(ref), initial=0.0)))
        np.testing.assert_allclose(got, ref, rtol=tol["rtol"], atol=tol["atol"] * scale, err_msg=what)


class Square(sg.Function):
    """A custom op: x*x with a hand-written backward."""

    @staticmethod
    def forward(ctx, v):
        ctx.save_for_backward(v)
        return v * v

    @staticmethod
    def backward(ctx, g):
        (v,) = ctx.saved_tensors
        return 2 * v * g


def build_cases(dtype: str) -> tuple[list, dict]:
    """The graph inputs and {case name: output value} of the suite, for one float dtype."""
    B = sg.Dim("B")
    x = sg.input("x", (B, 3, 4), dtype)      # any sign
    p = sg.input("p", (B, 3, 4), dtype)      # positive
    r = sg.input("r", (3, 1), dtype)
    m = sg.input("m", (13, 37), dtype)
    n = sg.input("n", (37, 19), dtype)
    ba = sg.input("big_a", (130, 300), dtype)
    bb = sg.input("big_b", (300, 70), dtype)
    lab = sg.input("lab", (B,), "int64")
    flag = sg.input("flag", (B, 3, 4), "bool")
    i32 = sg.input("i32", (B, 3, 4), "int32")
    W = sg.param("W", (4, 5), init=np.arange(20.0).reshape(4, 5) / 10 - 1, dtype=dtype)
    table = np.array([[1.5, -2.0, 0.25, 3.0]] * 3) * np.arange(1, 4)[:, None]
    cases = {
        # elementwise, every unary and binary op, fused chains, scalars on both sides
        "exp": sg.exp(x), "log": sg.log(p), "sin": sg.sin(x), "cos": sg.cos(x), "tanh": sg.tanh(x),
        "sigmoid": sg.sigmoid(x), "sqrt": sg.sqrt(p), "abs": abs(x), "relu": sg.relu(x), "neg": -x,
        "add": x + p, "sub": x - p, "mul": x * p, "div": x / p, "pow": p ** x, "square": x ** 2,
        "rsqrt": p ** -0.5, "maximum": sg.maximum(x, p - 1), "minimum": sg.minimum(x, p - 1),
        "scalars": 2.5 - x * 3 + 1 / p, "chain": sg.tanh(sg.exp(x) * 0.5 + sg.sigmoid(p)) - x,
        "less": x < p - 1, "less_equal": x <= 0, "greater": x > 0, "greater_equal": x >= p,
        "equal": sg.equal(lab, 2), "not_equal": sg.not_equal(x, x),
        "where": sg.where(flag, x, p), "where_scalar": sg.where(x > 0, x, 0.1 * x),
        "cast_int": sg.cast(x * 3, "int32"), "cast_bool": sg.cast(x, "bool"),
        "cast_from_bool": sg.cast(flag, dtype) * x, "cast_from_int": sg.cast(i32, dtype) / 3,
        "int_arith": i32 * 3 - i32, "int_pow": i32 ** 2, "int_div": i32 / 2,
        "stop_gradient": sg.stop_gradient(x) + 1,
        "vjp_op": sg.grad(sg.sum(sg.sigmoid(x) * p), x),
        # broadcasting
        "bcast_row": x + r, "bcast_col": x * sg.reshape(lab, (-1, 1, 1)).astype(dtype),
        "bcast_scalar_input": sg.sum(x) * x,
        # reductions over each axis, several, all, keepdims
        **{f"sum_{a}": sg.sum(x, axis=a) for a in (0, 1, 2)},
        **{f"max_{a}": sg.max(x, axis=a, keepdims=True) for a in (0, 1, 2)},
        **{f"argmax_{a}": sg.argmax(x, axis=a) for a in (0, 1, 2)},
        "sum_02": sg.sum(x, axis=(0, 2)), "sum_all": sg.sum(x), "mean_all": sg.mean(x),
        "max_all": sg.max(x), "sum_int": sg.sum(i32, axis=1), "argmax_flat": sg.argmax(x),
        "sum_of_transpose": sg.sum(sg.transpose(x, (2, 0, 1)), axis=1),
        # movement: aliases, strided views, copies where a reshape needs one
        "reshape": sg.reshape(x, (-1, 6)), "transpose": sg.transpose(x, (2, 0, 1)),
        "reshape_of_transpose": sg.reshape(sg.transpose(x, (0, 2, 1)), (-1, 12)),
        "expand": sg.broadcast_to(r, (2, 3, 4)), "expand_dims": sg.expand_dims(x, 1) * 2,
        # matmul: small odd sizes, transposed operands, blocks and threads
        "matmul": m @ n, "matmul_ta": sg.transpose(sg.transpose(m)) @ n,
        "matmul_tb": m @ sg.transpose(sg.transpose(n) * 1),
        "matmul_tt": sg.transpose(n) @ sg.transpose(m),
        "matmul_big": ba @ bb, "matmul_big_t": sg.transpose(bb) @ sg.transpose(ba),
        "matmul_param": sg.reshape(x, (-1, 4)) @ W, "matvec": m @ sg.sum(n, axis=1),
        # sources
        "const_array": x * sg.constant(table, dtype), "iota_onehot": sg.one_hot(lab, 5, dtype),
        "const_dims": sg.constant(1 / sympy.sympify(B), dtype) * sg.sum(x, axis=(1, 2)),
        "variable": W, "input_out": x,
        "custom": Square.apply(x) + 1, "custom_grad": sg.grad(sg.sum(Square.apply(x) * p), x),
        # composites
        "softmax": sg.softmax(x, axis=-1), "log_softmax": sg.log_softmax(sg.reshape(x, (-1, 4)), axis=0),
        "cross_entropy": sg.cross_entropy(sg.sum(x, axis=1), lab),
    }
    return [x, p, r, m, n, ba, bb, lab, flag, i32], cases


CASE_NAMES = list(build_cases("float64")[1])


class Suite:
    """One graph with many named outputs, compiled once; runs cases against the NumPy reference."""

    def __init__(self, dtype: str):
        self.dtype = dtype
        inputs, cases = build_cases(dtype)
        self.names = list(cases)
        self.fn = sg.function(inputs, list(cases.values()), backend="c")
        self.ref = sg.function(inputs, list(cases.values()), backend="numpy")
        self.results: dict[int, tuple] = {}

    def arrays(self, batch: int) -> list:
        rng = np.random.default_rng(batch)
        f = np.dtype(self.dtype)
        x = rng.standard_normal((batch, 3, 4)).astype(f)
        x[0, 0, :2] = x[0, 0, 2:]  # ties for max / argmax
        return [x, rng.uniform(0.5, 2.0, (batch, 3, 4)).astype(f), rng.standard_normal((3, 1)).astype(f),
                rng.standard_normal((13, 37)).astype(f), rng.standard_normal((37, 19)).astype(f),
                rng.standard_normal((130, 300)).astype(f), rng.standard_normal((300, 70)).astype(f),
                rng.integers(0, 4, batch).astype(np.int64), rng.random((batch, 3, 4)) < 0.5,
                rng.integers(-5, 6, (batch, 3, 4)).astype(np.int32)]

    def outputs(self, batch: int):
        if batch not in self.results:
            arrays = self.arrays(batch)
            self.results[batch] = (self.fn(*arrays), self.ref(*arrays))
        return self.results[batch]


@pytest.fixture(scope="module", params=["float32", "float64"])
def suite(request) -> Suite:
    return Suite(request.param)


@pytest.mark.parametrize("batch", [1, 5, 70])
@pytest.mark.parametrize("name", CASE_NAMES)
def test_case_matches_numpy(suite, name, batch):
    """Each case at several batch sizes, all on one compiled module, against the reference."""
    assert suite.names == CASE_NAMES
    got, ref = suite.outputs(batch)
    k = suite.names.index(name)
    assert_matches(got[k], ref[k], suite.dtype, f"{name} (B={batch}, {suite.dtype})")


def test_one_module_serves_every_batch_size(suite):
    module = suite.fn.module
    for batch in (5, 70):
        suite.outputs(batch)
    assert suite.fn.module is module
    assert suite.fn.module_name.startswith("_symgrad_")
    assert suite.fn.source_path.read_text() == suite.fn.source


def test_float_printing_matches_dtype(suite):
    """float32 graphs call float32 math (expf) and never the double function; float64 the reverse."""
    src = re.sub(r"/\*.*?\*/", "", suite.fn.source, flags=re.S)  # code only: comments quote the IR
    if suite.dtype == "float32":
        assert "expf(" in src and "tanhf(" in src
        assert not re.search(r"\bexp\(", src) and not re.search(r"\btanh\(", src)
    else:
        assert re.search(r"\bexp\(", src) and "expf(" not in src


def test_kernels_are_named_and_commented(suite):
    src = suite.fn.source
    assert re.search(r"SG_KERNEL void k\d+_matmul_t\d+\(", src)
    assert re.search(r"/\* t\d+: f(32|64)\[13,19\] = matmul\(m, n\) \*/", src)
    assert "#pragma omp parallel for if(" in src
    assert src.startswith("/*\n * Generated by symgrad")


# ---- lowering: views instead of copies -------------------------------------------

def test_transposed_matmul_operands_are_not_copied():
    a = sg.input("a", (8, 5), "float32")
    b = sg.input("b", (6, 8), "float32")
    plan = lower(Graph([a, b], [sg.transpose(a) @ sg.transpose(b)]))
    assert [type(k) for k in plan.kernels] == [MatmulKernel]
    (k,) = plan.kernels
    assert k.a.strides == (1, 5) and k.b.strides == (1, 8)


def test_elementwise_chain_fuses_into_one_loop():
    x = sg.input("x", (4, 5), "float32")
    plan = lower(Graph([x], [sg.tanh(sg.exp(x) * 2 + 1)]))
    assert len(plan.kernels) == 1 and isinstance(plan.kernels[0], LoopKernel)
    assert [s.node.op.name for s in plan.kernels[0].statements] == ["exp", "mul", "add", "tanh"]
    assert plan.kernels[0].shape == (20,)  # contiguous axes collapse into one loop


def test_reshape_of_contiguous_value_is_an_alias():
    x = sg.input("x", (4, 6), "float32")
    plan = lower(Graph([x], [sg.exp(sg.reshape(sg.transpose(sg.reshape(x, (2, 12))), (3, 8)))]))
    # transpose then reshape needs one copy; the first reshape and the exp read through views
    assert len(plan.kernels) == 2


def test_output_reshape_of_a_temporary_is_written_in_place():
    x = sg.input("x", (4, 6), "float32")
    plan = lower(Graph([x], [sg.reshape(sg.sum(x, axis=1, keepdims=True), (4,)), sg.transpose(sg.exp(x))]))
    # the sum writes output 0 directly; output 1 is a transpose, which needs its copy
    assert [type(k).__name__ for k in plan.kernels] == ["ReduceKernel", "LoopKernel", "LoopKernel"]
    assert plan.kernels[0].out is plan.outputs[0]
    assert plan.kernels[2].out is plan.outputs[1] and not plan.workspace[1:]


def test_sgd_update_writes_the_parameter_directly():
    """p - lr * g reads p only at the element it writes: no temporary, no copy back."""
    x = sg.input("x", (5, 3))
    w = sg.param("w", (3, 2), init="normal")
    step_graph = sg.train_step(sg.sum(x @ w), [w], sg.optim.SGD(lr=0.1), backend="numpy").graph
    plan = lower(step_graph)
    last = plan.kernels[-1]
    assert isinstance(last, LoopKernel) and last.out is plan.variables[0]
    assert not any("update" in line for k in plan.kernels for line in k.lines)  # no copy back


# ---- training: updates in place, reads before writes ---------------------------------

def _mlp(dtype: str):
    B = sg.Dim("B")
    x = sg.input("x", (B, 6), dtype)
    y = sg.input("y", (B,), "int64")
    rng = np.random.default_rng(7)
    W1 = sg.param("W1", (6, 8), init=rng.standard_normal((6, 8)) * 0.5, dtype=dtype)
    b1 = sg.param("b1", (8,), init=rng.standard_normal(8) * 0.1, dtype=dtype)
    W2 = sg.param("W2", (8, 3), init=rng.standard_normal((8, 3)) * 0.5, dtype=dtype)
    loss = sg.cross_entropy(sg.relu(x @ W1 + b1) @ W2, y)
    return loss, [W1, b1, W2]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_train_step_sgd_matches_numpy(dtype):
    # One model per backend: two steps of one model would train the same parameters (the model's).
    built = {b: _mlp(dtype) for b in ("c", "numpy")}
    steps = [sg.train_step(*built[b], sg.optim.SGD(lr=0.3, momentum=0.9), backend=b) for b in ("c", "numpy")]
    params = built["c"][1]
    initial = current_value(params[0])
    rng = np.random.default_rng(3)
    for batch in (16, 16, 5, 16):  # the last partial batch on the same module
        xb = rng.standard_normal((batch, 6)).astype(dtype)
        yb = rng.integers(0, 3, batch)
        losses = [s(x=xb, y=yb) for s in steps]
        np.testing.assert_allclose(losses[0], losses[1], **TOL[dtype])
    for name in ("W1", "b1", "W2"):
        np.testing.assert_allclose(steps[0].params[name], steps[1].params[name], **TOL[dtype])
    np.testing.assert_allclose(steps[0].state["W1.momentum_buffer"], steps[1].state["W1.momentum_buffer"],
                               **TOL[dtype])
    assert not np.allclose(steps[0].params["W1"], initial)


def test_updates_read_before_writing():
    """Swapping two variables through updates needs every read before any write."""
    a = sg.param("a", (3,), init=np.array([1.0, 2.0, 3.0]))
    b = sg.param("b", (3,), init=np.array([10.0, 20.0, 30.0]))
    z = sg.input("z", (3,))
    graph = Graph([z], [a + b + z, a], [(a, b), (b, a * 2), ])
    program = cbackend.compile(graph)
    variables = {"a": np.array([1.0, 2.0, 3.0], np.float32), "b": np.array([10.0, 20.0, 30.0], np.float32)}
    ref_vars = {k: v.copy() for k, v in variables.items()}
    zb = np.ones(3, np.float32)
    outs = program.run([zb], {}, variables)
    ref_outs, ref_updates = evaluate(graph, [zb], ref_vars, {})
    for got, ref in zip(outs, ref_outs):
        np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(variables["a"], [10.0, 20.0, 30.0])
    np.testing.assert_array_equal(variables["b"], [2.0, 4.0, 6.0])


def test_hostile_names_stay_in_comments():
    name = 'a"b{c}*/ system("rm -rf /")'
    x = sg.input('x*/ #include <evil>\n', (2, 3))
    w, w_ref = (sg.param(name, (3, 2), init=np.arange(6.0).reshape(3, 2)) for _ in range(2))  # one each to train
    step = sg.train_step(sg.sum((x @ w) ** 2), [w], sg.optim.SGD(lr=0.01), backend="c")
    ref = sg.train_step(sg.sum((x @ w_ref) ** 2), [w_ref], sg.optim.SGD(lr=0.01), backend="numpy")
    xb = np.arange(6.0, dtype=np.float32).reshape(2, 3) / 6
    assert step(**{x.name: xb}) == pytest.approx(ref(**{x.name: xb}), rel=1e-6)
    np.testing.assert_allclose(step.params[name], ref.params[name], rtol=1e-6)
    src = step.source
    assert name not in src  # only the escaped form, inside comments
    # every comment closes where it should: stripping comments leaves no user text
    code = re.sub(r"/\*.*?\*/", "", src, flags=re.S)
    assert "rm -rf" not in code and "evil" not in code


def test_bad_arrays_are_refused_before_native_code():
    x = sg.input("x", (4,))
    program = cbackend.compile(Graph([x], [sg.exp(x)]))
    with pytest.raises(ValueError):
        program.run([np.ones(5, np.float32)], {}, {})
    with pytest.raises(ValueError):
        program.run([np.ones(4, np.float64)], {}, {})
    with pytest.raises(ValueError):
        program.run([np.ones(8, np.float32)[::2]], {}, {})


# ---- the printer ------------------------------------------------------------------------

def test_printer_prints_float32_math_and_refuses_the_unknown():
    x, y = sympy.symbols("x y", real=True)
    p = KernelPrinter("float32")
    assert p.doprint(sympy.exp(x) + 1) == "expf(x) + 1.0f"
    # Comparisons, not fmaxf (which drops a NaN): a NaN operand gives NaN, as in NumPy and torch.
    assert p.doprint(sympy.Max(x, y)) == "(((x) > (y) || (x) != (x)) ? (x) : (y))"
    assert "?" in p.doprint(sympy.Piecewise((x, x > 0), (0, True)))
    assert "\n" not in p.doprint(sympy.Heaviside(x))
    assert KernelPrinter("float64").doprint(sympy.exp(x) / 3) == "(1.0/3.0)*exp(x)"
    with pytest.raises(CPrintError):
        p.doprint(sympy.Function("mystery")(x))
    with pytest.raises(CPrintError):
        KernelPrinter("int64").doprint(sympy.exp(x))


def test_abs_of_integers_compiles_and_matches_torch():
    """|x| of int64 and int32 on C, as torch.abs. The printer's own integer Abs (a comparison) was
    shadowed by the refusal installed for C99's math functions (fabs): C refused to compile it (the
    fuzzer found it)."""
    import torch
    assert KernelPrinter("int64").doprint(sympy.Abs(sympy.Symbol("x", real=True))) == "((x) < 0 ? -(x) : (x))"
    a, b = np.array([-3, 0, 5, -(2 ** 40)]), np.array([-7, 0, 7, 1], dtype=np.int32)
    x, y = sg.input("x", a.shape, dtype="int64"), sg.input("y", b.shape, dtype="int32")
    got = sg.function([x, y], [sg.abs(x), sg.abs(y) * 2], backend="c")(a, b)
    for g, w in zip(got, [torch.abs(torch.tensor(a)), torch.abs(torch.tensor(b)) * 2]):
        assert g.dtype == w.numpy().dtype
        np.testing.assert_array_equal(g, w.numpy())


def test_a_products_irrational_constants_print_as_one_literal():
    """sqrt(2/pi) (x + ...) -- GELU's -- multiplies by one literal, not by sqrtf(2) and then divides
    by sqrtf(pi) (a division the compiler must keep); a rational factor alone stays a fraction."""
    x, y = sympy.symbols("x y", real=True)
    gelu_scale = sympy.sqrt(2 / sympy.pi) * (x + y)
    assert KernelPrinter("float32").doprint(gelu_scale) == "0.7978846f*(x + y)"
    assert KernelPrinter("float64").doprint(-x / sympy.sqrt(sympy.pi)) == f"({-1 / math.sqrt(math.pi)!r})*x"
    assert KernelPrinter("float64").doprint(sympy.pi * sympy.E) == repr(float(sympy.N(sympy.pi * sympy.E, 40)))  # rounded once
    assert KernelPrinter("float32").doprint(x / 2) == "(1.0f/2.0f)*x"


def test_comment_escaping():
    text = cbackend.comment('a */ b /* c\nd ??/')
    assert "*/" not in text and "/*" not in text and "\n" not in text and "??" not in text


def test_edge_cases_match_numpy():
    """Size-1 reductions, reductions of broadcast literals, indices through movement ops,
    duplicated outputs, outputs that are leaves, and updates from literals and inputs: one module."""
    B = sg.Dim("B")
    x = sg.input("x", (B, 1, 3), "float64")
    k = sg.input("k", (2 * B,), "int64")
    v = sg.param("v", (3,), init=np.array([1.0, -2.0, 3.0]), dtype="float64")
    flag = sg.param("flag", (), init=np.array(0.0), dtype="float64")
    iota = sg.one_hot(sg.reshape(k, (B, 2)), 4, "float64")        # iota inside a reshape
    cases = [sg.argmax(x, axis=1), sg.max(x, axis=1), sg.sum(sg.broadcast_to(sg.constant(2.5, "float64"), (B, 3))),
             sg.transpose(iota, (2, 0, 1)) * 1.0, sg.reshape(sg.transpose(iota, (1, 0, 2)), (2, -1)) + 0.0,
             sg.sum(iota, axis=(0, 2)), v, v, x, sg.sum(x) * sg.sum(v)]
    graph = Graph([x, k], cases, [(v, sg.broadcast_to(sg.constant(7.0, "float64"), (3,))),
                                  (flag, sg.sum(x))])
    program = cbackend.compile(graph)
    for batch in (1, 4):
        rng = np.random.default_rng(batch)
        arrays = [rng.standard_normal((batch, 1, 3)), rng.integers(0, 4, 2 * batch).astype(np.int64)]
        variables = {"v": np.array([1.0, -2.0, 3.0]), "flag": np.array(0.0)}
        ref_outs, ref_updates = evaluate(graph, arrays, {n: a.copy() for n, a in variables.items()}, {B: batch})
        outs = program.run(arrays, {B: batch}, variables)
        for i, (got, ref) in enumerate(zip(outs, ref_outs)):
            assert_matches(got, ref, "float64", f"case {i} (B={batch})")
        np.testing.assert_array_equal(variables["v"], ref_updates[0])
        np.testing.assert_allclose(variables["flag"], ref_updates[1], rtol=1e-12)


def test_nan_follows_numpy():
    """NaN: x != x holds, max and argmax propagate it, comparisons against it are false."""
    x = sg.input("x", (2, 3))
    graph = Graph([x], [sg.not_equal(x, x), sg.max(x, axis=1), sg.argmax(x, axis=1), x < 1, sg.sum(x, axis=0)])
    program = cbackend.compile(graph)
    xb = np.array([[1.0, np.nan, 3.0], [-np.inf, 2.0, np.inf]], np.float32)
    ref, _ = evaluate(graph, [xb], {}, {})
    with np.errstate(invalid="ignore"):
        for got, want in zip(program.run([xb], {}, {}), ref):
            np.testing.assert_array_equal(got, want)


def test_an_output_array_is_written_again_only_when_nobody_kept_it():
    """A call's output array that the caller dropped (a step's loss, read as a float) is reused by
    the next call instead of allocated; one still referred to, as a result tuple, a name or a
    view's base, is never written again."""
    x = sg.input("x", (3,))
    f = sg.function([x], [x * 2, x + 1], backend="c")
    one, two = np.ones(3, np.float32), np.full(3, 2, np.float32)
    kept = f(one)
    doubled, _ = f(two)
    view = f(one)[1][1:]
    f(two)
    np.testing.assert_array_equal(kept[0], [2, 2, 2])
    np.testing.assert_array_equal(kept[1], [2, 2, 2])
    np.testing.assert_array_equal(doubled, [4, 4, 4])
    np.testing.assert_array_equal(view, [2, 2])
    assert kept[0] is not doubled
    first = id(f(one)[0])
    assert id(f(two)[0]) == first  # dropped at once: the same array again


def test_column_sums_of_every_width_match_numpy():
    """A sum over the rows into contiguous columns (a bias gradient) is split into tiles of columns,
    at least one per thread: widths below, at and past a tile (16 columns, the 256-column tile) and
    ragged ones each sum every column once, in float64 accumulators (so to NumPy's float64 sum
    within float32's rounding)."""
    widths = (1, 15, 16, 17, 100, 128, 300, 513)
    xs = [sg.input(f"x{n}", (300, n)) for n in widths]
    run = sg.function(xs, [sg.sum(x, axis=0) for x in xs], backend="c")
    rng = np.random.default_rng(5)
    values = [rng.standard_normal((300, n)).astype(np.float32) for n in widths]
    assert "const int64_t width = share >=" in run.source
    for got, value in zip(run(*values), values):
        np.testing.assert_allclose(got, value.astype(np.float64).sum(axis=0).astype(np.float32), rtol=1e-6, atol=1e-6)
