"""Chain composition: each maximal chain of single-use elementwise nodes, as one sympy expression.

The second half of `simplify`. A chain is composed into one expression over
its operands; a few cheap sympy strategies rewrite it (cancel, together,
factor_terms, powsimp: never the unbounded `simplify`), and the chain is
replaced by one derived elementwise op only when that costs strictly fewer
operations (sympy.count_ops) and computes what the chain computes: the same
NaNs and infinities at probe operands (+-inf, NaN, +-0, negatives) as the
chain evaluated node by node (`keeps_special_values`; sympy's algebra is real
algebra: it evaluates x - (x - x) and exp(log(x)) to x), and no overflow where
the chain has none (`stays_finite`), unless the user assumed finite operands.
"""

from __future__ import annotations

import functools
import operator

import sympy

from ..ir import dtypes as D
from ..ir import shapes as S
from ..ir import sympy_memo
from ..ir.elementwise import ARGS, derived_op
from ..ir.form_checks import keeps_finite_values, keeps_infinities, keeps_special_values, stays_finite
from ..ir.graph import Graph
from ..ir.numpy_expr import numpy_function
from ..ir.registry import ELEMENTWISE, lookup
from ..ir.value import Value, make
from .rewrite import const_like, is_nondeterministic, same_type, short_rational


def _op(name: str, *inputs: Value, **attrs) -> Value:
    return make(lookup(name), inputs, **attrs)


def is_scalar_const(v: Value) -> bool:
    """A 0-d constant node."""
    return v.op.name == "const" and v.shape == ()


# Chains costing more than this many operations are left as they are (bounded effort).
MAX_CHAIN_OPS = 40
# sympy's results of dividing by an inlined 0.0 (1/0 = zoo): not IEEE values, never emitted.
_NOT_REAL = (sympy.zoo, sympy.nan, sympy.oo, -sympy.oo)
_NON_RATIONAL = (sympy.Piecewise, sympy.Max, sympy.Min, sympy.Heaviside, sympy.sign, sympy.Abs)


def _chainable(v: Value) -> bool:
    """Float elementwise nodes with an expression; casts change type and stay boundaries."""
    return (v.op.kind == ELEMENTWISE and v.op.expr is not None and v.op.name != "cast"
            and v.op.arity == len(v.inputs) and D.is_float(v.dtype) and not is_nondeterministic(v))


@functools.lru_cache(maxsize=None)
def _cost(expr) -> int:
    """sympy's operation count of `expr` (asked of every op of every chain: kept per expression)."""
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
    (`keeps_special_values`, `keeps_infinities`: log(exp(x)) -> x loses the overflow, 1/(0 - x)
    -> -1/x the sign of 1/+0) unless the user assumed finite operands, and must overflow
    nowhere `exact` does not (`stays_finite`: sigmoid's backward composes to -y*(y - 1) at
    y = 1/(1 + exp(-x)), finite everywhere; `cancel` gives exp(x)/(exp(x) + 1)**2, nan past
    x = 89 in float32), and must give its finite values within rounding (`keeps_finite_values`:
    sign(gelu(x)) composes to sign(x), -1 where gelu's factor underflows and the chain gives 0).

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
    best = next((c for c in candidates if stays_finite(c, exact) and keeps_finite_values(c, exact, assume_finite)
                 and (assume_finite or keeps_special_values(c, exact) and keeps_infinities(c, exact))), None)
    sympy_memo.store("cheapest", __file__, key, sympy.S.NaN if best is None else best)
    return best


def _inline_number(v: Value):
    """A 0-d const inlined into a chain's expression: a number with a short exact form (2, -0.125),
    or an expression of Dims (1/B), so sympy can combine -1/B with 1/B; None for other values
    (0.1 and friends stay operands, so no rounding changes; so do 0.0 and -0.0: sympy's numbers
    have no signed zero, and -x + 0.0 composes to -x, -0.0 at x = 0 where the graph gives +0.0, and
    x - -0.0 to x; the probes of keeps_special_values cannot see it, -0.0 == 0.0)."""
    if not is_scalar_const(v) or not D.is_float(v.dtype):
        return None
    value = v.attrs["value"]
    if isinstance(value, sympy.Basic):
        return value
    if float(value) == 0:
        return None
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
        self.walked: list[int] = []   # ids of the nodes the walk composed (the inner ones)
        self.bounds: list[int] = []   # ids of the nodes it stopped at (the operands)
        self.expr, self.exact = self._compose(root, inner)

    def unchanged(self, inner_ids: set) -> bool:
        """Whether walking from the same root over a graph whose inner nodes are `inner_ids` meets the
        same nodes the same way: the root's inputs are the same objects (values are immutable), so
        only which of them are inner can change what the chain is."""
        return all(i in inner_ids for i in self.walked[1:]) and not any(i in inner_ids for i in self.bounds)

    def leaf(self, v: Value) -> sympy.Symbol:
        """The symbol standing for operand `v` (one per distinct value)."""
        if id(v) not in self.symbols:
            self.symbols[id(v)] = _leaf_symbol(len(self.leaves))
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
        composed: list = []  # the trees of the walk's finished nodes, the latest last
        while stack:
            v, inputs_done = stack.pop()
            if v is not root and not inner(v):
                self.bounds.append(id(v))
                number = _inline_number(v)
                composed.append(number if number is not None else self.leaf(v))
            elif not inputs_done:
                self.walked.append(id(v))
                self.members += 1
                self.cost += _cost(v.op.expr)
                if self.cost > MAX_CHAIN_OPS:
                    return None, None
                stack.append((v, True))
                stack.extend((i, False) for i in reversed(v.inputs))
            else:
                first = len(composed) - len(v.inputs)
                args = tuple(composed[first:])
                del composed[first:]
                composed.append((v.op, args))
        return _composed(composed[0])


@functools.lru_cache(maxsize=None)
def _composed(tree) -> tuple:
    """A chain's tree (a leaf, or (op, operand trees)) composed by sympy's evaluating constructors,
    and node by node. Kept per tree: every layer's chains and every parameter's update are the
    same trees over l0, l1, ..., and composing one costs sympy a millisecond."""
    def compose(t):
        if isinstance(t, sympy.Basic):
            return t
        return t[0].expr.xreplace(dict(zip(ARGS, map(compose, t[1]))))
    try:
        return compose(tree), _NodeByNode(tree)
    except (TypeError, ValueError):
        # sympy's evaluating constructors met a value they refuse: log of an inlined negative bound
        # of a clip is complex, and a Piecewise cannot compare it (clip(log(clip(x, -2, 2)))).
        # Such a chain is left as its nodes.
        return None, None


@functools.lru_cache(maxsize=None)
def _leaf_symbol(k: int) -> sympy.Symbol:
    """The symbol of a chain's k-th operand, `lk` (every chain numbers its operands alike)."""
    return sympy.Symbol(f"l{k}", real=True)


@functools.lru_cache(maxsize=None)
def _not_real(expr: sympy.Expr) -> bool:
    """Whether `expr` holds one of _NOT_REAL (asked of every chain: its expression repeats per layer)."""
    return expr.has(*_NOT_REAL)


@functools.lru_cache(maxsize=None)
def _free_symbols(expr: sympy.Expr) -> frozenset:
    """`expr.free_symbols` (which sympy walks the tree for at every call), kept per expression."""
    return frozenset(expr.free_symbols)


@functools.lru_cache(maxsize=None)
def _has_dims(expr: sympy.Expr) -> bool:
    """Whether `expr` names a Dim (asked of every chain's cheapest form, which repeats per layer)."""
    return any(isinstance(s, S.Dim) for s in expr.free_symbols)


def _extract_dims(expr: sympy.Expr, chain: "_Chain") -> sympy.Expr:
    """`expr` with each maximal subexpression of Dims only (1/B) made an operand: a const leaf."""
    if not _has_dims(expr):
        return expr
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


def _plan(chain: _Chain, assume_finite: bool) -> sympy.Expr | None:
    """The cheaper form `chain` is re-emitted in, or None where it stays as it is."""
    if chain.members < 2 or chain.cost > MAX_CHAIN_OPS or chain.expr is None:
        return None
    if _not_real(chain.expr):
        return None  # x / 0.0 inlined: sympy's zoo has no float meaning (and no C spelling)
    operands = set(chain.symbols.values())
    best = _cheapest(chain.expr, chain.exact, assume_finite)
    if best is None:
        return None  # every form sympy found differs from the chain at inf, NaN or overflow
    best = _extract_dims(best, chain)
    if _not_real(best) or _cost(best) >= chain.cost:
        return None
    if not assume_finite and operands - _free_symbols(best):
        return None  # an operand vanished (x - x -> 0): wrong for inf and nan
    return best


def simplify_chains(graph: Graph, assume_finite: bool = False, counts: dict | None = None,
                    kept: dict | None = None) -> Graph:
    """Each maximal single-use elementwise chain, re-emitted as one op when sympy makes it cheaper.

    `kept`, a dict the caller passes to each of its calls (with the same `assume_finite`), holds the
    chains left as they were (by root: id -> chain, which keeps the root alive): a later call whose
    graph holds the same root, the chain's nodes still inner and its operands not, leaves it as it
    is again without composing it (simplify's rounds: most chains are the last round's)."""
    kept = {} if kept is None else kept
    users = graph.users
    pinned = {id(v) for v in graph.outputs} | {id(n) for _, n in graph.updates}
    chainable = {id(v) for v in graph.nodes if _chainable(v)}
    # The chains' inner nodes (asked of every node of every chain): chainable, read once, by a
    # chainable node, and neither an output nor an update.
    inner_ids = {i for i in chainable if len(users[i]) == 1 and i not in pinned and id(users[i][0]) in chainable}

    def inner(v: Value) -> bool:
        return id(v) in inner_ids

    plans: dict[int, tuple] = {}
    for node in graph.nodes:
        if id(node) not in chainable or id(node) in inner_ids:
            continue
        earlier = kept.get(id(node))
        if earlier is not None and earlier.unchanged(inner_ids):
            continue  # the same chain as a call before found it, left as it is then
        chain = kept[id(node)] = _Chain(node, inner)
        best = _plan(chain, assume_finite)
        if best is not None:
            plans[id(node)] = (chain, best)
            del kept[id(node)]
    if not plans:
        return graph

    mapping: dict[int, Value] = {}
    emitted = 0
    for node in graph.nodes:
        new = None
        if id(node) in plans:
            new = _emit(*plans[id(node)], lambda v: mapping.get(id(v), v))  # new consts map to themselves
            emitted += new is not None
        if new is None:
            inputs = tuple(mapping[id(i)] for i in node.inputs)
            new = node if all(map(operator.is_, inputs, node.inputs)) else node.over(inputs)
        mapping[id(node)] = new
    if not emitted:
        return graph
    if counts is not None:
        counts["sympy_chain"] = counts.get("sympy_chain", 0) + emitted
    return Graph(graph.inputs, [mapping[id(v)] for v in graph.outputs],
                 [(mapping[id(t)], mapping[id(n)]) for t, n in graph.updates])
