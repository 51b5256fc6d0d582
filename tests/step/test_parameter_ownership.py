"""One owner of a parameter's value (DESIGN.md; symgrad/api/cells.py).

The module, every train step, its predict program and every sg.function built from the model
see a parameter's current value, whenever each was built; training updates it for all of them,
and every way of setting it (Module.load_state_dict, step.load, step.params[...] = ...) reaches
all of them. Each path is checked against the same model in torch (float64), trained on the same
batches, on every backend; a backend keeping its own copies (CUDA) is checked on the simulated
device of tests/backends/test_backend_cuda.py, beside the NumPy backend working on the cells.
"""

from __future__ import annotations

import gc
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

import symgrad as sg
from symgrad import nn

torch.set_num_threads(1)  # a small shared machine: torch's thread pool would only contend

RNG = np.random.default_rng(5)
BATCHES = [(RNG.standard_normal((8, 4)), RNG.integers(0, 3, 8)) for _ in range(5)]
PROBE = RNG.standard_normal((5, 4))
LR, MOMENTUM = 0.1, 0.9
B = sg.Dim("B")


def _model(seed: int = 0) -> nn.Module:
    sg.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 3)).double()


def _twin(model: nn.Module) -> torch.nn.Module:
    """The torch model with the symgrad model's current values (loaded strictly)."""
    twin = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.BatchNorm1d(5), torch.nn.Tanh(),
                               torch.nn.Linear(5, 3)).double()
    twin.load_state_dict({k: torch.from_numpy(v) for k, v in model.state_dict().items()})
    return twin


def _step(model, backend: str, lr: float = LR, momentum: float = MOMENTUM):
    """SGD on the cross-entropy, with the eval-mode logits as its predict program."""
    x, y = sg.input("x", (B, 4), "float64"), sg.input("y", (B,), "int64")
    loss = sg.cross_entropy(model.train()(x), y)
    logits = model.eval()(x)
    model.train()
    return sg.train_step(loss, model.parameters(), sg.optim.SGD(lr=lr, momentum=momentum), backend=backend,
                         predict=logits)


def _function(model, backend: str):
    """The eval-mode logits as a compiled function."""
    x = sg.input("x", (B, 4), "float64")
    out = model.eval()(x)
    model.train()
    return sg.function([x], out, backend=backend)


def _torch_sgd(twin, lr: float = LR, momentum: float = MOMENTUM):
    return torch.optim.SGD(twin.parameters(), lr=lr, momentum=momentum)


def _torch_train(twin, optimizer, batches) -> list[float]:
    twin.train()
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(twin(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _torch_logits(twin) -> np.ndarray:
    twin.eval()
    with torch.no_grad():
        out = twin(torch.from_numpy(PROBE)).numpy()
    twin.train()
    return out


def _assert_state(model, twin) -> None:
    """The module's state_dict (parameters and running statistics) is the torch model's."""
    state = model.state_dict()
    for name, value in twin.state_dict().items():
        np.testing.assert_allclose(state[name], value.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)


def _assert_logits(got, twin) -> None:
    np.testing.assert_allclose(got, _torch_logits(twin), rtol=1e-10, atol=1e-12)


# ---- reads: whoever was built when, they compute with the current values ---------------------

def test_functions_and_predict_built_before_or_after_training_use_the_trained_values(backend):
    model = _model()
    twin = _twin(model)
    before = _function(model, backend)
    step = _step(model, backend)
    losses = [step(x=x, y=y) for x, y in BATCHES]
    after = _function(model, backend)
    np.testing.assert_allclose(losses, _torch_train(twin, _torch_sgd(twin), BATCHES), rtol=1e-10)
    for got in (before(PROBE), after(PROBE), step.predict(x=PROBE)):
        _assert_logits(got, twin)
    _assert_state(model, twin)
    for name in step.params:
        np.testing.assert_allclose(step.params[name], twin.state_dict()[name].numpy(), rtol=1e-10, atol=1e-12)
    del step
    gc.collect()
    _assert_state(model, twin)  # the values are the model's: they outlive the step
    _assert_logits(before(PROBE), twin)


def test_two_steps_of_one_model_train_its_parameters_in_turn(backend):
    """As two torch optimizers over one model's parameters: each step starts where the other left."""
    model = _model()
    twin = _twin(model)
    steps = [_step(model, backend, lr=LR), _step(model, backend, lr=LR / 2)]
    optimizers = [_torch_sgd(twin, lr=LR), _torch_sgd(twin, lr=LR / 2)]
    for k, (x, y) in enumerate(BATCHES):
        got = steps[k % 2](x=x, y=y)
        assert got == pytest.approx(_torch_train(twin, optimizers[k % 2], [(x, y)])[0], rel=1e-10)
    _assert_state(model, twin)


def test_a_module_renamed_after_training_keeps_its_values(backend):
    """Attaching a module to a parent renames its leaves: the same parameters, under new names."""
    sg.manual_seed(2)
    layer = nn.Linear(4, 3).double()
    twin = torch.nn.Linear(4, 3).double()
    twin.load_state_dict({k: torch.from_numpy(v) for k, v in layer.state_dict().items()})
    x, target = sg.input("x", (B, 4), "float64"), sg.input("t", (B, 3), "float64")
    step = sg.train_step(sg.mse_loss(layer(x), target), layer.parameters(), sg.optim.SGD(lr=LR), backend=backend)
    optimizer = torch.optim.SGD(twin.parameters(), lr=LR)
    targets = [RNG.standard_normal((8, 3)) for _ in BATCHES]

    def train(batches):
        for (xb, _), tb in batches:
            step(x=xb, t=tb)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(twin(torch.from_numpy(xb)), torch.from_numpy(tb)).backward()
            optimizer.step()

    train(list(zip(BATCHES, targets))[:2])
    outer = nn.Sequential(layer)
    assert layer.weight.name == "0.weight" and list(step.params) == ["weight", "bias"]
    y = sg.input("x", (B, 4), "float64")
    f = sg.function([y], outer(y), backend=backend)
    with torch.no_grad():
        np.testing.assert_allclose(f(PROBE), twin(torch.from_numpy(PROBE)).numpy(), rtol=1e-10, atol=1e-12)
    train(list(zip(BATCHES, targets))[2:])  # the old step trains on, the new function sees it
    with torch.no_grad():
        np.testing.assert_allclose(f(PROBE), twin(torch.from_numpy(PROBE)).numpy(), rtol=1e-10, atol=1e-12)
    for name, value in twin.state_dict().items():
        np.testing.assert_allclose(outer.state_dict()[f"0.{name}"], value.numpy(), rtol=1e-10, atol=1e-12)


# ---- writes: every way of setting a value reaches everything built from the model ------------

def test_load_state_dict_sets_the_values_of_every_step_and_function(backend):
    model = _model(0)
    step = _step(model, backend, momentum=0.0)  # no optimizer state: torch's fresh optimizer is the same
    f = _function(model, backend)
    step(x=BATCHES[0][0], y=BATCHES[0][1])  # the step has run: its values are in use
    source = _model(1)
    twin = _twin(source)
    with torch.no_grad():
        twin[1].running_mean.uniform_()  # buffers are set too
    model.load_state_dict(twin.state_dict())  # torch tensors, as they come
    _assert_state(model, twin)
    _assert_logits(f(PROBE), twin)
    _assert_logits(step.predict(x=PROBE), twin)
    losses = [step(x=x, y=y) for x, y in BATCHES]
    np.testing.assert_allclose(losses, _torch_train(twin, _torch_sgd(twin, momentum=0.0), BATCHES), rtol=1e-10)
    _assert_state(model, twin)
    _assert_logits(f(PROBE), twin)


def test_step_load_sets_the_values_of_the_module_and_its_functions(backend, tmp_path):
    source = _model(0)
    twin = _twin(source)
    trained = _step(source, backend)
    for x, y in BATCHES[:3]:
        trained(x=x, y=y)
    trained.save(tmp_path / "ckpt.safetensors")
    optimizer = _torch_sgd(twin)
    _torch_train(twin, optimizer, BATCHES[:3])
    model = _model(1)  # other values, until the checkpoint is loaded
    f = _function(model, backend)
    step = _step(model, backend)
    step.load(tmp_path / "ckpt.safetensors")
    _assert_state(model, twin)
    _assert_logits(f(PROBE), twin)
    # Resumed with the checkpoint's momentum: on as torch goes on.
    losses = [step(x=x, y=y) for x, y in BATCHES[3:]]
    np.testing.assert_allclose(losses, _torch_train(twin, optimizer, BATCHES[3:]), rtol=1e-10)
    _assert_logits(f(PROBE), twin)


def test_assigning_step_params_sets_the_value_for_the_module_and_its_functions(backend):
    model = _model()
    twin = _twin(model)
    step = _step(model, backend)
    f = _function(model, backend)
    weight, mean = RNG.standard_normal((5, 4)), RNG.standard_normal(5)
    step.params["0.weight"] = weight
    step.state["1.running_mean"] = mean
    with torch.no_grad():
        twin[0].weight.copy_(torch.from_numpy(weight))
        twin[1].running_mean.copy_(torch.from_numpy(mean))
    _assert_state(model, twin)
    _assert_logits(f(PROBE), twin)
    losses = [step(x=x, y=y) for x, y in BATCHES]
    np.testing.assert_allclose(losses, _torch_train(twin, _torch_sgd(twin), BATCHES), rtol=1e-10)
    _assert_logits(f(PROBE), twin)


# ---- what the one owner refuses and shares ---------------------------------------------------

def test_one_parameter_under_two_names_in_one_graph_is_refused():
    layer = nn.Linear(2, 2)
    old = layer.weight
    outer = nn.Sequential(layer)  # renames it: 0.weight, the same parameter
    x = sg.input("x", (1, 2))
    with pytest.raises(ValueError, match="'weight' and '0.weight' are one parameter under two names"):
        sg.function([x], x @ old + outer(x))


def test_a_step_and_a_function_of_one_model_take_turns():
    """They share the parameters, so their calls (and the module's reads) share one lock."""
    model = _model()
    step, f = _step(model, "numpy"), _function(model, "numpy")
    assert step._lock is f._lock is model[0].weight.attrs["cell"].lock
    assert _step(_model(), "numpy")._lock is not step._lock  # another model's: independent


# ---- a backend keeping its own copies (CUDA), on the simulated device ------------------------

@pytest.fixture
def simulated(monkeypatch):
    """backend="cuda" on tests/backends/test_backend_cuda.py's simulated device (no GPU needed)."""
    import cffi

    from symgrad.backends.build import cache
    from symgrad.backends import cuda
    spec = importlib.util.spec_from_file_location(
        "_simulated_cuda", Path(__file__).parents[1] / "backends" / "test_backend_cuda.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def build(program, flags, arch):
        ffi = cffi.FFI()
        ffi.cdef(cuda.CDEF)
        built = type("Module", (), {})()
        built.ffi = ffi
        program._ffi = ffi  # the device reads it before the program's own assignment
        built.lib = module.SimulatedDevice(program)
        return cache.BuiltModule(built, "simulated", Path("simulated.cu"), Path("simulated.so"), Path("."))

    monkeypatch.setattr(cuda, "device_count", lambda: (1, ""))
    monkeypatch.setattr(cuda.CudaProgram, "_build", build)


def test_device_copies_and_host_values_stay_one_value(simulated):
    """A CUDA step trains on device copies; a NumPy step and function work on the host values;
    turn by turn each sees what the other trained, and load_state_dict reaches the device."""
    model = _model()
    twin = _twin(model)
    f = _function(model, "numpy")
    # No momentum: after load_state_dict the steps go on as a fresh torch optimizer does.
    steps = [_step(model, "cuda", lr=LR, momentum=0.0), _step(model, "numpy", lr=LR / 2, momentum=0.0)]
    optimizers = [_torch_sgd(twin, lr=LR, momentum=0.0), _torch_sgd(twin, lr=LR / 2, momentum=0.0)]
    for k, (x, y) in enumerate(BATCHES):
        got = steps[k % 2](x=x, y=y)
        assert got == pytest.approx(_torch_train(twin, optimizers[k % 2], [(x, y)])[0], rel=1e-10)
        _assert_state(model, twin)  # read from the device after the CUDA step
        _assert_logits(f(PROBE), twin)
        _assert_logits(steps[0].predict(x=PROBE), twin)
        for name in steps[0].params:
            np.testing.assert_allclose(steps[0].params[name], steps[1].params[name], rtol=0, atol=0)
    source = _twin(_model(1))
    model.load_state_dict(source.state_dict())
    _assert_logits(steps[0].predict(x=PROBE), source)
    x, y = BATCHES[0]
    want = _torch_train(source, _torch_sgd(source, momentum=0.0), [(x, y)])[0]
    assert steps[0](x=x, y=y) == pytest.approx(want, rel=1e-10)
    _assert_logits(f(PROBE), source)
    del steps, optimizers
    gc.collect()  # the device step, which held the newest values, is gone: they stayed the model's
    _assert_state(model, source)
    _assert_logits(f(PROBE), source)
