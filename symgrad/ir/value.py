"""The IR node: an immutable value produced by one op from other values.

A `Value` is both a node of the graph and the handle a user holds: the
Python operators build new nodes. Shapes and dtypes are computed by the op's
shape rule as the node is made, so mistakes surface while the graph is built.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from . import shapes as S
from .dtypes import SHORT_NAMES
from .registry import OpDef


class Value:
    """One node: `op` applied to `inputs` with attributes `attrs`.

    Immutable once made; identity is the node's identity (structural
    equality is the CSE pass's business), so Values work as dict keys even
    though `==` builds an elementwise comparison, as in PyTorch.
    """

    __slots__ = ("op", "inputs", "attrs", "shape", "dtype", "effects", "__weakref__")
    __array_priority__ = 1000  # numpy scalars defer to our operators

    def __init__(self, op: OpDef, inputs: tuple, attrs: dict, shape: tuple, dtype: str, effects: tuple = ()):
        object.__setattr__(self, "op", op)
        object.__setattr__(self, "inputs", tuple(inputs))
        object.__setattr__(self, "attrs", MappingProxyType(dict(attrs)))
        object.__setattr__(self, "shape", tuple(shape))
        object.__setattr__(self, "dtype", dtype)
        # (variable, new value) pairs that computing this value also performs: BatchNorm's running
        # statistics, a random stream's counter (symgrad.effects). Not part of what it computes.
        object.__setattr__(self, "effects", tuple(effects))

    def __setattr__(self, name, value):
        raise AttributeError("graph values are immutable")

    __hash__ = object.__hash__

    # ---- description -------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def name(self) -> "str | None":
        """The user's name for inputs and variables; None for computed values."""
        return self.attrs.get("name")

    @property
    def type_str(self) -> str:
        """`f32[B,10]`: dtype and shape as printed in graph text."""
        return SHORT_NAMES[self.dtype] + S.format_shape(self.shape)

    def __repr__(self) -> str:
        label = f" {self.name!r}" if self.name else ""
        return f"<Value {self.op.name}{label}: {self.type_str}>"

    def __bool__(self):
        raise TypeError("a graph value has no truth value while the graph is built; "
                        "use sg.where(cond, a, b) for a data-dependent choice")

    def __len__(self):
        if not self.shape:
            raise TypeError("len() of a 0-d value")
        return self.shape[0]

    def __getitem__(self, key): return _F().getitem(self, key)

    def __iter__(self):
        if not self.shape or not isinstance(self.shape[0], int):
            raise TypeError(f"iteration over a value of shape {self.type_str}: needs a fixed first axis")
        return (self[k] for k in range(self.shape[0]))

    # ---- operators: thin forwards to symgrad.functional ---------------
    def __add__(self, other): return _F().add(self, other)
    def __radd__(self, other): return _F().add(other, self)
    def __sub__(self, other): return _F().sub(self, other)
    def __rsub__(self, other): return _F().sub(other, self)
    def __mul__(self, other): return _F().mul(self, other)
    def __rmul__(self, other): return _F().mul(other, self)
    def __truediv__(self, other): return _F().div(self, other)
    def __rtruediv__(self, other): return _F().div(other, self)
    def __pow__(self, other): return _F().pow(self, other)
    def __rpow__(self, other): return _F().pow(other, self)
    def __matmul__(self, other): return _F().matmul(self, other)
    def __rmatmul__(self, other): return _F().matmul(other, self)
    def __floordiv__(self, other): return _F().floor_divide(self, other)
    def __rfloordiv__(self, other): return _F().floor_divide(other, self)
    def __mod__(self, other): return _F().remainder(self, other)
    def __rmod__(self, other): return _F().remainder(other, self)
    def __and__(self, other): return _F().bitwise_and(self, other)
    def __rand__(self, other): return _F().bitwise_and(other, self)
    def __or__(self, other): return _F().bitwise_or(self, other)
    def __ror__(self, other): return _F().bitwise_or(other, self)
    def __xor__(self, other): return _F().bitwise_xor(self, other)
    def __rxor__(self, other): return _F().bitwise_xor(other, self)
    def __lshift__(self, other): return _F().bitwise_left_shift(self, other)
    def __rlshift__(self, other): return _F().bitwise_left_shift(other, self)
    def __rshift__(self, other): return _F().bitwise_right_shift(self, other)
    def __rrshift__(self, other): return _F().bitwise_right_shift(other, self)
    def __invert__(self): return _F().bitwise_not(self)
    def __neg__(self): return _F().neg(self)
    def __pos__(self): return self
    def __abs__(self): return _F().abs(self)
    def __lt__(self, other): return _F().less(self, other)
    def __le__(self, other): return _F().less_equal(self, other)
    def __gt__(self, other): return _F().greater(self, other)
    def __ge__(self, other): return _F().greater_equal(self, other)
    def __eq__(self, other): return _F().equal(self, other)   # type: ignore[override]
    def __ne__(self, other): return _F().not_equal(self, other)  # type: ignore[override]

    # ---- methods, as on a torch.Tensor / numpy array -------------------
    @property
    def T(self) -> "Value":
        return _F().transpose(self)

    def sum(self, axis=None, keepdims=False): return _F().sum(self, axis=axis, keepdims=keepdims)
    def mean(self, axis=None, keepdims=False): return _F().mean(self, axis=axis, keepdims=keepdims)
    def max(self, axis=None, keepdims=False): return _F().max(self, axis=axis, keepdims=keepdims)
    def reshape(self, *shape): return _F().reshape(self, shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape)
    def transpose(self, *axes):
        # x.transpose(1, 0) and x.transpose((1, 0)), as on a numpy array.
        if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
            axes = tuple(axes[0])
        return _F().transpose(self, axes or None)
    def astype(self, dtype): return _F().cast(self, dtype)
    def asin(self): return _F().asin(self)
    def acos(self): return _F().acos(self)
    def atan(self): return _F().atan(self)
    def atan2(self, other): return _F().atan2(self, other)
    arcsin, arccos, arctan, arctan2 = asin, acos, atan, atan2
    def div(self, other, rounding_mode=None): return _F().divide(self, other, rounding_mode=rounding_mode)
    def floor_divide(self, other): return _F().floor_divide(self, other)
    def remainder(self, other): return _F().remainder(self, other)
    def fmod(self, other): return _F().fmod(self, other)
    def bitwise_and(self, other): return _F().bitwise_and(self, other)
    def bitwise_or(self, other): return _F().bitwise_or(self, other)
    def bitwise_xor(self, other): return _F().bitwise_xor(self, other)
    def bitwise_not(self): return _F().bitwise_not(self)
    def bitwise_left_shift(self, other): return _F().bitwise_left_shift(self, other)
    def bitwise_right_shift(self, other): return _F().bitwise_right_shift(self, other)


# The graph-building functions (symgrad.functional) that the operators above and the ops' VJP
# rules call. They are written above the IR, against it, so the IR cannot import them: the
# functional module hands itself down when it is imported (`provide_functions`), as JAX binds
# its Tracer's operators from jax.numpy. Set once, at import; never changed after.
_FUNCTIONS: list = []


def provide_functions(module) -> None:
    """Called by symgrad.functional as it is imported: the module the IR builds graph code with."""
    if not _FUNCTIONS:
        _FUNCTIONS.append(module)


def functions():
    """symgrad.functional, as handed down by `provide_functions`."""
    if not _FUNCTIONS:
        raise RuntimeError("graph operators need symgrad.functional: import symgrad before building graphs")
    return _FUNCTIONS[0]


_F = functions


def make(op: OpDef, inputs=(), **attrs: Any) -> Value:
    """Build a node of `op`, running its shape rule first."""
    shape, dtype = op.infer(tuple(inputs), attrs)
    return Value(op, inputs, attrs, shape, dtype)
