"""`sg.optim.lr_scheduler`: torch's learning-rate schedulers, setting a train step's runtime lr.

A scheduler is constructed on a train step, or on the optimizer a step was built with (or
will be: an optimizer constructed with its parameters, as torch's), exactly as torch's on a
torch optimizer:

    step = sg.train_step(loss, optimizer=sg.optim.AdamW(model.parameters(), lr=1e-3))
    scheduler = sg.optim.lr_scheduler.CosineAnnealingLR(step, T_max=100)
    for batch in batches:
        step(**batch)
        scheduler.step()

It drives the `param_groups` of what it was given (symgrad/optim/param_groups.py): each
group's "lr" is a runtime variable of the step (`step.lr` is group 0's), read at every call,
so a new learning rate costs no recompiling. The sequences are torch's, computed as torch
computes them (the same recurrences, in Python floats), so they equal torch's value for value:
`get_lr()` gives the next rates from the current ones, `step()` advances `last_epoch` and sets
them, `get_last_lr()` returns the rates last set, `state_dict()` / `load_state_dict()` hold
everything but the step or optimizer, as torch's.

What torch's schedulers can change besides the lr, the compiled step cannot: OneCycleLR's
momentum cycling (cycle_momentum=True, torch's default) changes momentum / betas, which are
compiled into the step's update, so it is refused with a clear error; pass cycle_momentum=False.
"""

from __future__ import annotations

import math
import numbers
import types
import warnings
from bisect import bisect_right
from collections import Counter

__all__ = ["LRScheduler", "LambdaLR", "StepLR", "MultiStepLR", "ConstantLR", "LinearLR", "ExponentialLR",
           "CosineAnnealingLR", "SequentialLR", "OneCycleLR"]


def _param_groups(target, what: str) -> list:
    """The parameter groups a scheduler drives: a train step's (its groups are bound to it, symgrad/
    optim/param_groups.py: known by their type, so this module needs nothing above sg.optim), or an
    optimizer's."""
    from .optimizer import Optimizer
    from .param_groups import ParamGroup
    groups = getattr(target, "param_groups", None)
    if not isinstance(target, Optimizer) and not (isinstance(groups, list) and
                                                  all(isinstance(g, ParamGroup) for g in groups)):
        groups = None
    if not groups:
        raise TypeError(f"{what}: expected a train step (sg.train_step) or an sg.optim optimizer holding "
                        f"parameters (sg.optim.AdamW(model.parameters(), lr=...)); got "
                        f"{type(target).__name__}" + (" with no parameter groups yet" if groups == [] else ""))
    return groups


def _positive_int(what: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{what}: {name} must be a positive int, got {value!r}")
    return int(value)


def _real(what: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise TypeError(f"{what}: {name} must be a finite real number, got {value!r}")
    return value


def _per_group(what: str, name: str, value, groups: list) -> list:
    """One value per group, as torch's _format_param: a list of len(groups), or one for all."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(groups):
            raise ValueError(f"{what}: {name} must have the same length as param_groups. {name} has "
                             f"{len(value)} values, param_groups has {len(groups)}.")
        return list(value)
    return [value] * len(groups)


class LRScheduler:
    """Base class, as torch.optim.lr_scheduler.LRScheduler: a subclass defines `get_lr()` (the
    next rates, from `last_epoch` and the groups' current rates) and, where torch has one,
    `_get_closed_form_lr()` (the rates at `last_epoch` from the base rates alone)."""

    def __init__(self, optimizer, last_epoch: int = -1):
        what = type(self).__name__
        groups = _param_groups(optimizer, what)
        if isinstance(last_epoch, bool) or not isinstance(last_epoch, numbers.Integral) or last_epoch < -1:
            raise ValueError(f"{what}: last_epoch must be an int >= -1, got {last_epoch!r}")
        self.optimizer = optimizer
        if last_epoch == -1:
            for group in groups:
                group.setdefault("initial_lr", group["lr"])
        else:
            for k, group in enumerate(groups):
                if "initial_lr" not in group:
                    raise KeyError(f"{what}: param_groups[{k}] has no 'initial_lr' when resuming with last_epoch "
                                   f"{last_epoch} (construct the scheduler with last_epoch=-1 first, or load its "
                                   f"state_dict)")
        self.base_lrs = [group["initial_lr"] for group in groups]
        self.last_epoch = int(last_epoch)
        self._initial_step()

    def _initial_step(self) -> None:
        """Set the rates of epoch 0 (torch's constructor does the same first step)."""
        self._step_count = 0
        self._is_initial = True
        try:
            self.step()
        finally:
            self._is_initial = False

    def get_lr(self) -> list[float]:
        """The rates for `last_epoch`, one per parameter group."""
        raise NotImplementedError(f"{type(self).__name__} defines get_lr()")

    def get_last_lr(self) -> list[float]:
        """The rates this scheduler set last, one per parameter group."""
        return list(self._last_lr)

    def step(self, epoch: int | None = None) -> None:
        """Advance one epoch (or jump to `epoch`, torch's deprecated form, using the closed form
        where there is one) and set the groups' learning rates: the step's runtime values."""
        self._step_count += 1
        if epoch is not None:
            warnings.warn("The epoch parameter in `scheduler.step()` is deprecated, as in torch; call "
                          "`scheduler.step()` without it", UserWarning, stacklevel=2)
        self._update_lr(epoch)

    def _update_lr(self, epoch: int | None = None) -> None:
        if epoch is None:
            self.last_epoch += 1
            values = self.get_lr()
        else:
            self.last_epoch = epoch
            closed = getattr(self, "_get_closed_form_lr", None)
            values = closed() if closed is not None else self.get_lr()
        groups = self.optimizer.param_groups
        for group, lr in zip(groups, values, strict=True):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in groups]

    def state_dict(self) -> dict:
        """Everything the scheduler holds but the step or optimizer, as torch's."""
        return {key: value for key, value in self.__dict__.items() if key != "optimizer"}

    def load_state_dict(self, state_dict: dict) -> None:
        """Take back a `state_dict()` (the rates themselves are the step's: step.save / step.load)."""
        self.__dict__.update(state_dict)

    def _current(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]


class LambdaLR(LRScheduler):
    """lr = initial_lr * lr_lambda(epoch), one function for all groups or one per group."""

    def __init__(self, optimizer, lr_lambda, last_epoch: int = -1):
        groups = _param_groups(optimizer, "LambdaLR")
        lambdas = list(lr_lambda) if isinstance(lr_lambda, (list, tuple)) else [lr_lambda] * len(groups)
        if len(lambdas) != len(groups):
            raise ValueError(f"LambdaLR: expected {len(groups)} lr_lambdas, but got {len(lambdas)}")
        if not all(callable(f) for f in lambdas):
            raise TypeError("LambdaLR: lr_lambda must be a function of the epoch, or a list of them")
        self.lr_lambdas = lambdas
        super().__init__(optimizer, last_epoch)

    def state_dict(self) -> dict:
        """As torch's: a plain function is not saved (None), a callable object's __dict__ is."""
        state = {key: value for key, value in self.__dict__.items() if key not in ("optimizer", "lr_lambdas")}
        state["lr_lambdas"] = [None if isinstance(f, types.FunctionType) else f.__dict__.copy()
                               for f in self.lr_lambdas]
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Take back a `state_dict()`: callable objects get their saved __dict__ back."""
        state = dict(state_dict)
        lambdas = state.pop("lr_lambdas")
        self.__dict__.update(state)
        for f, saved in zip(self.lr_lambdas, lambdas):
            if saved is not None:
                f.__dict__.update(saved)

    def get_lr(self) -> list[float]:
        return [base * f(self.last_epoch) for f, base in zip(self.lr_lambdas, self.base_lrs, strict=True)]


class StepLR(LRScheduler):
    """lr times gamma every step_size epochs."""

    def __init__(self, optimizer, step_size: int, gamma: float = 0.1, last_epoch: int = -1):
        self.step_size = _positive_int("StepLR", "step_size", step_size)
        self.gamma = _real("StepLR", "gamma", gamma)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        if self.last_epoch == 0 or self.last_epoch % self.step_size != 0:
            return self._current()
        return [lr * self.gamma for lr in self._current()]

    def _get_closed_form_lr(self) -> list[float]:
        return [base * self.gamma ** (self.last_epoch // self.step_size) for base in self.base_lrs]


class MultiStepLR(LRScheduler):
    """lr times gamma at each milestone epoch (a milestone listed twice multiplies twice)."""

    def __init__(self, optimizer, milestones, gamma: float = 0.1, last_epoch: int = -1):
        milestones = list(milestones)
        if any(isinstance(m, bool) or not isinstance(m, numbers.Integral) for m in milestones):
            raise TypeError(f"MultiStepLR: milestones must be ints, got {milestones!r}")
        self.milestones = Counter(int(m) for m in milestones)
        self.gamma = _real("MultiStepLR", "gamma", gamma)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        if self.last_epoch not in self.milestones:
            return self._current()
        return [lr * self.gamma ** self.milestones[self.last_epoch] for lr in self._current()]

    def _get_closed_form_lr(self) -> list[float]:
        milestones = sorted(self.milestones.elements())
        return [base * self.gamma ** bisect_right(milestones, self.last_epoch) for base in self.base_lrs]


class ConstantLR(LRScheduler):
    """lr times factor until total_iters epochs have passed, then the initial lr."""

    def __init__(self, optimizer, factor: float = 1.0 / 3, total_iters: int = 5, last_epoch: int = -1):
        if not 0 <= _real("ConstantLR", "factor", factor) <= 1:
            raise ValueError("ConstantLR: Constant multiplicative factor expected to be between 0 and 1.")
        self.factor = factor
        self.total_iters = _positive_int("ConstantLR", "total_iters", total_iters)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        if self.last_epoch == 0:
            return [lr * self.factor for lr in self._current()]
        if self.last_epoch != self.total_iters:
            return self._current()
        return [lr * (1.0 / self.factor) for lr in self._current()]

    def _get_closed_form_lr(self) -> list[float]:
        return [base * (self.factor + (self.last_epoch >= self.total_iters) * (1 - self.factor))
                for base in self.base_lrs]


class LinearLR(LRScheduler):
    """lr from initial_lr * start_factor to initial_lr * end_factor linearly over total_iters epochs."""

    def __init__(self, optimizer, start_factor: float = 1.0 / 3, end_factor: float = 1.0, total_iters: int = 5,
                 last_epoch: int = -1):
        if not 0 < _real("LinearLR", "start_factor", start_factor) <= 1:
            raise ValueError("LinearLR: Starting multiplicative factor expected to be greater than 0 and less "
                             "or equal to 1.")
        if not 0 <= _real("LinearLR", "end_factor", end_factor) <= 1:
            raise ValueError("LinearLR: Ending multiplicative factor expected to be between 0 and 1.")
        self.start_factor, self.end_factor = start_factor, end_factor
        self.total_iters = _positive_int("LinearLR", "total_iters", total_iters)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        if self.last_epoch == 0:
            return [lr * self.start_factor for lr in self._current()]
        if self._is_initial or self.last_epoch > self.total_iters:
            return self._current()
        # torch's recurrence: the ratio of this epoch's factor to the last one's.
        change = self.end_factor - self.start_factor
        ratio = 1.0 + change / (self.total_iters * self.start_factor + (self.last_epoch - 1) * change)
        return [lr * ratio for lr in self._current()]

    def _get_closed_form_lr(self) -> list[float]:
        return [base * (self.start_factor + (self.end_factor - self.start_factor)
                        * min(self.total_iters, self.last_epoch) / self.total_iters)
                for base in self.base_lrs]


class ExponentialLR(LRScheduler):
    """lr times gamma every epoch."""

    def __init__(self, optimizer, gamma: float, last_epoch: int = -1):
        self.gamma = _real("ExponentialLR", "gamma", gamma)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        if self._is_initial:  # resuming: the constructor's step keeps the current rates
            return self._current()
        return [lr * self.gamma for lr in self._current()]

    def _get_closed_form_lr(self) -> list[float]:
        return [base * self.gamma ** self.last_epoch for base in self.base_lrs]


class CosineAnnealingLR(LRScheduler):
    """lr = eta_min + (initial_lr - eta_min) * (1 + cos(pi * epoch / T_max)) / 2, by torch's recurrence
    (which, past T_max, climbs back up: a cosine of period 2 * T_max)."""

    def __init__(self, optimizer, T_max: int, eta_min: float = 0.0, last_epoch: int = -1):  # noqa: N803 (torch's name)
        self.T_max = _positive_int("CosineAnnealingLR", "T_max", T_max)
        self.eta_min = _real("CosineAnnealingLR", "eta_min", eta_min)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        eta_min, T = self.eta_min, self.T_max  # noqa: N806
        if self._is_initial:
            return self._current()
        if self._step_count == 1 and self.last_epoch > 0:
            return [eta_min + (base - eta_min) * (1 + math.cos(self.last_epoch * math.pi / T)) / 2
                    for base in self.base_lrs]
        if (self.last_epoch - 1 - T) % (2 * T) == 0:
            return [lr + (base - eta_min) * (1 - math.cos(math.pi / T)) / 2
                    for base, lr in zip(self.base_lrs, self._current(), strict=True)]
        return [(1 + math.cos(math.pi * self.last_epoch / T)) / (1 + math.cos(math.pi * (self.last_epoch - 1) / T))
                * (lr - eta_min) + eta_min for lr in self._current()]

    def _get_closed_form_lr(self) -> list[float]:
        return [self.eta_min + (base - self.eta_min) * (1 + math.cos(math.pi * self.last_epoch / self.T_max)) / 2
                for base in self.base_lrs]


class SequentialLR(LRScheduler):
    """The schedulers one after another, switching at the milestone epochs; each new one starts
    from epoch 0 at its milestone. The schedulers must be constructed on the same step or
    optimizer as this one."""

    def __init__(self, optimizer, schedulers: list, milestones: list, last_epoch: int = -1):
        groups = _param_groups(optimizer, "SequentialLR")
        schedulers, milestones = list(schedulers), list(milestones)
        if not schedulers:
            raise ValueError("SequentialLR expects at least one scheduler, but got no scheduler.")
        for k, scheduler in enumerate(schedulers):
            if not isinstance(scheduler, LRScheduler):
                raise TypeError(f"SequentialLR: schedulers[{k}] is a {type(scheduler).__name__}, not a scheduler")
            if scheduler.optimizer is not optimizer:
                raise ValueError(f"SequentialLR expects all schedulers to belong to the same step or optimizer, "
                                 f"but schedulers[{k}] ({type(scheduler).__name__}) drives another one")
        if len(milestones) != len(schedulers) - 1:
            raise ValueError(f"SequentialLR expects one milestone fewer than schedulers, but got "
                             f"{len(schedulers)} schedulers and {len(milestones)} milestones")
        self._schedulers, self._milestones = schedulers, milestones
        self.last_epoch = last_epoch + 1
        self.optimizer = optimizer
        for group in groups:  # back to the initial rates: each scheduler's construction set its own
            group["lr"] = group["initial_lr"]
        self._undo(self)  # ...and undid nothing of the others' epoch counts: undo their first step
        first = self._schedulers[bisect_right(self._milestones, 0)]
        first._initial_step()
        self._last_lr = first.get_last_lr()

    def _undo(self, scheduler) -> None:
        """One epoch back for every scheduler inside (nested SequentialLRs included)."""
        if hasattr(scheduler, "_schedulers"):
            for inner in scheduler._schedulers:
                self._undo(inner)
        elif scheduler is not self:
            scheduler.last_epoch -= 1

    def step(self) -> None:  # noqa: D102 -- torch's SequentialLR.step takes no epoch
        """Advance one epoch in the scheduler whose turn it is (a scheduler starts at epoch 0 at its milestone)."""
        self.last_epoch += 1
        k = bisect_right(self._milestones, self.last_epoch)
        scheduler = self._schedulers[k]
        if k > 0 and self._milestones[k - 1] == self.last_epoch:
            scheduler._update_lr(0)
        else:
            scheduler.step()
        self._last_lr = scheduler.get_last_lr()

    def state_dict(self) -> dict:
        """This scheduler's state, with each inner scheduler's state_dict in `_schedulers`."""
        state = {key: value for key, value in self.__dict__.items() if key not in ("optimizer", "_schedulers")}
        state["_schedulers"] = [s.state_dict() for s in self._schedulers]
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """Take back a `state_dict()`, each inner scheduler's included."""
        state = dict(state_dict)
        inner = state.pop("_schedulers")
        self.__dict__.update(state)
        for scheduler, saved in zip(self._schedulers, inner):
            scheduler.load_state_dict(saved)


class OneCycleLR(LRScheduler):
    """The 1cycle policy: from max_lr / div_factor up to max_lr over pct_start of total_steps, then
    down to initial_lr / final_div_factor (three_phase: back to the initial lr first), cosine or
    linear. cycle_momentum=True (torch's default) would change momentum / betas, compiled into the
    step: refused; pass cycle_momentum=False."""

    def __init__(self, optimizer, max_lr, total_steps: int | None = None, epochs: int | None = None,
                 steps_per_epoch: int | None = None, pct_start: float = 0.3, anneal_strategy: str = "cos",
                 cycle_momentum: bool = True, base_momentum=0.85, max_momentum=0.95, div_factor: float = 25.0,
                 final_div_factor: float = 1e4, three_phase: bool = False, last_epoch: int = -1):
        groups = _param_groups(optimizer, "OneCycleLR")
        if cycle_momentum:
            raise ValueError("OneCycleLR: cycle_momentum=True (torch's default) cycles momentum / betas, which "
                             "symgrad compiles into the step's update; only the lr is a runtime value. Pass "
                             "cycle_momentum=False")
        if total_steps is not None:
            self.total_steps = _positive_int("OneCycleLR", "total_steps", total_steps)
        elif epochs is not None and steps_per_epoch is not None:
            self.total_steps = (_positive_int("OneCycleLR", "epochs", epochs)
                                * _positive_int("OneCycleLR", "steps_per_epoch", steps_per_epoch))
        else:
            raise ValueError("OneCycleLR: You must define either total_steps OR (epochs AND steps_per_epoch)")
        if not isinstance(pct_start, float) or not 0 <= pct_start <= 1:
            raise ValueError(f"OneCycleLR: Expected float between 0 and 1 pct_start, but got {pct_start}")
        if anneal_strategy not in ("cos", "linear"):
            raise ValueError(f"OneCycleLR: anneal_strategy must be one of 'cos' or 'linear', instead got "
                             f"{anneal_strategy}")
        self._anneal_func_type = anneal_strategy
        self.cycle_momentum = False
        up = float(pct_start * self.total_steps) - 1
        if three_phase:
            self._schedule_phases = [{"end_step": up, "start_lr": "initial_lr", "end_lr": "max_lr"},
                                     {"end_step": float(2 * pct_start * self.total_steps) - 2,
                                      "start_lr": "max_lr", "end_lr": "initial_lr"},
                                     {"end_step": self.total_steps - 1, "start_lr": "initial_lr", "end_lr": "min_lr"}]
        else:
            self._schedule_phases = [{"end_step": up, "start_lr": "initial_lr", "end_lr": "max_lr"},
                                     {"end_step": self.total_steps - 1, "start_lr": "max_lr", "end_lr": "min_lr"}]
        if last_epoch == -1:
            for peak, group in zip(_per_group("OneCycleLR", "max_lr", max_lr, groups), groups):
                group["initial_lr"] = peak / div_factor
                group["max_lr"] = peak
                group["min_lr"] = group["initial_lr"] / final_div_factor
        super().__init__(optimizer, last_epoch)

    @staticmethod
    def _annealing_cos(start, end, pct):
        return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)

    @staticmethod
    def _annealing_linear(start, end, pct):
        return (end - start) * pct + start

    def get_lr(self) -> list[float]:
        step = self.last_epoch
        if step > self.total_steps:
            raise ValueError(f"OneCycleLR: Tried to step {step} times. The specified number of total steps is "
                             f"{self.total_steps}")
        anneal = self._annealing_cos if self._anneal_func_type == "cos" else self._annealing_linear
        rates = []
        for group in self.optimizer.param_groups:
            start = 0.0
            for k, phase in enumerate(self._schedule_phases):
                end = phase["end_step"]
                if step <= end or k == len(self._schedule_phases) - 1:
                    rates.append(anneal(group[phase["start_lr"]], group[phase["end_lr"]], (step - start) / (end - start)))
                    break
                start = end
        return rates
