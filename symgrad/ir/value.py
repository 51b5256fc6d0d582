"""The IR node: an immutable value produced by one op from other values.

A `Value` is both a node of the graph and the handle a user holds: the
Python operators build new nodes. Shapes and dtypes are computed by the op's
shape rule as the node is made, so mistakes surface while the graph is built.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from . import autocast
from . import shapes as S
from .dtypes import SHORT_NAMES
from .registry import OpDef, lookup


_new_value, _set = object.__new__, object.__setattr__


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
        # statistics, a random stream's counter (symgrad.api.effects). Not part of what it computes.
        object.__setattr__(self, "effects", tuple(effects))

    @staticmethod
    def of_fields(op: OpDef, inputs: tuple, attrs: MappingProxyType, shape: tuple, dtype: str,
                  effects: tuple) -> "Value":
        """A Value holding these fields as they are, none checked or copied (the constructor copies
        what a caller passes): for fields taken from Values already made (`over`, a pickle's)."""
        new = _new_value(Value)
        _set(new, "op", op)
        _set(new, "inputs", inputs)
        _set(new, "attrs", attrs)
        _set(new, "shape", shape)
        _set(new, "dtype", dtype)
        _set(new, "effects", effects)
        return new

    def over(self, inputs: tuple) -> "Value":
        """This node's op, attributes and type over other inputs (of the same types): the copy a
        pass makes of a node whose inputs it rebuilt. The read-only attributes are shared, not
        copied; the effects stay behind (a graph holds them in its updates once it is built)."""
        return Value.of_fields(self.op, inputs, self.attrs, self.shape, self.dtype, ())

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

    # ---- operators: thin forwards to symgrad.api.functional ---------------
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
    # Each forwards to the function of the same name (symgrad.api.functional and the modules it
    # re-exports), which holds torch's meaning and the checks; reductions take `dim=` /
    # `keepdim=` as well as `axis=` / `keepdims=`.
    @property
    def T(self) -> "Value":
        """The axes reversed (torch's and NumPy's .T)."""
        return _F().transpose(self)

    @property
    def mT(self) -> "Value":
        """The last two axes exchanged (torch's .mT: a batch of transposed matrices)."""
        if self.ndim < 2:
            raise ValueError(f"mT: needs at least 2 axes, got {self.type_str}")
        return _F().transpose(self, -2, -1)

    def size(self, dim=None):
        """The shape (a tuple of ints and Dims), or the size of axis `dim`, as torch's size()."""
        if dim is None:
            return self.shape
        if not isinstance(dim, int) or isinstance(dim, bool) or not -self.ndim <= dim < self.ndim:
            raise IndexError(f"size: dim {dim!r} is out of range for {self.type_str}")
        return self.shape[dim]

    def dim(self) -> int:
        """The number of axes (torch's dim(); .ndim)."""
        return self.ndim

    def numel(self):
        """The number of elements: an int, or a sympy expression of Dims."""
        return S.numel(self.shape)

    def sum(self, *args, **kwargs): return _F().sum(self, *args, **kwargs)
    def mean(self, *args, **kwargs): return _F().mean(self, *args, **kwargs)
    def max(self, *args, **kwargs): return _F().max(self, *args, **kwargs)
    def min(self, *args, **kwargs): return _F().min(self, *args, **kwargs)
    def amax(self, *args, **kwargs): return _F().amax(self, *args, **kwargs)
    def amin(self, *args, **kwargs): return _F().amin(self, *args, **kwargs)
    def argmax(self, *args, **kwargs): return _F().argmax(self, *args, **kwargs)
    def argmin(self, *args, **kwargs): return _F().argmin(self, *args, **kwargs)
    def var(self, *args, **kwargs): return _F().var(self, *args, **kwargs)
    def std(self, *args, **kwargs): return _F().std(self, *args, **kwargs)
    def prod(self, *args, **kwargs): return _F().prod(self, *args, **kwargs)
    def logsumexp(self, *args, **kwargs): return _F().logsumexp(self, *args, **kwargs)
    def softmax(self, *args, **kwargs): return _F().softmax(self, *args, **kwargs)
    def log_softmax(self, *args, **kwargs): return _F().log_softmax(self, *args, **kwargs)

    def reshape(self, *shape): return _F().reshape(self, _sizes(shape))
    def view(self, *shape):
        """x with a new shape (torch's view: reshape; graph values have no storage to share)."""
        if len(shape) == 1 and isinstance(shape[0], str):
            raise TypeError(f"view: reinterpreting {self.type_str} as dtype {shape[0]!r} is not supported; "
                            f"use .to(dtype) to convert")
        return _F().reshape(self, _sizes(shape))
    def view_as(self, other): return _F().reshape(self, other.shape)
    def reshape_as(self, other): return _F().reshape(self, other.shape)
    def transpose(self, *dims):
        """torch's x.transpose(d0, d1) exchanges two axes; a permutation (a tuple, or as many
        axes as x has, other than two) keeps numpy's meaning; no argument reverses the axes."""
        return _F().transpose(self, *dims)
    def permute(self, *dims): return _F().permute(self, _sizes(dims))
    def swapaxes(self, axis0, axis1): return _F().swapaxes(self, axis0, axis1)
    swapdims = swapaxes
    def t(self): return _F().transpose(self, 0, -1) if self.ndim == 2 else _F().transpose(self)
    def contiguous(self, *args, **kwargs):
        """x itself: the compiler decides every layout (torch's contiguous() copies)."""
        return self
    def clone(self, *args, **kwargs):
        """x itself: graph values are immutable, so a copy is the same value."""
        return self
    def detach(self): return _F().stop_gradient(self)
    def unsqueeze(self, dim): return _F().unsqueeze(self, dim)
    def squeeze(self, *args, **kwargs): return _F().squeeze(self, *args, **kwargs)
    def flatten(self, start_dim=0, end_dim=-1): return _F().flatten(self, start_dim, end_dim)
    def expand(self, *sizes): return _F().expand(self, _sizes(sizes))
    def expand_as(self, other): return _F().expand(self, other.shape)
    def split(self, split_size_or_sections, dim=0): return _F().split(self, split_size_or_sections, dim)
    def chunk(self, chunks, dim=0): return _F().chunk(self, chunks, dim)
    def narrow(self, dim, start, length): return _F().narrow(self, dim, start, length)
    def masked_fill(self, mask, value): return _F().masked_fill(self, mask, value)
    def where(self, condition, other): return _F().where(condition, self, other)
    def tril(self, diagonal=0): return _F().tril(self, diagonal)
    def triu(self, diagonal=0): return _F().triu(self, diagonal)
    def matmul(self, other): return _F().matmul(self, other)
    mm = bmm = matmul

    # dtype conversions, as torch's
    def astype(self, dtype): return _F().cast(self, dtype)
    def to(self, *args, **kwargs): return _F().to(self, *args, **kwargs)
    def type_as(self, other): return _F().cast(self, other.dtype)
    def float(self): return _F().cast(self, "float32")
    def double(self): return _F().cast(self, "float64")
    def long(self): return _F().cast(self, "int64")
    def int(self): return _F().cast(self, "int32")
    def bool(self): return _F().cast(self, "bool")

    # elementwise, as torch's methods
    def exp(self): return _F().exp(self)
    def log(self): return _F().log(self)
    def log1p(self): return _F().log1p(self)
    def sqrt(self): return _F().sqrt(self)
    def rsqrt(self): return 1 / _F().sqrt(self)
    def square(self): return self * self
    def reciprocal(self): return 1 / self
    def abs(self): return _F().abs(self)
    def neg(self): return _F().neg(self)
    def sin(self): return _F().sin(self)
    def cos(self): return _F().cos(self)
    def tanh(self): return _F().tanh(self)
    def sigmoid(self): return _F().sigmoid(self)
    def relu(self): return _F().relu(self)
    def erf(self): return _F().erf(self)
    def sign(self): return _F().sign(self)
    def floor(self): return _F().floor(self)
    def ceil(self): return _F().ceil(self)
    def round(self): return _F().round(self)
    def trunc(self): return _F().trunc(self)
    def pow(self, exponent): return _F().pow(self, exponent)
    def clamp(self, min=None, max=None): return _F().clip(self, min, max)
    clip = clamp
    def maximum(self, other): return _F().maximum(self, other)
    def minimum(self, other): return _F().minimum(self, other)
    def add(self, other, alpha=1): return _F().add(self, other if alpha == 1 else other * alpha)
    def sub(self, other, alpha=1): return _F().sub(self, other if alpha == 1 else other * alpha)
    def mul(self, other): return _F().mul(self, other)
    def eq(self, other): return _F().equal(self, other)
    def ne(self, other): return _F().not_equal(self, other)
    def lt(self, other): return _F().less(self, other)
    def le(self, other): return _F().less_equal(self, other)
    def gt(self, other): return _F().greater(self, other)
    def ge(self, other): return _F().greater_equal(self, other)
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


# The graph-building functions (symgrad.api.functional and the API modules on it, gathered by
# symgrad.api.operators) that the operators above and the ops' VJP rules call. They are written above
# the IR, against it, so the IR cannot import them: symgrad.api.operators hands itself down when it is
# imported (`provide_functions`), as JAX binds
# its Tracer's operators from jax.numpy. Set once, at import; never changed after.
_FUNCTIONS: list = []


def provide_functions(module) -> None:
    """Called by symgrad.api.operators as it is imported: the module the IR builds graph code with."""
    if not _FUNCTIONS:
        _FUNCTIONS.append(module)


def functions():
    """symgrad.api.operators, as handed down by `provide_functions`."""
    if not _FUNCTIONS:
        raise RuntimeError("graph operators need symgrad.api.operators: import symgrad before building graphs")
    return _FUNCTIONS[0]


_F = functions


def _sizes(args: tuple) -> tuple:
    """torch's size arguments: `f(2, 3)` or `f((2, 3))` (a tuple, list or a shape)."""
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        return tuple(args[0])
    return tuple(args)


def policy_inputs(op: OpDef, inputs: tuple, dtype: str) -> tuple:
    """`inputs` of a node of `op` as the autocast policy for `dtype` has them (symgrad.ir.autocast):
    cast where it says so."""
    out = []
    for x in inputs:
        want = autocast.target_dtype(op.name, x.dtype, dtype)
        if want == x.dtype:
            out.append(x)
        else:  # built directly: make() would apply the policy again
            cast = lookup("cast")
            shape, d = cast.infer((x,), {"dtype": want})
            out.append(Value(cast, (x,), {"dtype": want}, shape, d))
    return tuple(out)


def make(op: OpDef, inputs=(), **attrs: Any) -> Value:
    """Build a node of `op`, running its shape rule first (under `sg.autocast`, over its inputs as
    the mixed-precision policy casts them: symgrad.ir.autocast)."""
    mixed = autocast.active()
    if mixed is not None:
        inputs = policy_inputs(op, tuple(inputs), mixed)
    shape, dtype = op.infer(tuple(inputs), attrs)
    return Value(op, inputs, attrs, shape, dtype)
