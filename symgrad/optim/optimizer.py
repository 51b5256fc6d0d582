"""The optimizer interface: from (params, grads) to the graph's update pairs."""

from __future__ import annotations

import inspect
import math

import numpy as np

from .. import functional as F
from ..ir.value import Value
from ..sources import variable


def check_hyperparameter(what: str, value) -> None:
    """Refuse a hyperparameter that is not a finite non-negative number (ValueError naming `what`):
    a negative learning rate climbs the loss, a NaN or infinite one destroys every parameter."""
    number = float(value)
    if not (math.isfinite(number) and number >= 0):
        raise ValueError(f"{what} must be a finite non-negative number, got {value!r}")


class Optimizer:
    """Base class. A subclass implements `update(param, grad)` as graph code.

    State lives in variables named after their parameter (`W.momentum_buffer`),
    created with `state()`; hyperparameters that may change between steps
    without recompiling (the learning rate) are variables too, made by
    `hyper()`. `updates` returns the (variable, new value) pairs of the step.
    """

    def __init__(self, lr: float):
        check_hyperparameter(f"{type(self).__name__}: lr", lr)
        self.lr = lr
        self._pending: list[tuple[Value, Value]] = []

    def hyper(self, name: str, value: float, like: Value) -> Value:
        """A runtime scalar hyperparameter, read at every step, cast to `like`'s dtype. A new value
        (`step.lr = ...`) must be a finite non-negative number, as the constructor's."""
        key = ("hyper", name)
        if key not in self._made:
            self._made[key] = variable(name, np.array(value, dtype=np.float64), role="hyper")
        return F.cast(self._made[key], like.dtype)

    def state(self, param: Value, name: str, init: float = 0.0, shape=None, dtype=None) -> Value:
        """Optimizer state for `param`, named `<param>.<name>`, zeros (or `init`) at first."""
        shape = param.shape if shape is None else shape
        return variable(f"{param.name}.{name}", np.full(shape, init, dtype=dtype or param.dtype), role="optimizer")

    def assign(self, target: Value, new: Value) -> None:
        """Record that `target` (a state variable) takes `new` after this step."""
        self._pending.append((target, new))

    def update(self, param: Value, grad: Value) -> Value:
        """The parameter's new value, as graph code; calls `assign` for any state."""
        raise NotImplementedError(f"{type(self).__name__} defines update(param, grad)")

    def updates(self, params: list[Value], grads: list[Value], options: list[dict] | None = None
                ) -> list[tuple[Value, Value]]:
        """All (variable, new value) pairs of one step, parameters first.

        options: per parameter, hyperparameters that differ from this optimizer's (its parameter
        group's, as torch's `{"params": [...], "weight_decay": 0.0}`); see `for_group`.
        """
        self._made: dict = {}
        self._pending = []
        pairs = []
        for k, (p, g) in enumerate(zip(params, grads)):
            rule = self.for_group(options[k]) if options and options[k] else self
            pairs.append((p, F.cast(rule.update(p, g), p.dtype)))
        return pairs + self._pending

    def hyperparameters(self) -> dict:
        """The constructor's arguments as this optimizer holds them (by the constructor's names)."""
        names = [n for n in inspect.signature(type(self).__init__).parameters if n != "self"]
        return {name: getattr(self, name) for name in names}

    def for_group(self, options: dict) -> "Optimizer":
        """This optimizer with a parameter group's hyperparameters, sharing its state and variables.

        The learning rate is one runtime variable for the whole step (`step.lr`), so a group
        cannot set its own; any other constructor argument can be overridden, and is checked as
        the constructor checks it.
        """
        known = self.hyperparameters()
        if "lr" in options:
            raise ValueError(f"{type(self).__name__}: a parameter group cannot set its own lr (one runtime "
                             f"lr drives the step: step.lr); got lr={options['lr']!r}")
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(f"{type(self).__name__}: unknown parameter-group option(s) {unknown}; "
                             f"expected some of {sorted(set(known) - {'lr'})}")
        variant = type(self)(**{**known, **options})
        variant._made, variant._pending = self._made, self._pending  # one set of variables and updates
        return variant
