"""The functions a user calls on graph values: sg.exp, sg.sum, sg.softmax, ...

Each builds nodes of registered ops (symgrad.ir.ops); composites such as
softmax and cross_entropy are written here as graph code, so their
derivatives follow from their parts. Operand dtypes combine as torch's do
(`dtypes.result_type`); a Python scalar on either side of an operator becomes a
0-d constant of the dtype torch gives the pair.
"""

from __future__ import annotations

import numbers
import sys
from typing import Callable, Sequence

import numpy as np
import sympy

from .ir import dtypes as D
from .ir import shapes as S
from .ir.registry import lookup
from .ir.value import Value, make, provide_functions

__all__ = [
    "add", "sub", "mul", "div", "pow", "neg", "exp", "log", "sin", "cos", "tanh", "sigmoid",
    "relu", "sqrt", "abs", "asin", "acos", "atan", "atan2", "arcsin", "arccos", "arctan", "arctan2",
    "maximum", "minimum", "where", "less", "less_equal", "greater",
    "greater_equal", "equal", "not_equal", "cast", "stop_gradient", "constant", "sum", "mean",
    "max", "argmax", "reshape", "transpose", "broadcast_to", "expand_dims", "squeeze", "matmul",
    "softmax", "log_softmax", "one_hot", "nll_loss", "cross_entropy", "mse_loss", "elementwise",
    "apply_elementwise",
]


# ---- lifting Python values into the graph -------------------------------

def constant(value, dtype: str | None = None) -> Value:
    """A constant node: a Python number, a NumPy array or a sympy expression of Dims."""
    if isinstance(value, Value):
        return value
    if isinstance(value, sympy.Basic):
        return make(lookup("const"), value=value, shape=(), dtype=dtype or D.DEFAULT_FLOAT)
    if isinstance(value, np.ndarray):
        dt = D.canonical(dtype or (D.DEFAULT_FLOAT if value.dtype.kind == "f" else value.dtype))
        array = np.array(value, dtype=D.to_numpy(dt))
        array.flags.writeable = False
        return make(lookup("const"), value=array, shape=array.shape, dtype=dt)
    if isinstance(value, (numbers.Number, np.generic)):
        if dtype is None:
            dtype = ("bool" if isinstance(value, (bool, np.bool_)) else
                     "int64" if isinstance(value, (int, np.integer)) else D.DEFAULT_FLOAT)
        return make(lookup("const"), value=value.item() if isinstance(value, np.generic) else value,
                    shape=(), dtype=D.canonical(dtype))
    raise TypeError(f"cannot use {type(value).__name__} {value!r} as a graph value")


def _lift(a, b, op: str):
    """Both operands as Values. A Python scalar becomes a 0-d constant of the dtype torch gives
    the pair (`D.result_type`): beside the other operand the op's own rule then keeps it, since a
    0-d value only counts where it raises the category (`int_tensor * 0.5` is float32)."""
    if isinstance(a, Value) and isinstance(b, Value):
        return a, b
    if isinstance(a, Value):
        return a, _lift_one(b, a, op)
    if isinstance(b, Value):
        return _lift_one(a, b, op), b
    raise TypeError(f"{op}: at least one operand must be a graph value")


def _lift_one(x, partner: Value, op: str) -> Value:
    if isinstance(x, (numbers.Number, np.generic)) and not isinstance(x, np.ndarray):
        return constant(x, D.result_type(partner, x))
    if isinstance(x, sympy.Basic):  # an expression of Dims: a Python int where it is whole (B, B - 1)
        return constant(x, D.result_type(partner, 1 if x.is_integer else 0.5))
    if isinstance(x, np.ndarray):
        # An array is a tensor of its own dtype, but a float array (NumPy's float64 by default)
        # takes a float partner's precision, and the default float beside anything else.
        return constant(x, (partner.dtype if D.is_float(partner.dtype) else None) if x.dtype.kind == "f" else None)
    raise TypeError(f"{op}: unsupported operand of type {type(x).__name__}")


def _value(x, op: str, arg: str = "x") -> Value:
    if not isinstance(x, Value):
        raise TypeError(f"{op}: argument {arg} must be a graph value, got {type(x).__name__}")
    return x


def apply_elementwise(op, operands: Sequence[Value]) -> Value:
    """A node of elementwise `op` (an OpDef or a registered name) over `operands`."""
    op = lookup(op) if isinstance(op, str) else op
    return make(op, tuple(operands))


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


def _operand_text(x) -> str:
    """An operand as an error message names it: `bool [3]` for a value, the scalar itself."""
    return f"{x.dtype} {S.format_shape(x.shape)}" if isinstance(x, Value) else repr(x)


def _is_bool(x) -> bool:
    """Whether x is a bool operand: a bool value or array, or a Python bool."""
    return isinstance(x, (bool, np.bool_)) or (isinstance(x, (Value, np.ndarray)) and x.dtype == "bool")


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
    """x converted to `dtype`; gradients are cast back."""
    x = _value(x, "cast")
    dtype = D.canonical(dtype)
    return x if x.dtype == dtype else make(lookup("cast"), (x,), dtype=dtype)


def stop_gradient(x) -> Value:
    """x, with a zero derivative (jax.lax.stop_gradient, torch's .detach())."""
    return make(lookup("stop_gradient"), (_value(x, "stop_gradient"),))


# ---- reductions ----------------------------------------------------------

def _reduce(name, x, axis, keepdims):
    x = _value(x, name)
    axes = S.normalize_axes(axis, x.ndim, name)
    return make(lookup(name), (x,), axes=axes, keepdims=bool(keepdims))


def sum(x, axis=None, keepdims=False) -> Value:
    """Sum over `axis` (None: all), as numpy.sum."""
    return _reduce("sum", x, axis, keepdims)


def mean(x, axis=None, keepdims=False) -> Value:
    """Mean over `axis`; with symbolic sizes the divisor is an expression such as 1/B."""
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


def max(x, axis=None, keepdims=False) -> Value:
    """Maximum over `axis`; its gradient is shared evenly among ties (torch.amax)."""
    return _reduce("max", x, axis, keepdims)


def argmax(x, axis=None, keepdims=False) -> Value:
    """Index of the first maximum along one axis (None: of the flattened array)."""
    x = _value(x, "argmax")
    if axis is None:
        x, axis = reshape(x, (S.numel(x.shape),)), 0
        if keepdims:
            raise ValueError("argmax: keepdims needs an axis")
    if not isinstance(axis, int):
        raise TypeError(f"argmax: axis must be an int, got {axis!r}")
    return _reduce("argmax", x, axis, keepdims)


# ---- movement ----------------------------------------------------------------

def reshape(x, shape) -> Value:
    """x with a new shape of as many elements; one size may be -1."""
    x = _value(x, "reshape")
    shape = (shape,) if isinstance(shape, (int, sympy.Basic)) else tuple(shape)
    wildcards = [i for i, s in enumerate(shape) if isinstance(s, int) and s == -1]
    if len(wildcards) > 1:
        raise ValueError(f"reshape: only one size may be -1, got {shape}")
    if wildcards:
        known = S.numel([s for i, s in enumerate(shape) if i != wildcards[0]])
        rest = S.simplify(sympy.sympify(S.numel(x.shape)) / sympy.sympify(known))
        if rest.is_Rational and not rest.is_Integer:
            raise ValueError(f"reshape: cannot reshape {S.format_shape(x.shape)} to {shape}")
        shape = tuple(rest if i == wildcards[0] else s for i, s in enumerate(shape))
    shape = S.as_shape(shape)
    if shape == x.shape:
        return x
    return make(lookup("reshape"), (x,), shape=shape)


def transpose(x, axes=None) -> Value:
    """x with its axes permuted (default: reversed), as numpy.transpose."""
    x = _value(x, "transpose")
    if axes is not None:
        for a in axes:
            # Check before wrapping: a % ndim would turn axis 5 of a 2-D value into axis 1.
            if not isinstance(a, int) or isinstance(a, bool) or not -x.ndim <= a < x.ndim:
                raise ValueError(f"transpose: axes {tuple(axes)} are not a permutation of the {x.ndim} axes "
                                 f"of {S.format_shape(x.shape)}")
    perm = tuple(reversed(range(x.ndim))) if axes is None else tuple(a % x.ndim for a in axes)
    if perm == tuple(range(x.ndim)):
        return x
    return make(lookup("transpose"), (x,), perm=perm)


def broadcast_to(x, shape) -> Value:
    """x broadcast to `shape` (NumPy rules), without copying in compiled code."""
    x = _value(x, "broadcast_to")
    shape = S.as_shape(shape)
    if shape == x.shape:
        return x
    return make(lookup("expand"), (x,), shape=shape)


def expand_dims(x, axis: int) -> Value:
    """x with a new axis of size 1 at `axis`."""
    x = _value(x, "expand_dims")
    if not isinstance(axis, int) or isinstance(axis, bool) or not -x.ndim - 1 <= axis <= x.ndim:
        raise ValueError(f"expand_dims: axis {axis!r} is out of range for {S.format_shape(x.shape)} "
                         f"(a new axis goes at -{x.ndim + 1}..{x.ndim})")
    axis = axis % (x.ndim + 1)
    return reshape(x, x.shape[:axis] + (1,) + x.shape[axis:])


def squeeze(x, axis=None) -> Value:
    """x without axes of size 1 (all of them, or the given ones)."""
    x = _value(x, "squeeze")
    axes = S.normalize_axes(axis, x.ndim, "squeeze") if axis is not None else \
        tuple(a for a, s in enumerate(x.shape) if s == 1)
    for a in axes:
        if x.shape[a] != 1:
            raise ValueError(f"squeeze: axis {a} of {S.format_shape(x.shape)} has size {x.shape[a]}, not 1")
    return reshape(x, tuple(s for a, s in enumerate(x.shape) if a not in axes))


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


# ---- indexing primitives (symgrad.indexing builds slicing, cat, embedding on these) --------

def make_slice(x, starts, stops, steps) -> Value:
    """x[start:stop:step] on every axis, the bounds already normalized (see symgrad.indexing)."""
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


def log_softmax(x, axis: int = -1) -> Value:
    """log(softmax(x)) computed stably: x - max - log(sum(exp(x - max)))."""
    x = _value(x, "log_softmax")
    shifted = _shift_by_max(x, axis, "log_softmax")
    return shifted - log(sum(exp(shifted), axis=axis, keepdims=True))


def softmax(x, axis: int = -1) -> Value:
    """exp(x) / sum(exp(x)) along `axis`, computed stably."""
    x = _value(x, "softmax")
    e = exp(_shift_by_max(x, axis, "softmax"))
    return e / sum(e, axis=axis, keepdims=True)


def class_labels(labels, num_classes, op: str = "class_labels", arg: str = "labels") -> Value:
    """`labels` (integers), checked on every call to lie in [0, num_classes), as torch checks them.

    An input's labels are checked in Python before the program runs (symgrad.compiled);
    labels the graph computes are checked by the NumPy reference as it runs. `op` and `arg`
    name the caller in the error (cross_entropy's target).
    """
    labels = _value(labels, op, arg)
    if D.is_float(labels.dtype) or labels.dtype == "bool":
        raise TypeError(f"{op}: {arg} must be integers, got {labels.dtype} {S.format_shape(labels.shape)}")
    return make(lookup("class_labels"), (labels,), num_classes=num_classes, caller=op, arg=arg)


def _class_mask(labels: Value, num_classes) -> Value:
    """bool[..., num_classes]: True at each row's label (labels already checked)."""
    shape = labels.shape + (num_classes,)
    classes = make(lookup("iota"), shape=shape, axis=len(shape) - 1, dtype=labels.dtype)
    return equal(expand_dims(labels, -1), classes)


def one_hot(labels, num_classes: int, dtype: str = D.DEFAULT_FLOAT) -> Value:
    """labels (integers in [0, num_classes)) as one-hot rows of length `num_classes`."""
    labels = class_labels(labels, num_classes, "one_hot", "labels")
    return cast(_class_mask(labels, num_classes), dtype)


def _reduce_loss(per_element: Value, reduction: str, op: str) -> Value:
    if reduction == "mean":
        return mean(per_element)
    if reduction == "sum":
        return sum(per_element)
    if reduction == "none":
        return per_element
    raise ValueError(f"{op}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def nll_loss(log_probs, target, reduction: str = "mean") -> Value:
    """Negative log-likelihood of integer `target` under rows of log-probabilities (F.nll_loss)."""
    log_probs, target = _rows_and_targets(log_probs, target, "nll_loss", "log_probs")
    return _nll_loss(log_probs, target, reduction, "nll_loss")


def _rows_and_targets(scores, target, op: str, arg: str) -> tuple[Value, Value]:
    """`scores` [N, C] and `target` [N] as graph values, checked as torch's losses check them."""
    scores, target = _value(scores, op, arg), _value(target, op, "target")
    if scores.ndim != 2 or target.ndim != 1 or not S.same_size(scores.shape[0], target.shape[0]):
        raise ValueError(f"{op}: expects {arg} [N,C] and target [N], got "
                         f"{S.format_shape(scores.shape)} and {S.format_shape(target.shape)}")
    return scores, target


def _nll_loss(log_probs: Value, target: Value, reduction: str, op: str) -> Value:
    target = class_labels(target, log_probs.shape[1], op, "target")
    # Each row's target entry selected, not one_hot * log_probs: a masked class (log-probability
    # -inf) would give 0 * -inf = nan in the sum, where torch's gather gives the target's value.
    picked = sum(where(_class_mask(target, log_probs.shape[1]), log_probs, 0), axis=1)
    return _reduce_loss(-picked, reduction, op)


def cross_entropy(logits, target, reduction: str = "mean") -> Value:
    """Softmax cross-entropy of integer `target` (F.cross_entropy): mean over the batch by default."""
    logits, target = _rows_and_targets(logits, target, "cross_entropy", "logits")
    return _nll_loss(log_softmax(logits, axis=1), target, reduction, "cross_entropy")


def mse_loss(input, target, reduction: str = "mean") -> Value:
    """Mean squared error (F.mse_loss)."""
    input, target = _lift(input, target, "mse_loss")
    if input.shape != target.shape:
        S.broadcast_shapes(input.shape, target.shape, op="mse_loss")
    diff = input - target
    return _reduce_loss(diff * diff, reduction, "mse_loss")


# ---- user-defined elementwise ops ----------------------------------------------

def elementwise(name: str, fn, args: Sequence[sympy.Symbol] | None = None) -> Callable[..., Value]:
    """Define a new elementwise op from sympy; its derivatives come from sympy.diff.

    `fn` is a function of sympy symbols (`lambda x: sympy.log(1 + sympy.exp(x))`)
    or a sympy expression whose operands are `args` (default: its free symbols
    sorted by name). Returns the function that applies the op to graph values.
    """
    from .ir import elementwise as E

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


provide_functions(sys.modules[__name__])  # Value's operators and the VJP rules build with these


# x[...] (Value.__getitem__) dispatches here; symgrad.indexing builds on the primitives above.
from .indexing import getitem  # noqa: E402
# a // b, a % b, a & b, ... and their Value methods; symgrad.integer builds on the ops above.
from .integer import (bitwise_and, bitwise_left_shift, bitwise_not, bitwise_or, bitwise_right_shift,  # noqa: E402
                      bitwise_xor, floor_divide, fmod, remainder)
from .integer import div as divide  # noqa: E402  (torch.divide: div with rounding_mode; `div` above is a / b)
