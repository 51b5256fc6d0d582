"""The optimizer interface: from (params, grads) to the graph's update pairs."""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Mapping

import numpy as np
import sympy

from ..api import functional as F
from ..ir import dtypes as D
from ..ir.elementwise import ARGS, derived_op
from ..ir.value import Value
from ..api.sources import filled, variable
from .param_groups import SCHEDULER_KEYS, ParamGroup, check_hyperparameter, make_groups  # noqa: F401  (callers know it here)
from .param_groups import parse as parse_groups


class Optimizer:
    """Base class. A subclass implements `update(param, grad)` as graph code.

    Constructed as torch's, with the parameters first (`sg.optim.SGD(model.parameters(),
    lr=0.1)`, or parameter-group dicts), it holds them in `param_groups` and
    `sg.train_step(loss, optimizer=opt)` trains them; constructed with hyperparameters only
    (`sg.optim.SGD(lr=0.1)`), the parameters are train_step's `params` argument, and
    `param_groups` are those of the last step built with it (symgrad/optim/param_groups.py).

    State lives in variables named after their parameter (`W.momentum_buffer`),
    created with `state()`; hyperparameters that may change between steps
    without recompiling (the learning rate, one per parameter group) are variables too,
    made by `hyper()`. `updates` returns the (variable, new value) pairs of the step.
    """

    def __init__(self, params=None, lr=None, default_lr: float = 1e-3):
        if isinstance(params, numbers.Real) and not isinstance(params, bool):
            # The older spelling SGD(0.1): the learning rate first, no parameters.
            if lr is not None:
                raise TypeError(f"{type(self).__name__}: got a number for params and lr={lr!r}; pass the parameters "
                                f"first ({type(self).__name__}(model.parameters(), lr=...)) or lr alone")
            params, lr = None, params
        lr = default_lr if lr is None else lr
        check_hyperparameter(f"{type(self).__name__}: lr", lr)
        self.lr = lr
        self._params = params
        self._lr_name = "lr"
        self._pending: list[tuple[Value, Value]] = []
        self.param_groups: list[ParamGroup] = []

    def _init_groups(self) -> None:
        """Build `param_groups` from the constructor's params (a subclass calls this once its
        hyperparameters are set): each group's options over `defaults`, each checked as the
        constructor checks it."""
        if not hasattr(self, "_params"):
            return  # built already
        params, self._owns_params = self._params, self._params is not None
        del self._params
        if params is not None:
            what = type(self).__name__
            self.param_groups = make_groups(parse_groups(params, what), self.defaults, what)
            for group in self.param_groups:
                self.for_group(group)  # a bad option is refused now, not when a step is built

    def groups_for_step(self, params) -> list[ParamGroup]:
        """The parameter groups a train step trains: this optimizer's own (constructed as torch's),
        or those of train_step's `params`, which then become this optimizer's `param_groups`."""
        self._init_groups()  # a subclass that did not call it
        if params is None:
            if not self._owns_params:
                raise TypeError(f"train_step: no parameters to train; pass params=..., or construct the "
                                f"optimizer with them as torch's: sg.optim.{type(self).__name__}(model.parameters(), "
                                f"lr=...)")
            return self.param_groups
        parsed = parse_groups(params, "train_step")
        if self._owns_params:
            mine = [p for group in self.param_groups for p in dict.__getitem__(group, "params")]
            theirs = [p for members, _ in parsed for p in members]
            if len(mine) != len(theirs) or any(a is not b for a, b in zip(mine, theirs)) or \
                    any(options for _, options in parsed):
                raise ValueError("train_step: the optimizer was constructed with its parameters; pass them once: "
                                 "sg.train_step(loss, optimizer=opt)")
            return self.param_groups
        self.param_groups = make_groups(parsed, self.defaults, "train_step")
        return self.param_groups

    @property
    def defaults(self) -> dict:
        """The constructor's hyperparameters, as torch's `optimizer.defaults`."""
        return self.hyperparameters()

    def hyper(self, name: str, value: float, like: Value) -> Value:
        """A runtime scalar hyperparameter, read at every step, cast to `like`'s dtype. A new value
        (`step.lr = ...`) must be a finite non-negative number, as the constructor's. "lr" is
        this parameter group's own learning-rate variable."""
        if name == "lr":
            name = self._lr_name
        key = ("hyper", name)
        if key not in self._made:
            self._made[key] = variable(name, np.array(value, dtype=np.float64), role="hyper")
        return F.cast(self._made[key], like.dtype)

    def constant(self, value: float, dtype: str) -> Value:
        """A 0-d constant operand: one node for every parameter of the step, not one each."""
        key = ("constant", float(value), dtype)
        if key not in self._made:
            self._made[key] = F.constant(float(value), dtype)
        return self._made[key]

    def state(self, param: Value, name: str, init: float = 0.0, shape=None, dtype=None) -> Value:
        """Optimizer state for `param`, named `<param>.<name>`, zeros (or `init`) at first."""
        shape = param.shape if shape is None else shape
        return variable(f"{param.name}.{name}", filled(shape, init, D.to_numpy(dtype or param.dtype)), role="optimizer")

    def assign(self, target: Value, new: Value) -> None:
        """Record that `target` (a state variable) takes `new` after this step."""
        self._pending.append((target, new))

    def update(self, param: Value, grad: Value) -> Value:
        """The parameter's new value, as graph code; calls `assign` for any state."""
        raise NotImplementedError(f"{type(self).__name__} defines update(param, grad)")

    def updates(self, params: list[Value], grads: list[Value], options: list[dict] | None = None
                ) -> list[tuple[Value, Value]]:
        """All (variable, new value) pairs of one step, parameters first.

        options: per parameter, its group (a ParamGroup, with its own learning-rate variable), or
        a plain dict of hyperparameters that differ from this optimizer's (torch's
        `{"params": [...], "weight_decay": 0.0}`), or {}; see `for_group`.
        """
        self._made: dict = {}
        self._pending = []
        pairs, rules = [], {}
        for k, (p, g) in enumerate(zip(params, grads)):
            group = options[k] if options else None
            if not group:
                rule = self
            else:
                if id(group) not in rules:
                    rules[id(group)] = self.for_group(group)
                rule = rules[id(group)]
            pairs.append((p, F.cast(rule.update(p, g), p.dtype)))
        return pairs + self._pending

    def hyperparameters(self) -> dict:
        """The constructor's arguments as this optimizer holds them (by the constructor's names)."""
        names = [n for n in inspect.signature(type(self).__init__).parameters if n not in ("self", "params")]
        return {name: getattr(self, name) for name in names}

    def for_group(self, options: Mapping) -> "Optimizer":
        """This optimizer with a parameter group's hyperparameters, sharing its state and variables.

        A ParamGroup's learning rate is a runtime variable of its own (param_groups.py); a plain
        dict's cannot differ from the optimizer's (one variable, `step.lr`). Any other constructor
        argument can be overridden, and is checked as the constructor checks it.
        """
        known = self.hyperparameters()
        lr_name = options.lr_name if isinstance(options, ParamGroup) else self._lr_name
        is_group = isinstance(options, ParamGroup)
        # dict.items: a bound group's "lr" as given; the variable is made from the group's value.
        options = {k: v for k, v in dict.items(options) if k != "params" and k not in SCHEDULER_KEYS}
        if not is_group and "lr" in options and options["lr"] != self.lr:
            raise ValueError(f"{type(self).__name__}: a parameter group given to train_step as a plain dict "
                             f"cannot set its own lr; construct the optimizer with the groups "
                             f"({type(self).__name__}(groups, lr=...)) to give each group its runtime lr; "
                             f"got lr={options['lr']!r}")
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ValueError(f"{type(self).__name__}: unknown parameter-group option(s) {unknown}; "
                             f"expected some of {sorted(set(known))}")
        variant = type(self)(**{**known, **options})
        variant._made, variant._pending = getattr(self, "_made", {}), self._pending  # one set of variables and updates
        variant._lr_name = lr_name
        return variant


def formula(label: str, fn, *values: Value) -> Value:
    """`fn` over `values` as one elementwise node: `fn` takes sympy symbols and returns the
    expression (`lambda lr, t: lr / (1 - 0.9 ** t)`), printed in C as written. An optimizer's
    scalar arithmetic (bias corrections, the decay factor) and its update of a parameter are a
    few nodes per parameter this way, not a node per operation and constant: an AdamW step made
    50 nodes of each parameter so, and every pass, the lowering and the render walked each of
    them. `label` names the op's kernels. The op is made once per `fn` (its code and the values
    it closes over) and label: sympy's work is not repeated for every parameter."""
    if len(values) > len(ARGS):
        raise ValueError(f"formula {label}: at most {len(ARGS)} operands, got {len(values)}")
    closed = tuple(cell.cell_contents for cell in fn.__closure__ or ())
    # Kept only where what `fn` closes over is plain numbers or text (an object's attributes may
    # change), each by its type and exact text (0.0 and -0.0, 1 and True are equal keys otherwise).
    plain = all(isinstance(c, (int, float, str)) for c in closed)
    key = (label, fn.__code__, tuple((type(c), repr(c)) for c in closed)) if plain else None
    made = _FORMULAS.get(key) if key is not None else None
    if made is None:
        symbols = sympy.symbols(f"a0:{len(values)}", real=True)
        expr = sympy.sympify(fn(*symbols))
        used = sorted(expr.free_symbols, key=lambda s: s.name)   # the derived op's operands, in order
        op = derived_op(label, expr.xreplace(dict(zip(used, ARGS))), len(used))
        made = (op, [symbols.index(s) for s in used])
        if key is not None:
            _FORMULAS[key] = made
    op, positions = made
    return F.apply_elementwise(op, [values[k] for k in positions])


# (label, code, closed-over values) -> (the derived op, which of the values it reads, in order)
_FORMULAS: dict = {}
