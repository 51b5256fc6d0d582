"""The leaves a user creates: runtime inputs and parameters."""

from __future__ import annotations

import numpy as np

from .cells import SHARED_ROLES, Cell
from ..ir import dtypes as D
from ..ir import shapes as S
from ..ir.registry import lookup
from ..ir.value import Value, make

import itertools

INITS = ("zeros", "ones", "normal", "uniform")
_rng = np.random.default_rng(0)
# Leaves carry a creation number, so a graph lists its inputs in the order
# the user made them, whatever order the computation reaches them in.
_serial = itertools.count()


def seed_host_generator(seed: int) -> None:
    """Replace the NumPy generator behind parameters' initial values by one seeded with `seed`
    (sg.manual_seed seeds it and symgrad.api.random's default generator: symgrad.api.seeding)."""
    global _rng
    _rng = np.random.default_rng(seed)


def host_generator() -> np.random.Generator:
    """The NumPy generator that sg.manual_seed seeds, behind every parameter's initial value
    (sg.param's init="normal" / "uniform", nn layers' defaults, sg.nn.init). Read it afresh each
    time: manual_seed replaces it."""
    return _rng


def _check_name(name, what: str) -> str:
    if not isinstance(name, str) or not name:
        raise TypeError(f"{what}: name must be a non-empty string, got {name!r}")
    return name


def input(name: str, shape, dtype: str = "float32") -> Value:
    """A runtime argument of the compiled function: `x = sg.input("x", (B, 784))`."""
    return make(lookup("input"), name=_check_name(name, "input"), shape=S.as_shape(shape),
                dtype=D.canonical(dtype), serial=next(_serial))


# What a variable is for: it decides where a checkpoint and a state_dict put it.
ROLES = {
    "param": "a trainable parameter (sg.param)",
    "state": "a module's buffer, updated by its layer (BatchNorm's running statistics)",
    "optimizer": "an optimizer's per-parameter state (momentum buffers, Adam's moments and step)",
    "rng": "a random generator's seed and counter (Dropout's masks)",
    "hyper": "a hyperparameter read at every step (the learning rate)",
    "grad": "a gradient buffer that accumulate() sums into",
}


def variable(name: str, value: np.ndarray, role: str, cell: Cell | None = None) -> Value:
    """Persistent storage with an initial value, of one of the ROLES.

    A parameter or buffer (cells.SHARED_ROLES) carries a Cell, the one owner of its value
    (symgrad/api/cells.py): a new one holding a copy of `value`, or `cell` (the same parameter
    under another name, as a module renames its leaves). It keeps no initial value beside the
    cell: that would be a second copy of every parameter, which no step reads.
    The other roles keep `value` as `attrs["init"]`, from which each step makes its own copy.
    """
    if role not in ROLES:
        raise ValueError(f"variable {name!r}: unknown role {role!r}; expected one of {list(ROLES)}")
    value = np.asarray(value)
    attrs = {}
    if role in SHARED_ROLES:
        if cell is not None and (cell.array.shape != value.shape or cell.array.dtype != value.dtype):
            raise ValueError(f"variable {name!r}: its cell holds {cell.array.dtype}{list(cell.array.shape)}, "
                             f"not {value.dtype}{list(value.shape)}")
        attrs["cell"] = cell if cell is not None else Cell(value)
    elif cell is not None:
        raise ValueError(f"variable {name!r}: a {role} variable has no cell")
    else:
        attrs["init"] = _kept(value)
    return make(lookup("variable"), name=_check_name(name, role), shape=value.shape,
                dtype=D.canonical(value.dtype), role=role, serial=next(_serial), **attrs)


def _kept(value: np.ndarray) -> np.ndarray:
    """A read-only copy of an initial value; a constant fill (all strides 0, as
    `np.broadcast_to(0.0, shape)` gives: an optimizer's moments, gradient buffers) stays a view of
    its one element, so the only full copy is the one each step makes."""
    if value.size and not any(value.strides):
        return np.broadcast_to(np.array(value.flat[0], dtype=value.dtype), value.shape)
    kept = np.array(value, copy=True)
    kept.flags.writeable = False
    return kept


def filled(shape, fill, dtype) -> np.ndarray:
    """An initial value of `shape` whose every element is `fill`, without the memory of one:
    a zero-stride view (`variable` keeps it as such)."""
    return np.broadcast_to(np.array(fill, dtype=dtype), tuple(shape))


def param(name: str, shape, init="zeros", dtype: str = "float32") -> Value:
    """A trainable parameter: `W = sg.param("W", (784, 10), init="zeros")`.

    init: "zeros", "ones", "normal" (N(0,1)), "uniform" (U(0,1)) as in
    torch.nn.init's defaults, or an ndarray (cast to `dtype`).
    """
    _check_name(name, "param")
    dtype = D.canonical(dtype)
    shape = S.as_shape(shape)
    if any(not isinstance(s, int) for s in shape):
        raise ValueError(f"param {name!r}: a parameter's shape must be concrete, got {S.format_shape(shape)}")
    if isinstance(init, np.ndarray) or (not isinstance(init, str) and hasattr(init, "__array__")):
        array = np.asarray(init)
        if array.shape != shape:
            raise ValueError(f"param {name!r}: init has shape {S.format_shape(array.shape)}, expected {S.format_shape(shape)}")
        value = np.asarray(array, dtype=D.to_numpy(dtype))  # variable() keeps a copy of its own
    elif init == "zeros":
        value = np.zeros(shape, D.to_numpy(dtype))
    elif init == "ones":
        value = np.ones(shape, D.to_numpy(dtype))
    elif init == "normal":
        value = _rng.standard_normal(shape).astype(D.to_numpy(dtype))
    elif init == "uniform":
        value = _rng.random(shape).astype(D.to_numpy(dtype))
    else:
        raise ValueError(f"param {name!r}: init must be one of {INITS} or an ndarray, got {init!r}")
    return variable(name, value, "param")
