"""Checkpoints (symgrad/step/checkpoint.py): save, load, resume bit for bit, and torch interchange.

One model with every kind of state (parameters, BatchNorm buffers, optimizer
state, Dropout's generator, the learning rate) is trained with SGD+momentum
and with Adam on every backend; each step is compiled once per module.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import safetensors
import safetensors.numpy
import safetensors.torch
import torch

import symgrad as sg
from symgrad import nn

RNG = np.random.default_rng(7)
BATCHES = [(RNG.standard_normal((8, 5)).astype(np.float32), RNG.integers(0, 3, 8)) for _ in range(6)]
OPTIMIZERS = {
    "sgd_momentum": lambda: sg.optim.SGD(lr=0.05, momentum=0.9, weight_decay=1e-3),
    "adam": lambda: sg.optim.Adam(lr=1e-2),
}


def _model():
    sg.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Dropout(0.3), nn.Linear(6, 3))


def _torch_model():
    return torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU(),
                               torch.nn.Dropout(0.3), torch.nn.Linear(6, 3))


class Steps:
    """Two steps of two equal models (one trained on, one to load into) per (optimizer, backend):
    two steps of one model would train the same parameters (the model's)."""

    def __init__(self):
        self.built = {}

    def pair(self, optimizer: str, backend: str):
        key = (optimizer, backend)
        if key not in self.built:
            def make(model):
                x, y = sg.input("x", (sg.Dim("B"), 5)), sg.input("y", (sg.Dim("B"),), dtype="int64")
                return sg.train_step(sg.cross_entropy(model(x), y), model.parameters(), OPTIMIZERS[optimizer](),
                                     backend=backend)
            model = _model()
            self.built[key] = (model, make(model), make(_model()))
        return self.built[key]


@pytest.fixture(scope="module")
def steps():
    return Steps()


def _train(step, batches):
    return [step(x=x, y=y) for x, y in batches]


def _all_values(step) -> dict:
    return {name: step._read_variable(name) for name in step._storage}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_resumed_training_equals_uninterrupted_bit_for_bit(steps, backend, optimizer, tmp_path):
    _, trained, resumed = steps.pair(optimizer, backend)
    _train(trained, BATCHES[:3])
    trained.lr = 0.02  # a changed learning rate is state too
    path = tmp_path / "ckpt.safetensors"
    trained.save(path)
    resumed.load(path)
    assert all(np.array_equal(v, resumed._read_variable(n)) for n, v in _all_values(trained).items())
    losses_after = _train(trained, BATCHES[3:])
    assert _train(resumed, BATCHES[3:]) == losses_after  # dropout masks, moments, statistics: all equal
    for name, value in _all_values(trained).items():
        np.testing.assert_array_equal(resumed._read_variable(name), value, err_msg=name)


def test_checkpoint_holds_every_kind_of_state_with_its_role(steps, tmp_path):
    _, step, _ = steps.pair("adam", "numpy")
    path = tmp_path / "adam.safetensors"
    step.save(path)
    tensors = safetensors.numpy.load_file(str(path))
    with safetensors.safe_open(str(path), framework="np") as f:
        roles = json.loads(f.metadata()["roles"])
    assert set(roles) == set(tensors)
    assert {"0.weight", "1.running_mean", "1.num_batches_tracked", "0.weight.exp_avg", "0.weight.step",
            "rng.seed", "rng.counter", "lr"} <= set(tensors)
    assert roles["0.weight"] == "param" and roles["1.running_var"] == "state"
    assert roles["0.weight.exp_avg_sq"] == "optimizer" and roles["rng.counter"] == "rng" and roles["lr"] == "hyper"
    assert tensors["1.num_batches_tracked"].dtype == np.int64


def test_state_dict_is_the_models_and_loads_into_symgrad_and_torch_modules(steps):
    model, step, _ = steps.pair("sgd_momentum", "numpy")  # the model's step: the module reads what it trains
    _train(step, BATCHES[:2])
    state = step.state_dict()
    assert sorted(state) == sorted(model.state_dict())  # parameters and buffers, no optimizer state
    for name, value in model.state_dict().items():  # the trained values
        np.testing.assert_array_equal(value, state[name])
    twin = _torch_model()
    twin.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})  # strict: same keys
    np.testing.assert_array_equal(twin[0].weight.detach().numpy(), state["0.weight"])
    fresh = _model().load_state_dict(state)
    np.testing.assert_array_equal(fresh.state_dict()["1.running_var"], state["1.running_var"])


def test_checkpoint_loads_into_torch_and_a_torch_file_into_a_step(steps, tmp_path):
    _, step, other = steps.pair("adam", "numpy")
    _train(step, BATCHES[:2])
    path = tmp_path / "to_torch.safetensors"
    step.save(path)
    twin = _torch_model()
    result = twin.load_state_dict(safetensors.torch.load_file(str(path)), strict=False)
    assert result.missing_keys == []
    assert "0.weight.exp_avg" in result.unexpected_keys
    for name, value in twin.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), step.state_dict()[name], err_msg=name)

    torch.manual_seed(0)
    source = _torch_model()
    with torch.no_grad():
        source[1].running_mean.uniform_()
    from_torch = tmp_path / "from_torch.safetensors"
    safetensors.torch.save_file(source.state_dict(), str(from_torch))
    moments = other._read_variable("0.weight.exp_avg")
    other.load(from_torch)
    for name, value in source.state_dict().items():
        np.testing.assert_array_equal(other._read_variable(name), value.numpy(), err_msg=name)
    np.testing.assert_array_equal(other._read_variable("0.weight.exp_avg"), moments)  # not in the file: kept


@pytest.mark.parametrize("damage, message", [
    (lambda t: t.update({"0.weight": np.zeros((5, 6), np.float32)}), "'0.weight' is float32[5, 6]"),
    (lambda t: t.update({"0.bias": t["0.bias"].astype(np.float64)}), "'0.bias' is float64[6]"),
    (lambda t: t.update({"head.weight": np.zeros(3, np.float32)}), "['head.weight'] are not variables"),
    (lambda t: t.pop("4.bias"), "parameters ['4.bias'] are missing"),
    (lambda t: t.update({"lr": np.array(-1.0)}), "'lr' (a hyperparameter) must be a finite non-negative"),
])
def test_a_bad_checkpoint_says_what_is_wrong_and_changes_nothing(steps, tmp_path, damage, message):
    _, step, _ = steps.pair("sgd_momentum", "numpy")
    path = tmp_path / "good.safetensors"
    step.save(path)
    tensors = safetensors.numpy.load_file(str(path))
    tensors["0.weight"] = tensors["0.weight"] + 1.0  # would change the step, were it loaded
    damage(tensors)
    bad = tmp_path / "bad.safetensors"
    safetensors.numpy.save_file(tensors, str(bad))
    before = _all_values(step)
    with pytest.raises(ValueError) as caught:
        step.load(bad)
    assert message in str(caught.value) and "nothing loaded" in str(caught.value)
    for name, value in before.items():
        np.testing.assert_array_equal(step._read_variable(name), value, err_msg=name)


def test_a_file_that_is_not_safetensors_is_refused(steps, tmp_path):
    _, step, _ = steps.pair("sgd_momentum", "numpy")
    path = tmp_path / "junk.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        step.load(path)
