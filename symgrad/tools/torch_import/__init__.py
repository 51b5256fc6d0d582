"""`sg.from_torch`: a torch model, as written, imported into symgrad through torch.export.

    model = GPT(config)                                  # a torch.nn.Module
    imported = sg.from_torch(model, (idx, targets), dynamic_shapes={"idx": {0: B}, "targets": {0: B}})
    logits, loss = imported(sg.input("idx", (sg.Dim("B"), 64), "int64"), sg.input(...))
    step = sg.train_step(loss, optimizer=sg.optim.from_torch(torch_optimizer))
    ...
    model.load_state_dict(imported.state_dict())       # the trained weights back into torch

The stages, one module each: `exporting` (torch.export, the only caller of torch; core ATen
only where `in_place` finds the exported graph cannot be read as it is), `aten_table` (one entry
per ATen op: the symgrad ops it is), `interpret` (an exported graph to graph code), `imported`
(the sg.nn.Module with torch's names). torch is needed to import only:
what is built from the result (steps, exported C, checkpoints) never touches it.
"""

from __future__ import annotations

import inspect

from .exporting import UnsupportedTorchOp, check_supported, export_forward
from .imported import ImportedModule, TorchSubmodule, check_builds, parameter_for


def _named_inputs(module, example_inputs, dynamic_shapes):
    """The example inputs (a tuple of positional arguments, a dict of keyword ones, or one tensor)
    and dynamic_shapes (a tuple in argument order, or a dict by argument name) by argument name."""
    if isinstance(example_inputs, dict):
        args, kwargs = (), dict(example_inputs)
    elif isinstance(example_inputs, (tuple, list)):
        args, kwargs = tuple(example_inputs), {}
    else:
        args, kwargs = (example_inputs,), {}
    signature = inspect.signature(module.forward)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as error:
        raise TypeError(f"sg.from_torch: example_inputs do not fit {type(module).__name__}.forward: {error}") from None
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in signature.parameters.values()
           if p.name in bound.arguments):
        raise TypeError(f"sg.from_torch: {type(module).__name__}.forward takes *args or **kwargs; the import "
                        f"matches arguments by name, so give the forward named parameters")
    named = dict(bound.arguments)
    tensors = [v for v in named.values() if hasattr(v, "data_ptr")]
    if len({id(t) for t in tensors}) != len(tensors):
        # torch.export traces one tensor given twice as one input: the graph would read one
        # argument for both.
        raise ValueError("sg.from_torch: example_inputs give one tensor for two arguments; give each its own "
                         "(a .clone())")
    if dynamic_shapes is None or isinstance(dynamic_shapes, dict):
        return named, dynamic_shapes
    dynamic_shapes = tuple(dynamic_shapes)
    if len(dynamic_shapes) != len(args):
        raise ValueError(f"sg.from_torch: dynamic_shapes has {len(dynamic_shapes)} entries for {len(args)} "
                         f"positional example inputs")
    return named, dict(zip(list(named)[:len(args)], dynamic_shapes))


def from_torch(module, example_inputs, dynamic_shapes=None) -> ImportedModule:
    """A torch.nn.Module as an sg.nn.Module whose call builds its forward as graph code.

    module: the torch model, as written. example_inputs: its forward's arguments for
    torch.export (a tuple, a dict by name, or one tensor); the import traces this call, so call
    the result with graph values in the same places (torch's defaults for the rest).
    dynamic_shapes: torch.export's, e.g. {"idx": {0: torch.export.Dim("B")}}: those sizes may be
    symbolic (an sg.Dim) or any size when the result is called; the others are the example's.

    The result has torch's parameter and buffer names and the torch model's current values
    (a tied weight once), its buffers updated by the step as torch's forward updates them
    (BatchNorm's running statistics), and train() / eval() as torch's (starting in the torch
    model's mode). Returns the forward's structure: a value, a tuple, a dict.

    Raises UnsupportedTorchOp, naming the ATen op, the torch module and the source line, for an
    op symgrad has no counterpart for; nothing is returned then.
    """
    if not (hasattr(module, "named_parameters") and hasattr(module, "forward") and hasattr(module, "_modules")):
        raise TypeError(f"sg.from_torch: expected a torch.nn.Module, got {type(module).__name__}")
    inputs, dynamic_shapes = _named_inputs(module, example_inputs, dynamic_shapes)
    exported = export_forward(module, inputs, dynamic_shapes, bool(module.training))
    check_supported(exported)
    imported = ImportedModule(module, inputs, dynamic_shapes, exported)
    check_builds(imported, exported)
    return imported


__all__ = ["from_torch", "ImportedModule", "TorchSubmodule", "UnsupportedTorchOp", "parameter_for"]
