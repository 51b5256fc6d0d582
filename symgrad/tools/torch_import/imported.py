"""`ImportedModule`: a torch model as an `sg.nn.Module`, its forward built from the exported graph.

The module tree mirrors the torch one (a `TorchSubmodule` per torch submodule, under the same
attribute names), so `named_parameters()`, `state_dict()` and `load_state_dict()` use torch's
names and order: a tied weight is one parameter listed once and kept under each of its names in
state_dict, as torch's. Calling the module matches the arguments to the torch forward's
parameters by name and builds the exported forward of the current mode (train() / eval()) as
graph code (symgrad/tools/torch_import/interpret.py). The other mode is exported on its first call.

torch tensors of an imported model are recorded (by identity, weakly) with the symgrad parameter
they became, in sg.optim.from_torch's table (`record`), so `sg.optim.from_torch(torch_optimizer)`
finds them (`parameter_for`).
"""

from __future__ import annotations

import inspect
from collections import OrderedDict

from ...api.cells import current_value
from ...ir import dtypes as D
from ...ir.value import Value
from ...nn.module import Module
from ...optim.from_torch import parameter_for, record  # noqa: F401  (parameter_for: re-exported)
from ...api.sources import param, variable
from .exporting import Exported, UnsupportedTorchOp, check_supported, export_forward
from .interpret import build


class TorchSubmodule(Module):
    """A torch submodule's parameters, buffers and children, under torch's names. Only the imported
    model as a whole is called: torch.export traced the top-level forward."""

    def __init__(self, torch_type: str):
        super().__init__()
        self.torch_type = torch_type

    def forward(self, *args, **kwargs):
        raise TypeError(f"{self.torch_type}: a submodule of an imported torch model cannot be called on its "
                        f"own; call the imported model (torch.export traced its forward as a whole)")

    def __repr__(self) -> str:
        return super().__repr__().replace(type(self).__name__, self.torch_type, 1)


def _mirror(target: Module, torch_module, made: dict, leaves: dict) -> None:
    """Register `torch_module`'s parameters, persistent buffers and children on `target`, each torch
    tensor becoming one symgrad leaf (a tied tensor, the same leaf) and each torch module one mirror."""
    for name, tensor in torch_module._parameters.items():
        if tensor is None:
            continue
        if id(tensor) not in leaves:
            value = tensor.detach().cpu().numpy()
            leaves[id(tensor)] = param(name, value.shape, init=value, dtype=D.canonical(value.dtype))
        setattr(target, name, leaves[id(tensor)])
    for name, tensor in torch_module._buffers.items():
        if tensor is None or name in torch_module._non_persistent_buffers_set:
            continue
        if id(tensor) not in leaves:
            leaves[id(tensor)] = variable(name, tensor.detach().cpu().numpy(), role="state")
        setattr(target, name, leaves[id(tensor)])
    for name, child in torch_module._modules.items():
        if child is None:
            continue
        if id(child) not in made:
            made[id(child)] = TorchSubmodule(type(child).__name__)
            _mirror(made[id(child)], child, made, leaves)
        setattr(target, name, made[id(child)])


def _match(template, given, flat: dict, where: str) -> None:
    """Walk the export's input structure beside the caller's, filling flat[position] = (value,
    the argument's name as messages give it)."""
    if isinstance(template, int) and not isinstance(template, bool):
        flat[template] = (given, where.split(": ", 1)[-1])
    elif isinstance(template, (tuple, list)):
        if not isinstance(given, (tuple, list)) or len(given) != len(template):
            raise TypeError(f"{where}: expected a sequence of {len(template)} like the example, got {given!r}")
        for k, (t, g) in enumerate(zip(template, given)):
            _match(t, g, flat, f"{where}[{k}]")
    elif isinstance(template, dict):
        if not isinstance(given, dict) or set(given) != set(template):
            raise TypeError(f"{where}: expected a dict with keys {sorted(template)} like the example, got {given!r}")
        for key in template:
            _match(template[key], given[key], flat, f"{where}[{key!r}]")
    elif template is not None and template != given:
        raise TypeError(f"{where}: expected {template!r} as in the example inputs, got {given!r}")


def _rebuild(template, values: list):
    """The output structure with the flat positions replaced by values."""
    if isinstance(template, int) and not isinstance(template, bool):
        return values[template]
    if isinstance(template, tuple):
        return tuple(_rebuild(t, values) for t in template)
    if isinstance(template, list):
        return [_rebuild(t, values) for t in template]
    if isinstance(template, dict):
        return type(template)((k, _rebuild(t, values)) for k, t in template.items())
    return template


class ImportedModule(Module):
    """A torch model imported by `sg.from_torch`: an sg.nn.Module with torch's names and values
    whose call builds the torch forward as symgrad graph code."""

    def __init__(self, torch_module, inputs: dict, dynamic_shapes, exported: Exported):
        super().__init__()
        self.torch_type = type(torch_module).__name__
        leaves: dict = {}
        _mirror(self, torch_module, {id(torch_module): self}, leaves)
        # The torch model stays referenced for the other mode's export (see _exported), nothing else.
        object.__setattr__(self, "_torch_module", torch_module)
        object.__setattr__(self, "_example", (inputs, dynamic_shapes))
        object.__setattr__(self, "_programs", {exported.training: exported})
        object.__setattr__(self, "_signature", inspect.signature(torch_module.forward))
        self.train(exported.training)
        for name, tensor in list(torch_module.named_parameters(remove_duplicate=False)) + \
                list(torch_module.named_buffers(remove_duplicate=False)):
            record(tensor, self, name)

    def get_leaf(self, torch_name: str) -> Value:
        """The parameter or buffer `torch_name` ("transformer.h.0.attn.c_attn.weight") as it is now."""
        module = self
        *path, last = torch_name.split(".")
        for part in path:
            module = module._modules[part]
        leaf = module._parameters.get(last)
        return leaf if leaf is not None else module._buffers[last]

    def _exported(self) -> Exported:
        """The exported forward of the current mode: exported at import for the torch model's mode,
        the other on its first use."""
        mode = bool(self.training)
        if mode not in self._programs:
            inputs, dynamic_shapes = self._example
            exported = export_forward(self._torch_module, inputs, dynamic_shapes, mode)
            check_supported(exported)
            check_builds(self, exported)
            self._programs[mode] = exported
        return self._programs[mode]

    def forward(self, *args, **kwargs):
        """The torch forward as graph code: graph values (or Python values equal to the example's)
        where torch took tensors, in the structure torch returns (a value, a tuple, a dict)."""
        exported = self._exported()
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as error:
            raise TypeError(f"{self.torch_type}.forward: {error}") from None
        flat: dict = {}
        given = dict(bound.arguments)
        for name, template in exported.inputs_template.items():
            if name not in given:
                raise TypeError(f"{self.torch_type}.forward: the model was imported with {name!r} given; call it "
                                f"the same way (torch.export traced that call)")
            _match(template, given.pop(name), flat, f"{self.torch_type}.forward: argument {name!r}")
        extra = [name for name, value in given.items() if value is not None]
        if extra:
            raise TypeError(f"{self.torch_type}.forward: {extra} were not in the example inputs the model was "
                            f"imported with; import it with them to trace that call")
        inputs = [flat[k][0] for k in range(len(flat))]
        bound_sizes: dict = {}
        for k, (value, meta) in enumerate(zip(inputs, exported.input_meta)):
            self._check_input(flat[k][1], value, meta, bound_sizes)
        outputs = build(exported, self.get_leaf, inputs)
        return _rebuild(exported.outputs_template, outputs)

    def _check_input(self, k: str, value, meta, bound_sizes: dict) -> None:
        """Refuse an input unlike the example: a fixed size that differs, a dtype that differs, or
        two sizes that torch's dynamic_shapes made one symbol given differently."""
        if not isinstance(meta, tuple):
            if value != meta:
                raise TypeError(f"{self.torch_type}.forward: {k} is {value!r}; the export specialised it "
                                f"to {meta!r}")
            return
        shape, dtype = meta
        if not isinstance(value, Value):
            raise TypeError(f"{self.torch_type}.forward: {k} must be a graph value (sg.input), "
                            f"got {type(value).__name__}")
        want = "[" + ", ".join(str(s) for s in shape) + "]"
        if value.ndim != len(shape) or any(isinstance(s, int) and s != v for s, v in zip(shape, value.shape)):
            raise ValueError(f"{self.torch_type}.forward: {k} is {value.type_str}; the model was exported for "
                             f"{want} (the named sizes are those made dynamic through dynamic_shapes)")
        for s, v in zip(shape, value.shape):
            if isinstance(s, str):
                if s in bound_sizes and bound_sizes[s] != v:
                    raise ValueError(f"{self.torch_type}.forward: {k} is {value.type_str}, but the export's "
                                     f"size {s} was {bound_sizes[s]} in an earlier argument ({want})")
                bound_sizes[s] = v
        if D.canonical(value.dtype) != D.canonical(dtype):
            raise TypeError(f"{self.torch_type}.forward: {k} is {value.dtype}, the example was {dtype}")

    def state_dict(self):
        """torch's state_dict of the current values: torch tensors under torch's keys, so that
        `torch_model.load_state_dict(imported.state_dict())` puts the trained weights back (a tied
        weight's names share one tensor, as torch's). symgrad's own checkpoints (step.save) need
        no torch; this model came from torch, so torch is there."""
        import torch
        tensors: dict = {}
        out = OrderedDict()
        for name, leaf in self._state_leaves().items():
            key = id(leaf.attrs["cell"])
            if key not in tensors:
                tensors[key] = torch.from_numpy(current_value(leaf))
            out[name] = tensors[key]
        return out

    def extra_repr(self) -> str:
        return f"imported from torch {self.torch_type}"


def check_builds(module: ImportedModule, exported: Exported) -> None:
    """Build the forward once from inputs shaped as the export's (a Dim per dynamic size), so an
    argument symgrad refuses is reported while importing, not at the first call."""
    from ...ir.shapes import Dim
    from ...api.sources import input as graph_input
    inputs = []
    for k, meta in enumerate(exported.input_meta):
        if isinstance(meta, tuple):
            shape, dtype = meta
            shape = tuple(s if isinstance(s, int) else Dim(f"import_check_{s}" if s.isidentifier() else
                                                           f"import_check_{k}_{a}") for a, s in enumerate(shape))
            inputs.append(graph_input(f"import_check_{k}", shape, dtype=dtype))
        else:
            inputs.append(meta)
    build(exported, module.get_leaf, inputs)


__all__ = ["ImportedModule", "TorchSubmodule", "UnsupportedTorchOp", "parameter_for", "check_builds"]
