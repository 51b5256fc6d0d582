"""Optimizers constructed as torch's: `sg.optim.AdamW(model.parameters(), lr=...)` or with
parameter-group dicts, then `sg.train_step(loss, optimizer=opt)`; `opt.param_groups` as torch's,
each group's lr a runtime value of the step. Trained against torch.optim, float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import symgrad as sg
from symgrad import nn

torch.set_num_threads(1)

SIZES = (4, 6, 3)
RNG = np.random.default_rng(11)
BATCHES = [(RNG.standard_normal((8, SIZES[0])), RNG.integers(0, SIZES[2], 8)) for _ in range(6)]
B = sg.Dim("B")


def _models(seed: int = 0):
    torch.manual_seed(seed)
    twin = torch.nn.Sequential(torch.nn.Linear(SIZES[0], SIZES[1]), torch.nn.Tanh(),
                               torch.nn.Linear(SIZES[1], SIZES[2])).double()
    model = nn.Sequential(nn.Linear(SIZES[0], SIZES[1]), nn.Tanh(), nn.Linear(SIZES[1], SIZES[2])).double()
    model.load_state_dict(twin.state_dict())
    return model, twin


def _loss(model):
    x, y = sg.input("x", (B, SIZES[0]), "float64"), sg.input("y", (B,), "int64")
    return sg.cross_entropy(model(x), y)


def _torch_step(twin, optimizer, x, y) -> float:
    optimizer.zero_grad()
    loss = torch.nn.functional.cross_entropy(twin(torch.from_numpy(x)), torch.from_numpy(y))
    loss.backward()
    optimizer.step()
    return loss.item()


def _split(named):
    """nanoGPT's groups: matrices decay, vectors do not."""
    return ([p for _, p in named if p.ndim >= 2], [p for _, p in named if p.ndim < 2])


def _assert_same_state(model, twin):
    ours = model.state_dict()
    for name, value in twin.state_dict().items():
        np.testing.assert_allclose(ours[name], value.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)


CASES = {
    "sgd": (lambda ps, **kw: sg.optim.SGD(ps, lr=0.1, momentum=0.9, **kw),
            lambda ps, **kw: torch.optim.SGD(ps, lr=0.1, momentum=0.9, **kw)),
    "adam": (lambda ps, **kw: sg.optim.Adam(ps, lr=0.01, **kw), lambda ps, **kw: torch.optim.Adam(ps, lr=0.01, **kw)),
    "adamw": (lambda ps, **kw: sg.optim.AdamW(ps, lr=0.01, weight_decay=0.1, **kw),
              lambda ps, **kw: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1, **kw)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_constructed_with_the_parameters_trains_as_torch(name):
    ours, theirs = CASES[name]
    model, twin = _models()
    opt = ours(model.parameters())
    step = sg.train_step(_loss(model), optimizer=opt, backend="numpy")
    topt = theirs(twin.parameters())
    for x, y in BATCHES:
        assert step(x=x, y=y) == pytest.approx(_torch_step(twin, topt, x, y), rel=1e-12)
    _assert_same_state(model, twin)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_parameter_groups_with_their_own_options_and_lrs_train_as_torch(name):
    ours, theirs = CASES[name]
    model, twin = _models()
    decay, plain = _split(list(model.named_parameters()))
    tdecay, tplain = _split(list(twin.named_parameters()))
    opt = ours([{"params": decay, "weight_decay": 0.2}, {"params": plain, "weight_decay": 0.0, "lr": 0.003}])
    topt = theirs([{"params": tdecay, "weight_decay": 0.2}, {"params": tplain, "weight_decay": 0.0, "lr": 0.003}])
    step = sg.train_step(_loss(model), optimizer=opt, backend="numpy")
    for k, (x, y) in enumerate(BATCHES):
        if k == 3:  # a group's lr is a runtime value: set as in torch, no recompiling
            module = step.module
            opt.param_groups[1]["lr"] = 0.05
            topt.param_groups[1]["lr"] = 0.05
            assert step.module is module
        assert step(x=x, y=y) == pytest.approx(_torch_step(twin, topt, x, y), rel=1e-12)
    _assert_same_state(model, twin)


def test_param_groups_are_torchs():
    model, twin = _models()
    decay, plain = _split(list(model.named_parameters()))
    tdecay, tplain = _split(list(twin.named_parameters()))
    for ours, theirs in [(sg.optim.SGD(model.parameters(), lr=0.1, nesterov=True, momentum=0.5),
                          torch.optim.SGD(twin.parameters(), lr=0.1, nesterov=True, momentum=0.5)),
                         (sg.optim.AdamW([{"params": decay}, {"params": plain, "weight_decay": 0.0, "lr": 0.5}],
                                         betas=(0.8, 0.9)),
                          torch.optim.AdamW([{"params": tdecay}, {"params": tplain, "weight_decay": 0.0, "lr": 0.5}],
                                            betas=(0.8, 0.9)))]:
        assert len(ours.param_groups) == len(theirs.param_groups)
        for group, tgroup in zip(ours.param_groups, theirs.param_groups):
            assert set(group) <= set(tgroup)
            for key in group:
                if key == "params":
                    assert [p.shape for p in group[key]] == [tuple(t.shape) for t in tgroup[key]]
                else:
                    assert group[key] == tgroup[key], key
        assert set(ours.defaults) <= set(theirs.defaults)
        assert all(ours.defaults[k] == theirs.defaults[k] for k in ours.defaults)


def test_step_lr_and_the_groups_lrs_are_one_set_of_runtime_values():
    model, _ = _models()
    decay, plain = _split(list(model.named_parameters()))
    opt = sg.optim.AdamW([{"params": decay}, {"params": plain, "lr": 0.5}], lr=0.01)
    step = sg.train_step(_loss(model), optimizer=opt, backend="numpy")
    assert step.optimizer is opt
    assert step.lr == 0.01 and opt.param_groups[1]["lr"] == 0.5
    assert [g["lr"] for g in step.param_groups] == [0.01, 0.5]
    assert step.state["param_groups.1.lr"] == 0.5
    step.param_groups[1]["lr"] = 0.25  # the step's own groups: the same variables
    assert opt.param_groups[1]["lr"] == 0.25 and step.state["param_groups.1.lr"] == 0.25
    step.lr = 0.125  # every group's
    assert [g["lr"] for g in opt.param_groups] == [0.125, 0.125]
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['lr'\] must be a finite non-negative number"):
        opt.param_groups[0]["lr"] = float("nan")
    with pytest.raises(ValueError, match="step.lr must be a finite non-negative number"):
        step.lr = -1.0
    assert step.lr == 0.125
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['weight_decay'\] is compiled into the train step"):
        opt.param_groups[1]["weight_decay"] = 0.5
    opt.param_groups[1]["weight_decay"] = opt.param_groups[1]["weight_decay"]  # the same value: allowed
    opt.param_groups[0]["initial_lr"] = 0.01  # other keys are kept, as in a dict


def test_group_lrs_are_saved_and_loaded_with_the_step(tmp_path):
    model, _ = _models()
    decay, plain = _split(list(model.named_parameters()))
    opt = sg.optim.SGD([{"params": decay}, {"params": plain, "lr": 0.5}], lr=0.01)
    step = sg.train_step(_loss(model), optimizer=opt, backend="numpy")
    opt.param_groups[1]["lr"] = 0.2
    step.save(tmp_path / "step.safetensors")
    opt.param_groups[1]["lr"] = 0.3
    step.load(tmp_path / "step.safetensors")
    assert opt.param_groups[1]["lr"] == 0.2


def test_the_older_form_keeps_working():
    model, twin = _models()
    step = sg.train_step(_loss(model), model.parameters(), sg.optim.SGD(0.1), backend="numpy")
    topt = torch.optim.SGD(twin.parameters(), lr=0.1)
    for x, y in BATCHES[:3]:
        assert step(x=x, y=y) == pytest.approx(_torch_step(twin, topt, x, y), rel=1e-12)
    assert step.param_groups[0]["lr"] == 0.1 and list(step.state) == ["lr"]
    # The older form's groups become the optimizer's param_groups, each with its runtime lr.
    opt = sg.optim.AdamW(lr=0.01)
    decay, plain = _split(list(model.named_parameters()))
    step = sg.train_step(_loss(model), [{"params": decay}, {"params": plain, "weight_decay": 0.0}], opt,
                         backend="numpy")
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]
    opt.param_groups[1]["lr"] = 0.5
    assert step.state["param_groups.1.lr"] == 0.5 and step.lr == 0.01
    step = sg.train_step(_loss(model), sg.optim.SGD(model.parameters(), lr=0.1), backend="numpy")  # positional
    assert step.lr == 0.1


def test_bad_construction_is_refused():
    model, _ = _models()
    params = model.parameters()
    loss = _loss(model)
    with pytest.raises(ValueError, match="empty parameter list"):
        sg.optim.SGD([], lr=0.1)
    with pytest.raises(TypeError, match=r"SGD: params\[1\] must be an sg.param"):
        sg.optim.SGD([params[0], "bias"], lr=0.1)
    with pytest.raises(TypeError, match="wrap it in a list"):
        sg.optim.SGD(params[0], lr=0.1)
    with pytest.raises(TypeError, match="not a mix"):
        sg.optim.SGD([{"params": params[:1]}, params[1]], lr=0.1)
    with pytest.raises(ValueError, match="appear more than once"):
        sg.optim.Adam([{"params": params}, {"params": params[:1]}])
    with pytest.raises(ValueError, match=r"unknown parameter-group option\(s\) \['momentum'\]"):
        sg.optim.Adam([{"params": params, "momentum": 0.9}])
    with pytest.raises(ValueError, match="Adam: eps and weight_decay must be non-negative"):
        sg.optim.Adam([{"params": params, "weight_decay": -1.0}])
    with pytest.raises(ValueError, match="SGD: lr must be a finite non-negative number"):
        sg.optim.SGD([{"params": params, "lr": -1.0}], lr=0.1)
    with pytest.raises(TypeError, match="got a number for params and lr"):
        sg.optim.SGD(0.1, 0.9)
    with pytest.raises(TypeError, match="no parameters to train"):
        sg.train_step(loss, optimizer=sg.optim.SGD(lr=0.1), backend="numpy")
    with pytest.raises(ValueError, match="pass them once"):
        sg.train_step(loss, params[:2], sg.optim.SGD(params, lr=0.1), backend="numpy")
    with pytest.raises(TypeError, match="optimizer must be an sg.optim optimizer"):
        sg.train_step(loss, params, torch.optim.SGD([torch.zeros(1, requires_grad=True)]), backend="numpy")


@pytest.fixture(scope="module")
def c_groups_step():
    """One C step with two groups (compiled once for the module)."""
    model, twin = _models(1)
    decay, plain = _split(list(model.named_parameters()))
    tdecay, tplain = _split(list(twin.named_parameters()))
    opt = sg.optim.AdamW([{"params": decay}, {"params": plain, "weight_decay": 0.0, "lr": 0.002}], lr=0.01)
    topt = torch.optim.AdamW([{"params": tdecay}, {"params": tplain, "weight_decay": 0.0, "lr": 0.002}], lr=0.01)
    return model, twin, opt, topt, sg.train_step(_loss(model), optimizer=opt, backend="c")


def test_group_lrs_are_runtime_values_in_c(c_groups_step):
    model, twin, opt, topt, step = c_groups_step
    for k, (x, y) in enumerate(BATCHES):
        for group, tgroup in zip(opt.param_groups, topt.param_groups):
            group["lr"] = tgroup["lr"] = tgroup["lr"] * 0.7 if k % 2 else tgroup["lr"]
        assert step(x=x, y=y) == pytest.approx(_torch_step(twin, topt, x, y), rel=1e-10)
    _assert_same_state(model, twin)
