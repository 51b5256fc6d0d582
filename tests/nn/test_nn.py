"""sg.nn modules: registration and names, torch's initialisation and layouts, forward against torch."""

import numpy as np
import pytest
import torch

import symgrad as sg
from symgrad.api.cells import current_value
from symgrad import nn

torch.set_num_threads(1)  # a 2-core machine shared by parallel runs: torch's thread pool only contends


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
        self.head = nn.Linear(4, 2, bias=False)
        self.scale = sg.param("anything", (2,), init="ones")

    def forward(self, x):
        return self.head(self.inner(x)) * self.scale


def test_names_are_dotted_paths_and_name_the_graph_leaves():
    model = nn.Sequential(Block(), nn.Tanh(), nn.Linear(2, 5))
    names = [n for n, _ in model.named_parameters()]
    assert names == ["0.scale", "0.inner.0.weight", "0.inner.0.bias", "0.head.weight", "2.weight", "2.bias"]
    assert [p.name for p in model.parameters()] == names
    # A submodule lists its own parameters relative to itself, as torch does.
    assert [n for n, _ in model[0].inner.named_parameters()] == ["0.weight", "0.bias"]
    assert model[0].head.bias is None
    assert model[2].weight.shape == (5, 2)  # torch's (out, in) layout
    x = sg.input("x", (sg.Dim("B"), 3))
    step = sg.train_step(sg.sum(model(x)), model.parameters(), sg.optim.SGD(lr=0.1), backend="numpy")
    assert list(step.params) == names


def test_linear_default_init_is_torchs_uniform_bound():
    sg.manual_seed(0)
    layer = nn.Linear(400, 300)
    bound = 1 / np.sqrt(400)
    for leaf in (layer.weight, layer.bias):
        values = current_value(leaf)
        assert values.dtype == np.float32
        assert np.abs(values).max() <= bound
        assert np.abs(values).max() > 0.95 * bound  # spread over the whole range, not a narrower one
    assert abs(float(current_value(layer.weight).std()) - bound / np.sqrt(3)) < 0.01 * bound
    sg.manual_seed(0)
    again = nn.Linear(400, 300)
    np.testing.assert_array_equal(current_value(again.weight), current_value(layer.weight))


def test_linear_init_override():
    zeros = nn.Linear(3, 2, init="zeros")
    assert not current_value(zeros.weight).any() and not current_value(zeros.bias).any()
    custom = nn.Linear(3, 2, init=lambda shape: np.full(shape, 0.5), dtype="float64")
    assert custom.weight.dtype == "float64" and (current_value(custom.weight) == 0.5).all()
    with pytest.raises(ValueError, match="init returned shape"):
        nn.Linear(3, 2, init=lambda shape: np.zeros(3))
    with pytest.raises(ValueError, match="in_features"):
        nn.Linear(0, 2)


def test_forward_matches_torch_after_loading_its_state_dict(rng):
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Sigmoid(), torch.nn.Linear(5, 4),
                                    torch.nn.ReLU(), torch.nn.Linear(4, 2), torch.nn.Tanh()).double()
    model = nn.Sequential(nn.Linear(6, 5), nn.Sigmoid(), nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2),
                          nn.Tanh()).double()
    model.load_state_dict(reference.state_dict())
    x = sg.input("x", (sg.Dim("B"), 6), "float64")
    xb = rng.standard_normal((7, 6))
    out = sg.function([x], model(x), backend="numpy")(xb)
    np.testing.assert_allclose(out, reference(torch.from_numpy(xb)).detach().numpy(), atol=1e-12)


def test_linear_accepts_leading_axes(rng):
    layer = nn.Linear(3, 2, dtype="float64")
    x = sg.input("x", (2, 4, 3), "float64")
    xb = rng.standard_normal((2, 4, 3))
    out = sg.function([x], layer(x), backend="numpy")(xb)
    w, b = current_value(layer.weight), current_value(layer.bias)
    np.testing.assert_allclose(out, xb @ w.T + b, atol=1e-12)
    with pytest.raises(ValueError, match="in_features = 3"):
        layer(sg.input("z", (2, 4), "float64"))


def test_train_eval_reach_every_submodule():
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Dropout(0.5), nn.BatchNorm1d(2)))
    assert all(m.training for m in model.modules())
    assert model.eval() is model
    assert not any(m.training for m in model.modules())
    model.train()
    assert all(m.training for m in model.modules())


def test_state_dict_round_trip_and_errors():
    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    state = model.state_dict()
    assert list(state) == ["0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var",
                           "1.num_batches_tracked"]
    state["0.bias"] = np.array([1.0, 2.0, 3.0])
    model.load_state_dict(state)
    assert model.state_dict()["0.bias"].tolist() == [1.0, 2.0, 3.0]  # the current value; init is the first
    assert model[0].bias.name == "0.bias" and model[0].bias.dtype == "float32"
    with pytest.raises(ValueError, match="0.weight"):
        model.load_state_dict({**state, "0.weight": np.zeros((2, 2))})
    with pytest.raises(KeyError, match="missing"):
        model.load_state_dict({"0.weight": state["0.weight"]})


def test_state_dict_returns_the_trained_values(backend, rng):
    """After training, state_dict() holds what the step trained (parameters and running statistics),
    as torch's does; they stay readable after the step is gone; load_state_dict starts afresh."""
    import gc
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 1))
    initial = model.state_dict()
    x, y = sg.input("x", (8, 3)), sg.input("y", (8, 1))
    step = sg.train_step(sg.mse_loss(model(x), y), model.parameters(), sg.optim.SGD(lr=0.1), backend=backend)
    for _ in range(3):
        step(x=rng.standard_normal((8, 3)).astype(np.float32), y=rng.standard_normal((8, 1)).astype(np.float32))
    trained = model.state_dict()
    assert list(trained) == list(initial)
    for name in step.params:
        np.testing.assert_array_equal(trained[name], step.params[name], err_msg=name)
    moved = {name for name in step.params if not np.array_equal(trained[name], initial[name])}
    assert moved >= set(step.params) - {"0.bias"}
    # BatchNorm takes the mean out: 0.bias's gradient is zero but for float32 rounding (about 1e-8 on
    # the CPU, where the step is lost in the bias's rounding; larger on CUDA, whose steps then show).
    np.testing.assert_allclose(trained["0.bias"], initial["0.bias"], rtol=0, atol=1e-6)
    np.testing.assert_array_equal(trained["1.running_mean"], step.state["1.running_mean"])
    assert int(trained["1.num_batches_tracked"]) == 3
    model.state_dict()["0.bias"][:] = 7  # a copy: the step's value is untouched
    np.testing.assert_array_equal(step.params["0.bias"], trained["0.bias"])
    del step
    gc.collect()
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(value, trained[name], err_msg=name)
    model.load_state_dict(initial)  # sets the parameters' values: the model's, not a step's copy
    for name, value in model.state_dict().items():
        np.testing.assert_array_equal(value, initial[name], err_msg=name)


def test_module_attribute_errors():
    class NoInit(nn.Module):
        def __init__(self):
            self.w = 1

    with pytest.raises(AttributeError, match="super"):
        NoInit()
    block = nn.Module()
    with pytest.raises(TypeError, match="computed"):
        block.w = sg.input("x", (2,)) * 2
    with pytest.raises(AttributeError, match="no attribute 'missing'"):
        block.missing


def test_two_unattached_layers_collide_by_name():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    x = sg.input("x", (1, 2))
    with pytest.raises(ValueError, match="'weight'"):
        sg.train_step(sg.sum(b(a(x))), [*a.parameters(), *b.parameters()], sg.optim.SGD(lr=0.1))
