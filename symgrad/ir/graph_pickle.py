"""Pickling what was made from a graph, with that graph's nodes stored by reference.

The caches keep what the slow stages made from a graph the user builds again in every process:
the program cache the optimized graph, pass report and kernel plan of a program
(symgrad.backends.build.program_cache), the step cache the step graph that autodiff and the
optimizer made from a loss (symgrad.step.step_cache). Stored against a *reference* graph, a node
of that graph is its position in `reference.nodes`, a Dim its name, an op its registry name (a
derived op, which is not registered, its label and formula). Loaded against the reference graph
built again, what was made shares its nodes (its inputs, the model's parameters) as a fresh
result would: only the nodes made from them are new.

A leaf that must be the caller's own, an input or a variable holding a model's parameter or
buffer (its cell), cannot be stored as a copy: a copy would be another parameter, trained
apart from the model. One that is not a node of the reference graph refuses the pickle
(PicklingError), and the caller stores nothing.

A zero-stride array (an optimizer's moments start as one value broadcast to a parameter's
shape: symgrad.api.sources.filled) is stored as that value and shape, not as megabytes of it.
A sympy sum, product, power, function or Piecewise (a derived op's formula) is rebuilt from its
arguments unevaluated: they are canonical already, and sympy's own pickle would run each
function's evaluation again (7 of a 12-layer GPT's 18 ms of loading a cached step).
"""

from __future__ import annotations

import io
import pickle
from types import MappingProxyType

import numpy as np
import sympy
from sympy.core.function import AppliedUndef

from .elementwise import derived_op
from .graph import Graph
from .registry import REGISTRY, OpDef
from .shapes import Dim
from .value import Value


def dumps(made, reference: Graph) -> bytes:
    """`made` pickled, the nodes of `reference` (and its ops, Dims) stored by reference.

    Raises pickle.PicklingError (or TypeError for an object pickle refuses) where `made` holds
    something that cannot be stored so: an op not in the registry, a leaf of the caller's that
    `reference` lacks."""
    buffer = io.BytesIO()
    _Pickler(buffer, reference).dump(made)
    return buffer.getvalue()


def loads(data: bytes, reference: Graph):
    """What `dumps(made, reference)` stored, its references resolved against `reference` (the same
    graph, or one built again with the same structure: the same nodes in the same order)."""
    return _Unpickler(io.BytesIO(data), reference).load()


def _graph(state: dict) -> Graph:
    """A Graph from its attributes (`_Pickler.reducer_override`), its constructor's checks not re-run."""
    graph = Graph.__new__(Graph)
    graph.__dict__.update(state)
    return graph


def _value(op, inputs, attrs, shape, dtype, effects) -> Value:
    """A Value from the fields `_Pickler.reducer_override` stored: tuples and a dict the pickle made
    for it alone, so taken as they are, not copied as its constructor copies what a caller passes
    (a 12-layer GPT's step graph: 2,900 nodes, 1.5 of its 8 ms of loading)."""
    return Value.of_fields(op, inputs, MappingProxyType(attrs), shape, dtype, effects)


def _unevaluated(cls, args):
    """sympy's `cls(*args)` without its evaluation: `args` are those of an expression that was
    evaluated when it was made (`_Pickler.reducer_override`)."""
    return cls(*args, evaluate=False)


# The sympy nodes `_unevaluated` rebuilds (an undefined function's class is made at run time: it
# keeps sympy's own pickle).
_REBUILT = (sympy.Add, sympy.Mul, sympy.Pow, sympy.Function, sympy.Piecewise)


def _filled(element: np.ndarray, shape: tuple) -> np.ndarray:
    """The zero-stride array of `shape` whose every element is `element`'s one (read-only, as stored)."""
    return np.broadcast_to(element.reshape(()), shape)


def _reference(kind: str, *key):
    """Stands in a pickle for a node, an op or a Dim stored by reference: `_Unpickler.find_class`
    gives its own resolver in its place, so this is never called."""
    raise pickle.UnpicklingError("a reference to a graph's node read without its reference graph")


class _Pickler(pickle.Pickler):
    """Nodes of the reference graph, ops and Dims reduce to `_reference(kind, key)`. A reducer
    override, unlike a persistent_id, is not asked of the plain objects (ints, strings, tuples: most
    of a plan's 200,000), which the C pickler then writes alone, and a reference met again is
    memoized like any object: a GPT plan pickles in half the time."""

    def __init__(self, file, reference: Graph):
        super().__init__(file, protocol=5)
        self._position = {id(n): k for k, n in enumerate(reference.nodes)}

    def reducer_override(self, obj):
        kind = type(obj)
        if isinstance(obj, Value):
            k = self._position.get(id(obj))
            if k is not None:
                return _reference, ("node", k)
            if obj.op.name == "input" or "cell" in obj.attrs:
                raise pickle.PicklingError(f"{obj.op.name} {obj.name!r} is not a node of the reference graph: "
                                           f"a copy of it would be another {obj.op.name}")
            if kind is not Value:
                raise pickle.PicklingError(f"a {kind.__name__} (a Value of a class of its own) outside the "
                                           f"reference graph: rebuilt, it would be a plain Value")
            # A Value is immutable (its attrs a read-only mapping): rebuilt from its fields (`_value`).
            return _value, (obj.op, obj.inputs, dict(obj.attrs), obj.shape, obj.dtype, obj.effects)
        if kind is OpDef:
            if obj.extra.get("derived"):
                return _reference, ("derived", obj.name, obj.expr, obj.arity)
            if REGISTRY.get(obj.name) is not obj:
                raise pickle.PicklingError(f"op {obj.name!r} is not in the registry")
            return _reference, ("op", obj.name)
        if isinstance(obj, Dim):
            return _reference, ("dim", str(obj))
        # A Graph without its cached `users`: keyed by id(node), it names other objects once loaded
        # (recomputed on first use, as the other cached properties would be).
        if kind is Graph and "users" in vars(obj):
            return _graph, ({k: v for k, v in vars(obj).items() if k != "users"},)
        if isinstance(obj, _REBUILT) and obj.args and not isinstance(obj, AppliedUndef):
            return _unevaluated, (obj.func, obj.args)
        if kind is np.ndarray and obj.size > 1 and not any(obj.strides):
            return _filled, (obj.reshape(-1)[:1].copy(), obj.shape)
        return NotImplemented


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, reference: Graph):
        super().__init__(file)
        self._reference = reference
        self._dims = {str(d): d for d in reference.dims}

    def find_class(self, module, name):
        if module == __name__ and name == "_reference":
            return self._resolve
        return super().find_class(module, name)

    def _resolve(self, kind, *key):
        """What `_reference(kind, *key)` stands for, in the reference graph (or the registry)."""
        if kind == "node":
            return self._reference.nodes[key[0]]
        if kind == "op":
            return REGISTRY[key[0]]
        if kind == "derived":
            return derived_op(*key)
        if kind == "dim":
            return self._dims[key[0]]
        raise pickle.UnpicklingError(f"unknown reference {kind!r}")
