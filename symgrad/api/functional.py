"""The functions a user calls on graph values: sg.exp, sg.sum, sg.softmax, ...

Each builds nodes of registered ops (symgrad.ir.ops); composites such as
softmax are written here as graph code, so their derivatives follow from their
parts (the losses, in symgrad.api.losses, likewise). Names and meanings are torch's
where torch has them: `dim=` / `keepdim=` beside NumPy's `axis=` / `keepdims=`
(symgrad.api.spellings), torch.max / torch.min with a dim giving (values, indices),
transpose(x, d0, d1) exchanging two axes. Operand dtypes combine as torch's do
(`dtypes.result_type`); a Python scalar on either side of an operator becomes a
0-d constant of the dtype torch gives the pair.
"""

from __future__ import annotations

import numbers
from collections import namedtuple
from typing import Callable, Sequence

import builtins
import numpy as np
import sympy

from ..ir import dtypes as D
from ..ir import shapes as S
from ..ir.registry import lookup
from ..ir.value import Value, functions, make
from .lifting import _is_bool, _lift, _lift_one, _operand_text, _value, apply_elementwise, constant  # noqa: F401
from .movement import broadcast_to, expand, expand_dims, reshape, squeeze, transpose, unsqueeze  # noqa: F401
from .spellings import one_of, torch_dims

builtins_max = builtins.max  # this module's max is torch.max

__all__ = [
    "add", "sub", "mul", "div", "pow", "neg", "exp", "log", "sin", "cos", "tanh", "sigmoid",
    "relu", "sqrt", "abs", "asin", "acos", "atan", "atan2", "arcsin", "arccos", "arctan", "arctan2",
    "maximum", "minimum", "where", "less", "less_equal", "greater",
    "greater_equal", "equal", "not_equal", "cast", "stop_gradient", "constant", "sum", "mean",
    "max", "min", "amax", "amin", "argmax", "argmin", "reshape", "transpose", "broadcast_to", "expand_dims",
    "unsqueeze", "squeeze", "expand", "to", "matmul",
    "softmax", "log_softmax", "one_hot", "elementwise",
    "apply_elementwise",
]


def _binary(name):
    def fn(a, b):
        a, b = _lift(a, b, name)
        return apply_elementwise(name, (a, b))
    fn.__name__ = name
    fn.__doc__ = f"Elementwise {lookup(name).doc}, with NumPy broadcasting."
    return fn


def _unary(name):
    def fn(x):
        return apply_elementwise(name, (_value(x, name),))
    fn.__name__ = name
    fn.__doc__ = f"Elementwise {lookup(name).doc}."
    return fn


add, mul, div = (_binary(n) for n in ("add", "mul", "div"))


def sub(a, b) -> Value:
    """Elementwise a - b, with NumPy broadcasting. A bool operand (a tensor or a Python bool) is
    refused, as torch refuses it: a difference of masks is `^`, an inverted mask `~`."""
    if _is_bool(a) or _is_bool(b):
        raise TypeError(f"sub: {_operand_text(a)} - {_operand_text(b)}: subtraction with a bool operand "
                        "is not supported, as in torch; use ^ (sg.bitwise_xor) or ~ (sg.bitwise_not) for masks, "
                        "or cast to a number dtype first")
    a, b = _lift(a, b, "sub")
    return apply_elementwise("sub", (a, b))


def pow(a, b) -> Value:
    """Elementwise a ** b, with NumPy broadcasting, in torch's result dtype.

    An integer (or bool) base to a constant negative integer power is refused, as torch and
    NumPy refuse it (`int32 ** -2`): the result is not an integer. Cast the base to float first.
    A graph value of integer exponents computes integer powers as torch does (a negative one
    gives 1, -1 or 0). bool ** bool is refused as in torch (a Python bool exponent is the 0 or 1
    it stands for). A Python exponent of 0.5 is sqrt, as torch computes it (NaN at -inf and
    -0.0 at -0.0, where IEEE pow gives inf and +0.0; its gradient 0.5 * rsqrt(x) is NaN at -inf).
    """
    if _is_bool(a) and _is_bool(b) and isinstance(b, (Value, np.ndarray)):
        raise TypeError(f"pow: {_operand_text(a)} ** {_operand_text(b)}: pow is not defined for bool ** bool, "
                        "as in torch; cast to an integer dtype first")
    if isinstance(b, (numbers.Real, np.floating, np.integer)) and not isinstance(b, (bool, np.bool_)) \
            and b == 0.5 and isinstance(a, Value):
        return sqrt(_lift(a, b, "pow")[0])
    a, b = _lift(a, b, "pow")
    if not D.is_float(a.dtype) and not D.is_float(b.dtype) and b.op.name == "const" \
            and not isinstance(b.attrs["value"], sympy.Basic) and np.any(np.asarray(b.attrs["value"]) < 0):
        raise ValueError(f"pow: integers to negative integer powers are not allowed: "
                         f"{_operand_text(a)} ** {np.asarray(b.attrs['value']).tolist()}; "
                         f"cast the base to a float dtype first")
    return apply_elementwise("pow", (a, b))
maximum, minimum = _binary("maximum"), _binary("minimum")
less, less_equal, greater = _binary("less"), _binary("less_equal"), _binary("greater")
greater_equal, equal, not_equal = _binary("greater_equal"), _binary("equal"), _binary("not_equal")
exp, log, sin, cos = (_unary(n) for n in ("exp", "log", "sin", "cos"))


def neg(x) -> Value:
    """Elementwise -x. A bool x is refused, as torch refuses it: an inverted mask is `~x`."""
    if _is_bool(x):
        raise TypeError(f"neg: -{_operand_text(x)}: negation of a bool is not supported, as in torch; "
                        "use ~ (sg.bitwise_not) to invert a mask, or cast to a number dtype first")
    return apply_elementwise("neg", (_value(x, "neg"),))
tanh, sigmoid, relu, sqrt, abs = (_unary(n) for n in ("tanh", "sigmoid", "relu", "sqrt", "abs"))
asin, acos, atan = (_unary(n) for n in ("asin", "acos", "atan"))
atan2 = _binary("atan2")
arcsin, arccos, arctan, arctan2 = asin, acos, atan, atan2  # torch's and NumPy's other names


def where(cond, x, y) -> Value:
    """Elementwise choice: x where `cond` is true, else y (NumPy's where)."""
    cond = _value(cond, "where", "cond")
    if cond.dtype != "bool":
        raise TypeError(f"where: cond must be bool, got {cond.dtype} {S.format_shape(cond.shape)}")
    if not isinstance(x, Value) and not isinstance(y, Value):
        raise TypeError("where: at least one of x and y must be a graph value")
    x, y = _lift(x, y, "where")
    return apply_elementwise("where", (cond, x, y))


def cast(x, dtype) -> Value:
    """x converted to `dtype` (a name, a NumPy or a torch dtype); gradients are cast back."""
    x = _value(x, "cast")
    dtype = _dtype_name(dtype)
    return x if x.dtype == dtype else make(lookup("cast"), (x,), dtype=dtype)


def to(x, *args, dtype=None, device=None, copy: bool = False, non_blocking: bool = False) -> Value:
    """torch's x.to(...): x converted to a dtype (a name, a NumPy or torch dtype, or the dtype of
    a graph value given in its place). A device ("cpu", "cuda", a torch.device) changes nothing:
    the backend a graph is compiled for decides where it runs."""
    x = _value(x, "to")
    for arg in args:
        if isinstance(arg, Value):
            dtype = arg.dtype if dtype is None else dtype
        elif _is_device(arg):
            continue
        elif dtype is None:
            dtype = arg
        else:
            raise TypeError(f"to: got two dtypes, {dtype!r} and {arg!r}")
    return x if dtype is None else cast(x, _dtype_name(dtype))


def _is_device(arg) -> bool:
    if isinstance(arg, str):
        return arg.split(":")[0] in ("cpu", "cuda", "mps", "meta")
    return type(arg).__name__ == "device"


def _dtype_name(dtype) -> str:
    """An IR dtype name from a name, a NumPy dtype or a torch dtype (torch.float64 -> float64)."""
    if type(dtype).__name__ == "dtype" and str(dtype).startswith("torch."):
        dtype = str(dtype)[len("torch."):]
    return D.canonical(dtype)


def stop_gradient(x) -> Value:
    """x, with a zero derivative (jax.lax.stop_gradient, torch's .detach())."""
    return make(lookup("stop_gradient"), (_value(x, "stop_gradient"),))


# ---- reductions ----------------------------------------------------------

def _reduce(name, x, axis, keepdims):
    x = _value(x, name)
    axes = S.normalize_axes(axis, x.ndim, name)
    return make(lookup(name), (x,), axes=axes, keepdims=bool(keepdims))


@torch_dims
def sum(x, axis=None, keepdims=False) -> Value:
    """Sum over `axis` (None: all), as numpy.sum and torch.sum (`dim=`, `keepdim=`)."""
    return _reduce("sum", x, axis, keepdims)


@torch_dims
def mean(x, axis=None, keepdims=False) -> Value:
    """Mean over `axis` (torch.mean: `dim=`, `keepdim=`); with symbolic sizes the divisor is an
    expression such as 1/B."""
    x = _value(x, "mean")
    axes = S.normalize_axes(axis, x.ndim, "mean")
    count = S.numel([x.shape[a] for a in axes])
    total = _reduce("sum", x, axes, keepdims)
    if not D.is_float(total.dtype):
        total = cast(total, D.DEFAULT_FLOAT)
    return total * constant(ieee_ratio(1, count), total.dtype)


def ieee_ratio(numerator, denominator):
    """numerator / denominator for a constant: a sympy expression, or IEEE's value of n/0.

    sympy's n/0 is complex infinity (zoo), which no backend can hold; IEEE division gives
    +-inf, or nan for 0/0, as torch computes a mean over no elements (0 * inf = nan) or an
    unbiased variance of one element. Symbolic sizes stay symbolic (1/B; B is at least 1).
    """
    numerator, denominator = sympy.sympify(numerator), sympy.sympify(denominator)
    if denominator.is_zero:
        with np.errstate(divide="ignore", invalid="ignore"):
            return float(np.float64(float(numerator)) / np.float64(0.0))
    return numerator / denominator


@torch_dims
def amax(x, axis=None, keepdims=False) -> Value:
    """Maximum over `axis` (None: all; torch.amax): its gradient is shared evenly among ties."""
    return _reduce("max", x, axis, keepdims)


def _flip_order(x: Value) -> Value:
    """x under an order-reversing map, so that a max of it is a min of x: -x for floats (NaN
    stays NaN), ~x = -x - 1 for integers (no overflow at the most negative one), not for bools."""
    return neg(x) if D.is_float(x.dtype) else functions().bitwise_not(x)  # symgrad.api.integer's


@torch_dims
def amin(x, axis=None, keepdims=False) -> Value:
    """Minimum over `axis` (None: all; torch.amin): its gradient is shared evenly among ties."""
    return _flip_order(amax(_flip_order(_value(x, "amin")), axis=axis, keepdims=keepdims))


# What torch.max(x, dim) and torch.min(x, dim) return: the extremes and where they are.
MaxResult = namedtuple("max", ["values", "indices"])
MinResult = namedtuple("min", ["values", "indices"])


def _extreme(op: str, x, dim, keepdim, axis, keepdims, other):
    """torch.max / torch.min in all three forms (see max)."""
    x = _value(x, op)
    if isinstance(dim, (Value, np.ndarray)) or other is not None:
        if other is not None and dim is not None:
            raise TypeError(f"{op}: got both dim and other")
        return (maximum if op == "max" else minimum)(x, dim if other is None else other)
    one_of(op, "dim", dim, "axis", axis)
    if axis is not None or dim is None:
        keep = one_of(op, "keepdim", keepdim, "keepdims", keepdims)
        return (amax if op == "max" else amin)(x, axis=axis, keepdims=bool(keep))
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"{op}: dim must be an int, got {dim!r} (amax/amin reduce over several axes)")
    keep = bool(one_of(op, "keepdim", keepdim, "keepdims", keepdims))
    dim = S.normalize_axes(dim, x.ndim, op)[0]
    indices = (argmax if op == "max" else argmin)(x, axis=dim, keepdims=True)
    # The value at each index, as a sum of one selected entry: the gradient goes to that entry
    # alone, as torch's max(dim) sends it to its index (amax shares it among ties).
    at = equal(make(lookup("iota"), shape=x.shape, axis=dim, dtype=indices.dtype), indices)
    zero = constant(False if x.dtype == "bool" else 0, x.dtype)
    values = sum(where(at, x, zero), axis=dim, keepdims=True)
    values = values if values.dtype == x.dtype else cast(values, x.dtype)  # a bool's sum is an integer
    if not keep:
        values, indices = squeeze(values, axis=dim), squeeze(indices, axis=dim)
    return (MaxResult if op == "max" else MinResult)(values, indices)


def max(x, dim=None, keepdim=None, *, axis=None, keepdims=None, other=None):
    """torch.max's three forms. `max(x)`: the largest element. `max(x, dim)` (an int, torch's
    spelling, positional or `dim=`): a namedtuple (values, indices) of the maxima along `dim`
    and their first positions, the gradient going to those positions. `max(x, other)` (a graph
    value): the elementwise maximum. NumPy's `axis=` (ints or tuples) / `keepdims=` give the
    maxima alone (amax), as numpy.max."""
    return _extreme("max", x, dim, keepdim, axis, keepdims, other)


def min(x, dim=None, keepdim=None, *, axis=None, keepdims=None, other=None):
    """torch.min's three forms, as `max`: the smallest element; (values, indices) along an int
    `dim`; the elementwise minimum with a graph value; NumPy's `axis=` gives the minima alone."""
    return _extreme("min", x, dim, keepdim, axis, keepdims, other)


@torch_dims
def argmax(x, axis=None, keepdims=False) -> Value:
    """Index of the first maximum along one axis (None: of the flattened array), as torch.argmax."""
    x = _value(x, "argmax")
    if axis is None:
        x, axis = reshape(x, (S.numel(x.shape),)), 0
        if keepdims:
            raise ValueError("argmax: keepdims needs an axis")
    if not isinstance(axis, int):
        raise TypeError(f"argmax: axis must be an int, got {axis!r}")
    return _reduce("argmax", x, axis, keepdims)


@torch_dims
def argmin(x, axis=None, keepdims=False) -> Value:
    """Index of the first minimum along one axis (None: of the flattened array), as torch.argmin."""
    return argmax(_flip_order(_value(x, "argmin")), axis=axis, keepdims=keepdims)


# ---- matmul ------------------------------------------------------------------

def matmul(a, b) -> Value:
    """Matrix product with torch.matmul's rules: (M,K)@(K,N); 1-D operands gain an axis that the
    result drops; leading axes are batch dimensions that broadcast ((B,H,T,D) @ (B,H,D,T))."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = _lift(a, b, "matmul")  # `array @ x`: NumPy defers to Value.__rmatmul__
    a, b = _value(a, "matmul", "a"), _value(b, "matmul", "b")
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError(f"matmul: operands need at least one axis, got {S.format_shape(a.shape)} "
                         f"and {S.format_shape(b.shape)}")
    a2 = reshape(a, (1, a.shape[0])) if a.ndim == 1 else a
    b2 = reshape(b, (b.shape[0], 1)) if b.ndim == 1 else b
    if a2.ndim > 2 and b2.ndim == 2 and S.same_size(a2.shape[-1], b2.shape[0]):
        # (..., M, K) @ (K, N) is one 2-D product of the rows: a Linear layer on a sequence.
        flat = make(lookup("matmul"), (reshape(a2, (S.numel(a2.shape[:-1]), a2.shape[-1])), b2))
        out = reshape(flat, a2.shape[:-1] + (b2.shape[1],))
    else:
        try:
            out = make(lookup("matmul"), (a2, b2))
        except ValueError as exc:
            if a.ndim > 1 and b.ndim > 1:
                raise
            raise ValueError(f"matmul: shapes {S.format_shape(a.shape)} and {S.format_shape(b.shape)} "
                             f"do not align") from exc
    if a.ndim == 1:
        out = reshape(out, out.shape[:-2] + out.shape[-1:])
    if b.ndim == 1:
        out = reshape(out, out.shape[:-1])
    return out


# ---- indexing primitives (symgrad.api.indexing builds slicing, cat, embedding on these) --------

def make_slice(x, starts, stops, steps) -> Value:
    """x[start:stop:step] on every axis, the bounds already normalized (see symgrad.api.indexing)."""
    x = _value(x, "slice")
    if all(a == 0 and S.same_size(b, n) and c == 1 for a, b, c, n in zip(starts, stops, steps, x.shape)):
        return x
    return make(lookup("slice"), (x,), starts=tuple(starts), stops=tuple(stops), steps=tuple(steps))


def embed(g, shape, starts, steps) -> Value:
    """Zeros of `shape` with g written from `starts` by `steps`: the transpose of make_slice."""
    g = _value(g, "embed")
    shape = S.as_shape(shape)
    if g.shape == shape:
        return g
    return make(lookup("embed"), (g,), shape=shape, starts=tuple(starts), steps=tuple(steps))


def take(table, indices, axis: int = 0, checked: bool = False, purpose: str = "") -> Value:
    """table's entries at integer `indices` along `axis` (np.take). Unless `checked` (indices known
    to lie in range), the indices are checked against the axis's size before anything reads them.
    `purpose`: what the gather is for (a convolution's im2col), named by step.report()."""
    table, indices = _value(table, "take", "table"), _value(indices, "take", "indices")
    axis = S.normalize_axes(axis, table.ndim, "take")[0]
    if not checked:
        indices = class_labels(indices, table.shape[axis], op="take", arg="indices")
    return make(lookup("take"), (table, indices), axis=axis, **({"purpose": purpose} if purpose else {}))


def scatter_add(src, indices, axis: int, size, purpose: str = "") -> Value:
    """Zeros with `size` entries along `axis`, src's entries added at `indices`: take's transpose."""
    return make(lookup("scatter_add"), (_value(src, "scatter_add", "src"), indices), axis=axis, size=size,
                **({"purpose": purpose} if purpose else {}))


# ---- composites: softmax and the losses ------------------------------------

def _shift_by_max(x: Value, axis: int, op: str) -> Value:
    """x - max(x) along `axis` (no gradient through the max): exp of it cannot overflow.

    An empty axis has no max and needs no shift: softmax over it is empty, as in torch.
    """
    if x.shape[S.normalize_axes(axis, x.ndim, op)[0]] == 0:
        return x
    return x - stop_gradient(max(x, axis=axis, keepdims=True))


@torch_dims
def log_softmax(x, axis: int = -1) -> Value:
    """log(softmax(x)) along `axis` / `dim`, computed stably: x - max - log(sum(exp(x - max)))."""
    x = _value(x, "log_softmax")
    shifted = _shift_by_max(x, axis, "log_softmax")
    return shifted - log(sum(exp(shifted), axis=axis, keepdims=True))


@torch_dims
def softmax(x, axis: int = -1) -> Value:
    """exp(x) / sum(exp(x)) along `axis` / `dim` (torch.softmax), computed stably."""
    x = _value(x, "softmax")
    e = exp(_shift_by_max(x, axis, "softmax"))
    return e / sum(e, axis=axis, keepdims=True)


def class_labels(labels, num_classes, op: str = "class_labels", arg: str = "labels",
                 ignore_index: int | None = None) -> Value:
    """`labels` (integers), checked on every call to lie in [0, num_classes) or to equal
    `ignore_index` (when given), as torch checks them.

    An input's labels are checked in Python before the program runs (symgrad.step.compiled);
    labels the graph computes are checked by the NumPy reference as it runs. `op` and `arg`
    name the caller in the error (cross_entropy's target).
    """
    labels = _value(labels, op, arg)
    if D.is_float(labels.dtype) or labels.dtype == "bool":
        raise TypeError(f"{op}: {arg} must be integers, got {labels.dtype} {S.format_shape(labels.shape)}")
    ignored = {} if ignore_index is None else {"ignore_index": int(ignore_index)}
    return make(lookup("class_labels"), (labels,), num_classes=num_classes, caller=op, arg=arg, **ignored)


def _class_mask(labels: Value, num_classes) -> Value:
    """bool[..., num_classes]: True at each row's label (labels already checked)."""
    shape = labels.shape + (num_classes,)
    classes = make(lookup("iota"), shape=shape, axis=len(shape) - 1, dtype=labels.dtype)
    return equal(expand_dims(labels, -1), classes)


def one_hot(labels, num_classes: int, dtype: str = D.DEFAULT_FLOAT) -> Value:
    """labels (integers in [0, num_classes)) as one-hot rows of length `num_classes`."""
    labels = class_labels(labels, num_classes, "one_hot", "labels")
    return cast(_class_mask(labels, num_classes), dtype)


# ---- user-defined elementwise ops ----------------------------------------------

def elementwise(name: str, fn, args: Sequence[sympy.Symbol] | None = None) -> Callable[..., Value]:
    """Define a new elementwise op from sympy; its derivatives come from sympy.diff.

    `fn` is a function of sympy symbols (`lambda x: sympy.log(1 + sympy.exp(x))`)
    or a sympy expression whose operands are `args` (default: its free symbols
    sorted by name). Returns the function that applies the op to graph values.
    """
    from ..ir import elementwise as E

    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"elementwise: name must be an identifier, got {name!r}")
    if callable(fn) and not isinstance(fn, sympy.Basic):
        import inspect
        arity = len(inspect.signature(fn).parameters)
        expr = sympy.sympify(fn(*E.ARGS[:arity]))
    else:
        expr = sympy.sympify(fn)
        params = list(args) if args is not None else sorted(expr.free_symbols, key=lambda s: s.name)
        arity = len(params)
        expr = expr.xreplace({p: a for p, a in zip(params, E.ARGS)})
        expr = expr.xreplace({sympy.Symbol(a.name): a for a in E.ARGS})
    existing = E.REGISTRY.get(name)
    if existing is not None and existing.arity == arity and existing.expr == expr:
        op = existing  # the same definition run again (a notebook cell re-run): the same op
    else:
        op = E.define(name, expr, arity, "float", doc=f"{name}: {expr}")

    def apply(*operands):
        if len(operands) != arity:
            raise TypeError(f"{name}: takes {arity} operand(s), got {len(operands)}")
        values = [o for o in operands if isinstance(o, Value)]
        if not values:
            raise TypeError(f"{name}: at least one operand must be a graph value")
        return apply_elementwise(op, [_lift_one(o, values[0], name) if not isinstance(o, Value) else o
                                      for o in operands])
    apply.__name__ = name
    apply.op = op
    apply.__doc__ = f"Elementwise {name}(x) = {expr}."
    return apply
