"""`sg.optim.from_torch(torch_optimizer)`: a torch optimizer's symgrad twin, for an imported model.

The parameters are the symgrad parameters that `sg.from_torch` made of the optimizer's torch
tensors, grouped as the torch optimizer groups them, each group with its own options; the update
rule is the one of the same name (SGD with momentum / dampening / nesterov / weight decay, Adam,
AdamW). Options symgrad does not implement (amsgrad, maximize, ...) are refused by name rather than
ignored: the training would differ.

Which symgrad parameter a torch tensor became is recorded here, by the import (`record`, which
symgrad/tools/torch_import/imported.py calls for each tensor of an imported model) and read by the
conversion (`parameter_for`): the optimizer API owns the table, so it need not ask the import.
"""

from __future__ import annotations

import numbers
import weakref

from .adam import Adam
from .adamw import AdamW
from .optimizer import Optimizer
from .param_groups import SCHEDULER_KEYS
from .sgd import SGD

#: torch's implementation switches: they choose how torch computes, not what.
_HOW = ("foreach", "fused", "differentiable", "capturable")

#: For each torch optimizer: the symgrad class and the options it takes; any other option must
#: have the value given here (torch's default), or the conversion is refused.
_RULES = {
    "SGD": (SGD, ("lr", "momentum", "dampening", "weight_decay", "nesterov"), {"maximize": False}),
    "Adam": (Adam, ("lr", "betas", "eps", "weight_decay"),
             {"amsgrad": False, "maximize": False, "decoupled_weight_decay": False}),
    "AdamW": (AdamW, ("lr", "betas", "eps", "weight_decay"),
              {"amsgrad": False, "maximize": False, "decoupled_weight_decay": True}),
}

#: id(torch tensor) -> (weak reference to it, weak reference to the imported module, the tensor's torch name).
_IMPORTED: dict = {}


def record(tensor, module, torch_name: str) -> None:
    """Note that torch `tensor` became the leaf `module.get_leaf(torch_name)` of `module` (the
    sg.nn.Module sg.from_torch made). Both are held weakly: the record lives while they do."""
    _IMPORTED[id(tensor)] = (weakref.ref(tensor), weakref.ref(module), torch_name)


def parameter_for(tensor):
    """The symgrad parameter an imported torch parameter became, as its module holds it now; None
    if no live imported model holds it."""
    entry = _IMPORTED.get(id(tensor))
    if entry is None or entry[0]() is not tensor or entry[1]() is None:
        return None
    return entry[1]().get_leaf(entry[2])


def _plain(value):
    """A torch option as a Python value (a tensor learning rate as its float)."""
    if hasattr(value, "item") and not isinstance(value, numbers.Number):
        return value.item()
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return value


def _options(group: dict, kind: str, where: str) -> dict:
    cls, taken, fixed = _RULES[kind]
    out = {}
    for key, value in group.items():
        if key == "params" or key in _HOW or key in SCHEDULER_KEYS:
            continue
        if key in taken:
            out[key] = _plain(value)
        elif key in fixed:
            if value != fixed[key]:
                raise ValueError(f"sg.optim.from_torch: {where} sets {key}={value!r}; symgrad's {cls.__name__} "
                                 f"implements {key}={fixed[key]!r} only")
        else:
            raise ValueError(f"sg.optim.from_torch: {where} has the option {key}={value!r}, which symgrad's "
                             f"{cls.__name__} does not implement")
    return out


def from_torch(torch_optimizer) -> Optimizer:
    """The symgrad optimizer equal to `torch_optimizer` (torch.optim.SGD, Adam or AdamW) over the
    parameters `sg.from_torch` imported: the same hyperparameters and parameter groups, each
    group's lr a runtime value of the step. `sg.train_step(loss, optimizer=sg.optim.from_torch(opt))`.

    Refused (TypeError, ValueError): another optimizer class, an option symgrad does not
    implement, a parameter that no sg.from_torch import holds, an optimizer that has already
    stepped (its state would be lost).
    """
    kind = type(torch_optimizer).__name__
    if kind not in _RULES or not hasattr(torch_optimizer, "param_groups"):
        raise TypeError(f"sg.optim.from_torch: expected torch.optim.SGD, Adam or AdamW, got {kind}")
    if any(torch_optimizer.state.values()):
        raise ValueError(f"sg.optim.from_torch: the {kind} optimizer has already stepped; convert it before "
                         f"training (its moments are not carried over)")
    cls = _RULES[kind][0]
    defaults = _options(torch_optimizer.defaults, kind, f"{kind}'s defaults")
    groups = []
    for k, group in enumerate(torch_optimizer.param_groups):
        members = []
        for j, tensor in enumerate(group["params"]):
            leaf = parameter_for(tensor)
            if leaf is None:
                raise ValueError(f"sg.optim.from_torch: param_groups[{k}]['params'][{j}] (shape "
                                 f"{list(tensor.shape)}) belongs to no model imported with sg.from_torch; "
                                 f"import the model before converting its optimizer")
            members.append(leaf)
        groups.append({"params": members, **_options(group, kind, f"param_groups[{k}]")})
    return cls(groups, **defaults)


__all__ = ["from_torch"]
