"""Checkpoints: a train step's state in one safetensors file, and back.

A checkpoint holds every variable a step keeps between calls, under the
names the step uses, which are the module's dotted names (torch's
`state_dict` keys): parameters (`0.weight`), module buffers
(`1.running_mean`), optimizer state (`0.weight.exp_avg`, `0.weight.step`),
the dropout generator's seed and counter (`rng.seed`, `rng.counter`) and the
hyperparameters (`lr`). Gradient buffers of `accumulate()` are not saved, as
torch saves no `.grad`. The file's metadata records each tensor's role.

safetensors is the format torch, JAX and llm.c-style tools read: a
checkpoint loads into the equivalent `torch.nn.Module` with
`model.load_state_dict(safetensors.torch.load_file(path), strict=False)`
(strict=False: the optimizer's and generator's entries are not the model's),
and a torch model's `safetensors.torch.save_file(model.state_dict(), path)`
loads into a step, which keeps its own optimizer state.

Loading checks every entry (a variable of the step, the same shape and
dtype, a hyperparameter in range) before it changes anything. A parameter's
or buffer's value is its model's (symgrad/api/cells.py): loading sets it for the
module and everything else built from it too.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import OrderedDict
from pathlib import Path

import numpy as np

from ..ir import dtypes as D
from ..optim.optimizer import check_hyperparameter

FORMAT = "symgrad-checkpoint/1"
# What a step's state_dict() holds: what torch's model.state_dict() holds.
MODEL_ROLES = ("param", "state")
# Variables a checkpoint leaves out: transient, as torch's .grad.
UNSAVED_ROLES = ("grad",)


def _variables(step) -> dict:
    """The step's variables by name (its programs' too: they share its storage)."""
    return {name: v for name, v in step._variables.items() if name in step._storage}


def state_dict(step, roles=MODEL_ROLES) -> "OrderedDict[str, np.ndarray]":
    """Copies of the step's current values whose role is in `roles`, by name.

    The default, parameters and module buffers, is what torch's `model.state_dict()` holds, under
    the same names: `other.load_state_dict(step.state_dict())` gives another symgrad or torch
    module the trained values (the step's own model has them already: they are its parameters').
    """
    return OrderedDict((name, step._read_variable(name)) for name, v in _variables(step).items()
                       if v.attrs["role"] in roles)


def save(step, path) -> None:
    """Write the step's state (everything but gradient buffers) to `path`, a safetensors file.

    Written to a temporary file beside `path`, then renamed: a crash leaves the old checkpoint.
    """
    from safetensors.numpy import save_file

    variables = {name: v for name, v in _variables(step).items() if v.attrs["role"] not in UNSAVED_ROLES}
    tensors = {name: np.array(step._read_variable(name), order="C") for name in variables}  # 0-d stays 0-d
    roles = {name: v.attrs["role"] for name, v in variables.items()}
    path = Path(path)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    os.close(handle)
    try:
        save_file(tensors, temporary, metadata={"format": FORMAT, "roles": json.dumps(roles)})
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def read(path) -> tuple[dict, dict]:
    """The tensors of a safetensors file by name, and its metadata (empty if none)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="np") as f:
            return {name: f.get_tensor(name) for name in f.keys()}, dict(f.metadata() or {})
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"load: {path} is not a readable safetensors file ({exc})") from None


def load(step, path) -> None:
    """Restore the step's state from `path`: a checkpoint of `save`, or a model's state_dict.

    Every entry must name a variable of the step with the same shape and dtype, and every
    parameter of the step must be there; otherwise ValueError naming the entries, and nothing
    changes. Variables the file does not hold (a torch model's file holds no optimizer state)
    keep their values.
    """
    tensors, _ = read(path)
    variables = _variables(step)
    unknown = [name for name in tensors if name not in variables]
    missing = [name for name, v in variables.items() if v.attrs["role"] == "param" and name not in tensors]
    problems = []
    if unknown:
        problems.append(f"entries {unknown} are not variables of this step (it has {list(variables)})")
    if missing:
        problems.append(f"parameters {missing} are missing")
    for name, array in tensors.items():
        node = variables.get(name)
        if node is None:
            continue
        want = (tuple(node.shape), np.dtype(D.to_numpy(node.dtype)))
        if (array.shape, array.dtype) != want:
            problems.append(f"{name!r} is {array.dtype}{list(array.shape)}, the step's is "
                            f"{want[1]}{list(want[0])}")
        elif node.attrs["role"] == "hyper":
            try:
                check_hyperparameter(f"{name!r} (a hyperparameter)", array.item())
            except ValueError as exc:
                problems.append(str(exc))
    if problems:
        raise ValueError(f"load {path}: nothing loaded: " + "; ".join(problems))
    for name, array in tensors.items():
        step._write_variable(name, array)
