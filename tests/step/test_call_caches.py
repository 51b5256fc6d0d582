"""The caches on the call and compile paths: they must never change what a call checks or computes.

- Compiled._run remembers validated input signatures: a bad array after good calls still raises
  before native code, the variables unchanged.
- symgrad.ir.sympy_memo keeps derived partials on disk: a fresh process state reads back the
  same expressions; a corrupt memo file is ignored.
"""

import importlib.util
import json

import numpy as np
import pytest

import symgrad as sg
from symgrad.ir import elementwise, sympy_memo

#: numpy, and c where its backend imports (the same rule as conftest's `backend` fixture).
BACKENDS = ["numpy"] + (["c"] if importlib.util.find_spec("symgrad.backends.c") else [])


@pytest.fixture(scope="module", params=BACKENDS)
def step(request):
    x = sg.input("x", (sg.Dim("B"), 3))
    y = sg.input("y", (sg.Dim("B"),), dtype="int64")
    W = sg.param("W", (3, 2), init=np.full((3, 2), 0.1, np.float32))
    loss = sg.cross_entropy(sg.matmul(x, W), y)
    return sg.train_step(loss, params=[W], optimizer=sg.optim.SGD(lr=0.1), backend=request.param)


@pytest.mark.parametrize("bad, error", [
    (lambda x: np.ones((3, 4), np.float32).T, ValueError),                        # not C-contiguous
    (lambda x: x.astype(np.float64), TypeError),                                   # wrong dtype
    (lambda x: x[:, :2].copy(), ValueError),                                       # wrong shape
    (lambda x: x.tolist(), TypeError),                                             # not an array
    (lambda x: np.ones((0, 3), np.float32), ValueError),                           # Dim below 1
])
def test_bad_inputs_raise_after_cached_good_calls(step, bad, error):
    x = np.ones((4, 3), np.float32)
    y = np.zeros(4, np.int64)
    step(x=x, y=y)
    step(x=x, y=y)  # the signature is cached now
    before = step.params["W"]
    with pytest.raises(error):
        step(x=bad(x), y=y)
    np.testing.assert_array_equal(step.params["W"], before)
    with pytest.raises(ValueError):  # Dims inconsistent between inputs, shapes cached one by one
        step(x=x, y=np.zeros(5, np.int64))
    with pytest.raises(TypeError):   # a missing name is still named
        step(x=x)


def test_cached_signature_reused_for_a_new_batch_size(step):
    for batch in (2, 5, 2):
        x = np.ones((batch, 3), np.float32)
        assert np.isfinite(step(x=x, y=np.zeros(batch, np.int64)))


@pytest.mark.parametrize("op", ["tanh", "relu", "maximum"])  # relu's and maximum's are Piecewise
def test_partials_memo_round_trips(tmp_path, monkeypatch, op):
    monkeypatch.setenv("SYMGRAD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(sympy_memo, "_FILES", {})
    expected = elementwise._derive(elementwise.REGISTRY[op], 0)
    elementwise.partial_derivative.cache_clear()
    try:
        assert elementwise.partial_derivative(op, 0) == expected   # computed, then stored
        sympy_memo.flush()                                         # (a compile's build, or the exit)
        (memo,) = (tmp_path / "sympy").glob("partial-*.json")
        assert len(json.loads(memo.read_text())) >= 1
        monkeypatch.setattr(sympy_memo, "_FILES", {})                   # a fresh process
        elementwise.partial_derivative.cache_clear()
        monkeypatch.setattr(elementwise, "_derive", lambda op, i: pytest.fail("derived again"))
        assert elementwise.partial_derivative(op, 0) == expected   # read back from disk
    finally:
        elementwise.partial_derivative.cache_clear()


def test_corrupt_memo_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("SYMGRAD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(sympy_memo, "_FILES", {})
    source = elementwise.__file__
    sympy_memo.store("partial", source, "k", elementwise.ARGS[0] + 1)
    sympy_memo.flush()
    (memo,) = (tmp_path / "sympy").glob("partial-*.json")
    entries = json.loads(memo.read_text())
    memo.write_text(json.dumps({k: "__import__('os')" for k in entries}))
    monkeypatch.setattr(sympy_memo, "_FILES", {})
    assert sympy_memo.lookup("partial", source, "k") is None
    memo.write_text("not json")
    monkeypatch.setattr(sympy_memo, "_FILES", {})
    assert sympy_memo.lookup("partial", source, "k") is None
