"""The variables a compiled step shares between its programs (the step, accumulate, apply,
predict) and between threads: one name is one variable, and calls take turns."""

import sys
import threading

import numpy as np
import pytest

import symgrad as sg


def _linear_step(backend, **params):
    """loss = sum(x * W): its gradient is x whatever W is, so with x = 1 and lr = 1 every step
    (or accumulate + apply) subtracts exactly 1 from W, in any order."""
    x = sg.input("x", (1,))
    W = sg.param("W", (1,), init="zeros")
    extra = sum((sg.sum(p) for p in params.values()), sg.constant(0.0, "float32"))
    loss = sg.sum(x * W) + extra
    return sg.train_step(loss, [W], sg.optim.SGD(lr=1.0), backend=backend), np.ones(1, np.float32)


# ---- names ----------------------------------------------------------------------------------

def test_a_param_named_like_a_gradient_buffer_is_refused():
    frozen = sg.param("W.grad", (1,), init="ones")
    with pytest.raises(ValueError, match=r"param 'W\.grad' has the name of the gradient buffer of param 'W'"):
        _linear_step("numpy", frozen=frozen)


def test_a_predict_value_reading_a_param_named_like_a_gradient_buffer_is_refused():
    x = sg.input("x", (1,))
    W = sg.param("W", (1,), init="zeros")
    frozen = sg.param("W.grad", (1,), init=np.full(1, 100, np.float32))
    # refused while the step is built (its predict program is built with it), before any call
    with pytest.raises(ValueError, match=r"predict: param 'W\.grad' has the name of the gradient buffer"):
        sg.train_step(sg.sum(x * W), [W], sg.optim.SGD(lr=1.0), predict=x * W + frozen, backend="numpy")
    step = sg.train_step(sg.sum(x * W), [W], sg.optim.SGD(lr=1.0), backend="numpy")
    step.accumulate(x=np.ones(1, np.float32))
    step.apply()
    np.testing.assert_array_equal(step.params["W"], [-1])


def test_a_predict_param_named_like_the_learning_rate_is_refused():
    x = sg.input("x", (1,))
    W = sg.param("W", (1,), init="zeros")
    rate = sg.param("lr", (), init=np.array(5.0), dtype="float64")
    with pytest.raises(ValueError, match=r"predict: param 'lr' there and hyper 'lr' in the step are different"):
        sg.train_step(sg.sum(x * W), [W], sg.optim.SGD(lr=1.0), predict=x * sg.cast(rate, "float32"),
                      backend="numpy")


def test_a_param_named_like_the_learning_rate_names_both_kinds():
    with pytest.raises(ValueError, match=r"named 'lr' \(.*param.*hyper|named 'lr' \(.*hyper.*param"):
        _linear_step("numpy", rate=sg.param("lr", (), init="ones"))


# ---- threads --------------------------------------------------------------------------------

@pytest.fixture
def frequent_thread_switches():
    """Switch threads every microsecond, so that calls overlap whenever nothing serialises them."""
    saved = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(saved)


def _in_threads(*works):
    errors = []

    def guarded(work):
        try:
            work()
        except BaseException as exc:  # reported by the test, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(w,)) for w in works]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_four_threads_stepping_at_once_end_with_the_sequential_result(backend, frequent_thread_switches):
    step, ones = _linear_step(backend)

    def work():
        for _ in range(150):
            step(x=ones)

    _in_threads(*[work] * 4)
    np.testing.assert_array_equal(step.params["W"], [-600])


def test_steps_accumulates_and_applies_in_threads_take_turns(backend, frequent_thread_switches):
    step, ones = _linear_step(backend)

    def stepping():
        for _ in range(100):
            step(x=ones)

    def accumulating():
        for _ in range(100):
            step.accumulate(x=ones)
            step.apply()

    step.program_for("accumulate"), step.program_for("apply")  # compiled before the threads start
    _in_threads(stepping, stepping, accumulating, accumulating)
    step.apply()
    np.testing.assert_array_equal(step.params["W"], [-400])
    np.testing.assert_array_equal(step.state["W.grad"], [0])
