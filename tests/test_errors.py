"""Bad input: clear errors while the graph is built and on every refused call.

Build-time errors name the op and both shapes; call-time errors name the
input and both shapes, and a refused call changes nothing (parameters are
compared before and after).
"""

import functools

import numpy as np
import pytest

import symgrad as sg


def f32(shape):
    return np.zeros(shape, dtype=np.float32)


# ---- graph-build time ----------------------------------------------------------

def test_matmul_shape_mismatch_names_op_and_shapes():
    x = sg.input("x", (3, 4))
    W = sg.param("W", (5, 6))
    with pytest.raises(ValueError) as err:
        x @ W
    message = str(err.value)
    assert "matmul" in message and "[3,4]" in message and "[5,6]" in message


@pytest.mark.parametrize("build, words", [
    (lambda: sg.input("a", (3, 4)) + sg.input("b", (5, 6)), ["add", "[3,4]", "[5,6]"]),
    (lambda: sg.maximum(sg.input("a", (2, 3)), sg.input("b", (4,))), ["maximum", "[2,3]", "[4]"]),
    (lambda: sg.input("a", (4,)) @ sg.input("b", (3,)), ["matmul", "[4]", "[3]"]),
    (lambda: sg.input("a", (2, 3, 4)) @ sg.input("b", (5, 2)), ["matmul", "[2,3,4]", "[5,2]"]),
    (lambda: sg.input("a", (2, 3, 4)) @ sg.input("b", (3, 4, 2)), ["matmul", "batch", "[2,3,4]", "[3,4,2]"]),
    (lambda: sg.reshape(sg.input("a", (3, 4)), (5, 2)), ["reshape", "[3,4]", "[5,2]"]),
    (lambda: sg.broadcast_to(sg.input("a", (3, 4)), (2, 3, 5)), ["broadcast_to", "[3,4]", "[2,3,5]"]),
    (lambda: sg.transpose(sg.input("a", (3, 4)), (0, 0)), ["transpose", "[3,4]"]),
    (lambda: sg.sum(sg.input("a", (3, 4)), axis=2), ["sum", "axis 2", "rank 2"]),
    (lambda: sg.max(sg.input("a", (3, 4)), axis=(0, 0)), ["max", "repeated"]),
    (lambda: sg.squeeze(sg.input("a", (3, 4)), 2), ["squeeze", "[3,4]"]),  # (a kept axis of size 3 is torch's meaning)
    (lambda: sg.transpose(sg.input("a", (3, 4)), (0, 5)), ["transpose", "[3,4]"]),
    (lambda: sg.input("a", (3, 4)).transpose(1, 2), ["transpose", "[3,4]"]),
    (lambda: sg.expand_dims(sg.input("a", (3, 4)), 5), ["expand_dims", "axis 5", "[3,4]"]),
    (lambda: sg.expand_dims(sg.input("a", (3, 4)), -4), ["expand_dims", "[3,4]"]),
    (lambda: sg.argmax(sg.input("a", (3, 4)), axis=2), ["argmax", "axis 2"]),
    (lambda: sg.reshape(sg.input("a", (3, 4)), (-1, -1)), ["reshape", "-1"]),
    (lambda: sg.reshape(sg.input("a", (3, 4)), (-1, 5)), ["reshape", "[3,4]"]),
    (lambda: sg.cross_entropy(sg.input("a", (3, 4, 5)), sg.input("t", (3,), dtype="int64")),
     ["cross_entropy", "[3,4,5]"]),
    (lambda: sg.nll_loss(sg.input("a", (3, 4)), sg.input("t", (5,), dtype="int64")),
     ["nll_loss", "[3,4]", "[5]"]),
    (lambda: sg.mse_loss(sg.input("a", (3, 4)), sg.input("b", (4, 3))), ["mse_loss", "[3,4]", "[4,3]"]),
    (lambda: sg.where(sg.input("c", (3,), dtype="bool"), sg.input("a", (3,)), sg.input("b", (4,))),
     ["where", "[3]", "[4]"]),
])
def test_shape_mismatch_at_build_time(build, words):
    with pytest.raises(ValueError) as err:
        build()
    for word in words:
        assert word in str(err.value), f"{word!r} not in {str(err.value)!r}"


def test_symbolic_shape_mismatch_at_build_time():
    B, C = sg.Dim("B"), sg.Dim("C")
    with pytest.raises(ValueError, match=r"add.*\[B,4\].*\[C,4\]"):
        sg.input("a", (B, 4)) + sg.input("b", (C, 4))
    # The same Dim agrees with itself: no error.
    assert (sg.input("c", (B, 4)) + sg.input("d", (B, 1))).shape == (B, 4)


@pytest.mark.parametrize("build, words", [
    (lambda: sg.input("a", (3, 4)) @ sg.input("b", (4, 2), dtype="float64"),
     ["matmul", "float32", "float64", "[3,4]", "[4,2]"]),
    (lambda: sg.input("a", (3, 4), dtype="int64") @ sg.input("b", (4, 2), dtype="int64"), ["matmul", "int64"]),
    (lambda: sg.where(sg.input("c", (3,)), sg.input("a", (3,)), 0.0), ["where", "bool", "float32"]),
    (lambda: sg.one_hot(sg.input("t", (3,)), 4), ["one_hot", "float32"]),
    (lambda: sg.input("a", (3,)) + "text", ["add", "str"]),
    (lambda: sg.exp(np.ones(3)), ["exp", "ndarray"]),
    (lambda: sg.input("a", (3,), dtype="complex64"), ["complex64"]),
])
def test_type_errors_at_build_time(build, words):
    with pytest.raises(TypeError) as err:
        build()
    for word in words:
        assert word in str(err.value), f"{word!r} not in {str(err.value)!r}"


def test_value_has_no_truth_value():
    with pytest.raises(TypeError, match="where"):
        bool(sg.input("a", (3,)) > 0)


def test_param_shape_and_init_checked():
    with pytest.raises(ValueError, match="W"):
        sg.param("W", (sg.Dim("B"), 3))
    with pytest.raises(ValueError, match=r"\[2,2\]"):
        sg.param("W", (3, 3), init=np.zeros((2, 2)))
    with pytest.raises(ValueError, match="init"):
        sg.param("W", (3, 3), init="glorot-ish")


# ---- sg.grad ------------------------------------------------------------------------

def test_grad_of_non_scalar_needs_grad_output():
    x = sg.input("x", (3, 4), dtype="float64")
    with pytest.raises(ValueError, match=r"non-scalar.*grad_output|grad_output.*\[3,4\]") as err:
        sg.grad(sg.exp(x), [x])
    assert "[3,4]" in str(err.value)


def test_grad_output_of_wrong_shape():
    x = sg.input("x", (3, 4), dtype="float64")
    with pytest.raises(ValueError, match=r"\[4,3\].*\[3,4\]"):
        sg.grad(sg.exp(x), [x], grad_output=sg.input("g", (4, 3), dtype="float64"))


def test_grad_of_integer_or_non_value():
    t = sg.input("t", (3,), dtype="int64")
    x = sg.input("x", (3,), dtype="float64")
    with pytest.raises(TypeError, match="int64"):
        sg.grad(sg.sum(t), [t])
    with pytest.raises(TypeError, match="graph value"):
        sg.grad(sg.sum(x), [np.ones(3)])
    with pytest.raises(TypeError, match="graph value"):
        sg.grad(3.0, [x])


def test_unused_value_gets_zero_gradient_and_integer_input_none(backend):
    x = sg.input("x", (3,), dtype="float64")
    unused = sg.input("unused", (2, 5), dtype="float64")
    t = sg.input("t", (3,), dtype="int64")
    y = sg.sum(x * sg.cast(t, "float64"))
    gx, gu, gt = sg.grad(y, [x, unused, t])
    assert gt is None
    assert gu.shape == (2, 5) and gu.dtype == "float64"
    single = sg.grad(y, unused)  # one value in, one value out
    assert single.shape == (2, 5)
    f = sg.function([x, unused, t], [gx, gu], backend=backend)
    vx, vu = f(np.ones(3), np.ones((2, 5)), np.array([1, 2, 3]))
    np.testing.assert_array_equal(vx, [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(vu, np.zeros((2, 5)))


def test_stop_gradient_and_argmax_block_gradients():
    x = sg.input("x", (3,), dtype="float64")
    (g,) = sg.grad(sg.sum(sg.stop_gradient(x) * 2), [x])
    f = sg.function([x], g, backend="numpy")
    np.testing.assert_array_equal(f(np.ones(3)), np.zeros(3))


# ---- call time --------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _compiled(backend):
    """One function and one train step per backend, shared by every refused call."""
    B = sg.Dim("B")
    x = sg.input("x", (B, 4))
    y = sg.input("y", (B,), dtype="int64")
    W = sg.param("W", (4, 3), init=np.arange(12.0).reshape(4, 3) / 10)
    b = sg.param("b", (3,), init="ones")
    loss = sg.cross_entropy(x @ W + b, y)
    f = sg.function([x, y], [loss], backend=backend)
    step = sg.train_step(loss, params=[W, b], optimizer=sg.optim.SGD(lr=0.1), backend=backend)
    return f, step


def _snapshot(step):
    return {name: step.params[name].copy() for name in step.params}


GOOD_X, GOOD_Y = np.ones((5, 4), np.float32), np.zeros(5, np.int64)
BAD_CALLS = [
    # (x, y, exception, words the message must contain)
    (np.ones((5, 3), np.float32), GOOD_Y, ValueError, ["'x'", "[B,4]", "[5, 3]"]),
    (np.ones((5, 4), np.float64), GOOD_Y, TypeError, ["'x'", "float32", "float64"]),
    (GOOD_X, np.zeros(5, np.int32), TypeError, ["'y'", "int64", "int32"]),
    (np.ones((5, 4, 1), np.float32), GOOD_Y, ValueError, ["'x'", "[B,4]", "[5, 4, 1]"]),
    (np.ones(4, np.float32), GOOD_Y, ValueError, ["'x'", "[B,4]", "[4]"]),
    (GOOD_X, np.zeros(6, np.int64), ValueError, ["'y'", "B", "5", "6"]),
    (np.ones((4, 5), np.float32).T, GOOD_Y, ValueError, ["'x'", "contiguous"]),
    (np.ones((5, 8), np.float32)[:, ::2], GOOD_Y, ValueError, ["'x'", "contiguous"]),
    (GOOD_X.tolist(), GOOD_Y, TypeError, ["'x'", "list"]),
    (GOOD_X, 3, TypeError, ["'y'", "int"]),
    (np.ones((0, 4), np.float32), np.zeros(0, np.int64), ValueError, ["'x'", "B"]),
]


@pytest.mark.parametrize("x, y, exc, words", BAD_CALLS)
def test_refused_call_names_input_and_changes_nothing(backend, x, y, exc, words):
    f, step = _compiled(backend)
    before = _snapshot(step)
    for call in (lambda: f(x, y), lambda: step(x=x, y=y)):
        with pytest.raises(exc) as err:
            call()
        for word in words:
            assert word in str(err.value), f"{word!r} not in {str(err.value)!r}"
    after = _snapshot(step)
    for name in before:
        np.testing.assert_array_equal(after[name], before[name])


@pytest.mark.parametrize("kwargs, words", [
    ({"x": GOOD_X}, ["missing", "'y'"]),
    ({"x": GOOD_X, "y": GOOD_Y, "z": GOOD_Y}, ["unexpected", "'z'"]),
    ({"y": GOOD_Y, "labels": GOOD_Y}, ["missing", "'x'", "unexpected", "'labels'"]),
])
def test_train_step_missing_or_extra_names(backend, kwargs, words):
    _, step = _compiled(backend)
    before = _snapshot(step)
    with pytest.raises(TypeError) as err:
        step(**kwargs)
    for word in words:
        assert word in str(err.value), f"{word!r} not in {str(err.value)!r}"
    for name, value in _snapshot(step).items():
        np.testing.assert_array_equal(value, before[name])


def test_function_wrong_argument_count(backend):
    f, _ = _compiled(backend)
    with pytest.raises(TypeError, match=r"2 positional input.*\['x', 'y'\].*got 1"):
        f(GOOD_X)


def test_a_good_call_after_refused_ones_works(backend):
    """The refused calls left the step usable: a good call runs and moves the parameters."""
    f, step = _compiled(backend)
    before = _snapshot(step)
    (loss,) = f(GOOD_X, GOOD_Y)
    assert np.isfinite(loss)
    assert abs(step(x=GOOD_X, y=GOOD_Y) - float(loss)) < 1e-6
    assert not np.array_equal(step.params["W"], before["W"])


def test_param_assignment_is_checked(backend):
    _, step = _compiled(backend)
    with pytest.raises(ValueError, match=r"'W'.*\[4,3\].*\[3, 4\]"):
        step.params["W"] = np.zeros((3, 4))
    with pytest.raises(KeyError, match="nope"):
        step.params["nope"]


def test_function_rejects_missing_inputs_and_non_values():
    x = sg.input("x", (3,))
    y = sg.input("y", (3,))
    with pytest.raises(ValueError, match="'y'"):
        sg.function([x], [x + y])
    with pytest.raises(TypeError, match="ndarray"):
        sg.function([x], [np.ones(3)])


def test_train_step_rejects_bad_loss_and_params():
    x = sg.input("x", (3,))
    W = sg.param("W", (3,))
    with pytest.raises(ValueError, match="scalar"):
        sg.train_step(x * W, params=[W], optimizer=sg.optim.SGD(lr=0.1))
    with pytest.raises(TypeError, match=r"params\[0\]"):
        sg.train_step(sg.sum(x * W), params=[x], optimizer=sg.optim.SGD(lr=0.1))


def test_duplicate_names_are_refused():
    a, b = sg.input("same", (3,)), sg.input("same", (3,))
    with pytest.raises(ValueError, match="'same'"):
        sg.function([a, b], [a + b])


@pytest.mark.parametrize("value", [-1, float("nan"), float("inf")])
def test_learning_rate_is_checked_as_the_optimizer_checks_it(backend, value):
    """step.lr (or step.state["lr"]) takes a finite non-negative number only, as SGD(lr=...) does."""
    _, step = _compiled(backend)
    with pytest.raises(ValueError, match=r"SGD: lr must be a finite non-negative number"):
        sg.optim.SGD(lr=value)
    lr = step.lr
    with pytest.raises(ValueError, match=r"step\.lr must be a finite non-negative number, got"):
        step.lr = value
    with pytest.raises(ValueError, match=r"'lr'.*must be a finite non-negative number"):
        step.state["lr"] = value
    assert step.lr == lr
    step.lr = 0.0  # zero is a learning rate (a frozen model), and a later good value is taken
    step.lr = lr
    assert step.lr == lr


def test_the_same_input_twice_is_refused():
    a = sg.input("a", (3,))
    with pytest.raises(ValueError, match=r"'a'.*twice.*positions 0 and 1"):
        sg.function([a, a], [a * 2])


@pytest.mark.parametrize("make", [
    lambda: np.ma.masked_array(np.ones((5, 4), np.float32), mask=np.eye(5, 4, dtype=bool)),
    lambda: np.matrix(np.ones((5, 4), np.float32)),
], ids=["masked", "matrix"])
@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
def test_ndarray_subclasses_are_refused(backend, make):
    """A masked array or np.matrix is refused before any backend reads its raw data; a memory map
    (whose data is what it means) is taken."""
    f, step = _compiled(backend)
    before = _snapshot(step)
    x = make()
    for call in (lambda: f(x, GOOD_Y), lambda: step(x=x, y=GOOD_Y)):
        with pytest.raises(TypeError, match=rf"input 'x'.*plain numpy.ndarray.*{type(x).__name__}"):
            call()
    with pytest.raises(TypeError, match=r"variable 'b'.*plain numpy.ndarray"):
        step.params["b"] = np.ma.masked_array(np.zeros(3), mask=[0, 1, 0])
    for name, value in _snapshot(step).items():
        np.testing.assert_array_equal(value, before[name])


def test_memory_mapped_inputs_are_taken(backend, tmp_path):
    f, _ = _compiled(backend)
    mapped = np.lib.format.open_memmap(tmp_path / "x.npy", mode="w+", dtype=np.float32, shape=(5, 4))
    mapped[...] = GOOD_X
    np.testing.assert_array_equal(f(mapped, GOOD_Y)[0], f(GOOD_X, GOOD_Y)[0])


def test_state_names_are_checked_and_gradient_buffers_writable(backend):
    """A missing name (read or written) raises a KeyError naming it and the names there are; the
    gradient buffers that accumulate() makes can be read and assigned, and apply() uses them."""
    x = sg.input("x", (2,))
    W = sg.param("W", (2,), init="ones")
    step = sg.train_step(sg.sum(x * W), [W], sg.optim.SGD(lr=0.5), backend=backend)
    for access in (lambda: step.state["W.grad"], lambda: step.state.__setitem__("W.grad", np.zeros(2))):
        with pytest.raises(KeyError, match=r"'W.grad'.*have \['lr'\].*accumulate"):
            access()
    with pytest.raises(KeyError, match=r"'nope'.*have \['W'\]"):
        step.params["nope"] = np.zeros(2)
    step.accumulate(x=np.ones(2, np.float32))
    np.testing.assert_array_equal(step.state["W.grad"], [1, 1])
    step.state["W.grad"] = np.array([4.0, -2.0])
    with pytest.raises(ValueError, match=r"'W.grad'.*\[2\].*\[3\]"):
        step.state["W.grad"] = np.zeros(3)
    step.apply()
    np.testing.assert_allclose(step.params["W"], [1 - 0.5 * 4, 1 + 0.5 * 2])
    np.testing.assert_array_equal(step.state["W.grad"], [0, 0])


# ---- issue 35: what a call's errors say first, and name ----

def test_every_shape_is_checked_before_contiguity(backend):
    """A strided array of the wrong shape is told its shape first; a strided y does not hide x's
    wrong shape."""
    f, step = _compiled(backend)
    strided_y = np.zeros(10, np.int64)[::2]
    for x, y in [(np.ones((3, 5), np.float32).T, GOOD_Y), (np.ones((5, 3), np.float32), strided_y)]:
        for call in (lambda: f(x, y), lambda: step(x=x, y=y)):
            with pytest.raises(ValueError, match=r"input 'x': expected shape \[B,4\]") as err:
                call()
            assert "contiguous" not in str(err.value)
    with pytest.raises(ValueError, match="input 'y'.*not C-contiguous"):
        f(GOOD_X, strided_y)


def test_a_positional_call_lists_the_input_names(backend):
    f, step = _compiled(backend)
    with pytest.raises(TypeError, match=r"takes its inputs by name \['x', 'y'\]: step\(x=\.\.\., y=\.\.\.\); "
                                        r"got 2 positional arguments"):
        step(GOOD_X, GOOD_Y)
    with pytest.raises(TypeError, match=r"2 positional input\(s\) \['x', 'y'\]"):
        f(GOOD_X)
    np.testing.assert_array_equal(f(x=GOOD_X, y=GOOD_Y)[0], f(GOOD_X, GOOD_Y)[0])  # by name too


class _Positions(sg.nn.Module):
    """Token and position embeddings, as nanoGPT's: wte(idx) + wpe(arange(T))."""

    def __init__(self):
        super().__init__()
        self.wte = sg.nn.Embedding(16, 4)
        self.wpe = sg.nn.Embedding(8, 4)

    def forward(self, idx):
        return self.wte(idx) + self.wpe(sg.arange(idx.shape[1]))


@functools.lru_cache(maxsize=None)
def _positions(backend):
    model = _Positions()
    idx = sg.input("idx", (sg.Dim("B"), sg.Dim("T")), dtype="int64")
    return sg.function([idx], model(idx), backend=backend)


def test_a_context_longer_than_the_position_table_names_the_embedding(backend):
    f = _positions(backend)
    assert f(np.zeros((2, 8), np.int64)).shape == (2, 8, 4)  # the whole table: fine
    with pytest.raises(ValueError) as err:
        f(np.zeros((2, 9), np.int64))
    message = str(err.value)
    for word in ("embedding", "'wpe.weight' has 8 rows", "reaches 8", "T = 9", "longer than"):
        assert word in message, message
    assert "classes" not in message


def test_ids_outside_a_token_table_name_it_and_class_labels_say_classes(backend):
    with pytest.raises(ValueError) as err:
        _positions(backend)(np.array([[1, 16]], np.int64))
    message = str(err.value)
    assert "embedding: input (input 'idx') holds 16 at index [0, 1]" in message, message
    assert "'wte.weight' has 16 rows" in message and "classes" not in message
    f, _ = _compiled(backend)
    with pytest.raises(ValueError, match=r"cross_entropy: target \(input 'y'\) holds 3 .* for 3 classes"):
        f(GOOD_X, np.array([0, 1, 3, 0, 0], np.int64))


def test_a_torch_tensor_on_another_device_names_cpu(backend):
    torch = pytest.importorskip("torch")
    f, step = _compiled(backend)
    meta = torch.empty((5, 4), device="meta")
    for call in (lambda: f(meta, GOOD_Y), lambda: step(x=meta, y=GOOD_Y)):
        with pytest.raises(TypeError, match=r"input 'x': a torch tensor on device 'meta'.*\.cpu\(\)"):
            call()
