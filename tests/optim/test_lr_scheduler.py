"""sg.optim.lr_scheduler against torch.optim.lr_scheduler: the same lr sequences over 100 steps
(value for value, every group), on an optimizer or a train step, and a scheduled step training
as torch's."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

import symgrad as sg
from symgrad import nn
from symgrad.optim import lr_scheduler as S

torch.set_num_threads(1)
T = torch.optim.lr_scheduler
STEPS = 100
LRS = (0.1, 0.03)  # two groups with their own lrs


def _ours(lrs=LRS, optimizer=sg.optim.SGD):
    params = [sg.param(f"p{k}", (2,), dtype="float64") for k in range(len(lrs))]
    return optimizer([{"params": [p], "lr": lr} for p, lr in zip(params, lrs)], lr=0.5)


def _theirs(lrs=LRS, optimizer=torch.optim.SGD):
    return optimizer([{"params": [torch.zeros(2, requires_grad=True)], "lr": lr} for lr in lrs], lr=0.5)


class Halving:
    """A callable object: LambdaLR's state_dict keeps its __dict__."""

    def __init__(self, every):
        self.every = every

    def __call__(self, epoch):
        return 0.5 ** (epoch // self.every)


# (name, our scheduler of an optimizer, torch's): several parameterisations of each class.
CASES = [
    ("LambdaLR", lambda o, L: L.LambdaLR(o, lambda e: 0.95 ** e)),
    ("LambdaLR per group", lambda o, L: L.LambdaLR(o, [lambda e: 1 / (1 + e), Halving(7)])),
    ("StepLR", lambda o, L: L.StepLR(o, step_size=10)),
    ("StepLR gamma", lambda o, L: L.StepLR(o, step_size=3, gamma=0.7)),
    ("MultiStepLR", lambda o, L: L.MultiStepLR(o, milestones=[10, 30, 30, 80], gamma=0.5)),
    ("ExponentialLR", lambda o, L: L.ExponentialLR(o, gamma=0.97)),
    ("CosineAnnealingLR", lambda o, L: L.CosineAnnealingLR(o, T_max=100)),
    ("CosineAnnealingLR restarts", lambda o, L: L.CosineAnnealingLR(o, T_max=17, eta_min=0.001)),
    ("LinearLR", lambda o, L: L.LinearLR(o)),
    ("LinearLR decay", lambda o, L: L.LinearLR(o, start_factor=1.0, end_factor=0.05, total_iters=60)),
    ("ConstantLR", lambda o, L: L.ConstantLR(o, factor=0.5, total_iters=20)),
    ("SequentialLR warmup cosine", lambda o, L: L.SequentialLR(
        o, [L.LinearLR(o, start_factor=0.01, total_iters=10), L.CosineAnnealingLR(o, T_max=90, eta_min=1e-4)],
        milestones=[10])),
    ("SequentialLR three", lambda o, L: L.SequentialLR(
        o, [L.ConstantLR(o, factor=0.1, total_iters=5), L.ExponentialLR(o, gamma=0.9),
            L.StepLR(o, step_size=7, gamma=0.5)], milestones=[5, 40])),
    ("OneCycleLR", lambda o, L: L.OneCycleLR(o, max_lr=1.0, total_steps=STEPS + 1, cycle_momentum=False)),
    ("OneCycleLR linear three-phase", lambda o, L: L.OneCycleLR(
        o, max_lr=[0.5, 0.2], epochs=11, steps_per_epoch=10, pct_start=0.25, anneal_strategy="linear",
        three_phase=True, cycle_momentum=False, div_factor=10.0, final_div_factor=100.0)),
]


def _sequence(scheduler, optimizer_step=lambda: None) -> list[list[float]]:
    rates = [scheduler.get_last_lr()]
    for _ in range(STEPS):
        optimizer_step()
        scheduler.step()
        rates.append(scheduler.get_last_lr())
    return rates


@pytest.mark.parametrize("name, make", CASES, ids=[c[0] for c in CASES])
def test_lr_sequences_equal_torchs(name, make):
    ours, theirs = _ours(), _theirs()
    mine = _sequence(make(ours, S))
    topt = theirs
    reference = _sequence(make(topt, T), topt.step)
    assert mine == reference  # value for value: the same recurrences in the same floats
    assert [g["lr"] for g in ours.param_groups] == [g["lr"] for g in topt.param_groups]


@pytest.mark.parametrize("name, make", CASES[::3], ids=[c[0] for c in CASES[::3]])
def test_state_dict_resumes_the_sequence(name, make):
    ours = _ours()
    scheduler = make(ours, S)
    for _ in range(37):
        scheduler.step()
    saved = scheduler.state_dict()
    assert "optimizer" not in saved
    rest = [scheduler.step() or scheduler.get_last_lr() for _ in range(20)]
    again = _ours()
    resumed = make(again, S)
    resumed.load_state_dict(saved)
    for group, lr in zip(again.param_groups, saved["_last_lr"]):
        group["lr"] = lr  # the rates are the optimizer's (a step's: step.save / step.load), as in torch
    assert [resumed.step() or resumed.get_last_lr() for _ in range(20)] == rest


def test_state_dict_keys_are_torchs():
    ours, theirs = S.StepLR(_ours(), 5), T.StepLR(_theirs(), 5)
    assert set(ours.state_dict()) <= set(theirs.state_dict())
    lam = S.LambdaLR(_ours(), [lambda e: 1.0, Halving(3)])
    assert lam.state_dict()["lr_lambdas"] == [None, {"every": 3}]


def test_a_scheduler_on_a_step_sets_its_runtime_lrs():
    sg.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2)).double()
    x, y = sg.input("x", (4, 3), "float64"), sg.input("y", (4,), "int64")
    weight, bias = model.parameters()
    opt = sg.optim.SGD([{"params": [weight]}, {"params": [bias], "lr": 0.01}], lr=0.1)
    step = sg.train_step(sg.cross_entropy(model(x), y), optimizer=opt, backend="numpy")
    module = step.module
    scheduler = S.StepLR(step, step_size=2, gamma=0.5)
    assert scheduler.optimizer is step
    for k in range(5):
        scheduler.step()
    assert step.lr == 0.1 * 0.25 and step.state["param_groups.1.lr"] == 0.01 * 0.25
    assert scheduler.get_last_lr() == [0.1 * 0.25, 0.01 * 0.25] == [g["lr"] for g in opt.param_groups]
    assert step.module is module  # no recompiling
    on_optimizer = S.ExponentialLR(opt, gamma=0.5)  # the optimizer bound to the step: the same variables
    on_optimizer.step()
    assert step.lr == 0.1 * 0.25 * 0.5


def test_a_scheduler_made_before_the_step_drives_it():
    """torch's order: optimizer, scheduler, then the loop; the step compiled in between starts from
    the scheduler's first lr and follows it."""
    sg.manual_seed(0)
    model = nn.Linear(3, 2, dtype="float64")
    x, y = sg.input("x", (4, 3), "float64"), sg.input("y", (4,), "int64")
    opt = sg.optim.Adam(model.parameters(), lr=0.1)
    scheduler = S.LinearLR(opt, start_factor=0.25, total_iters=3)
    step = sg.train_step(sg.cross_entropy(model(x), y), optimizer=opt, backend="numpy")
    assert step.lr == 0.025
    rates = []
    for _ in range(4):
        scheduler.step()
        rates.append(step.lr)
    theirs = _theirs((0.1,), torch.optim.Adam)
    reference = T.LinearLR(theirs, start_factor=0.25, total_iters=3)
    expected = []
    for _ in range(4):
        theirs.step()
        reference.step()
        expected.append(theirs.param_groups[0]["lr"])
    assert rates == expected


def test_bad_schedulers_are_refused():
    with pytest.raises(ValueError, match="cycle_momentum=True .* Pass cycle_momentum=False"):
        S.OneCycleLR(_ours(), max_lr=0.1, total_steps=10)
    with pytest.raises(TypeError, match="no parameter groups yet"):
        S.StepLR(sg.optim.SGD(lr=0.1), step_size=2)
    with pytest.raises(TypeError, match="expected a train step .* got Adam"):
        S.StepLR(torch.optim.Adam([torch.zeros(1, requires_grad=True)]), step_size=2)
    with pytest.raises(ValueError, match="step_size must be a positive int"):
        S.StepLR(_ours(), step_size=0)
    with pytest.raises(ValueError, match="expected 2 lr_lambdas, but got 1"):
        S.LambdaLR(_ours(), [lambda e: 1.0])
    with pytest.raises(ValueError, match="same step or optimizer"):
        a, b = _ours(), _ours()
        S.SequentialLR(a, [S.StepLR(a, 2), S.StepLR(b, 2)], milestones=[3])
    with pytest.raises(ValueError, match="one milestone fewer than schedulers"):
        a = _ours()
        S.SequentialLR(a, [S.StepLR(a, 2)], milestones=[3])
    cycle = S.OneCycleLR(_ours(), max_lr=0.1, total_steps=3, cycle_momentum=False)
    for _ in range(3):
        cycle.step()
    with pytest.raises(ValueError, match="Tried to step 4 times"):
        cycle.step()
    with pytest.raises(KeyError, match="no 'initial_lr'"):
        S.StepLR(_ours(), step_size=2, last_epoch=5)


def test_a_scheduled_step_trains_as_torch():
    """AdamW with nanoGPT's groups, linear warmup then cosine decay, on a symgrad step and in torch."""
    torch.manual_seed(0)
    twin = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).double()
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    model.load_state_dict(twin.state_dict())
    rng = np.random.default_rng(2)
    batches = [(rng.standard_normal((8, 4)), rng.integers(0, 3, 8)) for _ in range(8)]

    def groups(named):
        return [{"params": [p for _, p in named if p.ndim >= 2], "weight_decay": 0.1},
                {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0}]

    x, y = sg.input("x", (sg.Dim("B"), 4), "float64"), sg.input("y", (sg.Dim("B"),), "int64")
    step = sg.train_step(sg.cross_entropy(model(x), y), backend="numpy",
                         optimizer=sg.optim.AdamW(groups(list(model.named_parameters())), lr=0.02))
    topt = torch.optim.AdamW(groups(list(twin.named_parameters())), lr=0.02)

    def schedule(o, L):
        return L.SequentialLR(o, [L.LinearLR(o, start_factor=0.1, total_iters=3),
                                  L.CosineAnnealingLR(o, T_max=5, eta_min=0.002)], milestones=[3])

    ours, theirs = schedule(step, S), schedule(topt, T)
    for xb, yb in batches:
        loss = step(x=xb, y=yb)
        topt.zero_grad()
        tloss = torch.nn.functional.cross_entropy(twin(torch.from_numpy(xb)), torch.from_numpy(yb))
        tloss.backward()
        topt.step()
        assert loss == pytest.approx(tloss.item(), rel=1e-12)
        ours.step()
        theirs.step()
        assert ours.get_last_lr() == theirs.get_last_lr()
    state = model.state_dict()
    for name, value in twin.state_dict().items():
        np.testing.assert_allclose(state[name], value.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)


def test_epoch_argument_uses_the_closed_form_as_torch():
    ours, theirs = _ours(), _theirs()
    a, b = S.CosineAnnealingLR(ours, T_max=10), T.CosineAnnealingLR(theirs, T_max=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a.step(7)
        b.step(7)
    assert a.get_last_lr() == b.get_last_lr()
    assert math.isclose(a.get_last_lr()[0], 0.1 * (1 + math.cos(math.pi * 0.7)) / 2)
