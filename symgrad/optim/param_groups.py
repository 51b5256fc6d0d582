"""torch's parameter groups: `optimizer.param_groups`, and their learning rates as runtime values.

An optimizer constructed as torch's (`sg.optim.AdamW(model.parameters(), lr=...)`, or with
dicts `[{"params": [...], "weight_decay": 0.0}, {"params": [...]}]`) holds its parameters in
groups: `ParamGroup` dicts with "params" and every hyperparameter, the optimizer's defaults
filled in where a group does not set its own, as torch's `param_groups`.

`sg.train_step(loss, optimizer=opt)` compiles each group's update with that group's options.
Each group's learning rate is a runtime variable of the step (group 0's is `lr`, group k's
`param_groups.k.lr`), read at every step: `group["lr"] = x` sets it in every step built from
the optimizer, without recompiling, which is what torch's schedulers do (sg.optim.lr_scheduler).
The other options are compiled into the step; changing one afterwards is refused.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Mapping

from ..ir import dtypes as D
from ..ir.value import Value

#: Keys torch's schedulers keep in a group beside the optimizer's options (not compiled).
SCHEDULER_KEYS = ("initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum")


def check_hyperparameter(what: str, value) -> None:
    """Refuse a hyperparameter that is not a finite non-negative number (ValueError naming `what`):
    a negative learning rate climbs the loss, a NaN or infinite one destroys every parameter."""
    number = float(value)
    if not (math.isfinite(number) and number >= 0):
        raise ValueError(f"{what} must be a finite non-negative number, got {value!r}")


def lr_variable_name(index: int) -> str:
    """The name of group `index`'s learning-rate variable in a step (`step.lr` is group 0's)."""
    return "lr" if index == 0 else f"param_groups.{index}.lr"


def is_lr_variable(name: str) -> bool:
    """Whether `name` is a group's learning-rate variable."""
    return name == "lr" or (name.startswith("param_groups.") and name.endswith(".lr"))


def _check_param(p, where: str) -> Value:
    if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str):
        p = p[1]  # torch 2.x accepts named parameters: (name, parameter) pairs
    if not isinstance(p, Value) or p.op.name != "variable" or p.attrs["role"] != "param":
        raise TypeError(f"{where} must be an sg.param, got {p!r}")
    if not D.is_float(p.dtype):
        raise TypeError(f"{where}: param {p.name!r} is {p.dtype}; only float params train")
    return p


def parse(params, what: str) -> list[tuple[list[Value], dict]]:
    """torch's `params` argument as (parameters, options) per group: sg.param values (or a
    name -> param mapping, or (name, param) pairs) make one group; dicts with "params" and options
    make one group each. Refuses (TypeError, ValueError) anything else, empty groups and a
    parameter listed twice."""
    if isinstance(params, Value):
        raise TypeError(f"{what}: params must be an iterable of sg.param values or of dicts, got one value "
                        f"{params!r}; wrap it in a list")
    if isinstance(params, Mapping):
        params = list(params.values())
    try:
        entries = list(params)
    except TypeError:
        raise TypeError(f"{what}: params must be an iterable of sg.param values or of dicts, "
                        f"got {type(params).__name__}") from None
    if not entries:
        raise ValueError(f"{what}: got an empty parameter list")
    groups: list[tuple[list[Value], dict]] = []
    if all(isinstance(e, Mapping) for e in entries):
        for k, entry in enumerate(entries):
            if "params" not in entry:
                raise TypeError(f"{what}: parameter group {k} has no 'params' entry")
            members = entry["params"]
            members = [members] if isinstance(members, Value) else \
                list(members.values()) if isinstance(members, Mapping) else list(members)
            if not members:
                raise ValueError(f"{what}: parameter group {k} has no parameters")
            members = [_check_param(p, f"{what}: param_groups[{k}]['params'][{j}]") for j, p in enumerate(members)]
            groups.append((members, {key: v for key, v in entry.items() if key != "params"}))
    elif any(isinstance(e, Mapping) for e in entries):
        raise TypeError(f"{what}: params must be all sg.param values or all parameter-group dicts, not a mix")
    else:
        groups.append(([_check_param(p, f"{what}: params[{k}]") for k, p in enumerate(entries)], {}))
    flat = [p for members, _ in groups for p in members]
    repeated = sorted({p.name for p in flat if sum(q is p for q in flat) > 1})
    if repeated:
        raise ValueError(f"{what}: parameters {repeated} appear more than once (in two groups?)")
    return groups


class ParamGroup(dict):
    """One of torch's parameter groups: "params" and the optimizer's options for them.

    Until a train step is built from its optimizer it is a plain dict. Afterwards "lr" is the
    steps' runtime value: reading it gives the newest step's, setting it sets it in every live
    step built from the optimizer (checked first: a finite non-negative number); the other
    options are compiled in, and a different value is refused (ValueError). Keys of torch's
    schedulers ("initial_lr", ...) and any other key are kept as in a dict.
    """

    def __init__(self, entries: dict, index: int, compiled: tuple):
        super().__init__(entries)
        self.index = index
        self.lr_name = lr_variable_name(index)
        self._compiled = frozenset(compiled)
        self._steps: list = []  # weak references to the steps compiled with this group

    def _live(self) -> list:
        steps = [s for s in (ref() for ref in self._steps) if s is not None]
        self._steps = [weakref.ref(s) for s in steps]
        return steps

    def attach(self, step) -> None:
        """Make `step`'s variable the group's lr from now on (train_step calls this)."""
        self._live()
        self._steps.append(weakref.ref(step))
        super().__setitem__("lr", float(step._read_variable(self.lr_name)))

    def __getitem__(self, key):
        if key == "lr":
            steps = self._live()
            if steps:
                return float(steps[-1]._read_variable(self.lr_name))
        return super().__getitem__(key)

    def get(self, key, default=None):
        """dict.get, with "lr" the step's runtime value."""
        return self[key] if key in self else default

    def __setitem__(self, key, value) -> None:
        steps = self._live()
        if key == "lr":
            check_hyperparameter(f"param_groups[{self.index}]['lr']", value)
            for step in steps:
                step._write_variable(self.lr_name, value)
        elif steps and (key == "params" or key in self._compiled) and \
                not (key in self and _same(super().__getitem__(key), value)):
            raise ValueError(f"param_groups[{self.index}][{key!r}] is compiled into the train step; only 'lr' "
                             f"changes between steps (build a new step for another {key})")
        super().__setitem__(key, value)

    def setdefault(self, key, default=None):
        """dict.setdefault, through the checks of setting an item."""
        if key not in self:
            self[key] = default
        return self[key]

    def update(self, *args, **kwargs) -> None:
        """dict.update, item by item through the checks of setting one."""
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def items(self):
        """(key, value) pairs, with "lr" the step's runtime value."""
        return [(key, self[key]) for key in self]

    def values(self):
        """The values, with "lr" the step's runtime value."""
        return [self[key] for key in self]

    def __repr__(self) -> str:
        return repr(dict(self.items()))


def _same(a, b) -> bool:
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(x is y for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 -- values that do not compare are different
        return False


def make_groups(parsed: list[tuple[list[Value], dict]], defaults: dict, what: str) -> list[ParamGroup]:
    """ParamGroups from parsed groups: each group's options over the optimizer's `defaults`.
    An option the optimizer does not have is refused, except torch's scheduler keys."""
    groups = []
    for k, (members, options) in enumerate(parsed):
        unknown = sorted(set(options) - set(defaults) - set(SCHEDULER_KEYS))
        if unknown:
            raise ValueError(f"{what}: unknown parameter-group option(s) {unknown} in group {k}; "
                             f"expected some of {sorted(defaults)}")
        groups.append(ParamGroup({"params": members, **defaults, **options}, k, tuple(defaults)))
    return groups


def bind(step, groups: list[ParamGroup]) -> list[ParamGroup]:
    """Make `step`'s learning-rate variables those of the optimizer's `groups` (setting a group's
    "lr" sets it in the step too), and return the step's own groups: copies that reach this step
    alone (`step.param_groups`, what a scheduler constructed on the step drives)."""
    own = []
    for group in groups:
        group.attach(step)
        mine = ParamGroup(dict(dict.items(group)), group.index, tuple(group._compiled))
        mine.attach(step)
        own.append(mine)
    return own
