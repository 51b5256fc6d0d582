"""Numbers that used to differ from PyTorch (issue 15, items 6-11), checked against torch.

Each test compiles what it needs once per backend (module-scoped caches) and compares
values and gradients with torch 2.13 CPU; NaN and inf must agree exactly in place.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import sympy
import torch
import torch.nn.functional as TF

import symgrad as sg


NAN, INF = float("nan"), float("inf")


def assert_like_torch(got, want, rtol=1e-5, atol=1e-6, what=""):
    """Same shape, same NaN and inf positions, finite values close."""
    want = want.detach().numpy() if isinstance(want, torch.Tensor) else np.asarray(want)
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), want.astype(np.float64),
                               rtol=rtol, atol=atol, equal_nan=True, err_msg=what)


@pytest.fixture(scope="module")
def compiled():
    """Build each (name, backend) program once for the module: a C build costs about a second."""
    cache: dict = {}

    def get(name, backend, build):
        key = (name, backend)
        if key not in cache:
            cache[key] = build(backend)
        return cache[key]
    return get


# ---- 6: labels outside [0, C) are refused, as torch refuses them -------------------------

CLASSES = 4
BAD_LABELS = (CLASSES, 1 << 40, -1)


def _classifier_step(backend):
    x = sg.input("x", (sg.Dim("B"), 3))
    y = sg.input("y", (sg.Dim("B"),), dtype="int64")
    W = sg.param("W", (3, CLASSES), init=np.arange(12, dtype=np.float32).reshape(3, CLASSES) / 10)
    logits = x @ W
    step = sg.train_step(sg.cross_entropy(logits, y), [W], sg.optim.SGD(lr=0.5), backend=backend)
    nll = sg.function([x, y], sg.nll_loss(sg.log_softmax(logits, axis=1), y, reduction="sum"), backend=backend)
    return step, nll


@pytest.mark.parametrize("bad", BAD_LABELS)
def test_cross_entropy_refuses_labels_outside_classes(compiled, backend, bad):
    step, nll = compiled("classifier", backend, _classifier_step)
    x = np.ones((3, 3), np.float32)
    y = np.array([0, bad, 1], np.int64)
    with pytest.raises(IndexError, match="out of bounds"):  # torch refuses the same labels
        TF.cross_entropy(torch.ones(3, CLASSES), torch.from_numpy(y))
    before = step.params["W"]
    for call in (lambda: step(x=x, y=y), lambda: step.accumulate(x=x, y=y)):
        with pytest.raises(ValueError, match=rf"cross_entropy: target \(input 'y'\) holds {bad} at index \[1\], "
                                             rf"outside \[0, {CLASSES}\)"):
            call()
    with pytest.raises(ValueError, match=rf"nll_loss: target \(input 'y'\) holds {bad}"):
        nll(x, y)
    step.apply()  # nothing was accumulated: the refused accumulate added nothing
    np.testing.assert_array_equal(step.params["W"], before)
    np.testing.assert_array_equal(step.state["W.grad"], np.zeros_like(before))
    # The same step still trains on good labels, as torch does.
    good = np.array([0, 3, 1], np.int64)
    W = torch.tensor(before, requires_grad=True)
    TF.cross_entropy(torch.from_numpy(x) @ W, torch.from_numpy(good)).backward()
    assert_like_torch(step(x=x, y=good),
                      TF.cross_entropy(torch.from_numpy(x) @ torch.from_numpy(before), torch.from_numpy(good)))
    assert_like_torch(step.params["W"], W.detach() - 0.5 * W.grad)
    step.params["W"] = before


def test_compiled_c_checks_its_labels_in_the_entry_not_in_python(compiled):
    """C refuses bad labels itself (a status before any kernel runs, a few ns a label), so a call
    pays no Python check; the refusal names the label as the Python check does (above)."""
    pytest.importorskip("cffi")
    step, nll = compiled("classifier", "c", _classifier_step)
    assert step._label_checks == [] and nll._label_checks == []
    entry = step.source[step.source.rindex("int symgrad_run("):]
    # (the ignore_index, -100 by default as torch's, is the one label outside [0, 4) let through)
    check = "if ((uint64_t)(int64_t)in1[i] >= (uint64_t)(4) && (int64_t)in1[i] != (int64_t)(-100LL))"
    assert check in entry and entry.index(check) < entry.index("k0_")
    with pytest.raises(ValueError, match=r"cross_entropy: target \(input 'y'\) holds -1 at index \[2\]"):
        step(x=np.ones((3, 3), np.float32), y=np.array([0, 1, -1]))


def test_labels_computed_in_the_graph_are_checked_by_the_reference():
    x = sg.input("x", (2, 3))
    y = sg.input("y", (2,), dtype="int64")
    f = sg.function([x, y], sg.cross_entropy(x, y + 1), backend="numpy")
    assert np.isfinite(f(np.zeros((2, 3), np.float32), np.array([0, 1])))
    with pytest.raises(ValueError, match=r"cross_entropy: target \(computed in the graph\) holds 3 at index \[1\]"):
        f(np.zeros((2, 3), np.float32), np.array([0, 2]))


def test_one_hot_refuses_labels_outside_classes(compiled, backend):
    def build(be):
        y = sg.input("y", (3,), dtype="int64")
        return sg.function([y], sg.one_hot(y, 5), backend=be)
    f = compiled("one_hot", backend, build)
    np.testing.assert_array_equal(f(np.array([0, 4, 2])), TF.one_hot(torch.tensor([0, 4, 2]), 5).numpy())
    with pytest.raises(ValueError, match=r"one_hot: labels \(input 'y'\) holds 5 at index \[1\]"):
        f(np.array([0, 5, 2]))


# ---- 7: a masked class (logit -inf) is no NaN --------------------------------------------

MASKED_LOGITS = np.array([[0, -INF, 1], [2, 0, -INF], [-INF, 3, 0.5]], np.float32)
MASKED_TARGET = np.array([0, 1, 2], np.int64)


def _masked_loss(backend):
    x = sg.input("x", (3, 3))
    y = sg.input("y", (3,), dtype="int64")
    loss = sg.cross_entropy(x, y)
    per_row = sg.cross_entropy(x, y, reduction="none")
    return sg.function([x, y], [loss, per_row, sg.grad(loss, [x])[0]], backend=backend)


def test_cross_entropy_with_masked_class_matches_torch(compiled, backend):
    f = compiled("masked", backend, _masked_loss)
    loss, per_row, grad = f(MASKED_LOGITS, MASKED_TARGET)
    x = torch.tensor(MASKED_LOGITS, requires_grad=True)
    want = TF.cross_entropy(x, torch.from_numpy(MASKED_TARGET))
    want.backward()
    assert_like_torch(loss, want)
    assert_like_torch(per_row, TF.cross_entropy(x, torch.from_numpy(MASKED_TARGET), reduction="none"))
    assert_like_torch(grad, x.grad)
    one = f(np.array([[0, -INF, 1]] * 3, np.float32), np.zeros(3, np.int64))[0]
    assert one == pytest.approx(1.3132616, rel=1e-6)  # torch's value for logits [0, -inf, 1], target 0


# ---- 8: maximum, minimum and relu propagate NaN -----------------------------------------

NAN_A = np.array([NAN, 1, 2, NAN, -1, 0], np.float32)
NAN_B = np.array([0, NAN, 2, NAN, 3, -0.5], np.float32)


def _nan_ops(backend):
    a, b = sg.input("a", (6,)), sg.input("b", (6,))
    outs = [sg.maximum(a, b), sg.minimum(a, b), sg.relu(a)]
    weights = sg.constant(np.arange(1, 7, dtype=np.float32))
    grads = [g for o, wrt in zip(outs, [(a, b), (a, b), (a,)]) for g in sg.grad(sg.sum(o * weights), list(wrt))]
    return sg.function([a, b], outs + grads, backend=backend)


def test_maximum_minimum_relu_propagate_nan_as_torch(compiled, backend):
    got = compiled("nan_ops", backend, _nan_ops)(NAN_A, NAN_B)
    want = []
    a, b = (torch.tensor(v, requires_grad=True) for v in (NAN_A, NAN_B))
    weights = torch.arange(1, 7, dtype=torch.float32)
    outs = [torch.maximum(a, b), torch.minimum(a, b), torch.relu(a)]
    want += outs
    for o, wrt in zip(outs, [(a, b), (a, b), (a,)]):
        want += torch.autograd.grad((o * weights).sum(), wrt)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert_like_torch(g, w)


# ---- 9: pow's gradients at 0; integer ** negative integer refused ------------------------

POW_X = np.array([0, 0, 0, 0, -1, -2, 2, 3, 0], np.float32)
POW_Y = np.array([0, 0.3, 2, -1, 0.5, 2, -0.5, 0, 1], np.float32)


def _pow(backend):
    x, y = sg.input("x", (9,)), sg.input("y", (9,))
    z = x ** y
    square = x ** 2  # a constant exponent: its derivative folds to 2*x
    return sg.function([x, y], [z, *sg.grad(sg.sum(z), [x, y]), sg.grad(sg.sum(square), [x])[0]],
                       backend=backend)


def test_pow_gradients_match_torch_at_zero(compiled, backend):
    z, dx, dy, dsquare = compiled("pow", backend, _pow)(POW_X, POW_Y)
    x, y = torch.tensor(POW_X, requires_grad=True), torch.tensor(POW_Y, requires_grad=True)
    want = x ** y
    want_dx, want_dy = torch.autograd.grad(want.sum(), [x, y])
    assert_like_torch(z, want)
    assert_like_torch(dx, want_dx)
    assert_like_torch(dy, want_dy)
    assert_like_torch(dx[:3], [0, INF, 0])  # the example, spelled out
    assert_like_torch(dy[:3], [0, 0, 0])
    assert_like_torch(dsquare, torch.autograd.grad((x ** 2).sum(), [x])[0])


def test_integer_to_negative_integer_power_is_refused():
    i = sg.input("i", (3,), dtype="int32")
    with pytest.raises(RuntimeError):  # torch refuses it
        torch.tensor([1, 2, 3], dtype=torch.int32) ** -2
    with pytest.raises(ValueError, match=r"pow: integers to negative integer powers are not allowed: "
                                         r"int32 \[3\] \*\* -2"):
        i ** -2
    with pytest.raises(ValueError, match=r"pow: integers .* \*\* \[2, -1, -1\]"):
        i ** np.array([2, -1, -1], np.int32)
    f = sg.function([i], [i ** 2, i ** 0.5], backend="numpy")  # positive and float powers stay allowed
    squares, roots = f(np.array([1, 2, 3], np.int32))
    np.testing.assert_array_equal(squares, [1, 4, 9])
    assert_like_torch(roots, torch.tensor([1, 2, 3], dtype=torch.int32) ** 0.5)


# ---- 10: derivatives stay finite where the function is ----------------------------------

LARGE = np.array([300, -300, 100, -100, 30, -30, 0.5, 0], np.float32)
softplus = sg.elementwise("softplus_reliability", lambda x: sympy.log(1 + sympy.exp(x)))
silu = sg.elementwise("silu_reliability", lambda x: x / (1 + sympy.exp(-x)))  # an exp ratio times x
TORCH_UNARY = {"sigmoid": (sg.sigmoid, torch.sigmoid), "tanh": (sg.tanh, torch.tanh),
               "softplus": (softplus, TF.softplus), "silu": (silu, TF.silu), "exp": (sg.exp, torch.exp)}


def _gradients_only(backend):
    x = sg.input("x", (8,))
    return sg.function([x], [sg.grad(sg.sum(fn(x)), [x])[0] for fn, _ in TORCH_UNARY.values()],
                       backend=backend)


def test_derivatives_finite_at_large_inputs_when_only_the_gradient_is_output(compiled, backend):
    got = compiled("grads_only", backend, _gradients_only)(LARGE)
    for (name, (_, torch_fn)), g in zip(TORCH_UNARY.items(), got):
        x = torch.tensor(LARGE, requires_grad=True)
        (want,) = torch.autograd.grad(torch_fn(x).sum(), [x])
        assert_like_torch(g, want, what=name)
    assert got[0][0] == 0 and got[0][1] == 0  # sigmoid's gradient at +-300: 0, not nan


def test_stays_finite_refuses_forms_that_overflow():
    from symgrad.ir.elementwise import stays_finite

    x = sympy.Symbol("x", real=True)
    y = 1 / (1 + sympy.exp(-x))
    assert stays_finite(-y * (y - 1), y)
    assert not stays_finite(sympy.exp(x) / (sympy.exp(x) + 1) ** 2, -y * (y - 1))
    assert stays_finite(sympy.log(x), sympy.log(x))  # non-finite where the reference is: allowed


# ---- 11: means over nothing and variances of one element are NaN, not sympy's zoo ---------

def _empty_means(backend):
    z = sg.input("z", (3, 0))
    return sg.function([z], [sg.mean(z, axis=1), sg.mean(z), sg.sum(z, axis=1)], backend=backend)


def test_mean_over_empty_axis_is_nan_as_torch(compiled, backend):
    got = compiled("empty_means", backend, _empty_means)(np.zeros((3, 0), np.float32))
    z = torch.zeros(3, 0)
    for g, w in zip(got, [z.mean(1), z.mean(), z.sum(1)]):
        assert_like_torch(g, w)


def test_unbiased_variance_of_one_row_is_nan_as_torch(backend):
    """BatchNorm's running variance takes the unbiased batch variance, var * N/(N - 1): at a batch
    of one row (N a Dim; a fixed size 1 is refused while building), torch.var's NaN."""
    bn = sg.nn.BatchNorm1d(2)
    x = sg.input("x", (sg.Dim("N"), 2))
    step = sg.train_step(sg.sum(bn(x)), bn.parameters(), sg.optim.SGD(lr=0.0), backend=backend)
    step(x=np.array([[1.0, 2.0]], np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that one element has no degrees of freedom
        want = 0.9 * 1 + 0.1 * torch.tensor([[1.0, 2.0]]).var(dim=0)  # torch.var of one element: nan
    assert_like_torch(step.state["running_var"], want)


# ---- found by the differential fuzzer (tests/test_fuzz.py) -----------------------------

def _fuzz_cases(backend):
    x = sg.input("x", (5,), dtype="float64")
    a, b = sg.input("a", (3,), dtype="float64"), sg.input("b", (3,), dtype="float64")
    empty = sg.input("empty", (3, 0), dtype="float64")
    log = sg.log(x)
    exp_log = sg.exp(log)
    tie = sg.minimum(a, b)
    # log is an output too, so the pipeline's rule (not its chain composition) decides exp(log(x)).
    quotient = a / b
    outs = [exp_log, log, *sg.grad(sg.sum(tie * 2.0), [a, b]), sg.softmax(empty, axis=1), sg.log_softmax(empty, axis=1),
            *sg.grad(sg.sum(quotient * 3.0), [a, b])]
    return sg.function([x, a, b, empty], outs, backend=backend)


FUZZ_X = np.array([-1e-4, -2.0, 0.0, 3.0, NAN])
FUZZ_A, FUZZ_B = np.array([INF, -INF, 1.0]), np.array([INF, -INF, 2.0])


def test_fuzz_found_exp_of_log_of_negative_is_nan(compiled, backend):
    """The rule exp(log(x)) -> x was wrong for x < 0 (NaN in NumPy and torch): it is gone."""
    got = compiled("fuzz", backend, _fuzz_cases)(FUZZ_X, FUZZ_A, FUZZ_B, np.zeros((3, 0)))[0]
    assert_like_torch(got, torch.exp(torch.log(torch.tensor(FUZZ_X))))


def test_fuzz_found_minimum_gradient_splits_at_equal_infinities(compiled, backend):
    """minimum(inf, inf) is a tie (torch halves the cotangent); inf - inf = NaN read as a NaN operand."""
    got = compiled("fuzz", backend, _fuzz_cases)(FUZZ_X, FUZZ_A, FUZZ_B, np.zeros((3, 0)))[2:4]
    a, b = (torch.tensor(v, requires_grad=True) for v in (FUZZ_A, FUZZ_B))
    want = torch.autograd.grad((torch.minimum(a, b) * 2.0).sum(), [a, b])
    for g, w in zip(got, want):
        assert_like_torch(g, w)
    assert_like_torch(got[0], [1.0, 1.0, 2.0])


def test_fuzz_found_softmax_over_empty_axis_is_empty(compiled, backend):
    """softmax and log_softmax over an axis of size 0 are empty (torch), not a refused max."""
    softmax, log_softmax = compiled("fuzz", backend, _fuzz_cases)(FUZZ_X, FUZZ_A, FUZZ_B, np.zeros((3, 0)))[4:6]
    assert softmax.shape == log_softmax.shape == torch.softmax(torch.zeros(3, 0), dim=1).shape


def test_fuzz_found_div_gradient_finite_where_the_quotient_is(compiled, backend):
    """d(a/b)/db was -a/b**2: 0/0 or inf where b**2 underflows or overflows although a/b is finite
    (a = b = 1e-300 gave -inf, torch -3e300). Now -(a/b)/b as torch, reusing the quotient."""
    a_values, b_values = np.array([1e-300, 1e300, 3.0]), np.array([1e-300, 1e300, -2.0])
    got = compiled("fuzz", backend, _fuzz_cases)(FUZZ_X, a_values, b_values, np.zeros((3, 0)))[6:8]
    a, b = (torch.tensor(v, requires_grad=True) for v in (a_values, b_values))
    want = torch.autograd.grad((a / b * 3.0).sum(), [a, b])
    for g, w in zip(got, want):
        assert_like_torch(g, w, rtol=1e-12, atol=0)



def _tanh_of_quotient_by_zero(backend):
    x = sg.input("x", (3,), dtype="float64")
    y = sg.tanh(x / 0.0)
    return sg.function([x], [y, *sg.grad(sg.sum(y), [x])], backend=backend)


def test_fuzz_found_chain_dividing_by_zero_compiles_and_matches_torch(compiled, backend):
    """A chain with x / 0.0 composed to sympy's zoo (complex infinity): CPrintError on C. Such
    chains are now left as they are."""
    values = np.array([1.0, 0.0, -1.0])
    got = compiled("quotient_by_zero", backend, _tanh_of_quotient_by_zero)(values)
    x = torch.tensor(values, requires_grad=True)
    y = torch.tanh(x / 0.0)
    for g, w in zip(got, [y, torch.autograd.grad(y.sum(), [x])[0]]):
        assert_like_torch(g, w)


def _composed_chains(backend):
    """Single-use chains that sympy's real algebra would compose to something else at inf, NaN
    or outside log's domain: x - (x - x) -> x, exp(log(x)) -> x, (x*y)/y -> x."""
    x, y = sg.input("x", (6,), dtype="float64"), sg.input("y", (6,), dtype="float64")
    outs = [x - (x - x), sg.exp(sg.log(x)), (x * y) / y]
    return sg.function([x, y], outs + list(sg.grad(sg.sum(sg.abs(x) * y), [x])), backend=backend)


CHAIN_X = np.array([INF, -INF, -1.0, 0.0, NAN, 2.0])
CHAIN_Y = np.array([0.0, INF, NAN, 3.0, 1.0, -INF])


def test_chain_composition_keeps_special_values(compiled, backend):
    """The composed chain is only taken where it is NaN and infinite exactly where the nodes are
    (C composed all three chains to x: inf for x - (x - x) at x = inf, -1 for exp(log(-1)))."""
    got = compiled("chains", backend, _composed_chains)(CHAIN_X, CHAIN_Y)
    x, y = torch.tensor(CHAIN_X), torch.tensor(CHAIN_Y)
    for g, w in zip(got, [x - (x - x), torch.exp(torch.log(x)), (x * y) / y]):
        assert_like_torch(g, w)


def test_abs_gradient_at_nan_is_zero_as_in_torch(compiled, backend):
    """d|x|/dx = sign(x), and sign(NaN) = 0 as torch.sign: the gradient at NaN is 0 for a finite
    cotangent (NumPy's sign gave NaN on the reference backend)."""
    got = compiled("chains", backend, _composed_chains)(CHAIN_X, CHAIN_Y)[3]
    x = torch.tensor(CHAIN_X, requires_grad=True)
    (want,) = torch.autograd.grad((x.abs() * torch.tensor(CHAIN_Y)).sum(), [x])
    assert_like_torch(got, want)
    assert got[4] == 0.0  # x = NaN, cotangent 1


def test_keeps_special_values_refuses_real_algebra_that_ieee_does_not_do():
    from symgrad.ir.elementwise import keeps_special_values

    x, y = sympy.symbols("x y", real=True)
    with sympy.evaluate(False):
        x_minus_nothing, exp_log, quotient = x - (x - x), sympy.exp(sympy.log(x)), (x * y) / y
        twice = x + x
    for exact in (x_minus_nothing, exp_log, quotient):
        assert not keeps_special_values(x, exact), exact
    assert keeps_special_values(2 * x, twice)  # NaN and inf at the same operands
    assert not keeps_special_values(x * (y + 1), x * y + x)  # inf * 0 = NaN at x = inf, y = -1
