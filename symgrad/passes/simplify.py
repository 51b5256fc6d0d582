"""Algebraic simplification: identity rewrites, then sympy on elementwise chains.

Part one is a set of small rules (each docstring states its identity) run
to a fixed point by `rewrite.apply_rules`: arithmetic identities (`x*1`,
`x+0`, `--x`, `log(exp(x))`), movement algebra (transpose of transpose,
reshape chains, broadcasts absorbed by the elementwise ops that would
broadcast anyway), `sum` of a broadcast, and casts of casts.

Part two composes each maximal chain of single-use elementwise nodes into
one sympy expression, tries a few cheap sympy strategies on it (cancel,
together, factor_terms, powsimp: never the unbounded `simplify`), and
replaces the chain by one derived elementwise op only when that costs
strictly fewer operations (sympy.count_ops).

Floating-point notes. Every rule is exact for finite operands except where
its docstring says otherwise. `x*0 -> 0` is wrong for x = inf or nan, so it
is off unless `assume_finite=True` (torch does not fold it either). sympy's
algebra is real algebra: composing a chain evaluates x - (x - x) to x and
exp(log(x)) to x, rational rewriting removes singularities ((x*x - 1)/(x - 1)
-> x + 1). So a composed form is taken only where it is NaN and infinite at
the same probe operands (+-inf, NaN, +-0, negatives) as the chain computed
node by node (`keeps_special_values`), or under `assume_finite=True`. Forms
regroup roundings: results agree to float tolerance, not bit for bit.
"""

from __future__ import annotations

import functools

import sympy

from ..ir import dtypes as D
from ..ir import shapes as S
from ..ir import sympy_memo
from ..ir.elementwise import ARGS, derived_op, keeps_special_values, numpy_function, stays_finite
from ..ir.graph import Graph
from ..ir.registry import ELEMENTWISE, REDUCE, lookup
from ..ir.value import Value, make
from .dce import RULES as NOOP_RULES
from .fold import fold_scalar
from .rewrite import apply_rules, const_like, is_nondeterministic, is_value, same_type, short_rational


def _op(name: str, *inputs: Value, **attrs) -> Value:
    return make(lookup(name), inputs, **attrs)


def _is_scalar_const(v: Value) -> bool:
    return v.op.name == "const" and v.shape == ()


# ---- arithmetic identities ---------------------------------------------------

def mul_one(node: Value) -> Value | None:
    """x * 1 -> x and 1 * x -> x (exact, NaN and inf included)."""
    if node.op.name == "mul":
        a, b = node.inputs
        if is_value(b, 1):
            return same_type(node, a)
        if is_value(a, 1):
            return same_type(node, b)
    return None


def add_zero(node: Value) -> Value | None:
    """x + 0 -> x and 0 + x -> x (exact, except that -0.0 + 0 is +0.0: equal values)."""
    if node.op.name == "add":
        a, b = node.inputs
        if is_value(b, 0):
            return same_type(node, a)
        if is_value(a, 0):
            return same_type(node, b)
    return None


def sub_zero(node: Value) -> Value | None:
    """x - 0 -> x (exact)."""
    if node.op.name == "sub" and is_value(node.inputs[1], 0):
        return same_type(node, node.inputs[0])
    return None


def zero_sub(node: Value) -> Value | None:
    """0 - x -> -x (exact, except that 0 - 0.0 is +0.0 where -0.0 is -0.0: equal values)."""
    if node.op.name == "sub" and is_value(node.inputs[0], 0):
        return same_type(node, _op("neg", node.inputs[1]))
    return None


def mul_minus_one(node: Value) -> Value | None:
    """x * -1 -> -x and -1 * x -> -x (exact)."""
    if node.op.name == "mul":
        a, b = node.inputs
        if is_value(b, -1):
            return same_type(node, _op("neg", a))
        if is_value(a, -1):
            return same_type(node, _op("neg", b))
    return None


def mul_zero(node: Value) -> Value | None:
    """x * 0 -> 0 and 0 * x -> 0: only for finite x (inf * 0 and nan * 0 are nan).

    Off by default; `simplify(graph, assume_finite=True)` turns it on.
    """
    if node.op.name == "mul":
        for zero in node.inputs:
            if is_value(zero, 0) and zero.dtype == node.dtype:
                c = const_like(0.0 if D.is_float(node.dtype) else False if node.dtype == "bool" else 0,
                               node.dtype)
                return _op("expand", c, shape=node.shape) if node.shape else c
    return None


def neg_neg(node: Value) -> Value | None:
    """-(-x) -> x (exact)."""
    if node.op.name == "neg" and node.inputs[0].op.name == "neg":
        return same_type(node, node.inputs[0].inputs[0])
    return None


def log_exp(node: Value) -> Value | None:
    """log(exp(x)) -> x, for every real x (more exact: the original overflows to inf for large x)."""
    if node.op.name == "log" and node.inputs[0].op.name == "exp":
        return same_type(node, node.inputs[0].inputs[0])
    return None


def neg_scaled(node: Value) -> Value | None:
    """-(c * x) -> (-c) * x for a 0-d constant c, whose negation then folds (exact)."""
    if node.op.name == "neg" and node.inputs[0].op.name == "mul":
        a, b = node.inputs[0].inputs
        if _is_scalar_const(b):
            a, b = b, a
        if _is_scalar_const(a):
            return same_type(node, _op("mul", _op("neg", a), b))
    return None


def scaled_neg(node: Value) -> Value | None:
    """(-x) * c -> x * (-c) for a 0-d constant c, whose negation then folds (exact)."""
    if node.op.name == "mul":
        a, b = node.inputs
        if _is_scalar_const(a):
            a, b = b, a
        if _is_scalar_const(b) and a.op.name == "neg":
            return same_type(node, _op("mul", a.inputs[0], _op("neg", b)))
    return None


# ---- movement algebra ------------------------------------------------------

def transpose_transpose(node: Value) -> Value | None:
    """transpose(transpose(x, p), q) -> transpose(x, p[q]) (x itself when p[q] is the identity)."""
    if node.op.name == "transpose" and node.inputs[0].op.name == "transpose":
        inner = node.inputs[0]
        p, q = inner.attrs["perm"], node.attrs["perm"]
        perm = tuple(p[j] for j in q)
        x = inner.inputs[0]
        return x if perm == tuple(range(len(perm))) else _op("transpose", x, perm=perm)
    return None


def reshape_reshape(node: Value) -> Value | None:
    """reshape(reshape(x, s1), s2) -> reshape(x, s2): row-major order is kept by both."""
    if node.op.name == "reshape" and node.inputs[0].op.name == "reshape":
        x = node.inputs[0].inputs[0]
        return x if x.shape == node.shape else _op("reshape", x, shape=node.shape)
    return None


def expand_expand(node: Value) -> Value | None:
    """expand(expand(x, s1), s2) -> expand(x, s2): broadcasting composes."""
    if node.op.name == "expand" and node.inputs[0].op.name == "expand":
        return _op("expand", node.inputs[0].inputs[0], shape=node.shape)
    return None


def _strip_leading_ones(shape: tuple) -> tuple:
    k = 0
    while k < len(shape) and shape[k] == 1:
        k += 1
    return shape[k:]


def _same_but_leading_ones(a: tuple, b: tuple) -> bool:
    """Shapes that NumPy broadcasting treats alike: equal once leading 1s are dropped."""
    return _strip_leading_ones(a) == _strip_leading_ones(b)


def expand_of_reshape(node: Value) -> Value | None:
    """expand(reshape(x, (1,..,1) + shape(x)), s) -> expand(x, s): broadcasting adds leading 1s itself."""
    if node.op.name == "expand" and node.inputs[0].op.name == "reshape":
        x = node.inputs[0].inputs[0]
        if _same_but_leading_ones(x.shape, node.inputs[0].shape) and len(x.shape) <= node.ndim:
            return _op("expand", x, shape=node.shape)
    return None


def reshape_of_broadcast_scalar(node: Value) -> Value | None:
    """reshape(expand(c, s1), s2) -> expand(c, s2) for a 0-d c: every element is c either way."""
    if node.op.name == "reshape" and node.inputs[0].op.name == "expand":
        c = node.inputs[0].inputs[0]
        if c.shape == ():
            return _op("expand", c, shape=node.shape)
    return None


def absorb_broadcast(node: Value) -> Value | None:
    """f(.., expand(x), ..) -> f(.., x, ..) for elementwise f when the result's shape is unchanged;
    likewise for a reshape that only adds or removes leading 1s. Elementwise ops broadcast their
    operands NumPy-style, so the explicit broadcast repeats what f does anyway."""
    if node.op.kind != ELEMENTWISE:
        return None
    for k, v in enumerate(node.inputs):
        if v.op.name == "expand" or (v.op.name == "reshape"
                                     and _same_but_leading_ones(v.shape, v.inputs[0].shape)):
            inputs = node.inputs[:k] + (v.inputs[0],) + node.inputs[k + 1:]
            try:
                shape = S.broadcast_shapes(*(i.shape for i in inputs))
            except ValueError:
                continue
            if shape == node.shape:
                return Value(node.op, inputs, node.attrs, node.shape, node.dtype)
    return None


def unary_through_broadcast(node: Value) -> Value | None:
    """f(expand(x, s)) -> expand(f(x), s) for unary elementwise f: f runs on fewer elements."""
    if node.op.kind == ELEMENTWISE and len(node.inputs) == 1 and node.inputs[0].op.name == "expand":
        x = node.inputs[0].inputs[0]
        inner = make(node.op, (x,), **node.attrs)
        return same_type(node, _op("expand", inner, shape=node.shape))
    return None


# ---- reductions --------------------------------------------------------------

def _broadcast_axes(x_shape: tuple, shape: tuple) -> set:
    lead = len(shape) - len(x_shape)
    return set(range(lead)) | {lead + i for i, s in enumerate(x_shape) if s == 1 and shape[lead + i] != 1}


def sum_of_broadcast(node: Value) -> Value | None:
    """sum(expand(x, s), axes) -> reshape(x) * n when `axes` are exactly the broadcast axes,
    n being the number of copies (exact in real arithmetic; in floats, one rounding instead of n)."""
    if node.op.name != "sum" or node.inputs[0].op.name != "expand" or not D.is_float(node.dtype):
        return None
    e = node.inputs[0]
    x = e.inputs[0]
    axes = set(node.attrs["axes"])
    broadcast = _broadcast_axes(x.shape, e.shape)
    if not broadcast <= axes or any(a not in broadcast and e.shape[a] != 1 for a in axes):
        return None
    count = S.numel([e.shape[a] for a in sorted(broadcast)])
    base = x if x.shape == node.shape else _op("reshape", x, shape=node.shape)
    if count == 1:
        return same_type(node, base)
    return same_type(node, _op("mul", base, const_like(count, node.dtype)))


def sum_of_sum(node: Value) -> Value | None:
    """sum(sum(x, A, keepdims=k), A2, keepdims=k) -> sum(x, A + A2, keepdims=k): one pass over x
    (exact in real arithmetic; the additions are grouped differently)."""
    if node.op.name != "sum" or node.inputs[0].op.name != "sum":
        return None
    inner = node.inputs[0]
    keep = node.attrs["keepdims"]
    if inner.attrs["keepdims"] != keep:
        return None
    x = inner.inputs[0]
    first = set(inner.attrs["axes"])
    remaining = list(range(x.ndim)) if keep else [a for a in range(x.ndim) if a not in first]
    axes = tuple(sorted(first | {remaining[a] for a in node.attrs["axes"]}))
    return same_type(node, _op("sum", x, axes=axes, keepdims=keep))


def drop_kept_axes(node: Value) -> Value | None:
    """reshape(r(x, A, keepdims=True), shape without A) -> r(x, A, keepdims=False) for a reduction r:
    the reshape only removes the kept size-1 axes."""
    if node.op.name != "reshape" or node.inputs[0].op.kind != REDUCE:
        return None
    r = node.inputs[0]
    if not r.attrs["keepdims"]:
        return None
    dropped = tuple(s for a, s in enumerate(r.shape) if a not in r.attrs["axes"])
    if dropped != node.shape:
        return None
    return same_type(node, make(r.op, r.inputs, **{**r.attrs, "keepdims": False}))


def sum_of_scaled(node: Value) -> Value | None:
    """sum(c * x) -> c * sum(x) for a 0-d constant c (linearity; one multiply per result)."""
    if node.op.name == "sum" and node.inputs[0].op.name == "mul":
        a, b = node.inputs[0].inputs
        if _is_scalar_const(b):
            a, b = b, a
        # Same dtype throughout: otherwise the sum would run in a narrower type than before.
        if _is_scalar_const(a) and b.shape == node.inputs[0].shape and a.dtype == b.dtype == node.dtype:
            return same_type(node, _op("mul", a, _op("sum", b, **node.attrs)))
    return None


def sum_of_neg(node: Value) -> Value | None:
    """sum(-x) -> -sum(x) (exact: negation commutes with rounding)."""
    if node.op.name == "sum" and node.inputs[0].op.name == "neg":
        return same_type(node, _op("neg", _op("sum", node.inputs[0].inputs[0], **node.attrs)))
    return None


# ---- casts -------------------------------------------------------------------

# (from, to) conversions that keep every value exactly.
LOSSLESS = frozenset({("bool", "int32"), ("bool", "int64"), ("bool", "float32"), ("bool", "float64"),
                      ("int32", "int64"), ("int32", "float64"), ("float32", "float64")})


def cast_cast(node: Value) -> Value | None:
    """cast(cast(x, b), c) -> cast(x, c) when x -> b is lossless (x itself when c is x's dtype)."""
    if node.op.name == "cast" and node.inputs[0].op.name == "cast":
        x = node.inputs[0].inputs[0]
        if (x.dtype, node.inputs[0].dtype) in LOSSLESS:
            return x if x.dtype == node.dtype else _op("cast", x, dtype=node.dtype)
    return None


RULES = (*NOOP_RULES, fold_scalar, mul_one, add_zero, sub_zero, zero_sub, mul_minus_one, neg_neg,
         log_exp, neg_scaled, scaled_neg, transpose_transpose, reshape_reshape, expand_expand,
         expand_of_reshape, reshape_of_broadcast_scalar, absorb_broadcast, unary_through_broadcast,
         sum_of_broadcast, sum_of_sum, drop_kept_axes, sum_of_scaled, sum_of_neg, cast_cast)
FINITE_RULES = (mul_zero,)


# ---- sympy on elementwise chains ----------------------------------------------

# Chains costing more than this many operations are left as they are (bounded effort).
MAX_CHAIN_OPS = 40
# sympy's results of dividing by an inlined 0.0 (1/0 = zoo): not IEEE values, never emitted.
_NOT_REAL = (sympy.zoo, sympy.nan, sympy.oo, -sympy.oo)
_NON_RATIONAL = (sympy.Piecewise, sympy.Max, sympy.Min, sympy.Heaviside, sympy.sign, sympy.Abs)


def _chainable(v: Value) -> bool:
    """Float elementwise nodes with an expression; casts change type and stay boundaries."""
    return (v.op.kind == ELEMENTWISE and v.op.expr is not None and v.op.name != "cast"
            and v.op.arity == len(v.inputs) and D.is_float(v.dtype) and not is_nondeterministic(v))


def _cost(expr) -> int:
    return int(sympy.count_ops(expr))


def _candidates(expr: sympy.Expr) -> list:
    """The composed expression and a few cheap rewritings of it (no unbounded simplify)."""
    out = [expr]
    if expr.has(*_NON_RATIONAL):
        return out
    for strategy in (sympy.cancel, sympy.together, sympy.factor_terms, sympy.powsimp):
        try:
            out.append(strategy(expr))
        except (sympy.PolynomialError, TypeError, ValueError, NotImplementedError):
            pass
    return out


@functools.lru_cache(maxsize=None)
def _op_function(op):
    """An elementwise op's expression as a NumPy function of its operands (ops are immutable)."""
    return numpy_function(ARGS[:op.arity], op.expr)


class _NodeByNode:
    """A chain as its nodes compute it, one op after another: the reference its composed forms
    are checked against. (sympy's unevaluated constructors cannot stand in: nested Piecewise
    recurse without end when built unevaluated.)

    `tree` is a leaf (a symbol, or an inlined number, possibly of Dims) or (op, operand trees).
    """

    def __init__(self, tree):
        self.tree = tree
        self.key = repr(self._describe(tree))
        self.free_symbols = set()
        stack = [tree]
        while stack:
            t = stack.pop()
            if isinstance(t, sympy.Basic):
                self.free_symbols |= t.free_symbols
            else:
                stack.extend(t[1])

    def __eq__(self, other):  # by what it computes: _cheapest's in-process memo finds repeats
        return isinstance(other, _NodeByNode) and other.key == self.key

    def __hash__(self):
        return hash(self.key)

    @classmethod
    def _describe(cls, tree):
        # An op by its expression: derived ops share labels (mul_vjp0) across different formulas.
        return sympy.srepr(tree) if isinstance(tree, sympy.Basic) else \
            (sympy.srepr(tree[0].expr), *map(cls._describe, tree[1]))

    def evaluate(self, values: dict):
        """The chain at operand arrays `values` (symbol -> array), in float64."""
        def run(tree):
            if isinstance(tree, sympy.Basic):
                if tree in values:
                    return values[tree]
                if not tree.free_symbols:
                    return float(tree)
                symbols = sorted(tree.free_symbols, key=lambda s: s.name)
                return numpy_function(symbols, tree)(*(values[s] for s in symbols))
            return _op_function(tree[0])(*map(run, tree[1]))
        return run(self.tree)


@functools.lru_cache(maxsize=4096)
def _cheapest(expr: sympy.Expr, exact: _NodeByNode, assume_finite: bool) -> sympy.Expr | None:
    """The cheapest of `_candidates(expr)` that computes what the chain computes, or None.

    `expr` is the chain composed by sympy's evaluating constructors, `exact` the same chain
    node by node, as the graph computes it. sympy's evaluation is
    real algebra, exact for finite operands only (x - (x - x) -> x, exp(log(x)) -> x), so
    every form, `expr` included, must keep `exact`'s NaNs and infinities
    (`keeps_special_values`) unless the user assumed finite operands, and must overflow
    nowhere `exact` does not (`stays_finite`: sigmoid's backward composes to -y*(y - 1) at
    y = 1/(1 + exp(-x)), finite everywhere; `cancel` gives exp(x)/(exp(x) + 1)**2, nan past
    x = 89 in float32).

    Cached: chains of the same form (every parameter's optimizer update, every layer's
    backward) compose to the same expression over l0, l1, ..., and sympy's rewritings cost
    milliseconds each; a fresh process reads earlier results from the on-disk memo, which
    keeps warm compiles fast.
    """
    key = f"{exact.key}|{assume_finite}"
    known = sympy_memo.lookup("cheapest", __file__, key)
    if known is not None:
        return None if known == sympy.S.NaN else known
    candidates = sorted(_candidates(expr), key=_cost)
    best = next((c for c in candidates if stays_finite(c, exact)
                 and (assume_finite or keeps_special_values(c, exact))), None)
    sympy_memo.store("cheapest", __file__, key, sympy.S.NaN if best is None else best)
    return best


def _inline_number(v: Value):
    """A 0-d const inlined into a chain's expression: a number with a short exact form (2, -0.125),
    or an expression of Dims (1/B), so sympy can combine -1/B with 1/B; None for other values
    (0.1 and friends stay operands, so no rounding changes)."""
    if not _is_scalar_const(v) or not D.is_float(v.dtype):
        return None
    value = v.attrs["value"]
    if isinstance(value, sympy.Basic):
        return value
    return short_rational(value)


class _Chain:
    """One maximal chain: its root, the nodes composed into it and its expression.

    A chain costing more than MAX_CHAIN_OPS is not composed to the end (`expr` is None): it is
    left as it is, and a chain of thousands of nodes neither builds a huge expression nor walks
    deeper than the limit.
    """

    def __init__(self, root: Value, inner):
        self.root = root
        self.leaves: list[Value] = []
        self.symbols: dict[int, sympy.Symbol] = {}
        self.members = 0
        self.cost = 0
        self.expr, self.exact = self._compose(root, inner)

    def leaf(self, v: Value) -> sympy.Symbol:
        """The symbol standing for operand `v` (one per distinct value)."""
        if id(v) not in self.symbols:
            self.symbols[id(v)] = sympy.Symbol(f"l{len(self.leaves)}", real=True)
            self.leaves.append(v)
        return self.symbols[id(v)]

    def _compose(self, root: Value, inner):
        """The chain's expression over its leaves, and the chain node by node (`_NodeByNode`);
        (None, None) once its cost passes MAX_CHAIN_OPS.

        An iterative post-order walk, inputs left to right, so that the leaves are numbered
        l0, l1, ... in the order they are first read (the key of `_cheapest`'s memo). The chain is
        a tree: an inner node has one user, so no node is composed twice.
        """
        stack = [(root, False)]
        composed: list = []  # (evaluated, exact) of the walk's finished nodes, the latest last
        while stack:
            v, inputs_done = stack.pop()
            if v is not root and not inner(v):
                number = _inline_number(v)
                leaf = number if number is not None else self.leaf(v)
                composed.append((leaf, leaf))
            elif not inputs_done:
                self.members += 1
                self.cost += _cost(v.op.expr)
                if self.cost > MAX_CHAIN_OPS:
                    return None, None
                stack.append((v, True))
                stack.extend((i, False) for i in reversed(v.inputs))
            else:
                first = len(composed) - len(v.inputs)
                args = composed[first:]
                del composed[first:]
                evaluated = v.op.expr.xreplace(dict(zip(ARGS, (a for a, _ in args))))
                composed.append((evaluated, (v.op, tuple(tree for _, tree in args))))
        expr, tree = composed[0]
        return expr, _NodeByNode(tree)


def _extract_dims(expr: sympy.Expr, chain: "_Chain") -> sympy.Expr:
    """`expr` with each maximal subexpression of Dims only (1/B) made an operand: a const leaf."""
    if expr.free_symbols and all(isinstance(s, S.Dim) for s in expr.free_symbols):
        return chain.leaf(const_like(expr, chain.root.dtype))
    if not expr.args or not any(isinstance(s, S.Dim) for s in expr.free_symbols):
        return expr
    return expr.func(*(_extract_dims(a, chain) for a in expr.args))


def _emit(chain: _Chain, best: sympy.Expr, mapped) -> Value | None:
    """Graph code for `best` over the chain's (rebuilt) leaves, of the root's type; or None."""
    root = chain.root
    if best.is_Symbol:
        leaf = mapped(chain.leaves[list(chain.symbols.values()).index(best)])
        if leaf.dtype != root.dtype:
            return None
        return leaf if leaf.shape == root.shape else _op("expand", leaf, shape=root.shape)
    if not best.free_symbols:
        if not best.is_number:
            return None
        c = const_like(int(best) if best.is_Integer else float(best), root.dtype)
        return _op("expand", c, shape=root.shape) if root.shape else c
    used = [(sym, leaf) for sym, leaf in zip(chain.symbols.values(), chain.leaves) if sym in best.free_symbols]
    if len(used) > len(ARGS):
        return None
    renamed = best.xreplace({sym: ARGS[k] for k, (sym, _) in enumerate(used)})
    op = derived_op("simplified", renamed, len(used))
    return same_type(root, make(op, tuple(mapped(leaf) for _, leaf in used)))


def simplify_chains(graph: Graph, assume_finite: bool = False, counts: dict | None = None) -> Graph:
    """Each maximal single-use elementwise chain, re-emitted as one op when sympy makes it cheaper."""
    users = graph.users
    pinned = {id(v) for v in graph.outputs} | {id(n) for _, n in graph.updates}

    def inner(v: Value) -> bool:
        us = users[id(v)]
        return (_chainable(v) and len(us) == 1 and id(v) not in pinned and _chainable(us[0]))

    plans: dict[int, tuple] = {}
    for node in graph.nodes:
        if not _chainable(node) or inner(node):
            continue
        chain = _Chain(node, inner)
        if chain.members < 2 or chain.cost > MAX_CHAIN_OPS:
            continue
        if chain.expr.has(*_NOT_REAL):
            continue  # x / 0.0 inlined: sympy's zoo has no float meaning (and no C spelling)
        operands = set(chain.symbols.values())
        best = _cheapest(chain.expr, chain.exact, assume_finite)
        if best is None:
            continue  # every form sympy found differs from the chain at inf, NaN or overflow
        best = _extract_dims(best, chain)
        if best.has(*_NOT_REAL):
            continue
        if _cost(best) >= chain.cost:
            continue
        if not assume_finite and operands - best.free_symbols:
            continue  # an operand vanished (x - x -> 0): wrong for inf and nan
        plans[id(node)] = (chain, best)

    mapping: dict[int, Value] = {}
    emitted = 0
    for node in graph.nodes:
        new = None
        if id(node) in plans:
            new = _emit(*plans[id(node)], lambda v: mapping.get(id(v), v))  # new consts map to themselves
            emitted += new is not None
        if new is None:
            new = node if not node.inputs else Value(node.op, tuple(mapping[id(i)] for i in node.inputs),
                                                     node.attrs, node.shape, node.dtype)
            if all(a is b for a, b in zip(new.inputs, node.inputs)):
                new = node
        mapping[id(node)] = new
    if not emitted:
        return graph
    if counts is not None:
        counts["sympy_chain"] = counts.get("sympy_chain", 0) + emitted
    return Graph(graph.inputs, [mapping[id(v)] for v in graph.outputs],
                 [(mapping[id(t)], mapping[id(n)]) for t, n in graph.updates])


def simplify(graph: Graph, assume_finite: bool = False, counts: dict | None = None) -> Graph:
    """The graph with every identity rule applied to a fixed point, then its chains simplified.

    assume_finite: also apply rewrites that are wrong for inf/nan operands
    (`x*0 -> 0`, sympy results that drop an operand).
    """
    rules = RULES + (FINITE_RULES if assume_finite else ())
    for _ in range(4):  # a simplified chain may expose new identities, rarely more than once
        before = graph
        graph = apply_rules(graph, rules, counts=counts)
        graph = simplify_chains(graph, assume_finite, counts)
        if graph is before:
            break
    return graph
