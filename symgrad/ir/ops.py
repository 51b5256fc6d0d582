"""The primitive ops: each one's shape rule, NumPy reference, VJP and kind, together.

Elementwise ops are one sympy expression each (their VJPs are derived);
the structural ops (sources, reductions, movement, matmul, custom) carry a
VJP written as graph code against `symgrad.api.functional`.
"""

from __future__ import annotations

import functools

import numpy as np
import sympy
from sympy.codegen.cfunctions import log1p

from . import dtypes as D
from . import shapes as S
from .elementwise import ARGS, OUT, apply_expression, define, derived_op, elementwise_vjp, partial_derivative
from .registry import CUSTOM, MATMUL, MOVEMENT, REDUCE, SOURCE, OpDef, register
from .rounding import round_half_even, trunc
from .value import functions as _F  # symgrad.api.functional, for VJP rules written as graph code

x0, x1, x2 = ARGS[:3]




# ---- elementwise: defined once as sympy expressions ----------------------

define("add", x0 + x1, 2, doc="x + y")
define("sub", x0 - x1, 2, doc="x - y")
define("mul", x0 * x1, 2, doc="x * y")
define("div", x0 / x1, 2, "float", doc="x / y (true division)")


def _pow_vjp(node, g, wants):
    """torch's pow backward. d/dx: where(y == 0, 0, g * y * x**(y - 1)), the derived VJP (g folded
    into the mask: 0 even where g is inf). d/dy: g * where(x == 0 & y >= 0, 0, x**y * log(x)), the
    mask on the factor, so 0 * g is NaN where g is infinite or NaN (torch's pow_backward_exponent).
    A constant exponent is torch's Python-scalar one, whose x**(e - 1) takes torch's fast path:
    for e = 1.5, 1.5 * sqrt(x) (NaN at x = -inf, where IEEE pow(x, 0.5) gives inf)."""
    F = _F()
    x, y = node.inputs
    grads = elementwise_vjp(node, g, (wants[0], False))
    if wants[0] and y.op.name == "const" and not isinstance(y.attrs["value"], sympy.Basic) \
            and np.ndim(y.attrs["value"]) == 0 and float(y.attrs["value"]) == 1.5:
        grads[0] = F.mul(g, F.mul(F.sqrt(x), 1.5))
    if wants[1]:
        factor = apply_expression(partial_derivative(node.op, 1), {OUT: node, x0: x, x1: y}, name="pow_vjp1")
        grads[1] = F.mul(g, factor)
    return grads


# torch's pow backward: d/dx is 0 where y == 0 (not y * x**(y-1) = 0 * inf at x = 0), d/dy is
# 0 where x == 0 and y >= 0 (not x**y * log(x) = 0 * -inf): x**y is constant there (_pow_vjp).
_POW = define("pow", x0 ** x1, 2, doc="x ** y", vjp=_pow_vjp,
              zero_derivative_where={0: sympy.Eq(x1, 0), 1: sympy.And(sympy.Eq(x0, 0), x1 >= 0)})


def integer_power(base: np.ndarray, exponent: np.ndarray) -> np.ndarray:
    """base ** exponent of integers as torch and the C helper sg_ipow compute it, in int64
    (wrapping on overflow): a negative exponent gives 1/base truncated, so 1, -1 or 0 (NumPy raises)."""
    base, exponent = np.broadcast_arrays(np.asarray(base, np.int64), np.asarray(exponent, np.int64))
    result, square, bits = np.ones(base.shape, np.int64), base.copy(), np.maximum(exponent, 0)
    with np.errstate(over="ignore"):
        while bits.any():  # square and multiply, one bit of the exponent a round
            result = np.where(bits & 1, result * square, result)
            square, bits = square * square, bits >> 1
    reciprocal = np.where(base == 1, 1, np.where(base == -1, np.where(exponent & 1, -1, 1), 0))
    return np.where(exponent < 0, reciprocal, result)


def _pow_numpy(float_pow):
    def run(args, node, env):
        if D.is_float(node.dtype):
            return float_pow(args, node, env)
        return np.broadcast_to(integer_power(*args).astype(D.to_numpy(node.dtype)), env.shape(node))
    return run


_POW.numpy = _pow_numpy(_POW.numpy)
define("neg", -x0, 1, doc="-x")
define("exp", sympy.exp(x0), 1, "float")
define("log", sympy.log(x0), 1, "float")
define("sin", sympy.sin(x0), 1, "float")
define("cos", sympy.cos(x0), 1, "float")
# NaN outside [-1, 1] and a derivative of +-inf at +-1, as torch (1/sqrt(1 - x**2) from sympy).
define("asin", sympy.asin(x0), 1, "float", doc="arcsine, in [-pi/2, pi/2]; NaN outside [-1, 1]")
define("acos", sympy.acos(x0), 1, "float", doc="arccosine, in [0, pi]; NaN outside [-1, 1]")
define("atan", sympy.atan(x0), 1, "float", doc="arctangent, in (-pi/2, pi/2)")
# torch's atan2 backward multiplies by 1/(x**2 + y**2) taken as 0 where that sum is 0 (at the
# origin, or where it underflows): a zero gradient there, not sympy's 0/0.
define("atan2", sympy.atan2(x0, x1), 2, "float", doc="atan2(y, x): the angle of the point (x, y), in [-pi, pi]",
       zero_derivative_where={0: sympy.Eq(x0**2 + x1**2, 0), 1: sympy.Eq(x0**2 + x1**2, 0)})
define("tanh", sympy.tanh(x0), 1, "float")
define("sigmoid", 1 / (1 + sympy.exp(-x0)), 1, "float", doc="1 / (1 + exp(-x))")
define("sqrt", sympy.sqrt(x0), 1, "float")
define("abs", sympy.Abs(x0), 1, doc="|x|; its derivative is sign(x), 0 at 0 as in torch")
define("erf", sympy.erf(x0), 1, "float")
define("log1p", log1p(x0), 1, "float", doc="log(1 + x), exact for tiny x")
# torch's softplus: log(1 + exp(beta*x))/beta, and x itself where beta*x > threshold (x1 = beta,
# x2 = threshold). As one Piecewise, the derivative's exp(beta*x)/(exp(beta*x) + 1) is only
# evaluated below the threshold, where it cannot overflow.
define("softplus", sympy.Piecewise((x0, x0 * x1 > x2), (log1p(sympy.exp(x0 * x1)) / x1, True)), 3, "float",
       doc="softplus(x, beta, threshold): log(1 + exp(beta*x))/beta; x past the threshold")


def _gelu_vjp(node, g, wants):
    """g * (Phi(x) + x * phi(x)), with Phi(x) as erfc(-x / sqrt 2) / 2. sympy's derivative of the
    erf form, x*phi(x) + erf(x/sqrt 2)/2 + 1/2, cancels to 0 below x = -8.7 where the true value
    (and torch's, whose Phi is exactly 0 there) is x*phi(x), -2e-170 at x = -28: an infinite
    cotangent then gave NaN against torch's -inf (the fuzzer found it). erfc(|x|/sqrt 2)/2 has no cancellation."""
    tail = sympy.erfc(sympy.Abs(x0) / sympy.sqrt(2)) / 2   # Phi(-|x|), by erfc of |x| (sympy turns erfc(-u) into 2 - erfc(u))
    # Phi(x) = tail below 0, 1 - tail from 0 on, as 0 + tail and 1 - tail: exact selects of constants
    # around one erfc. (erfc inside both arms of a select kept gcc from vectorizing the loop, which
    # then took 16 ns an element.)
    phi = sympy.Piecewise((0, x0 < 0), (1, True)) + sympy.Piecewise((1, x0 < 0), (-1, True)) * tail
    slope = phi + x0 * sympy.exp(-x0**2 / 2) / sympy.sqrt(2 * sympy.pi)
    return [_F().mul(g, apply_expression(slope, {x0: node.inputs[0]}, name="gelu_vjp0")) if wants[0] else None]


define("gelu", x0 / 2 * (1 + sympy.erf(x0 / sympy.sqrt(2))), 1, "float", doc="x * Phi(x), Phi the normal CDF",
       vjp=_gelu_vjp)
# GELU's tanh approximation, x/2 * (1 + tanh(u)) with u = sqrt(2/pi) * (x + 0.044715 x**3), is the
# same function as x * s with s = sigmoid(2u) = 1 / (1 + exp(-2u)), since 1 + tanh(u) = 2s. The op
# computes x * s: one exp and one division, where tanh costs a polynomial, an exp and a division (a
# GPT's GELU loops took 1.5x the time), and 1 + tanh(u), which cancels for u << 0 (torch's float32
# GELU is 0 from x = -5.3 on, where the true value is -2.7e-8; -8.4e-11 at x = -6), is never formed.
_GELU_U = sympy.sqrt(2 / sympy.pi) * (x0 + sympy.Rational(44715, 10**6) * x0**3)
# Its derivative is sympy's of the tanh form: finite wherever the op is, to every order. That of
# x * s, x * exp(-2u) * 2u' / (1 + exp(-2u))**2, is inf/inf (NaN) below u = -44, where exp(-2u)
# overflows and the derivative is 0.
_GELU_IN_TANH = derived_op("gelu_tanh", x0 / 2 * (1 + sympy.tanh(_GELU_U)), 1)

define("gelu_tanh", x0 / (1 + sympy.exp(-2 * _GELU_U)), 1, "float",
       doc="GELU's tanh approximation, as torch's gelu(approximate='tanh'), computed as x * sigmoid(2u)",
       vjp=functools.partial(elementwise_vjp, derived_as=_GELU_IN_TANH))


def _zero_vjp(node, g, wants):
    """A zero gradient of the operand's shape, as torch's zeros_like(grad) for the steps: not
    "no gradient", because torch goes on through the chain rule with it (0 * inf = NaN upstream)."""
    F = _F()
    return [F.broadcast_to(F.constant(0, x.dtype), x.shape) if want else None
            for x, want in zip(node.inputs, wants)]


define("sign", sympy.sign(x0), 1, vjp=_zero_vjp, doc="-1, 0 or 1; 0 at NaN, as torch.sign")
define("floor", sympy.floor(x0), 1, vjp=_zero_vjp)
define("ceil", sympy.ceiling(x0), 1, vjp=_zero_vjp)
define("trunc", trunc(x0), 1, vjp=_zero_vjp, doc="rounding toward zero")
define("round", round_half_even(x0), 1, vjp=_zero_vjp, doc="rounding to nearest, ties to even")


def _clip_vjp(node, g, wants):
    """torch's clamp backward: to x where lo <= x <= hi (0 at NaN), to lo where x < lo < hi, to hi
    where x > hi or hi < lo. (sympy's derivative of the Piecewise would pass a NaN x's cotangent.)"""
    F = _F()
    x, lo, hi = node.inputs
    inside = F.where(F.greater_equal(x, lo), F.where(F.less_equal(x, hi), g, 0.0), 0.0)
    below = F.where(F.less(x, lo), F.where(F.less(lo, hi), g, 0.0), 0.0)
    above = F.where(F.greater(x, hi), g, F.where(F.less(hi, lo), g, 0.0))
    return [grad if want else None for grad, want in zip((inside, below, above), wants)]


# torch.clamp: NaN where x is NaN (every comparison of it is false), else min(max(x, lo), hi),
# so hi wins where lo > hi.
define("clip", sympy.Piecewise((x2, sympy.Or(x0 > x2, sympy.And(x0 < x1, x1 > x2))), (x1, x0 < x1), (x0, True)),
       3, vjp=_clip_vjp, doc="clip(x, lo, hi): torch.clamp")
# relu as a Piecewise tested by x <= 0, so a NaN (which compares false) passes through as in
# torch, and the derivative is 0 at 0 and 1 at NaN (torch's threshold_backward).
define("relu", sympy.Piecewise((0, x0 <= 0), (x0, True)), 1, doc="max(x, 0); NaN stays NaN")
# Max/Min differentiate to Heaviside(x - y), which is 1/2 at ties: torch splits
# the gradient of maximum/minimum evenly between equal operands too. A NaN operand
# gives NaN (NumPy, torch), and its cotangent passes to both operands (elementwise._torch_masks),
# also where a fused chain makes both operands one value (is_nan: sympy reads v == v as True).
define("maximum", sympy.Max(x0, x1), 2)
define("minimum", sympy.Min(x0, x1), 2)
define("where", sympy.Piecewise((x1, sympy.Ne(x0, 0)), (x2, True)), 3, "select",
       doc="where(cond, x, y): x where cond holds, else y")
for _name, _rel in (("less", sympy.Lt), ("less_equal", sympy.Le), ("greater", sympy.Gt),
                    ("greater_equal", sympy.Ge), ("equal", sympy.Eq), ("not_equal", sympy.Ne)):
    define(_name, _rel(x0, x1, evaluate=False), 2, "bool", differentiable=False)


def _cast_infer(inputs, attrs):
    (x,) = inputs
    return x.shape, D.canonical(attrs["dtype"])


def _cast_vjp(node, g, wants):
    (x,) = node.inputs
    return [_F().cast(g, x.dtype)]


def _cast_numpy(args, node, env):
    with np.errstate(over="ignore", invalid="ignore"):  # too large for a 16-bit float: inf, as in torch
        return args[0].astype(D.to_numpy(node.dtype))


register(OpDef("cast", "elementwise", _cast_infer, _cast_numpy,
               _cast_vjp, doc="convert to attrs['dtype']", expr=x0, arity=1))
register(OpDef("stop_gradient", "elementwise", lambda inputs, attrs: (inputs[0].shape, inputs[0].dtype),
               lambda args, node, env: args[0], lambda node, g, wants: [None],
               doc="identity whose derivative is zero", expr=x0, arity=1))


# The unsigned view of each integer label dtype (a dict hit: this runs on every call).
_UNSIGNED = {np.dtype(np.int32): np.dtype(np.uint32), np.dtype(np.int64): np.dtype(np.uint64)}


def check_labels(labels: np.ndarray, num_classes: int, node, source: str) -> None:
    """Raise ValueError unless every entry of `labels` lies in [0, num_classes) or is the node's
    `ignore_index` (torch's check).

    `node` is the class_labels node (it names the op and argument); `source` says where the
    labels came from ("input 'y'"). One reduction over an unsigned view: a negative label
    reads as a huge unsigned one, so `max >= num_classes` catches both ends.
    """
    if labels.size == 0 or labels.view(_UNSIGNED[labels.dtype]).max() < num_classes:
        return
    flat = labels.reshape(-1)
    outside = (flat < 0) | (flat >= num_classes)
    ignore = node.attrs.get("ignore_index")
    if ignore is not None:
        outside &= flat != ignore
        if not outside.any():
            return
    bad = int(np.flatnonzero(outside)[0])
    where = np.unravel_index(bad, labels.shape)
    raise ValueError(f"{node.attrs['caller']}: {node.attrs['arg']} ({source}) holds {int(flat[bad])} at "
                     f"index {list(map(int, where))}, outside [0, {num_classes}){range_words(node, num_classes)}"
                     + (f" (and not the ignore_index {ignore})" if ignore is not None else ""))


# Callers whose integer labels pick entries of a table (an embedding's rows), not classes.
LOOKUPS = ("take", "embedding")


def range_words(node, num_classes) -> str:
    """What [0, num_classes) is to a class_labels node's caller, for its errors: classes for class
    labels; for a lookup, the rows of the table it names (`table`, an embedding's weight)."""
    if node.attrs["caller"] not in LOOKUPS:
        return f" for {num_classes} classes"
    table = node.attrs.get("table")
    return f": {table!r} has {num_classes} rows" if table else f": the table's axis has {num_classes} entries"


# Ops that move labels without changing them: labels reached through these are an input's own.
_LABEL_MOVES = ("reshape", "transpose", "expand")


def label_checks(graph) -> list[tuple[int, object]]:
    """(input position, class_labels node) for each label check whose labels are an input.

    Labels reached from an input through reshapes, transposes and broadcasts hold the
    input's own values, so checking the input array checks them.
    """
    position = {id(v): k for k, v in enumerate(graph.inputs)}
    checks = []
    for node in graph.nodes:
        if node.op.name != "class_labels":
            continue
        source = node.inputs[0]
        while source.op.name in _LABEL_MOVES:
            source = source.inputs[0]
        if id(source) in position:
            checks.append((position[id(source)], node))
    return checks


def _class_labels_numpy(args, node, env):
    (labels,) = args
    num_classes = S.evaluate(node.attrs["num_classes"], env.bindings)
    check_labels(np.asarray(labels), int(num_classes), node, "computed in the graph")
    return labels


# Labels that must lie in [0, num_classes): an identity that carries the check. Calls check
# input labels in Python before running (symgrad.step.compiled); the NumPy reference checks computed
# ones here. The passes drop the node (passes/dce.py), so compiled code never sees it.
register(OpDef("class_labels", "elementwise", lambda inputs, attrs: (inputs[0].shape, inputs[0].dtype),
               _class_labels_numpy, lambda node, g, wants: [None],
               doc="integer labels, checked to lie in [0, attrs['num_classes'])", expr=x0, arity=1))


# ---- sources: the leaves of every graph ---------------------------------

def _leaf_infer(inputs, attrs):
    return S.as_shape(attrs["shape"]), D.canonical(attrs["dtype"])


register(OpDef("input", SOURCE, _leaf_infer, lambda args, node, env: env.inputs[node],
               doc="a runtime argument, passed at every call"))
register(OpDef("variable", SOURCE, _leaf_infer, lambda args, node, env: env.variables[node],
               doc="persistent storage: a parameter, optimizer state or hyperparameter"))


def _const_numpy(args, node, env):
    value = node.attrs["value"]
    if isinstance(value, sympy.Basic):
        value = _dims_value(value, env.bindings)
    return np.asarray(value, dtype=D.to_numpy(node.dtype))


def _dims_value(expr: sympy.Expr, bindings: dict) -> float:
    """An expression of Dims (1/B, B/(B - 1)) at the bound sizes, as compiled code computes it.

    Exact where sympy's value is a real number; where it is not (B/(B - 1) at B = 1 is zoo),
    in IEEE float64 arithmetic, as the C and CUDA code divide: 1/0 = inf, 0/0 = nan.
    """
    exact = expr.xreplace({k: sympy.Integer(v) for k, v in bindings.items()})
    if exact.is_extended_real and exact.is_finite:
        return float(exact)
    symbols = sorted(expr.free_symbols, key=lambda s: s.name)
    with np.errstate(all="ignore"):
        return float(sympy.lambdify(symbols, expr, "numpy")(*(np.float64(bindings[s]) for s in symbols)))


register(OpDef("const", SOURCE, _leaf_infer, _const_numpy,
               doc="a constant; its value may be an expression of Dims, such as 1/B"))


def _iota_numpy(args, node, env):
    shape = env.shape(node)
    axis = node.attrs["axis"]
    index = np.arange(shape[axis], dtype=D.to_numpy(node.dtype))
    return np.broadcast_to(index.reshape([-1 if a == axis else 1 for a in range(len(shape))]), shape)


register(OpDef("iota", SOURCE, _leaf_infer, _iota_numpy, doc="the index along attrs['axis']"))


# ---- reductions ------------------------------------------------------------

def _reduced_shape(shape, axes, keepdims):
    return tuple(1 if a in axes else s for a, s in enumerate(shape) if keepdims or a not in axes)


def _reduce_infer(name):
    def infer(inputs, attrs):
        (x,) = inputs
        axes = S.normalize_axes(attrs["axes"], x.ndim, name)
        if attrs["axes"] != axes:
            raise ValueError(f"{name}: axes must be normalised before the node is made")
        if name == "sum":
            dtype = x.dtype if D.is_float(x.dtype) else "int64"
        elif name == "argmax":
            dtype = "int64"
        else:
            dtype = x.dtype
        if name != "sum":
            for a in axes:
                if isinstance(x.shape[a], int) and x.shape[a] == 0:
                    raise ValueError(f"{name}: cannot reduce over axis {a} of size 0 in {S.format_shape(x.shape)}")
        return _reduced_shape(x.shape, axes, attrs["keepdims"]), dtype
    return infer


def _expand_back(g, node):
    """Reshape a reduction's cotangent to keepdims form, then broadcast to the input."""
    F = _F()
    (x,) = node.inputs
    kept = _reduced_shape(x.shape, node.attrs["axes"], True)
    return F.broadcast_to(F.reshape(g, kept), x.shape)


def _sum_vjp(node, g, wants):
    return [_expand_back(g, node)]


def _max_vjp(node, g, wants):
    """d max: the cotangent split evenly among the elements equal to the max (torch.amax)."""
    F = _F()
    (x,) = node.inputs
    kept = _reduced_shape(x.shape, node.attrs["axes"], True)
    winners = F.cast(F.equal(x, F.broadcast_to(F.reshape(node, kept), x.shape)), x.dtype)
    count = F.sum(winners, axis=node.attrs["axes"], keepdims=True)
    return [winners * F.broadcast_to(F.reshape(g, kept) / count, x.shape)]


def _reducer(fn):
    def run(args, node, env):
        return np.asarray(fn(args[0], axis=node.attrs["axes"], keepdims=node.attrs["keepdims"]),
                          dtype=D.to_numpy(node.dtype))
    return run


def _argmax_numpy(args, node, env):
    (axis,) = node.attrs["axes"]
    return np.asarray(np.argmax(args[0], axis=axis, keepdims=node.attrs["keepdims"]), dtype=np.int64)


register(OpDef("sum", REDUCE, _reduce_infer("sum"), _reducer(np.sum), _sum_vjp))
register(OpDef("max", REDUCE, _reduce_infer("max"), _reducer(np.max), _max_vjp))
register(OpDef("argmax", REDUCE, _reduce_infer("argmax"), _argmax_numpy,
               doc="index of the first maximum along one axis"))


# ---- movement: index remapping, no arithmetic --------------------------------

def _reshape_infer(inputs, attrs):
    (x,) = inputs
    shape = S.as_shape(attrs["shape"])
    if not S.same_size(S.numel(shape), S.numel(x.shape)):
        raise ValueError(f"reshape: cannot reshape {S.format_shape(x.shape)} "
                         f"({S.numel(x.shape)} elements) to {S.format_shape(shape)} ({S.numel(shape)} elements)")
    return shape, x.dtype


def _transpose_infer(inputs, attrs):
    (x,) = inputs
    perm = tuple(attrs["perm"])
    if sorted(perm) != list(range(x.ndim)):
        raise ValueError(f"transpose: axes {perm} are not a permutation of the {x.ndim} axes "
                         f"of {S.format_shape(x.shape)}")
    return tuple(x.shape[p] for p in perm), x.dtype


def _expand_infer(inputs, attrs):
    (x,) = inputs
    shape = S.as_shape(attrs["shape"])
    if len(shape) < x.ndim or S.broadcast_shapes(x.shape, shape, op="broadcast_to") != shape:
        raise ValueError(f"broadcast_to: cannot broadcast {S.format_shape(x.shape)} to {S.format_shape(shape)}")
    return shape, x.dtype


register(OpDef("reshape", MOVEMENT, _reshape_infer,
               lambda args, node, env: args[0].reshape(env.shape(node)),
               lambda node, g, wants: [_F().reshape(g, node.inputs[0].shape)]))
register(OpDef("transpose", MOVEMENT, _transpose_infer,
               lambda args, node, env: np.transpose(args[0], node.attrs["perm"]),
               lambda node, g, wants: [_F().transpose(g, tuple(np.argsort(node.attrs["perm"]).tolist()))]))
# expand's VJP hands back the cotangent at the broadcast shape; the autodiff
# driver sums it down to the input's shape, as for any broadcasting op.
register(OpDef("expand", MOVEMENT, _expand_infer,
               lambda args, node, env: np.broadcast_to(args[0], env.shape(node)),
               lambda node, g, wants: [g], doc="broadcast_to"))


# ---- matmul ---------------------------------------------------------------

def _matmul_infer(inputs, attrs):
    a, b = inputs
    if a.ndim < 2 or b.ndim < 2:
        raise ValueError(f"matmul: expects operands of 2 or more axes here, got {S.format_shape(a.shape)} "
                         f"and {S.format_shape(b.shape)}")
    if not S.same_size(a.shape[-1], b.shape[-2]):
        raise ValueError(f"matmul: shapes {S.format_shape(a.shape)} and {S.format_shape(b.shape)} "
                         f"do not align ({a.shape[-1]} != {b.shape[-2]})")
    if a.dtype != b.dtype or not D.is_float(a.dtype):
        raise TypeError(f"matmul: operands must share one float dtype, got {a.dtype} {S.format_shape(a.shape)} "
                        f"and {b.dtype} {S.format_shape(b.shape)}")
    try:  # leading axes broadcast, as torch.matmul's batch dimensions
        batch = S.broadcast_shapes(a.shape[:-2], b.shape[:-2], op="matmul")
    except ValueError:
        raise ValueError(f"matmul: the batch dimensions of {S.format_shape(a.shape)} and "
                         f"{S.format_shape(b.shape)} do not broadcast") from None
    return batch + (a.shape[-2], b.shape[-1]), a.dtype


def _matrix_transpose(F, x):
    """x with its last two axes swapped."""
    return F.transpose(x, tuple(range(x.ndim - 2)) + (x.ndim - 1, x.ndim - 2))


def _matmul_vjp(node, g, wants):
    """g @ b^T and a^T @ g, on the broadcast batch; the autodiff driver sums each down to its
    operand's own batch shape."""
    F = _F()
    a, b = node.inputs
    return [F.matmul(g, _matrix_transpose(F, b)) if wants[0] else None,
            F.matmul(_matrix_transpose(F, a), g) if wants[1] else None]


register(OpDef("matmul", MATMUL, _matmul_infer, lambda args, node, env: args[0] @ args[1], _matmul_vjp))


# ---- custom ops with a user-written backward -----------------------------------

def _custom_infer(inputs, attrs):
    return inputs[0].shape, inputs[0].dtype


def _custom_vjp(node, g, wants):
    """Input 0 is the forward's result (not traced); the rest get the user's backward."""
    return [None, *node.attrs["function"].vjp(node, g, wants[1:])]


register(OpDef("custom", CUSTOM, _custom_infer, lambda args, node, env: args[0], _custom_vjp,
               doc="custom(result, *inputs): result, with a hand-written backward for inputs"))
