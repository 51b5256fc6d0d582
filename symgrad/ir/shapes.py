"""Static shapes whose sizes are ints or symbolic `Dim`s (sympy expressions).

A shape is a tuple of sizes. A size is a Python int or a sympy expression
over `Dim` symbols (`B`, `2*B`); the emitted code takes each Dim as a runtime
argument, and every check here is symbolic so it runs while the graph is built.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import sympy

Size = "int | sympy.Expr"


class Dim(sympy.Symbol):
    """A symbolic size, bound at call time from the shapes of the inputs.

    >>> B = Dim("B")
    >>> x = input("x", (B, 784))
    """

    def __new__(cls, name: str):
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"Dim name must be an identifier, got {name!r}")
        return super().__new__(cls, name, integer=True, positive=True)


def as_size(size) -> "int | sympy.Expr":
    """Normalise one size: ints stay ints, sympy integers become ints."""
    if isinstance(size, bool):
        raise TypeError(f"a size must be an int or a Dim, got {size!r}")
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"a size must be non-negative, got {size}")
        return size
    if hasattr(size, "__index__") and not isinstance(size, sympy.Basic):
        return as_size(int(size))
    if isinstance(size, sympy.Basic):
        size = sympy.sympify(size)
        if size.is_Integer:
            return as_size(int(size))
        if not size.free_symbols:
            raise TypeError(f"a size must be an int or an expression of Dims, got {size}")
        return size
    raise TypeError(f"a size must be an int or a Dim, got {size!r}")


def as_shape(shape) -> tuple:
    """Normalise a shape given as an int, a tuple or a list."""
    if isinstance(shape, (int, sympy.Basic)) and not isinstance(shape, bool):
        shape = (shape,)
    return tuple(as_size(s) for s in shape)


def format_size(size) -> str:
    return str(size).replace(" ", "")


def format_shape(shape: Sequence) -> str:
    """`(B, 10)` as `[B,10]`, the form used in graph text and error messages."""
    return "[" + ",".join(format_size(s) for s in shape) + "]"


def simplify(expr) -> sympy.Expr:
    """sympy.simplify, but not of an expression of at most one operation on atoms (B, exp(x0),
    1/x0): sympy's own evaluation has left it as simple as it gets, and sympy.simplify's first
    call in a process imports sympy.physics.units (0.2-0.3 s, a third of a cold compile of an MLP)."""
    expr = sympy.sympify(expr)
    return expr if sympy.count_ops(expr) <= 1 else sympy.simplify(expr)


def same_size(a, b) -> bool:
    """Whether two sizes are provably equal."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return simplify(sympy.sympify(a) - sympy.sympify(b)) == 0


def same_shape(a: Sequence, b: Sequence) -> bool:
    """Whether two shapes are provably equal, axis by axis."""
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


def numel(shape: Sequence) -> "int | sympy.Expr":
    """The number of elements, symbolic when any size is."""
    n = 1
    for s in shape:
        n = n * s
    return as_size(sympy.expand(n)) if isinstance(n, sympy.Basic) else n


def broadcast_shapes(*shapes: Sequence, op: str = "broadcast") -> tuple:
    """NumPy broadcasting over symbolic shapes; raises ValueError naming `op`."""
    ndim = max((len(s) for s in shapes), default=0)
    result = []
    for axis in range(ndim):
        size = 1
        for shape in shapes:
            k = axis - (ndim - len(shape))
            if k < 0:
                continue
            s = shape[k]
            if isinstance(s, int) and s == 1:
                continue
            if isinstance(size, int) and size == 1:
                size = s
            elif not same_size(size, s):
                listed = " and ".join(format_shape(x) for x in shapes)
                raise ValueError(f"{op}: shapes {listed} do not broadcast (axis {axis}: {size} vs {s})")
        result.append(size)
    return tuple(result)


def normalize_axes(axis, ndim: int, op: str) -> tuple[int, ...]:
    """Turn `axis=` (None, an int or a tuple, negatives allowed) into sorted axes."""
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    out = []
    for a in axes:
        if not isinstance(a, int) or isinstance(a, bool):
            raise TypeError(f"{op}: axis must be an int or a tuple of ints, got {axis!r}")
        if not -ndim <= a < ndim:
            raise ValueError(f"{op}: axis {a} is out of range for a tensor of rank {ndim}")
        out.append(a % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"{op}: repeated axis in {axis!r}")
    return tuple(sorted(out))


def dims_of(shapes: Iterable[Sequence]) -> list[sympy.Symbol]:
    """The Dim symbols used by some shapes, in first-seen order."""
    seen: dict = {}
    for shape in shapes:
        for s in shape:
            if isinstance(s, sympy.Basic):
                for sym in sorted(s.free_symbols, key=lambda x: x.name):
                    seen.setdefault(sym, None)
    return list(seen)


def evaluate(size, bindings: dict) -> int:
    """A concrete size from a symbolic one, given Dim values by symbol."""
    if isinstance(size, int):
        return size
    value = size.xreplace({k: sympy.Integer(v) for k, v in bindings.items()})
    if not value.is_Integer:
        missing = ", ".join(sorted(str(s) for s in value.free_symbols))
        raise ValueError(f"size {size} is not determined by the inputs (unbound: {missing})")
    return int(value)


def evaluate_shape(shape: Sequence, bindings: dict) -> tuple[int, ...]:
    """A concrete shape from a symbolic one."""
    return tuple(evaluate(s, bindings) for s in shape)
