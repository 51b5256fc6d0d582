"""torch CPU tensors as inputs (issue 35): read in place where contiguous, copied where strided,
refused on another device with an error naming `.cpu()`; torch stays an optional import."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import symgrad as sg
from symgrad.step.call_checks import host_array

BACKENDS = ["numpy", "c"]
W0 = (np.arange(12, dtype=np.float32).reshape(3, 4) - 6) / 10


def _model(backend: str):
    """A softmax regression: its step (with predict) and a function of the same logits."""
    x, y = sg.input("x", (sg.Dim("B"), 3)), sg.input("y", (sg.Dim("B"),), dtype="int64")
    W = sg.param("W", (3, 4), init=W0)
    logits = sg.tanh(x) @ W
    step = sg.train_step(sg.cross_entropy(logits, y), [W], sg.optim.SGD(lr=0.5), predict=logits,
                         backend=backend)
    return step, sg.function([x], logits, backend=backend)


@pytest.fixture(scope="module", params=BACKENDS)
def built(request):
    """(backend, step, function), compiled once per backend for the module."""
    step, f = _model(request.param)
    return request.param, step, f


def _batch(rows: int = 5):
    rng = np.random.default_rng(rows)
    return rng.standard_normal((rows, 3)).astype(np.float32), rng.integers(0, 4, rows)


def test_a_contiguous_cpu_tensor_is_read_in_place():
    t = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    array = host_array("input 'x'", t)
    assert type(array) is np.ndarray and array.ctypes.data == t.data_ptr()
    assert np.shares_memory(array, t.numpy())
    offset = t[1:]  # a contiguous view that starts inside its storage
    assert host_array("input 'x'", offset).ctypes.data == offset.data_ptr()


def test_the_compiled_program_receives_the_tensors_memory(built, monkeypatch):
    backend, _, f = built
    program, seen = f.program, []
    name = "run_checked" if hasattr(program, "run_checked") else "run"
    run = getattr(program, name)

    def spy(arrays, *rest):
        seen.extend(a.ctypes.data for a in arrays)
        return run(arrays, *rest)

    monkeypatch.setattr(program, name, spy)
    t = torch.from_numpy(_batch()[0])
    f(t)
    assert seen == [t.data_ptr()], backend


def test_tensors_and_arrays_give_the_same_results(built):
    backend, step, f = built
    xb, yb = _batch()
    np.testing.assert_array_equal(f(torch.from_numpy(xb)), f(xb))
    np.testing.assert_array_equal(f(x=torch.from_numpy(xb)), f(xb))  # by name as well
    np.testing.assert_array_equal(step.predict(x=torch.from_numpy(xb)), f(xb))
    twin, _ = _model(backend)  # the same model from the same weights, trained on numpy arrays
    for k in range(3):
        xb, yb = _batch(4 + k)
        ours = step(x=torch.from_numpy(xb), y=torch.from_numpy(yb))
        assert ours == twin(x=xb, y=yb)
    np.testing.assert_array_equal(step.params["W"], twin.params["W"])


def test_a_strided_tensor_is_copied_and_left_as_it_was(built):
    _, _, f = built
    xb = _batch(6)[0]
    t = torch.from_numpy(np.ascontiguousarray(xb.T)).T  # the same values, column-major
    assert not t.is_contiguous()
    before = t.clone()
    np.testing.assert_array_equal(f(t), f(xb))
    assert torch.equal(t, before)
    assert not np.shares_memory(host_array("input 'x'", t), t.numpy())


def test_tensors_that_require_grad_or_carry_lazy_bits_are_read_by_value(built):
    _, _, f = built
    xb = _batch()[0]
    np.testing.assert_array_equal(f(torch.from_numpy(xb).requires_grad_()), f(xb))
    np.testing.assert_array_equal(f(-torch.from_numpy(-xb)), f(xb))  # a negation view: resolved


def test_labels_in_a_tensor_are_checked(built):
    _, step, _ = built
    xb = _batch()[0]
    with pytest.raises(ValueError, match=r"holds 7 at index \[2\], outside \[0, 4\)"):
        step(x=torch.from_numpy(xb), y=torch.tensor([0, 1, 7, 2, 3]))


def test_a_tensor_on_another_device_names_cpu(built):
    _, step, f = built
    meta = torch.empty((5, 3), device="meta")
    with pytest.raises(TypeError, match=r"input 'x'.*device 'meta'.*\.cpu\(\)"):
        f(meta)
    with pytest.raises(TypeError, match=r"input 'x'.*\.cpu\(\)"):
        step(x=meta, y=torch.zeros(5, dtype=torch.long))


def test_a_tensor_of_the_wrong_dtype_is_refused_naming_both(built):
    _, _, f = built
    with pytest.raises(TypeError, match=r"input 'x': expected dtype float32, got float64"):
        f(torch.zeros((5, 3), dtype=torch.float64))
    with pytest.raises(TypeError, match=r"input 'x'.*bfloat16"):
        f(torch.zeros((5, 3), dtype=torch.bfloat16))


def test_other_objects_pass_through_to_the_usual_checks():
    class Tensor:  # not torch's, whatever its module says
        pass

    Tensor.__module__ = "torchvision.fake"
    thing = Tensor()
    assert host_array("input 'x'", thing) is thing
    assert host_array("input 'x'", [1.0]) == [1.0]


def test_symgrad_does_not_import_torch():
    code = ("import sys, numpy as np, symgrad as sg; x = sg.input('x', (2,)); "
            "sg.function([x], x * 2, backend='numpy')(np.ones(2, np.float32)); "
            "assert not any(m == 'torch' or m.startswith('torch.') for m in sys.modules), 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
