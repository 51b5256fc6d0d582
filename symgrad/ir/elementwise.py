"""Elementwise ops defined by sympy expressions, and their derivatives.

An elementwise op is one sympy expression over the scalar symbols x0, x1, ...
Its NumPy reference comes from `sympy.lambdify`, its C/CUDA body from a sympy
code printer, and its VJP from `sympy.diff`: nothing about a derivative is
written by hand. Each partial derivative is computed once per op and cached.

Where a derivative reads better in terms of the op's own output (sigmoid:
y*(1-y), exp: y, tanh: 1-y**2), it is rewritten so, and the backward reuses
the value the forward computed instead of recomputing transcendental calls.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Sequence

import numpy as np
import sympy
from sympy.logic.boolalg import BooleanFunction

from . import sympy_memo
from . import dtypes as D
from . import shapes as S
from .form_checks import keeps_infinities, keeps_special_values, stays_finite  # noqa: F401 (read here by tests)
from .numpy_expr import numpy_function
from .registry import ELEMENTWISE, REGISTRY, OpDef, register
from .value import functions

# x0..x7: the op's operands; y: its own output; g: the incoming cotangent.
ARGS = sympy.symbols("x0:8", real=True)
OUT = sympy.Symbol("y", real=True)
COTANGENT = sympy.Symbol("g", real=True)

# Output dtype rules: "promote" (torch's result type, dtypes.result_type), "float" (promote, then
# at least float32: exp of an int, int / int are floats, as in torch), "bool" (comparisons).
# "select" (where): promote over every operand but the first, the condition.
DTYPE_RULES = ("promote", "float", "bool", "select")


def _infer(name: str, arity: int, dtype_rule: str):
    def infer(inputs, attrs):
        if len(inputs) != arity:
            raise TypeError(f"{name}: takes {arity} operand(s), got {len(inputs)}")
        shape = S.broadcast_shapes(*(v.shape for v in inputs), op=name)
        if dtype_rule == "bool":
            return shape, "bool"
        operands = inputs[1:] if dtype_rule == "select" else inputs
        dtype = D.result_type(*operands)
        if dtype_rule == "float" and not D.is_float(dtype):
            dtype = D.DEFAULT_FLOAT
        return shape, dtype
    return infer


def compute_dtype(node) -> str:
    """The dtype an elementwise node's arithmetic runs in, its operands cast to it first (torch's
    common dtype): the node's own, or for a bool result over other dtypes (a comparison) the
    operands' result type. A 16-bit float computes in float32 and rounds its result once
    (torch's opmath type). The C and CUDA code cast alike (backends/plan.py)."""
    return D.compute_type(D.result_type(*node.inputs) if node.dtype == "bool" and node.inputs else node.dtype)


def _numpy_impl(expr: sympy.Expr, arity: int) -> Callable:
    fn = None  # lambdified on first use: defining an op (every import, every derived VJP) stays cheap

    def run(args, node, env):
        nonlocal fn
        if fn is None:
            fn = numpy_function(ARGS[:arity], expr)
        # In the common dtype, as torch and the compiled code compute: int32 + float32 rounds
        # once in float32, where NumPy would add in float64 and round twice.
        common = D.to_numpy(compute_dtype(node))
        args = [a if a.dtype == common else a.astype(common) for a in map(np.asarray, args)]
        # Broadcast first: sympy prints Max/Min/Piecewise with helpers that
        # want operands of one shape.
        args = np.broadcast_arrays(*args) if len(args) > 1 else args
        with np.errstate(all="ignore"):  # inf/nan follow IEEE, as in torch
            out = fn(*args)
        out = np.asarray(out).astype(D.to_numpy(node.dtype), copy=False)
        return np.broadcast_to(out, env.shape(node)) if out.shape != env.shape(node) else out
    return run


def define(name: str, expr: sympy.Expr, arity: int, dtype_rule: str = "promote",
           doc: str = "", vjp: Callable | None = None, differentiable: bool = True,
           zero_derivative_where: dict | None = None) -> OpDef:
    """Register an elementwise op over ARGS[:arity]; its VJP comes from sympy.diff.

    zero_derivative_where: {i: condition over ARGS}: d op/d x_i is 0 where the condition holds.
        For points where the derivative's closed form reads 0 * inf or 0 ** -1 but the limit
        (torch's value) is 0: d/dx of x**y at y == 0, d/dy of x**y at x == 0, y >= 0.
    """
    return register(_elementwise_op(name, expr, arity, dtype_rule, doc, vjp, differentiable,
                                    zero_derivative_where))


def _elementwise_op(name: str, expr: sympy.Expr, arity: int, dtype_rule: str = "promote",
                    doc: str = "", vjp: Callable | None = None, differentiable: bool = True,
                    zero_derivative_where: dict | None = None, extra: dict | None = None) -> OpDef:
    """The OpDef of an elementwise op (see `define`), not registered."""
    if dtype_rule not in DTYPE_RULES:
        raise ValueError(f"{name}: unknown dtype rule {dtype_rule!r}")
    stray = expr.free_symbols - set(ARGS[:arity])
    if stray:
        raise ValueError(f"{name}: expression uses symbols {sorted(map(str, stray))} "
                         f"beyond its operands {list(ARGS[:arity])}")
    op = OpDef(name=name, kind=ELEMENTWISE, infer=_infer(name, arity, dtype_rule),
               numpy=_numpy_impl(expr, arity), doc=doc or f"{name}: {expr}",
               expr=expr, arity=arity,
               # (i, condition) pairs: a tuple, which the graph fingerprint can describe.
               extra={**(extra or {}), **({"zero_derivative_where": tuple(sorted(zero_derivative_where.items()))}
                                         if zero_derivative_where else {})})
    op.vjp = vjp if vjp is not None else (elementwise_vjp if differentiable else None)
    return op


# ---- derivatives ---------------------------------------------------------

def _cost(expr: sympy.Expr) -> int:
    """Calls to transcendental functions and non-integer powers: what is slow to evaluate."""
    cost = 0
    for node in sympy.preorder_traversal(expr):
        if isinstance(node, sympy.Function) and not isinstance(node, (sympy.Piecewise,)):
            cost += 1
        elif isinstance(node, sympy.Pow) and not node.exp.is_Integer:
            cost += 1
    return cost


def _torch_masks(partial: sympy.Expr) -> sympy.Expr:
    """Heaviside(u, h0) -> 0 where u < 0, h0 where u == 0, else 1: a mask that a NaN passes.

    sympy differentiates Max(x, y) to Heaviside(x - y); torch's maximum backward is
    `where(x == y, g/2, g).masked_fill(x < y, 0)`, so where x or y is NaN (no comparison
    holds) the cotangent passes through, to both operands. NumPy's heaviside(nan) is nan
    and a C `u > 0 ? 1 : (u < 0 ? 0 : h0)` gives h0: the Piecewise reads alike on all
    backends, and as torch.

    The argument u = a - b is compared as a < b and a == b, not u < 0 and u == 0: equal
    infinities are a tie (torch halves the cotangent), while inf - inf is NaN.
    """
    def mask(u, h0=sympy.Rational(1, 2)):
        terms = sympy.Add.make_args(u)
        a = sympy.Add(*(t for t in terms if not t.could_extract_minus_sign()))
        b = -sympy.Add(*(t for t in terms if t.could_extract_minus_sign()))
        # The tie excludes a NaN in words sympy keeps: once a fused chain makes both operands
        # one value (maximum(v, minimum(v, v))), Eq(v, v) is True and Lt(v, v) False, and
        # without `not is_nan(v)` a NaN would split its cotangent instead of passing it whole.
        return sympy.Piecewise((0, sympy.Lt(a, b)), (h0, sympy.And(sympy.Eq(a, b), sympy.Not(is_nan(a)))),
                               (1, True))
    return partial.replace(sympy.Heaviside, mask)


class is_nan(BooleanFunction):  # noqa: N801  (the name printed in graphs and reports)
    """x != x: whether x is NaN. sympy's own Ne(x, x) is False for any symbol (its numbers are
    real), so a NaN test must be a function of its own, which C prints as x != x."""

    nargs = 1

    @classmethod
    def eval(cls, x):
        if x.is_number:
            return sympy.true if x is sympy.nan else sympy.false
        return None

    def _ccode(self, printer):
        x = printer._print(self.args[0])
        return f"(({x}) != ({x}))"

    _cxxcode = _ccode
    _cudacode = _ccode

    def _numpycode(self, printer):
        return f"numpy.isnan({printer._print(self.args[0])})"


def _in_terms_of_output(expr: sympy.Expr, partial: sympy.Expr) -> sympy.Expr | None:
    """Rewrite a unary op's derivative in terms of y = expr(x0), if that is cheaper.

    Candidates: the raw derivative with expr replaced by y (tanh: 1 - y**2),
    and the derivative at each inverse x0 = f^-1(y) found by sympy.solve,
    simplified (sigmoid: y*(1 - y)). A candidate is kept only when it has no
    x0 left, verifies numerically at sample points on both sides of zero
    (so a branch such as sqrt(1 - y**2) for cos is refused), is cheaper, and
    stays finite wherever the derivative in x is (`stays_finite`).
    """
    x = ARGS[0]
    candidates = [sympy.diff(expr, x).subs(expr, OUT)]
    inverses = []
    # A derivative that the output alone gives, with no function left to call (sqrt: 1/(2*y); tanh:
    # 1 - y**2), is as cheap as a rewrite gets: the inverse's forms are not searched for it.
    in_output_alone = not candidates[0].has(x) and _cost(candidates[0]) == 0
    # sympy.solve inverts an expression that reads x once by peeling one function at a time
    # (sigmoid, tanh, exp: milliseconds); where x occurs more than once (GELU's tanh form,
    # x*(1 + tanh(c*(x + k*x**3)))/2) the inverse is rarely closed-form and solve can search
    # for minutes. Such ops keep their derivative in x.
    if not in_output_alone and sum(1 for atom in sympy.preorder_traversal(expr) if atom == x) == 1:
        try:
            inverses = sympy.solve(sympy.Eq(OUT, expr), x, check=False)
        except (NotImplementedError, ValueError, TypeError):
            pass
    for inverse in inverses:
        try:
            at = partial.subs(x, inverse)
            candidates.append(S.simplify(at))
            candidates.append(sympy.factor(sympy.cancel(S.simplify(at.rewrite(sympy.exp)))))
        except (NotImplementedError, ValueError, TypeError, AttributeError):
            continue  # sympy could not evaluate this branch: keep the derivative in x
    f = sympy.lambdify(x, expr, "math")
    d = sympy.lambdify(x, partial, "math")
    samples = [-2.7, -1.3, -0.6, -0.2, 0.15, 0.45, 0.8, 1.4, 2.2, 3.1]

    def key(e):
        return (_cost(e), sympy.count_ops(e))

    best = None
    for rewritten in candidates:
        if rewritten.has(x) or rewritten.has(sympy.zoo, sympy.nan) or key(rewritten) >= key(partial):
            continue
        r = sympy.lambdify(OUT, rewritten, "math")
        checked, ok = 0, True
        for t in samples:
            try:
                want, y = complex(d(t)), complex(f(t))
            except Exception:  # noqa: BLE001 - outside the domain (log of a negative), or no math.* twin
                continue
            if want.imag or y.imag:
                continue
            try:
                got = complex(r(y.real))
            except Exception:  # noqa: BLE001 - a rewrite that cannot be evaluated is refused
                ok = False
                break
            checked += 1
            if abs(got - want.real) > 1e-9 * (1 + abs(want.real)):
                ok = False
                break
        if ok and checked >= 3 and (best is None or key(rewritten) < key(best)) \
                and stays_finite(rewritten.xreplace({OUT: expr}), partial):
            best = rewritten
    return best


# sympy.simplify's time grows steeply with its input (GELU's tanh form, 41 operations, took
# minutes in trigsimp); a larger derivative keeps sympy.diff's form, which is correct as it is.
MAX_SIMPLIFY_OPS = 24


@lru_cache(maxsize=None)
def partial_derivative(op: "OpDef | str", i: int) -> sympy.Expr:
    """d op / d x_i as a sympy expression over ARGS and OUT, cached per op (an OpDef, or the name
    of a registered one)."""
    op = REGISTRY[op] if isinstance(op, str) else op
    # Deriving costs sympy tens of milliseconds per op: a fresh process reads earlier results.
    zero_where = op.extra.get("zero_derivative_where", ())
    key = f"{sympy.srepr(op.expr)}|{op.arity}|{i}|{sympy.srepr(sympy.Tuple(*map(sympy.Tuple, zero_where)))}"
    known = sympy_memo.lookup("partial", __file__, key)
    if known is not None:
        return known
    partial = _derive(op, i)
    sympy_memo.store("partial", __file__, key, partial)
    return partial


def _derive(op: OpDef, i: int) -> sympy.Expr:
    """d op / d x_i derived by sympy: diff, masks folded, simplified, rewritten in y where cheaper.

    A simplified or rewritten form is taken only where it stays finite wherever the plain
    derivative is (`stays_finite`); a unary derivative of exps that overflows where the op is
    finite is split at x = 0 (`_split_at_zero`); the op's zero_derivative_where points come last.
    """
    partial = sympy.diff(op.expr, ARGS[i])
    # The derivative of a step (Heaviside, sign) is zero almost everywhere, as
    # torch treats its masks: DiracDelta would only print as an unknown name.
    partial = partial.replace(sympy.DiracDelta, lambda *args: sympy.S.Zero)
    partial = _torch_masks(partial)
    if partial.has(sympy.Piecewise, sympy.sign):
        partial = sympy.piecewise_fold(partial)
    elif _cost(partial) > 0 and sympy.count_ops(partial) <= MAX_SIMPLIFY_OPS and not _settled(partial):
        simplified = S.simplify(partial)
        partial = simplified if stays_finite(simplified, partial) else partial
    # Kinked ops (relu, abs, max) keep their masks in x: there is nothing to gain.
    if op.arity == 1 and _cost(partial) > 0 and not partial.has(sympy.Piecewise, sympy.sign):
        partial = _in_terms_of_output(op.expr, partial) or partial
    if op.arity > 1 and _cost(partial) + sympy.count_ops(partial) > 0:
        partial = _reuse_output(op.expr, partial) or partial
    if op.arity == 1 and partial.has(sympy.exp) \
            and not stays_finite(partial.xreplace({OUT: op.expr}), op.expr):
        partial = _split_at_zero(partial, op.expr) or partial
    zero_where = dict(op.extra.get("zero_derivative_where", ()))
    if i in zero_where:
        partial = sympy.Piecewise((0, zero_where[i]), (partial, True))
    return partial


def _settled(partial: sympy.Expr) -> bool:
    """Whether sympy.simplify has nothing to do in `partial`: a product of powers with numeric
    exponents (sqrt's 1/(2*sqrt(x)), cos's -sin(x)), which sympy's constructors have merged
    already, with at most one function call among its factors. A sum may factor or cancel, powers
    with symbolic exponents combine (pow's x1*x0**x1/x0 into x1*x0**(x1 - 1)), and so may two
    functions (sin(x)**2/cos(x)**2 into tan(x)**2). Not calling it saves a cold compile its first
    call's import of sympy.physics.units (0.06 s)."""
    calls = [f for f in sympy.Mul.make_args(partial) if f.has(sympy.Function)]
    return (not partial.has(sympy.Add) and len(calls) <= 1
            and all(p.exp.is_Number for p in partial.atoms(sympy.Pow)))


def _reuse_output(expr: sympy.Expr, partial: sympy.Expr) -> sympy.Expr | None:
    """The derivative of an op of several operands with its own output y put in, or None.

    div: -x0/x1**2 -> -y/x1, torch's -(x0/x1)/x1, finite where x1**2 overflows or underflows
    (x0 = x1 = 1e300, or x1 = 1e-300) although the quotient is not; pow: x0**x1*log(x0) ->
    y*log(x0). Taken when cheaper and finite wherever the plain derivative is, y evaluated as a
    value of its own (x1*y/x0 for pow is refused: 0/0 at x0 = 0).
    """
    rewritten = partial.subs(expr, OUT)
    if rewritten == partial or not rewritten.has(OUT):
        return None
    if (_cost(rewritten), sympy.count_ops(rewritten)) >= (_cost(partial), sympy.count_ops(partial)):
        return None
    as_value = rewritten.xreplace({OUT: sympy.UnevaluatedExpr(expr)})
    return rewritten if stays_finite(as_value, partial) else None


def _split_at_zero(partial: sympy.Expr, expr: sympy.Expr) -> sympy.Expr | None:
    """A unary derivative that overflows on one side, as two forms that do not: or None.

    SiLU's x*exp(-x)/(1 + exp(-x))**2 + ... is inf/inf = nan for x << 0 although silu(x) is
    finite there. Written as a rational function of t = exp(x), it is finite for x < 0; of
    t = exp(-x), for x >= 0. Taken only when the result stays finite wherever `expr` is.
    """
    x, t = ARGS[0], sympy.Dummy("t", positive=True)
    try:
        rising = sympy.cancel(partial.subs(sympy.exp(x), t)).subs(t, sympy.exp(x))
        falling = sympy.cancel(partial.subs(sympy.exp(x), 1 / t)).subs(t, sympy.exp(-x))
    except (sympy.PolynomialError, TypeError, ValueError, NotImplementedError):
        return None
    split = sympy.Piecewise((falling, x >= 0), (rising, True))
    return split if stays_finite(split, expr) else None


def elementwise_vjp(node, g, wants: Sequence[bool], derived_as: OpDef | None = None):
    """The VJP of any sympy-defined op: g * d op/d x_i, one fused node per input. `derived_as`: the
    op whose expression is differentiated instead of the node's own, one computing the same
    function in a form whose derivative behaves better (gelu_tanh's)."""
    derived_as = node.op if derived_as is None else derived_as
    out = []
    for i, want in enumerate(wants):
        form = _vjp_form(derived_as, i, node.op.name, len(node.inputs)) if want else None
        # None: no contribution (relu's second derivative, where's condition); it tells the
        # driver to skip it (a 0-ary node would have no shape).
        out.append(None if form is None else
                   apply_form(form, {COTANGENT: g, OUT: node, **dict(zip(ARGS, node.inputs))}))
    return out


@lru_cache(maxsize=None)
def _vjp_form(op: OpDef, i: int, label: str, arity: int) -> tuple | None:
    """g * d op/d x_i as an `expression_form` (None: zero), named after the op `label`: made once
    per op and operand, where sympy's work on it (the fold, the renaming, the derived op's key)
    was repeated for every node of the op (a GPT's hundred elementwise backward nodes)."""
    partial = partial_derivative(op, i)
    if partial == 0:
        return None
    # g folded into a mask's branches: Piecewise((g, c), (0, True)) is 0 where the mask is,
    # as torch's masked backwards give (g*0 would be nan for g = inf), with one multiply fewer.
    return expression_form(sympy.piecewise_fold(COTANGENT * partial), (COTANGENT, OUT, *ARGS[:arity]),
                           name=f"{label}_vjp{i}")


def apply_expression(expr: sympy.Expr, values: dict, name: str):
    """Build graph code computing `expr`, whose symbols stand for `values`.

    The trivial shapes of a VJP (g, -g, g*v) reuse the neg and mul ops; any
    other expression becomes one node of a derived elementwise op (registered
    once per name), which sympy can differentiate again for higher orders.
    """
    return apply_form(expression_form(expr, tuple(values), name), values)


def expression_form(expr: sympy.Expr, symbols: tuple, name: str) -> tuple:
    """How `apply_expression` builds `expr` over values for `symbols`, without the values:
    ("value", s) for a symbol itself, ("neg", s), ("mul", a, b), or ("op", derived op, the
    symbols it takes in order)."""
    expr = sympy.sympify(expr)
    if expr in symbols:
        return ("value", expr)
    if expr.is_Mul and len(expr.args) == 2:
        a, b = expr.args
        if a == -1 and b in symbols:
            return ("neg", b)
        if a in symbols and b in symbols:
            return ("mul", a, b)
    used = tuple(sorted(expr.free_symbols, key=lambda s: s.name))
    return ("op", derived_op(name, expr.xreplace(dict(zip(used, ARGS))), len(used)), used)


def apply_form(form: tuple, values: dict):
    """The graph code of an `expression_form`, its symbols standing for `values`."""
    kind = form[0]
    if kind == "value":
        return values[form[1]]
    F = functions()
    if kind == "neg":
        return F.neg(values[form[1]])
    if kind == "mul":
        return F.mul(values[form[1]], values[form[2]])
    return F.apply_elementwise(form[1], [values[s] for s in form[2]])


@lru_cache(maxsize=None)
def derived_op(label: str, expr: sympy.Expr, arity: int) -> OpDef:
    """The op computing `expr` (a derivative, a simplified chain): not registered, it travels on
    the nodes that use it, and prints as its formula. `label` says where it came from
    (relu_vjp0, simplified) and names the kernels that compute it. One OpDef per (label,
    expression): a memo of a pure function, so that equal derivatives are one op for CSE."""
    # Its doc names the formula without printing it: sympy's printer costs a millisecond per op,
    # paid for every derived op a cached step graph brings back (symgrad.step.step_cache).
    return _elementwise_op(label, expr, arity, dtype_rule="float", doc=f"{label}: the formula op.expr",
                           extra={"derived": True})


FUNCTION_COST = 8  # operations an exp, tanh or erf counts as


def expr_cost(expr) -> int:
    """Operations per element of an elementwise expression (None: an opaque one); transcendental
    functions weigh FUNCTION_COST. What fusion and rematerialization weigh recomputing against storing."""
    if expr is None:
        return FUNCTION_COST
    cost = 0
    for sub in sympy.preorder_traversal(sympy.sympify(expr)):
        if isinstance(sub, sympy.Function) and not isinstance(sub, (sympy.Piecewise, sympy.Max, sympy.Min,
                                                                     sympy.Abs, sympy.sign, sympy.Heaviside)):
            cost += FUNCTION_COST
        elif isinstance(sub, sympy.Pow) and not (sub.exp.is_Integer and abs(int(sub.exp)) <= 2):
            cost += FUNCTION_COST
        elif isinstance(sub, (sympy.Add, sympy.Mul)):
            cost += len(sub.args) - 1
        elif isinstance(sub, (sympy.Pow, sympy.Piecewise, sympy.Max, sympy.Min, sympy.Abs,
                              sympy.core.relational.Relational)):
            cost += 1
    return cost
