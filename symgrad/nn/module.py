"""`Module`: the container a PyTorch user expects, holding graph leaves instead of tensors.

A module's parameters are `sg.param` values and its buffers (BatchNorm's
running statistics) state variables; calling a module builds graph code.
Assigning a module, parameter or buffer as an attribute registers it, as in
torch. Leaf names must be unique within a graph and are the keys of
`step.params` / `step.state`, so every leaf is named by its dotted path from
the outermost module: `Sequential(Linear(4, 3))` has a parameter `0.weight`.
Attaching a module to a parent renames its leaves (they are remade with the
new name, the same parameter); build the module tree before calling it.

A parameter assigned to a second attribute is shared, as torch's weight
tying (`self.transformer.wte.weight = self.lm_head.weight`): both attributes
hold the same leaf, named by the path at which `named_parameters()` first
finds it, and a train step trains the one matrix with the sum of both uses'
gradients. `named_parameters()` lists it once, `state_dict()` under every
key, as torch's do.

A parameter's value is owned by its cell (symgrad/api/cells.py), not by what is
compiled from it: the module, every train step, `predict` and every
`sg.function` built from the model see its current value, training updates
it and `load_state_dict` sets it for all of them.

`train()` / `eval()` choose which graph the layers build on their next call
(batch statistics and dropout, or running statistics and identity), so a
training loss and an inference output come from two calls:

    model.train(); loss = nn.functional.cross_entropy(model(x), y)
    model.eval();  logits = model(x)
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Iterator, Mapping

import numpy as np

from ..api.cells import current_value
from ..ir import dtypes as D
from ..ir.value import Value
from ..api.sources import variable

_LEAF_ROLES = {"param": "_parameters", "state": "_buffers"}
_LEAF_TABLES = tuple(_LEAF_ROLES.values())


def _renamed(leaf: Value, name: str) -> Value:
    """`leaf` under `name`: a new variable of the same parameter (its cell, its value)."""
    if leaf.name == name:
        return leaf
    cell = leaf.attrs["cell"]
    return variable(name, cell.array, role=leaf.attrs["role"], cell=cell)


def _joined(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


class Module:
    """Base class of layers and models: override `forward`; assign submodules and leaves as attributes."""

    def __init__(self):
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "_parent", None)  # weak reference to the module it was last attached to
        object.__setattr__(self, "training", True)

    # ---- registration --------------------------------------------------
    def __setattr__(self, name: str, value) -> None:
        if "_parameters" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__}: call super().__init__() before assigning attributes")
        if isinstance(value, Module):
            self._attach({name: value})
            return
        for table in ("_parameters", "_buffers", "_modules"):
            self.__dict__[table].pop(name, None)
        if isinstance(value, Value):
            self.__dict__.pop(name, None)  # a plain attribute of that name would shadow the registered one
        if isinstance(value, Value) and value.op.name == "variable":
            role = value.attrs["role"]
            if role not in _LEAF_ROLES:
                raise TypeError(f"{type(self).__name__}.{name}: a {role} variable cannot belong to a module")
            # The leaf itself, not a copy: a parameter already registered elsewhere is shared (tied).
            self.__dict__[_LEAF_ROLES[role]][name] = value
            self._root()._name_leaves()
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
                self._root()._name_leaves()  # a leaf tied there may have lost its first name
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

    def _attach(self, modules: dict) -> None:
        """Register `modules` (name -> submodule) under their names, then name the tree's leaves
        once: each naming walks the whole tree, so a ModuleList of n blocks named after each
        block would walk n * n / 2 of them (containers attach all theirs in one call)."""
        for module in modules.values():
            if not isinstance(module, Module):
                raise TypeError(f"add_module: expected a Module, got {type(module).__name__}")
        for name, module in modules.items():
            for table in ("_parameters", "_buffers", "_modules"):
                self.__dict__[table].pop(name, None)
            self.__dict__.pop(name, None)  # a plain attribute of that name would shadow the registered one
            self._modules[name] = module
            object.__setattr__(module, "_parent", weakref.ref(self))
        self._root()._name_leaves()

    def _root(self) -> "Module":
        """The outermost module holding this one (following the modules each was last attached
        to, while they still hold it); this one if none does."""
        module, seen = self, {id(self)}
        while module._parent is not None:
            parent = module._parent()
            if parent is None or id(parent) in seen or not any(m is module for m in parent._modules.values()):
                break
            seen.add(id(parent))
            module = parent
        return module

    def _name_leaves(self) -> None:
        """Name every leaf of this module's tree by the dotted path at which traversal first finds
        it (torch's named_parameters() order), remaking those whose name changes. A parameter
        found again (tied), or an older variable of it, gets that same leaf: one variable per
        parameter, whatever attribute the graph reads it through."""
        first: dict[int, Value] = {}  # id(cell) -> the leaf under its first name
        for path, module in self.named_modules():
            for table in _LEAF_TABLES:
                entries = module.__dict__[table]
                for key, leaf in list(entries.items()):
                    cell = id(leaf.attrs["cell"])
                    if cell not in first:
                        first[cell] = _renamed(leaf, _joined(path, key))
                    entries[key] = first[cell]

    # ---- traversal -------------------------------------------------------
    def named_modules(self, prefix: str = "", remove_duplicate: bool = True) -> Iterator[tuple[str, "Module"]]:
        """This module and every submodule, with dotted names ('' for this one), depth first in
        registration order; a module held twice is listed once unless `remove_duplicate=False`."""
        seen: set[int] = set()
        stack = [(prefix, self)]
        while stack:
            name, module = stack.pop(0)
            if remove_duplicate and id(module) in seen:
                continue
            seen.add(id(module))
            yield name, module
            stack[0:0] = [(_joined(name, k), m) for k, m in module._modules.items()]

    def apply(self, fn) -> "Module":
        """Call `fn(module)` on every submodule, depth first (children before their parent), then on
        this module; returns self, as torch's apply. The habit of `model.apply(init_weights)` with
        sg.nn.init's functions inside: they set the parameters' values for everything built from them."""
        if not callable(fn):
            raise TypeError(f"apply: expected a function of a module, got {type(fn).__name__}")
        for child in self.children():
            child.apply(fn)
        fn(self)
        return self

    def children(self) -> list["Module"]:
        """The direct submodules."""
        return list(self._modules.values())

    def modules(self) -> list["Module"]:
        """This module and all submodules."""
        return [m for _, m in self.named_modules()]

    def _named_leaves(self, table: str, remove_duplicate: bool = True) -> Iterator[tuple[str, Value]]:
        seen: set[int] = set()
        for path, module in self.named_modules(remove_duplicate=remove_duplicate):
            for key, leaf in module.__dict__[table].items():
                cell = id(leaf.attrs["cell"])
                if not remove_duplicate or cell not in seen:
                    seen.add(cell)
                    yield _joined(path, key), leaf

    def named_parameters(self, remove_duplicate: bool = True) -> Iterator[tuple[str, Value]]:
        """(dotted name, parameter) pairs, as torch's named_parameters(): a parameter held by
        two attributes (tied) once, under the name found first, unless `remove_duplicate=False`."""
        return self._named_leaves("_parameters", remove_duplicate)

    def parameters(self) -> list[Value]:
        """The trainable parameters, in registration order, each once (pass to sg.train_step)."""
        return [p for _, p in self.named_parameters()]

    def named_buffers(self, remove_duplicate: bool = True) -> Iterator[tuple[str, Value]]:
        """(dotted name, buffer) pairs: running statistics and other layer state."""
        return self._named_leaves("_buffers", remove_duplicate)

    def _state_leaves(self) -> "OrderedDict[str, Value]":
        """torch's state_dict keys and their leaves: module by module, depth first, each module's
        parameters then its buffers, every key of a tied parameter and of a module held twice."""
        out: OrderedDict = OrderedDict()
        for path, module in self.named_modules(remove_duplicate=False):
            for table in _LEAF_TABLES:
                for key, leaf in module.__dict__[table].items():
                    out[_joined(path, key)] = leaf
        return out

    def buffers(self) -> list[Value]:
        """The state variables the layers update themselves."""
        return [b for _, b in self.named_buffers()]

    # ---- values ------------------------------------------------------------
    def state_dict(self) -> "OrderedDict[str, np.ndarray]":
        """Current values of parameters and buffers by dotted name, as copies, with torch's keys,
        order and layouts (a tied parameter under each of its names).

        The values are the parameters' own (symgrad/api/cells.py): what every train step built from
        the model has trained so far, or what `load_state_dict` set; the initial values before.
        """
        return OrderedDict((name, current_value(leaf)) for name, leaf in self._state_leaves().items())

    def load_state_dict(self, state: Mapping, strict: bool = True) -> "Module":
        """Set the current values of parameters and buffers by dotted name (NumPy arrays, or torch
        tensors: a torch state_dict loads as it is).

        The values are set for everything built from the model, before or after: every train
        step, its predict program and every sg.function see them at their next call. Shapes must
        match; values are cast to each leaf's dtype. strict: the keys must be exactly those of
        state_dict() (a tied parameter's every name, as torch asks); a key of a tied parameter
        set twice takes the value that comes last, as torch's. Refused (KeyError, ValueError)
        before anything changes.
        """
        state = {k: np.asarray(v.detach().cpu().numpy() if hasattr(v, "detach") else v) for k, v in state.items()}
        known = self._state_leaves()
        missing = [k for k in known if k not in state]
        unexpected = [k for k in state if k not in known]
        if strict and (missing or unexpected):
            raise KeyError(f"load_state_dict: missing {missing}, unexpected {unexpected}")
        values = []
        for name, leaf in known.items():
            if name not in state:
                continue
            value = state[name]
            if value.shape != tuple(leaf.shape):
                raise ValueError(f"load_state_dict: {name!r} has shape {list(value.shape)}, "
                                 f"expected {list(leaf.shape)}")
            values.append((leaf, value.astype(D.to_numpy(leaf.dtype))))
        for leaf, value in values:
            leaf.attrs["cell"].write(value)
        return self

    def to(self, dtype) -> "Module":
        """Remake every float parameter and buffer in `dtype` (e.g. "float64") from its current
        value; returns self. They are new parameters: steps and functions built before keep
        training and reading the old ones (compiled code has one dtype)."""
        dtype = D.canonical(dtype)
        if not D.is_float(dtype):
            raise TypeError(f"Module.to: expected a float dtype, got {dtype}")
        remade: dict[int, Value] = {}  # id(old cell) -> new leaf: a tied parameter stays tied
        for _, module in self.named_modules():
            for table in _LEAF_TABLES:
                entries = module.__dict__[table]
                for key, leaf in list(entries.items()):
                    if D.is_float(leaf.dtype) and leaf.dtype != dtype:
                        cell = id(leaf.attrs["cell"])
                        if cell not in remade:
                            remade[cell] = variable(leaf.name, current_value(leaf).astype(dtype),
                                                    role=leaf.attrs["role"])
                        entries[key] = remade[cell]
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
