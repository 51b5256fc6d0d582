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


def _step_nodes(optimizer_class, count: int, **options) -> int:
    """Nodes of a step training `count` separate parameters with `optimizer_class`."""
    x = sg.input("x", (4, 3))
    params = [sg.param(f"w{k}", (3, 2), init="ones") for k in range(count)]
    loss = sum((x @ w).sum() for w in params)
    optimizer = optimizer_class(params, lr=1e-3, **options)
    return len(sg.train_step(loss, optimizer=optimizer, backend="numpy").graph.nodes)


def test_adamw_is_a_few_nodes_per_parameter():
    """AdamW's update of a parameter is a few nodes more than SGD's (optimizer.formula: the bias
    corrections, the decay factor, the second moment and the parameter's update one node each), not
    a node per operation and constant: every pass, the lowering and the render walk every node, and
    a GPT layer's AdamW updates were 400 of its 584 nodes."""
    def per_parameter(optimizer_class, **options):
        return _step_nodes(optimizer_class, 3, **options) - _step_nodes(optimizer_class, 2, **options)
    extra = per_parameter(sg.optim.AdamW, weight_decay=0.1) - per_parameter(sg.optim.SGD)
    assert extra <= 16, extra   # 37 when each operation and constant was a node (11 now)


def test_formula_makes_its_op_once_for_plain_constants_only(monkeypatch):
    """formula's op is made once per function and the numbers it closes over (sympy's work is not
    repeated per parameter); a function closing over an object is made again at every call, since
    the object's attributes may have changed."""
    from symgrad.optim import optimizer as module
    made = []
    real = module.derived_op
    monkeypatch.setattr(module, "derived_op", lambda *args: made.append(args) or real(*args))
    monkeypatch.setattr(module, "_FORMULAS", {})
    x = sg.input("x", (3,))

    def scaled(c):
        return module.formula("scaled", lambda a: c * a, x)

    assert scaled(2.0).op is scaled(2.0).op and len(made) == 1
    assert scaled(3.0).op.expr != scaled(2.0).op.expr and len(made) == 2

    class Holder:
        value = 2.0
    holder = Holder()

    def held():
        return module.formula("held", lambda a: holder.value * a, x)

    first = held()
    holder.value = 3.0
    assert held().op.expr != first.op.expr and len(made) == 4
