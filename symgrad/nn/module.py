"""`Module`: the container a PyTorch user expects, holding graph leaves instead of tensors.

A module's parameters are `sg.param` values and its buffers (BatchNorm's
running statistics) state variables; calling a module builds graph code.
Assigning a module, parameter or buffer as an attribute registers it, as in
torch. Leaf names must be unique within a graph and are the keys of
`step.params` / `step.state`, so every leaf is named by its dotted path from
the outermost module: `Sequential(Linear(4, 3))` has a parameter `0.weight`.
Attaching a module to a parent renames its leaves (they are remade with the
new name); build the module tree before calling it.

`train()` / `eval()` choose which graph the layers build on their next call
(batch statistics and dropout, or running statistics and identity), so a
training loss and an inference output come from two calls:

    model.train(); loss = nn.functional.cross_entropy(model(x), y)
    model.eval();  logits = model(x)
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator, Mapping

import numpy as np

from ..ir import dtypes as D
from ..ir.value import Value
from ..sources import variable

_LEAF_ROLES = {"param": "_parameters", "state": "_buffers"}


def _remade(leaf: Value, name: str, value: np.ndarray | None = None) -> Value:
    """`leaf` under a new name (or with a new value): a new variable of the same role."""
    if value is None and leaf.name == name:
        return leaf
    init = leaf.attrs["init"] if value is None else value
    return variable(name, init, role=leaf.attrs["role"])


class Module:
    """Base class of layers and models: override `forward`; assign submodules and leaves as attributes."""

    def __init__(self):
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "_prefix", "")
        object.__setattr__(self, "training", True)

    # ---- registration --------------------------------------------------
    def __setattr__(self, name: str, value) -> None:
        if "_parameters" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__}: call super().__init__() before assigning attributes")
        for table in ("_parameters", "_buffers", "_modules"):
            self.__dict__[table].pop(name, None)
        if isinstance(value, (Module, Value)):
            self.__dict__.pop(name, None)  # a plain attribute of that name would shadow the registered one
        if isinstance(value, Module):
            self._modules[name] = value
            value._set_prefix(f"{self._prefix}{name}.")
        elif isinstance(value, Value) and value.op.name == "variable":
            role = value.attrs["role"]
            if role not in _LEAF_ROLES:
                raise TypeError(f"{type(self).__name__}.{name}: a {role} variable cannot belong to a module")
            self.__dict__[_LEAF_ROLES[role]][name] = _remade(value, self._prefix + name)
        elif isinstance(value, Value):
            raise TypeError(f"{type(self).__name__}.{name}: only sg.param values and buffers can be module "
                            f"attributes, got a computed {value!r}")
        else:
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str):
        # Only reached when ordinary lookup fails: registered leaves and submodules.
        for table in ("_parameters", "_buffers", "_modules"):
            entries = self.__dict__.get(table)
            if entries is not None and name in entries:
                return entries[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def __delattr__(self, name: str) -> None:
        for table in ("_parameters", "_buffers", "_modules"):
            if name in self.__dict__[table]:
                del self.__dict__[table][name]
                return
        object.__delattr__(self, name)

    def register_buffer(self, name: str, value) -> Value:
        """A state variable of this module (not trained; updated by the layer itself), from an array."""
        setattr(self, name, variable(name, np.asarray(value), role="state"))
        return self._buffers[name]

    def register_parameter(self, name: str, value: Value) -> Value:
        """Register an `sg.param` under `name` (same as assigning the attribute)."""
        if not isinstance(value, Value) or value.op.name != "variable" or value.attrs["role"] != "param":
            raise TypeError(f"register_parameter: expected an sg.param, got {value!r}")
        setattr(self, name, value)
        return self._parameters[name]

    def add_module(self, name: str, module: "Module") -> None:
        """Register a submodule under `name` (same as assigning the attribute)."""
        if not isinstance(module, Module):
            raise TypeError(f"add_module: expected a Module, got {type(module).__name__}")
        setattr(self, name, module)

    def _set_prefix(self, prefix: str) -> None:
        object.__setattr__(self, "_prefix", prefix)
        for table in ("_parameters", "_buffers"):
            entries = self.__dict__[table]
            for key, leaf in list(entries.items()):
                entries[key] = _remade(leaf, prefix + key)
        for key, child in self._modules.items():
            child._set_prefix(f"{prefix}{key}.")

    # ---- traversal -------------------------------------------------------
    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, "Module"]]:
        """This module and every submodule, with dotted names ('' for this one)."""
        seen: set[int] = set()
        stack = [(prefix, self)]
        while stack:
            name, module = stack.pop(0)
            if id(module) in seen:
                continue
            seen.add(id(module))
            yield name, module
            stack[0:0] = [(f"{name}.{k}" if name else k, m) for k, m in module._modules.items()]

    def children(self) -> list["Module"]:
        """The direct submodules."""
        return list(self._modules.values())

    def modules(self) -> list["Module"]:
        """This module and all submodules."""
        return [m for _, m in self.named_modules()]

    def _named_leaves(self, table: str) -> Iterator[tuple[str, Value]]:
        seen: set[int] = set()
        for path, module in self.named_modules():
            for key, leaf in module.__dict__[table].items():
                if id(leaf) not in seen:
                    seen.add(id(leaf))
                    yield (f"{path}.{key}" if path else key), leaf

    def named_parameters(self) -> Iterator[tuple[str, Value]]:
        """(dotted name, parameter) pairs, as torch's named_parameters()."""
        return self._named_leaves("_parameters")

    def parameters(self) -> list[Value]:
        """The trainable parameters, in registration order (pass to sg.train_step)."""
        return [p for _, p in self.named_parameters()]

    def named_buffers(self) -> Iterator[tuple[str, Value]]:
        """(dotted name, buffer) pairs: running statistics and other layer state."""
        return self._named_leaves("_buffers")

    def buffers(self) -> list[Value]:
        """The state variables the layers update themselves."""
        return [b for _, b in self.named_buffers()]

    # ---- values ------------------------------------------------------------
    def state_dict(self) -> "OrderedDict[str, np.ndarray]":
        """Current values of parameters and buffers by dotted name (torch's keys and layouts), as copies.

        A leaf that a train step (or a function whose layers update it, such
        as BatchNorm's running statistics) has updated reads its value from
        the one built last that updates it: after training, the trained
        values. Before that, the initial values.
        """
        from ..compiled import current_value  # compiled imports the backends; nn must not at import
        out: OrderedDict = OrderedDict()
        for name, leaf in [*self.named_parameters(), *self.named_buffers()]:
            out[name] = current_value(leaf)
        return out

    def load_state_dict(self, state: Mapping, strict: bool = True) -> "Module":
        """Replace initial values by dotted name (e.g. from a torch state_dict converted to NumPy).

        Leaves are remade with the new values, so load before building the
        graph. Shapes must match; values are cast to each leaf's dtype.
        """
        state = {k: np.asarray(v.detach().cpu().numpy() if hasattr(v, "detach") else v) for k, v in state.items()}
        known = dict([*self.named_parameters(), *self.named_buffers()])
        missing = [k for k in known if k not in state]
        unexpected = [k for k in state if k not in known]
        if strict and (missing or unexpected):
            raise KeyError(f"load_state_dict: missing {missing}, unexpected {unexpected}")
        for path, module in self.named_modules():
            for table in ("_parameters", "_buffers"):
                entries = module.__dict__[table]
                for key, leaf in list(entries.items()):
                    full = f"{path}.{key}" if path else key
                    if full not in state:
                        continue
                    value = state[full]
                    if value.shape != tuple(leaf.shape):
                        raise ValueError(f"load_state_dict: {full!r} has shape {list(value.shape)}, "
                                         f"expected {list(leaf.shape)}")
                    entries[key] = _remade(leaf, leaf.name, value.astype(D.to_numpy(leaf.dtype)))
        return self

    def to(self, dtype) -> "Module":
        """Remake every float parameter and buffer in `dtype` (e.g. "float64"); returns self."""
        dtype = D.canonical(dtype)
        if not D.is_float(dtype):
            raise TypeError(f"Module.to: expected a float dtype, got {dtype}")
        for _, module in self.named_modules():
            for table in ("_parameters", "_buffers"):
                entries = module.__dict__[table]
                for key, leaf in list(entries.items()):
                    if D.is_float(leaf.dtype) and leaf.dtype != dtype:
                        entries[key] = _remade(leaf, leaf.name, np.asarray(leaf.attrs["init"]).astype(dtype))
        return self

    def double(self) -> "Module":
        """Float64 parameters and buffers (torch's .double())."""
        return self.to("float64")

    # ---- modes and calls ---------------------------------------------------
    def train(self, mode: bool = True) -> "Module":
        """Training mode for this module and its submodules: the next call builds the training graph."""
        for module in self.modules():
            object.__setattr__(module, "training", bool(mode))
        return self

    def eval(self) -> "Module":
        """Inference mode: Dropout is the identity, BatchNorm uses its running statistics."""
        return self.train(False)

    def forward(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} must define forward()")

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def extra_repr(self) -> str:
        """The layer's arguments, shown in repr()."""
        return ""

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__}({self.extra_repr()}"]
        for key, child in self._modules.items():
            body = repr(child).replace("\n", "\n  ")
            lines.append(f"  ({key}): {body}")
        return lines[0] + ")" if len(lines) == 1 else "\n".join(lines) + "\n)"
