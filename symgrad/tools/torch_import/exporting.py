"""torch.export of one forward (training or evaluation mode) into the plain data the importer reads.

`export_forward` runs torch.export on the module with the example inputs given by name (so the
call is matched to the torch forward's parameters by name). When the interpreter can read the
exported graph as it is (in_place.direct_writes: every op in the table, in-place writes it can
replay), that graph is the result; otherwise torch functionalises it and decomposes it to core
ATen except the composite ops symgrad has whole (aten_table.KEEP_WHOLE). It returns an `Exported`:
the FX graph, which torch name each placeholder reads (parameter, buffer, constant, user input),
which outputs are buffer updates, and the structures of the inputs and outputs as templates with
integer leaves (so matching a call needs no torch). This is the only module that calls torch.export.
"""

from __future__ import annotations

import operator
import os
import warnings
from dataclasses import dataclass, field

from .aten_table import KEEP_WHOLE, TABLE
from .in_place import direct_writes


class UnsupportedTorchOp(NotImplementedError):
    """An ATen op (or argument) symgrad cannot compile, named with the torch module and source line."""


@dataclass
class Exported:
    """One exported forward, as the importer reads it."""
    graph: object                      # torch.fx.Graph, core ATen ops plus KEEP_WHOLE
    placeholders: dict                 # placeholder name -> (kind, torch name or None)
    constants: dict                    # torch name -> numpy array (lifted constants, non-persistent buffers)
    mutations: list                    # (output position, buffer's torch name): buffers the forward updates
    user_outputs: list                 # output positions of the user's outputs, in flattened order
    inputs_template: dict              # argument name -> structure with int leaves (positions of user inputs)
    outputs_template: object           # the forward's return structure with int leaves
    input_meta: list = field(default_factory=list)  # per user input: (shape, dtype), a symbolic size as its
    #                                                 torch name ('s0'); or the Python value export specialised
    training: bool = True
    writes: dict = field(default_factory=dict)  # node name -> the names each value it writes in place goes by
    #                                             (in_place.direct_writes; empty for a functionalised graph)
    decomposed: bool = False                    # torch functionalised and decomposed the graph (run_decompositions)


def _operators() -> dict:
    """The Python operators export leaves in the graph for size arithmetic (sym_size * 3, ...)."""
    import torch
    ops = {operator.getitem: operator.getitem, operator.add: operator.add, operator.sub: operator.sub,
           operator.mul: operator.mul, operator.floordiv: operator.floordiv, operator.mod: operator.mod,
           operator.truediv: operator.truediv, operator.neg: operator.neg, operator.pow: operator.pow}
    for name in ("sym_float", "sym_int", "sym_max", "sym_min", "sym_not"):
        fn = getattr(torch, name, None)
        if fn is not None:
            ops[fn] = {"sym_float": float, "sym_int": int, "sym_max": max, "sym_min": min,
                       "sym_not": operator.not_}[name]
    return ops


def op_name(target) -> str:
    """The name an FX node's target goes by in aten_table.TABLE ("aten.linear.default")."""
    return str(target)


def display_name(target) -> str:
    """An op as a message names it: the overload's name without ".default" ("aten.linalg_qr")."""
    name = op_name(target)
    return name[:-len(".default")] if name.endswith(".default") else name


def location(node) -> str:
    """Where a node came from: `Module.forward (file.py:12)` from its module stack and the innermost
    frame of its stack trace, plus `at <path>` for a submodule (`at transformer.wte`)."""
    stack = node.meta.get("nn_module_stack") or {}
    owner, path = "forward", ""
    if stack:
        path, type_name = list(stack.values())[-1]
        type_name = type_name if isinstance(type_name, str) else getattr(type_name, "__name__", str(type_name))
        owner = f"{type_name.rsplit('.', 1)[-1]}.forward"
    where = f" at {path}" if path else ""
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    frames = [line.strip() for line in trace if line.strip().startswith("File ")]
    if frames:
        # 'File "/path/model.py", line 12, in forward'
        parts = frames[-1].split('"')
        file = os.path.basename(parts[1]) if len(parts) > 2 else "?"
        line = frames[-1].split("line ")[-1].split(",")[0]
        return f"{owner} ({file}:{line}){where}"
    return owner + where


def check_supported(exported: Exported) -> None:
    """Refuse (UnsupportedTorchOp) the first op of the graph that has no entry in the table,
    naming the ATen op, the torch module it sits in and the source line."""
    operators = _operators()
    for node in exported.graph.nodes:
        if node.op != "call_function" or node.target in operators:
            continue
        name = op_name(node.target)
        if name not in TABLE and node.name not in exported.writes:
            raise UnsupportedTorchOp(f"sg.from_torch: {display_name(node.target)} in {location(node)} has no "
                                     f"symgrad counterpart; nothing was imported")


def python_operators() -> dict:
    """The size-arithmetic targets and the Python functions that compute them."""
    return _operators()


def _template(spec, count: int):
    """A pytree spec as a plain structure whose leaves are the flat positions 0..count-1."""
    from torch.utils import _pytree as pytree
    return pytree.tree_unflatten(list(range(count)), spec)


def _decomposition_table():
    import torch
    table = torch.export.default_decompositions()
    for name in KEEP_WHOLE:
        namespace, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        target = getattr(packet, overload, None) if packet is not None else None
        if target is not None:
            table.pop(target, None)
    return table


def _name_dynamic_sizes(input_meta: list, positions: dict, dynamic_shapes) -> None:
    """Give the symbolic sizes of the top-level tensor inputs the names of the user's
    torch.export.Dim ("B", not torch's "s77"), so messages about a call speak the user's words."""
    renamed = {}
    for name, spec in (dynamic_shapes or {}).items():
        position = positions.get(name)
        if not isinstance(position, int) or not isinstance(input_meta[position], tuple):
            continue
        shape = input_meta[position][0]
        axes = spec.items() if isinstance(spec, dict) else enumerate(spec or ())
        for axis, dim in axes:
            label = getattr(dim, "__name__", None)
            if label and isinstance(shape[axis], str) and label.isidentifier():
                renamed.setdefault(shape[axis], label)
    if len(set(renamed.values())) != len(renamed):
        return  # two torch symbols under one name: keep torch's, which stay distinct
    for k, meta in enumerate(input_meta):
        if isinstance(meta, tuple):
            input_meta[k] = (tuple(renamed.get(s, s) if isinstance(s, str) else s for s in meta[0]), meta[1])


def _direct(program) -> dict | None:
    """in_place.direct_writes of the exported graph, or None where torch must functionalise it
    first (also when its signature already has outputs other than the user's)."""
    from torch.export.graph_signature import InputKind, OutputKind
    signature = program.graph_signature
    if any(spec.kind != OutputKind.USER_OUTPUT for spec in signature.output_specs):
        return None
    buffers = {spec.arg.name for spec in signature.input_specs
               if spec.kind == InputKind.BUFFER and spec.persistent}
    return direct_writes(program.graph, buffers, _operators())


def export_forward(module, inputs: dict, dynamic_shapes, training: bool) -> Exported:
    """torch.export of `module` in training or evaluation mode, called with `inputs` (argument
    name -> example), as core ATen with the KEEP_WHOLE ops left whole. The module's own mode is
    put back afterwards."""
    import torch
    from torch.export.graph_signature import InputKind, OutputKind

    was_training = module.training
    module.train(training)
    try:
        with warnings.catch_warnings():
            # torch 2.13's own export code trips its pytree deprecation (LeafSpec); not the user's to act on.
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            program = torch.export.export(module, (), inputs, dynamic_shapes=dynamic_shapes, strict=False)
            writes = _direct(program)
            if writes is None:
                program = program.run_decompositions(_decomposition_table())
    finally:
        module.train(was_training)
    signature = program.graph_signature
    placeholders, constants = {}, {}
    kinds = {InputKind.PARAMETER: "param", InputKind.BUFFER: "buffer", InputKind.CONSTANT_TENSOR: "constant",
             InputKind.USER_INPUT: "input"}
    user_count = 0
    for spec in signature.input_specs:
        kind = kinds.get(spec.kind)
        if kind is None:
            raise UnsupportedTorchOp(f"sg.from_torch: the exported forward takes a {spec.kind.name} input "
                                     f"({spec.arg.name}); only parameters, buffers, constants and tensors are imported")
        if kind == "buffer" and not spec.persistent:
            kind = "constant"  # a non-persistent buffer is not in state_dict: a constant of the graph
        if kind == "constant":
            value = program.constants.get(spec.target)
            if value is None:
                value = module.get_buffer(spec.target)
            constants[spec.target] = value.detach().cpu().numpy()
        if kind == "input":
            placeholders[spec.arg.name] = ("input", user_count)
            user_count += 1
        else:
            placeholders[spec.arg.name] = (kind, spec.target)
    mutations, user_outputs = [], []
    for position, spec in enumerate(signature.output_specs):
        if spec.kind == OutputKind.BUFFER_MUTATION:
            mutations.append((position, spec.target))
        elif spec.kind == OutputKind.USER_OUTPUT:
            user_outputs.append(position)
        else:
            raise UnsupportedTorchOp(f"sg.from_torch: the exported forward has a {spec.kind.name} output "
                                     f"({spec.target}); symgrad imports outputs and buffer updates only")
    input_meta = []
    for node in program.graph.nodes:
        if node.op == "placeholder" and placeholders[node.name][0] == "input":
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                shape = tuple(s if isinstance(s, int) else str(s) for s in val.shape)
                input_meta.append((shape, str(val.dtype).replace("torch.", "")))
            else:
                input_meta.append(val)
    args_template, kwargs_template = _template(program.call_spec.in_spec, user_count)
    _name_dynamic_sizes(input_meta, dict(kwargs_template), dynamic_shapes)
    return Exported(graph=program.graph, placeholders=placeholders, constants=constants, mutations=mutations,
                    user_outputs=user_outputs, inputs_template=dict(kwargs_template),
                    outputs_template=_template(program.call_spec.out_spec, len(user_outputs)),
                    input_meta=input_meta, training=training, writes=writes or {},
                    decomposed=writes is None)
