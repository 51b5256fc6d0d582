"""Containers: Sequential, ModuleList, ModuleDict, holding submodules under torch's names."""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Mapping

from ..ir.value import Value
from .module import Module


class _Ordered(Module):
    """Submodules read by position: indexing, len() and iteration in registration order."""

    def __getitem__(self, index: int) -> Module:
        return list(self._modules.values())[index]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())


class Sequential(_Ordered):
    """Modules applied in order; children are named "0", "1", ... (or by an OrderedDict's keys)."""

    def __init__(self, *modules):
        super().__init__()
        if len(modules) == 1 and isinstance(modules[0], OrderedDict):
            items = list(modules[0].items())
        else:
            items = [(str(k), m) for k, m in enumerate(modules)]
        for name, module in items:
            if not isinstance(module, Module):
                raise TypeError(f"Sequential: item {name} is a {type(module).__name__}, not a Module")
        self._attach(dict(items))

    def forward(self, x: Value) -> Value:
        for module in self._modules.values():
            x = module(x)
        return x


class ModuleList(_Ordered):
    """Submodules in a list, named "0", "1", ... (torch.nn.ModuleList); not callable itself."""

    def __init__(self, modules: Iterable[Module] = ()):
        super().__init__()
        self.extend(modules)

    def append(self, module: Module) -> "ModuleList":
        """Add `module` at the end, named by its position."""
        self.add_module(str(len(self._modules)), module)
        return self

    def extend(self, modules: Iterable[Module]) -> "ModuleList":
        """Append each of `modules` (their leaves named once, after the last)."""
        start = len(self._modules)
        self._attach({str(start + k): module for k, module in enumerate(modules)})
        return self


def _check_key(name) -> None:
    if not isinstance(name, str) or not name or "." in name:
        raise ValueError(f"ModuleDict: a key must be a non-empty string without '.', got {name!r}")


class ModuleDict(Module):
    """Submodules by name (torch.nn.ModuleDict), in insertion order; not callable itself."""

    def __init__(self, modules: Mapping[str, Module] | None = None):
        super().__init__()
        modules = dict(modules or {})
        for name in modules:
            _check_key(name)
        self._attach(modules)  # the leaves named once, after the last

    def __setitem__(self, name: str, module: Module) -> None:
        _check_key(name)
        self.add_module(name, module)

    def __getitem__(self, name: str) -> Module:
        return self._modules[name]

    def __contains__(self, name) -> bool:
        return name in self._modules

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules)

    def keys(self):
        return self._modules.keys()

    def values(self):
        return self._modules.values()

    def items(self):
        return self._modules.items()
