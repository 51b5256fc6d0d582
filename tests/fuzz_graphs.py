"""Random graphs for the differential fuzzer (tests/test_fuzz.py).

A graph is drawn from a seeded generator as plain data, a `FuzzGraph`: a list
of `Step`s, each an op name, the indices of the earlier values it reads and
its attributes. The same steps are then built twice, once with symgrad and
once with torch, so the two sides never share code that could hide a defect.

The ops cover every group of the IR: elementwise (unary, binary, with
scalars), broadcasting, reductions (sum, mean, max, softmax), matmul and
movement (transpose, reshape, broadcast_to, expand_dims, squeeze). Shapes
have 0 to 3 axes of sizes 0, 1 and odd or even small sizes. Values are drawn
finite (N(0, 1), scaled by 1e-3, 1 or 30) or with specials mixed in: 0, +-inf, NaN,
exp's overflow and underflow points (710, -745) and small numbers (+-1e-8).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

import symgrad as sg

# Axis sizes: mostly small odd and even ones, 1 for broadcasting, 0 (an empty axis) now and then.
SIZES = (1, 1, 2, 3, 3, 4, 5, 7, 0)
# Large values are exp's overflow and underflow points (710, -745), small ones +-1e-8. No huge or
# tiny magnitudes (1e30, 1e-30, subnormals): they make intermediates of 1e30 that cancel (x/x's
# gradient g/x - g*(x/x)/x, a sum of +1e30, -1e30 and order-1 terms), where the result is one
# rounding of a 1e30 term and depends on evaluation order (torch: -8.8e12, NumPy: 0 for the
# gradient of tanh(sin(x))/tanh(sin(x)) at 1e-30): float arithmetic, not a defect.
# No -0.0: torch differentiates x ** 0.5 as 0.5 / sqrt(x), -inf at -0.0 where IEEE pow gives +inf.
SPECIALS = np.array([0.0, np.inf, -np.inf, np.nan, 1e-8, -1e-8, 710.0, -745.0])
SCALARS = (0.0, 1.0, -1.0, 2.0, 0.5, 3.0, -2.0, 1e-8, 1e8)


@dataclass(frozen=True)
class Step:
    """One value of a graph: `op` applied to the earlier values `args` (indices), with `attrs`."""

    op: str
    args: tuple = ()
    attrs: tuple = ()   # (name, value) pairs, hashable and printable


@dataclass(frozen=True)
class FuzzGraph:
    """A random graph: its steps (inputs are steps too) and how its input values are drawn."""

    steps: tuple
    specials: bool      # input values mix in +-0, +-inf, NaN, huge and tiny numbers

    @property
    def input_steps(self) -> list[int]:
        return [k for k, s in enumerate(self.steps) if s.op == "input"]

    def __str__(self) -> str:
        lines = [f"v{k} = {s.op}({', '.join([f'v{a}' for a in s.args] + [f'{n}={v!r}' for n, v in s.attrs])})"
                 for k, s in enumerate(self.steps)]
        return "; ".join(lines) + f"   [specials={self.specials}]"


# --------------------------------------------------------------------------
# The op table: each op once, as (symgrad builder, torch builder), both taking the
# argument values then the attributes as keywords.


def _torch_reduce(fn, x, axis, keepdims):
    dims = tuple(range(x.ndim)) if axis is None else (axis,)
    if not dims:   # a 0-d value: reducing over no axis is the value itself
        return fn(x.reshape(1), dim=0)
    return fn(x, dim=dims, keepdim=keepdims)


def _sg_where_greater(a, b):
    return sg.where(sg.greater(a, b), a, b)


UNARY: dict[str, tuple[Callable, Callable]] = {
    "neg": (lambda x: -x, lambda x: -x),
    "exp": (sg.exp, torch.exp),
    "log": (sg.log, torch.log),
    "sqrt": (sg.sqrt, torch.sqrt),
    "tanh": (sg.tanh, torch.tanh),
    "sigmoid": (sg.sigmoid, torch.sigmoid),
    "relu": (sg.relu, torch.relu),
    "abs": (sg.abs, torch.abs),
    "sin": (sg.sin, torch.sin),
    "cos": (sg.cos, torch.cos),
    "erf": (sg.erf, torch.erf),
    "log1p": (sg.log1p, torch.log1p),
    "softplus": (sg.softplus, torch.nn.functional.softplus),
    "gelu": (sg.gelu, torch.nn.functional.gelu),
    "gelu_tanh": (lambda x: sg.gelu(x, approximate="tanh"), lambda x: torch.nn.functional.gelu(x, approximate="tanh")),
    "sign": (sg.sign, torch.sign),
    "floor": (sg.floor, torch.floor),
    "round": (sg.round, torch.round),
    "trunc": (sg.trunc, torch.trunc),
    "clip": (lambda x: sg.clip(x, -2.0, 1.5), lambda x: torch.clamp(x, -2.0, 1.5)),
}
BINARY: dict[str, tuple[Callable, Callable]] = {
    "add": (lambda a, b: a + b, lambda a, b: a + b),
    "sub": (lambda a, b: a - b, lambda a, b: a - b),
    "mul": (lambda a, b: a * b, lambda a, b: a * b),
    "div": (lambda a, b: a / b, lambda a, b: a / b),
    "pow": (lambda a, b: a ** b, lambda a, b: a ** b),
    "maximum": (sg.maximum, torch.maximum),
    "minimum": (sg.minimum, torch.minimum),
    "where_greater": (_sg_where_greater, lambda a, b: torch.where(a > b, a, b)),
}
SCALAR_OPS: dict[str, tuple[Callable, Callable]] = {
    "add_scalar": (lambda x, c: x + c, lambda x, c: x + c),
    "rsub_scalar": (lambda x, c: c - x, lambda x, c: c - x),
    "mul_scalar": (lambda x, c: x * c, lambda x, c: x * c),
    "div_scalar": (lambda x, c: x / c, lambda x, c: x / c),
    "pow_scalar": (lambda x, c: x ** c, lambda x, c: x ** c),
}
REDUCE: dict[str, tuple[Callable, Callable]] = {
    "sum": (lambda x, axis, keepdims: sg.sum(x, axis=axis, keepdims=keepdims),
            lambda x, axis, keepdims: _torch_reduce(torch.sum, x, axis, keepdims)),
    "mean": (lambda x, axis, keepdims: sg.mean(x, axis=axis, keepdims=keepdims),
             lambda x, axis, keepdims: _torch_reduce(torch.mean, x, axis, keepdims)),
    "max": (lambda x, axis, keepdims: sg.max(x, axis=axis, keepdims=keepdims),
            lambda x, axis, keepdims: _torch_reduce(torch.amax, x, axis, keepdims)),
    "softmax": (lambda x, axis: sg.softmax(x, axis=axis), lambda x, axis: torch.softmax(x, dim=axis)),
    "log_softmax": (lambda x, axis: sg.log_softmax(x, axis=axis), lambda x, axis: torch.log_softmax(x, dim=axis)),
}
MOVEMENT: dict[str, tuple[Callable, Callable]] = {
    "transpose": (lambda x, perm: sg.transpose(x, perm), lambda x, perm: x.permute(perm)),
    "reshape": (lambda x, shape: sg.reshape(x, shape), lambda x, shape: x.reshape(shape)),
    "broadcast_to": (lambda x, shape: sg.broadcast_to(x, shape), lambda x, shape: x.expand(shape)),
    "expand_dims": (lambda x, axis: sg.expand_dims(x, axis), lambda x, axis: x.unsqueeze(axis)),
    "squeeze": (lambda x, axis: sg.squeeze(x, axis), lambda x, axis: x.squeeze(axis)),
}
MATMUL = {"matmul": (lambda a, b: a @ b, lambda a, b: a @ b)}
OPS = {**UNARY, **BINARY, **SCALAR_OPS, **REDUCE, **MOVEMENT, **MATMUL}


# --------------------------------------------------------------------------
# Drawing graphs


class _Drawer:
    """Draws one graph step by step, tracking each value's shape."""

    MAX_INPUTS = 3

    def __init__(self, rng: np.random.Generator, specials: bool):
        self.rng = rng
        self.specials = specials
        self.steps: list[Step] = []
        self.shapes: list[tuple] = []

    def choice(self, options):
        return options[int(self.rng.integers(len(options)))]

    def add(self, op: str, args=(), **attrs) -> int:
        self.steps.append(Step(op, tuple(args), tuple(attrs.items())))
        self.shapes.append(_shape_of(self.steps, self.shapes))
        return len(self.steps) - 1

    def new_input(self, shape) -> int:
        return self.add("input", shape=tuple(shape))

    def random_shape(self) -> tuple:
        return tuple(self.choice(SIZES) for _ in range(self.choice((0, 1, 1, 2, 2, 2, 3))))

    def broadcast_partner(self, shape) -> tuple:
        """A shape that broadcasts with `shape`: some axes set to 1, leading axes dropped or added."""
        partner = [1 if self.rng.random() < 0.3 else s for s in shape]
        drop = int(self.rng.integers(len(partner) + 1)) if self.rng.random() < 0.3 else 0
        partner = partner[drop:]
        if drop == 0 and len(partner) < 3 and self.rng.random() < 0.15:
            partner = [self.choice((1, 2, 3))] + partner
        return tuple(partner)

    def operand(self, shape) -> int:
        """An earlier value whose shape broadcasts with `shape`, or a new input that does."""
        fits = [k for k, s in enumerate(self.shapes) if _broadcasts(s, shape)]
        if fits and (len(self.steps_inputs()) >= self.MAX_INPUTS or self.rng.random() < 0.5):
            return self.choice(fits)
        return self.new_input(self.broadcast_partner(shape))

    def steps_inputs(self) -> list[int]:
        return [k for k, s in enumerate(self.steps) if s.op == "input"]

    def step(self):
        x = int(self.rng.integers(len(self.steps))) if self.rng.random() < 0.4 else len(self.steps) - 1
        shape = self.shapes[x]
        kind = self.choice(("unary", "unary", "binary", "binary", "scalar", "reduce", "movement", "matmul"))
        if kind == "unary":
            op = self.choice(sorted(UNARY))
            if op in ("sin", "cos") and self.steps[x].op != "input":
                # Only of inputs: sin of a computed 1e200 is ill-conditioned (one ulp of its argument,
                # which NumPy's and torch's libms may round differently, changes it entirely).
                x = self.choice(self.steps_inputs())
            return self.add(op, (x,))
        if kind == "binary":
            y = self.operand(shape)
            args = (x, y) if self.rng.random() < 0.5 else (y, x)
            op = self.choice(sorted(BINARY))
            return self.add(op, args)
        if kind == "scalar":
            return self.add(self.choice(sorted(SCALAR_OPS)), (x,), c=self.choice(SCALARS))
        if kind == "reduce":
            return self.reduce(x, shape)
        if kind == "movement":
            return self.move(x, shape)
        return self.matmul(x, shape)

    def reduce(self, x: int, shape) -> int:
        op = self.choice(sorted(REDUCE))
        if op in ("softmax", "log_softmax"):
            if not shape:
                return self.add("exp", (x,))
            return self.add(op, (x,), axis=int(self.rng.integers(-len(shape), len(shape))))
        axis = None if not shape or self.rng.random() < 0.3 else int(self.rng.integers(len(shape)))
        if op == "max" and 0 in (shape if axis is None else (shape[axis],)):
            op = "sum"   # max over nothing is an error in NumPy and torch (no identity)
        return self.add(op, (x,), axis=axis, keepdims=bool(self.rng.random() < 0.4))

    def move(self, x: int, shape) -> int:
        n = len(shape)
        options = ["reshape", "broadcast_to"] + (["transpose"] if n >= 2 else []) + \
            (["expand_dims"] if n < 3 else []) + (["squeeze"] if 1 in shape else [])
        op = self.choice(options)
        if op == "transpose":
            return self.add(op, (x,), perm=tuple(int(a) for a in self.rng.permutation(n)))
        if op == "expand_dims":
            return self.add(op, (x,), axis=int(self.rng.integers(-n - 1, n + 1)))
        if op == "squeeze":
            return self.add(op, (x,), axis=self.choice([a for a, s in enumerate(shape) if s == 1]))
        if op == "broadcast_to":
            target = [self.choice((2, 3, 5)) if s == 1 and self.rng.random() < 0.7 else s for s in shape]
            if n < 3 and self.rng.random() < 0.5:
                target = [self.choice((1, 2, 3))] + target
            return self.add(op, (x,), shape=tuple(target))
        return self.add(op, (x,), shape=_random_factoring(self.rng, int(np.prod(shape, dtype=int)), shape))

    def matmul(self, x: int, shape) -> int:
        if len(shape) not in (1, 2):
            return self.add("tanh", (x,))
        k = shape[-1]
        partners = [j for j, s in enumerate(self.shapes) if len(s) in (1, 2) and s[0] == k]
        if partners and self.rng.random() < 0.4:
            y = self.choice(partners)
        else:
            y = self.new_input((k,) if self.rng.random() < 0.25 else (k, self.choice(SIZES)))
        return self.add("matmul", (x, y))


def _random_factoring(rng, n: int, old) -> tuple:
    """A shape of n elements (0 to 3 axes), different from `old` where one exists."""
    if n == 0:
        options = [(0,), (0, 3), (3, 0), (1, 0, 2)]
    else:
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        options = [(n,), (1, n), (n, 1)] + [(d, n // d) for d in divisors] + \
            [(d, e, n // (d * e)) for d in divisors for e in divisors if (n // d) % e == 0]
        if n == 1:
            options.append(())
    options = [o for o in options if o != tuple(old)] or [tuple(old)]
    return options[int(rng.integers(len(options)))]


def _broadcasts(a, b) -> bool:
    return all(x == y or x == 1 or y == 1 for x, y in zip(reversed(a), reversed(b)))


def _shape_of(steps, shapes) -> tuple:
    """The shape of the last step, computed by torch on meta tensors (shapes only, no data)."""
    step = steps[-1]
    if step.op == "input":
        return dict(step.attrs)["shape"]
    args = [torch.empty(shapes[a], device="meta", dtype=torch.float64) for a in step.args]
    return tuple(OPS[step.op][1](*args, **dict(step.attrs)).shape)


def draw_graph(rng: np.random.Generator) -> FuzzGraph:
    """One random graph of 1 to 6 ops over 1 to 3 inputs; half of them get special input values."""
    drawer = _Drawer(rng, specials=bool(rng.random() < 0.5))
    drawer.new_input(drawer.random_shape())
    for _ in range(int(rng.integers(1, 7))):
        drawer.step()
    return FuzzGraph(tuple(drawer.steps), specials=drawer.specials)


def draw_graphs(seed: int, count: int) -> list[FuzzGraph]:
    """`count` graphs from one seed: the same seed gives the same graphs."""
    rng = np.random.default_rng(seed)
    return [draw_graph(rng) for _ in range(count)]


def draw_values(graph: FuzzGraph, shapes, rng: np.random.Generator) -> list[np.ndarray]:
    """float64 arrays for the graph's inputs; with specials, about a quarter of the elements are special."""
    arrays = []
    for shape in shapes:
        a = rng.standard_normal(shape) * rng.choice([1.0, 1e-3, 30.0])
        if graph.specials:
            mask = rng.random(shape) < 0.25
            a = np.where(mask, rng.choice(SPECIALS, size=shape), a)
        arrays.append(np.asarray(a, dtype=np.float64))
    return arrays


# --------------------------------------------------------------------------
# Building the drawn graph


def build(graph: FuzzGraph, builders: int, inputs: list) -> object:
    """The graph's last value, built from `inputs` (one per input step) with side `builders`
    (0: symgrad, 1: torch)."""
    values = []
    given = iter(inputs)
    for step in graph.steps:
        if step.op == "input":
            values.append(next(given))
        else:
            values.append(OPS[step.op][builders](*(values[a] for a in step.args), **dict(step.attrs)))
    return values[-1]


def input_shapes(graph: FuzzGraph) -> list[tuple]:
    return [dict(graph.steps[k].attrs)["shape"] for k in graph.input_steps]
