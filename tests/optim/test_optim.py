"""SGD and Adam against torch.optim: 50 steps on an MLP, float64, on every backend."""

import numpy as np
import pytest
import torch

import symgrad as sg
from symgrad import nn

torch.set_num_threads(1)  # a 2-core machine shared by parallel runs: torch's thread pool only contends

STEPS = 50
SIZES = (5, 16, 3)


def torch_mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(SIZES[0], SIZES[1]), torch.nn.Tanh(),
                               torch.nn.Linear(SIZES[1], SIZES[2])).double()


def symgrad_mlp(reference: torch.nn.Module) -> nn.Module:
    model = nn.Sequential(nn.Linear(SIZES[0], SIZES[1]), nn.Tanh(), nn.Linear(SIZES[1], SIZES[2])).double()
    return model.load_state_dict(reference.state_dict())


def batches(seed: int, n: int = STEPS, size: int = 8):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((size, SIZES[0])), rng.integers(0, SIZES[2], size)) for _ in range(n)]


def compile_mlp(reference, optimizer, backend):
    model = symgrad_mlp(reference)
    B = sg.Dim("B")
    x, y = sg.input("x", (B, SIZES[0]), "float64"), sg.input("y", (B,), "int64")
    loss = nn.functional.cross_entropy(model(x), y)
    return sg.train_step(loss, model.parameters(), optimizer, backend=backend)


def run_torch(reference, optimizer, data, lr_at=None):
    for k, (xb, yb) in enumerate(data):
        if lr_at is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr_at(k)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(reference(torch.from_numpy(xb)), torch.from_numpy(yb))
        loss.backward()
        optimizer.step()
    return {k: v.detach().numpy() for k, v in reference.state_dict().items()}


def run_symgrad(step, data, lr_at=None):
    for k, (xb, yb) in enumerate(data):
        if lr_at is not None:
            step.lr = lr_at(k)
        step(x=xb, y=yb)


def assert_params_match(step, expected):
    assert list(step.params) == list(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(step.params[name], value, rtol=0, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("config", [
    dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    dict(lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.001),
    dict(lr=0.2),
], ids=["momentum-nesterov-wd", "dampening", "plain"])
def test_sgd_matches_torch(backend, config):
    reference = torch_mlp(0)
    step = compile_mlp(reference, sg.optim.SGD(**config), backend)
    initial = {k: v.detach().numpy().copy() for k, v in reference.state_dict().items()}
    data = batches(1)
    torch_opt = torch.optim.SGD(reference.parameters(), **config)
    expected = run_torch(reference, torch_opt, data)
    run_symgrad(step, data)
    assert_params_match(step, expected)
    # Training moved the parameters: the match is not one of untouched initial values.
    assert np.abs(step.params["0.weight"] - initial["0.weight"]).max() > 1e-2
    if config.get("momentum"):
        last = list(reference.parameters())[-1]
        np.testing.assert_allclose(step.state["2.bias.momentum_buffer"],
                                   torch_opt.state[last]["momentum_buffer"].numpy(), atol=1e-9)


def test_adam_matches_torch(backend):
    config = dict(lr=0.01, betas=(0.85, 0.99), eps=1e-7, weight_decay=0.01)
    reference = torch_mlp(2)
    step = compile_mlp(reference, sg.optim.Adam(**config), backend)
    initial = step.params["0.weight"]
    data = batches(3)
    torch_opt = torch.optim.Adam(reference.parameters(), **config)
    expected = run_torch(reference, torch_opt, data)
    run_symgrad(step, data)
    assert_params_match(step, expected)
    assert np.abs(step.params["0.weight"] - initial).max() > 1e-2
    # The optimizer state is readable and is torch's.
    last = list(reference.parameters())[-1]
    state = torch_opt.state[last]
    assert step.state["2.bias.step"] == pytest.approx(float(state["step"])) == STEPS
    np.testing.assert_allclose(step.state["2.bias.exp_avg"], state["exp_avg"].numpy(), atol=1e-9)
    np.testing.assert_allclose(step.state["2.bias.exp_avg_sq"], state["exp_avg_sq"].numpy(), atol=1e-9)


def test_learning_rate_schedule_without_recompiling(backend):
    reference = torch_mlp(4)
    step = compile_mlp(reference, sg.optim.Adam(lr=0.02), backend)
    program = step.program
    schedule = lambda k: 0.02 * 0.9 ** k  # noqa: E731
    data = batches(5, n=20)
    expected = run_torch(reference, torch.optim.Adam(reference.parameters(), lr=0.02), data, lr_at=schedule)
    run_symgrad(step, data, lr_at=schedule)
    assert step.program is program
    assert step.lr == pytest.approx(schedule(19))
    assert_params_match(step, expected)


def test_optimizer_arguments_are_checked():
    with pytest.raises(ValueError, match="betas"):
        sg.optim.Adam(lr=0.1, betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="lr"):
        sg.optim.Adam(lr=-1.0)
    with pytest.raises(ValueError, match="nesterov"):
        sg.optim.SGD(lr=0.1, nesterov=True)
