"""Random graphs for the differential fuzzer (tests/test_fuzz.py).

A graph is drawn from a seeded generator as plain data, a `FuzzGraph`: a list
of `Step`s, each an op name, the indices of the earlier values it reads and
its attributes. The same steps are then built twice, once with symgrad and
once with torch, so the two sides never share code that could hide a defect.

The ops cover every group of the IR: elementwise (unary, binary, with
scalars, comparisons and `where`), broadcasting, reductions (sum, mean, max,
softmax, var and std with corrections), matmul, movement (transpose, reshape,
broadcast_to, expand_dims, squeeze), indexing (slices with steps, negative
bounds and windows at either end, integer indices, None and Ellipsis; take,
scatter_add, concat, split, pad), convolutions (conv1d, conv2d: stride,
padding, dilation, groups, bias), pooling (max, avg) and attention (causal or
not, fused or general, with a boolean mask). Inputs are float64, and now and
then int64, int32 or bool, mixed under torch's promotion (`torch.result_type`
decides every step's dtype; a step whose torch result would be float32 is
drawn again, so that every float compares in float64).

Shapes have 0 to 3 axes of sizes 0, 1 and odd or even small sizes; one graph
in four draws larger sizes (more than the 64 elements constant folding stores,
so a constant gradient reaches the lowering). Float values are drawn finite
(N(0, 1), scaled by 1e-3, 1 or 30) or with specials mixed in: 0, +-inf, NaN,
exp's overflow and underflow points (710, -745) and small numbers (+-1e-8);
integers lie in [-4, 4]. Each graph says how its gradients are seeded: by a
random cotangent, or by sum or mean of its output (a broadcast constant).

`build(..., nudge=)` builds the torch side with every computed value moved by
one rounding error of its op: tests/test_fuzz.py compares against those runs
where a result is ill-conditioned (see `nudge`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

import symgrad as sg
from symgrad.api import functional as sgf

# Axis sizes: mostly small odd and even ones, 1 for broadcasting, 0 (an empty axis) now and then.
SIZES = (1, 1, 2, 3, 3, 4, 5, 7, 0)
# A "big" graph's sizes: its inputs have more than the 64 elements that constant folding stores.
BIG_SIZES = (8, 9, 10, 12, 1)
# Large values are exp's overflow and underflow points (710, -745), small ones +-1e-8. No huge or
# tiny magnitudes (1e30, 1e-30, subnormals): they make intermediates of 1e30 that cancel (x/x's
# gradient g/x - g*(x/x)/x, a sum of +1e30, -1e30 and order-1 terms), where the result is one
# rounding of a 1e30 term and depends on evaluation order (torch: -8.8e12, NumPy: 0 for the
# gradient of tanh(sin(x))/tanh(sin(x)) at 1e-30): float arithmetic, not a defect.
# No -0.0: torch differentiates x ** 0.5 as 0.5 / sqrt(x), -inf at -0.0 where IEEE pow gives +inf.
SPECIALS = np.array([0.0, np.inf, -np.inf, np.nan, 1e-8, -1e-8, 710.0, -745.0])
SCALARS = (0.0, 1.0, -1.0, 2.0, 0.5, 3.0, -2.0, 1e-8, 1e8)
INT_SCALARS = (0, 1, -1, 2, 3)
FLOAT, INTS = "float64", ("int64", "int32", "bool")
INT_LIMIT = 2 ** 30   # integer values stay below this: no step may overflow int32


@dataclass(frozen=True)
class Step:
    """One value of a graph: `op` applied to the earlier values `args` (indices), with `attrs`."""

    op: str
    args: tuple = ()
    attrs: tuple = ()   # (name, value) pairs, printable

    @property
    def kw(self) -> dict:
        return dict(self.attrs)


@dataclass(frozen=True)
class FuzzGraph:
    """A random graph: its steps (inputs are steps too), how its input values are drawn and how
    its gradients are seeded ("random": sum(out * cot) with a random cotangent; "sum", "mean":
    of out itself, so the gradient entering the last op is a broadcast constant)."""

    steps: tuple
    specials: bool      # float inputs mix in +-0, +-inf, NaN, huge and tiny numbers
    cotangent: str = "random"

    @property
    def input_steps(self) -> list[int]:
        return [k for k, s in enumerate(self.steps) if s.op == "input"]

    def __str__(self) -> str:
        lines = [f"v{k} = {s.op}({', '.join([f'v{a}' for a in s.args] + [f'{n}={v!r}' for n, v in s.attrs])})"
                 for k, s in enumerate(self.steps)]
        return "; ".join(lines) + f"   [specials={self.specials}, cotangent={self.cotangent}]"


# --------------------------------------------------------------------------
# The op table: each op once, as (symgrad builder, torch builder, rounding), both builders taking
# the argument values then the attributes as keywords. `rounding` says how the op's result may
# differ from the exact one, for `nudge`: "exact" (a copy, a max, a comparison), "round" (one
# rounding of each element), "underflow" (one rounding, and 0 may be a flushed subnormal), "sum"
# (a sum of products: an error of eps times the op of the operands' magnitudes), or the name of an
# op of its own error (softmax, log_softmax, var, std, attention).


@dataclass(frozen=True)
class Op:
    sg: Callable
    torch: Callable
    rounding: str = "round"


def _torch_reduce(fn, x, axis, keepdims):
    dims = tuple(range(x.ndim)) if axis is None else (axis,)
    if not dims:   # a 0-d value: reducing over no axis is the value itself
        return fn(x.reshape(1), dim=0)
    return fn(x, dim=dims, keepdim=keepdims)


def _torch_var(x, axis, correction, keepdims, root=False):
    fn = torch.std if root else torch.var
    return fn(x, dim=axis, correction=correction, keepdim=keepdims)


def _sizes(sections):
    return list(sections) if isinstance(sections, tuple) else sections


def _joined(parts, pieces, cat):
    """The split's pieces at `pieces`, joined again (two pieces not next to each other: a gradient
    that is a sum of embeds into windows with a gap between them)."""
    return parts[pieces[0]] if len(pieces) == 1 else cat([parts[i] for i in pieces])


def _sg_index(x, key):
    return x[key]


def _torch_take(x, axis, indices):
    return x[(slice(None),) * axis + (torch.tensor(indices, dtype=torch.int64),)]


def _torch_scatter_add(src, axis, indices, size):
    shape = list(src.shape)
    shape[axis] = size
    return torch.zeros(shape, dtype=src.dtype).index_add(axis, torch.tensor(indices, dtype=torch.int64), src)


def _sg_attention(q, k, v, mask=None, causal=False, scale=None):
    return sg.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)


def _torch_attention(q, k, v, mask=None, causal=False, scale=None):
    """torch's math backend: its definition, softmax(q k^T * scale + mask) v, in plain ops (its CPU
    flash kernel gives 0 where a row's scores are all NaN)."""
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                                scale=scale)


UNARY: dict[str, Op] = {
    "neg": Op(lambda x: -x, lambda x: -x, "exact"),
    "exp": Op(sg.exp, torch.exp, "underflow"),
    "log": Op(sg.log, torch.log),
    "sqrt": Op(sg.sqrt, torch.sqrt),
    "tanh": Op(sg.tanh, torch.tanh),
    "sigmoid": Op(sg.sigmoid, torch.sigmoid, "underflow"),
    "relu": Op(sg.relu, torch.relu, "exact"),
    "abs": Op(sg.abs, torch.abs, "exact"),
    "sin": Op(sg.sin, torch.sin),
    "cos": Op(sg.cos, torch.cos),
    "erf": Op(sg.erf, torch.erf),
    # torch.log1p(5e-324) is 0 (the exact value is 5e-324; 1.5e-323 gives 2e-323): a 0 may be a flushed subnormal
    "log1p": Op(sg.log1p, torch.log1p, "underflow"),
    "softplus": Op(sg.softplus, torch.nn.functional.softplus, "underflow"),
    "gelu": Op(sg.gelu, torch.nn.functional.gelu, "gelu"),
    "gelu_tanh": Op(lambda x: sg.gelu(x, approximate="tanh"),
                    lambda x: torch.nn.functional.gelu(x, approximate="tanh"), "gelu"),
    "sign": Op(sg.sign, torch.sign, "exact"),
    "floor": Op(sg.floor, torch.floor, "exact"),
    "round": Op(sg.round, torch.round, "exact"),
    "trunc": Op(sg.trunc, torch.trunc, "exact"),
    "clip": Op(lambda x: sg.clip(x, -2.0, 1.5), lambda x: torch.clamp(x, -2.0, 1.5), "exact"),
}
BINARY: dict[str, Op] = {
    "add": Op(lambda a, b: a + b, lambda a, b: a + b),
    "sub": Op(lambda a, b: a - b, lambda a, b: a - b),
    "mul": Op(lambda a, b: a * b, lambda a, b: a * b),
    "div": Op(lambda a, b: a / b, lambda a, b: a / b),
    "pow": Op(lambda a, b: a ** b, lambda a, b: a ** b),
    "maximum": Op(sg.maximum, torch.maximum, "exact"),
    "minimum": Op(sg.minimum, torch.minimum, "exact"),
    "where_greater": Op(lambda a, b: sg.where(sg.greater(a, b), a, b), lambda a, b: torch.where(a > b, a, b), "exact"),
}
COMPARE: dict[str, Op] = {
    "greater": Op(sg.greater, torch.gt, "exact"),
    "less_equal": Op(sg.less_equal, torch.le, "exact"),
    "equal": Op(sg.equal, torch.eq, "exact"),
    "not_equal": Op(sg.not_equal, torch.ne, "exact"),
}
SCALAR_OPS: dict[str, Op] = {
    "add_scalar": Op(lambda x, c: x + c, lambda x, c: x + c),
    "rsub_scalar": Op(lambda x, c: c - x, lambda x, c: c - x),
    "mul_scalar": Op(lambda x, c: x * c, lambda x, c: x * c),
    "div_scalar": Op(lambda x, c: x / c, lambda x, c: x / c),
    "pow_scalar": Op(lambda x, c: x ** c, lambda x, c: x ** c),
}
REDUCE: dict[str, Op] = {
    "sum": Op(lambda x, axis, keepdims: sg.sum(x, axis=axis, keepdims=keepdims),
              lambda x, axis, keepdims: _torch_reduce(torch.sum, x, axis, keepdims), "sum"),
    "mean": Op(lambda x, axis, keepdims: sg.mean(x, axis=axis, keepdims=keepdims),
               lambda x, axis, keepdims: _torch_reduce(torch.mean, x, axis, keepdims), "sum"),
    "max": Op(lambda x, axis, keepdims: sg.max(x, axis=axis, keepdims=keepdims),
              lambda x, axis, keepdims: _torch_reduce(torch.amax, x, axis, keepdims), "exact"),
    "softmax": Op(lambda x, axis: sg.softmax(x, axis=axis), lambda x, axis: torch.softmax(x, dim=axis), "softmax"),
    "log_softmax": Op(lambda x, axis: sg.log_softmax(x, axis=axis), lambda x, axis: torch.log_softmax(x, dim=axis),
                      "log_softmax"),
    "var": Op(lambda x, axis, correction, keepdims: sg.var(x, axis=axis, correction=correction, keepdims=keepdims),
              _torch_var, "var"),
    "std": Op(lambda x, axis, correction, keepdims: sg.std(x, axis=axis, correction=correction, keepdims=keepdims),
              lambda x, axis, correction, keepdims: _torch_var(x, axis, correction, keepdims, root=True), "std"),
}
MOVEMENT: dict[str, Op] = {
    "transpose": Op(lambda x, perm: sg.transpose(x, perm), lambda x, perm: x.permute(perm), "exact"),
    "reshape": Op(lambda x, shape: sg.reshape(x, shape), lambda x, shape: x.reshape(shape), "exact"),
    "broadcast_to": Op(lambda x, shape: sg.broadcast_to(x, shape), lambda x, shape: x.expand(shape), "exact"),
    "expand_dims": Op(lambda x, axis: sg.expand_dims(x, axis), lambda x, axis: x.unsqueeze(axis), "exact"),
    "squeeze": Op(lambda x, axis: sg.squeeze(x, axis), lambda x, axis: x.squeeze(axis), "exact"),
}
INDEXING: dict[str, Op] = {
    "index": Op(_sg_index, lambda x, key: x[key], "exact"),
    "take": Op(lambda x, axis, indices: sg.take(x, sg.constant(np.array(indices, dtype=np.int64)), axis=axis),
               _torch_take, "exact"),
    "scatter_add": Op(lambda x, axis, indices, size: sgf.scatter_add(x, sg.constant(np.array(indices, dtype=np.int64)),
                                                                     axis, size),
                      _torch_scatter_add, "sum"),
    "concat": Op(lambda *xs, axis: sg.concat(list(xs), axis=axis), lambda *xs, axis: torch.cat(xs, dim=axis), "exact"),
    "split": Op(lambda x, sections, axis, pieces: _joined(sg.split(x, _sizes(sections), dim=axis), pieces,
                                                           lambda parts: sg.concat(parts, axis=axis)),
                lambda x, sections, axis, pieces: _joined(torch.split(x, _sizes(sections), dim=axis), pieces,
                                                          lambda parts: torch.cat(parts, dim=axis)), "exact"),
    "pad": Op(lambda x, padding, mode, value: sg.pad(x, padding, mode=mode, value=value),
              lambda x, padding, mode, value: torch.nn.functional.pad(x, padding, mode=mode,
                                                                      value=value if mode == "constant" else None),
              "exact"),
}
HEAVY: dict[str, Op] = {
    "conv1d": Op(lambda x, w, b=None, **kw: sg.conv1d(x, w, b, **kw),
                 lambda x, w, b=None, **kw: torch.nn.functional.conv1d(x, w, b, **kw), "sum"),
    "conv2d": Op(lambda x, w, b=None, **kw: sg.conv2d(x, w, b, **kw),
                 lambda x, w, b=None, **kw: torch.nn.functional.conv2d(x, w, b, **kw), "sum"),
    "max_pool2d": Op(lambda x, **kw: sg.max_pool2d(x, **kw), lambda x, **kw: torch.nn.functional.max_pool2d(x, **kw),
                     "exact"),
    "avg_pool2d": Op(lambda x, **kw: sg.avg_pool2d(x, **kw), lambda x, **kw: torch.nn.functional.avg_pool2d(x, **kw),
                     "sum"),
    "attention": Op(_sg_attention, _torch_attention, "attention"),
}
DTYPES: dict[str, Op] = {
    "where": Op(sg.where, torch.where, "exact"),
    "to_float": Op(lambda x: sg.cast(x, FLOAT), lambda x: x.to(torch.float64), "exact"),
}
MATMUL = {"matmul": Op(lambda a, b: a @ b, lambda a, b: a @ b, "sum")}
OPS = {**UNARY, **BINARY, **COMPARE, **SCALAR_OPS, **REDUCE, **MOVEMENT, **INDEXING, **HEAVY, **DTYPES, **MATMUL}
# Ops that take float operands only (an integer operand is cast to float64 first).
FLOAT_ONLY = {"exp", "log", "sqrt", "tanh", "sigmoid", "sin", "cos", "erf", "log1p", "softplus", "gelu",
              "gelu_tanh", "clip", "div", "pow", "div_scalar", "pow_scalar", "mean", "softmax", "log_softmax",
              "var", "std", "matmul", "scatter_add", *HEAVY}
TORCH_DTYPES = {"float64": torch.float64, "float32": torch.float32, "int64": torch.int64, "int32": torch.int32,
                "bool": torch.bool}


class Refused(Exception):
    """A step torch refuses, or one whose result would be float32: drawn again."""


# --------------------------------------------------------------------------
# Drawing graphs


class _Drawer:
    """Draws one graph step by step, tracking each value's shape, dtype and integer bound."""

    MAX_INPUTS = 3
    MAX_TRIES = 8

    def __init__(self, rng: np.random.Generator, specials: bool, big: bool, mixed: bool):
        self.rng = rng
        self.specials, self.big, self.mixed = specials, big, mixed
        self.steps: list[Step] = []
        self.shapes: list[tuple] = []
        self.dtypes: list[str] = []
        self.bounds: list[float] = []   # the largest magnitude an integer value can hold
        self.has_heavy = False   # one convolution, pooling or attention per graph
        self.last = False        # drawing the graph's last step

    def choice(self, options):
        return options[int(self.rng.integers(len(options)))]

    def chance(self, p: float) -> bool:
        return bool(self.rng.random() < p)

    def add(self, op: str, args=(), **attrs) -> int:
        """Append a step; `Refused` (and nothing appended) when torch refuses it or its result is
        float32 or may overflow an integer."""
        step = Step(op, tuple(args), tuple(attrs.items()))
        if op == "input":
            shape, dtype = attrs["shape"], attrs.get("dtype", FLOAT)
            bound = 4.0 if dtype in ("int64", "int32") else 1.0
        else:
            try:
                value = _torch_probe(step, [self.shapes[a] for a in args], [self.dtypes[a] for a in args])
            except (RuntimeError, ValueError, IndexError, TypeError) as exc:
                raise Refused(str(exc)) from exc
            shape, dtype = tuple(value.shape), str(value.dtype).replace("torch.", "")
            if dtype not in (FLOAT, *INTS):
                raise Refused(f"{op} gives {dtype}")
            bound = _int_bound(step, [self.bounds[a] for a in args], [self.shapes[a] for a in args])
            if dtype != FLOAT and bound > INT_LIMIT:
                raise Refused(f"{op} may overflow")
        self.steps.append(step)
        self.shapes.append(tuple(shape))
        self.dtypes.append(dtype)
        self.bounds.append(bound)
        return len(self.steps) - 1

    def new_input(self, shape, dtype: str = FLOAT, finite: bool = False) -> int:
        """A new input; `finite`: its values get no specials even in a graph with specials."""
        return self.add("input", shape=tuple(shape), dtype=dtype, **({"finite": True} if finite else {}))

    def input_dtype(self) -> str:
        return self.choice(INTS) if self.mixed and self.chance(0.35) else FLOAT

    def random_shape(self, ndim: int | None = None) -> tuple:
        sizes = BIG_SIZES if self.big else SIZES
        ndim = self.choice((0, 1, 1, 2, 2, 2, 3) if not self.big else (2, 2, 3)) if ndim is None else ndim
        return tuple(self.choice(sizes) for _ in range(ndim))

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
        if fits and (len(self.input_steps()) >= self.MAX_INPUTS or self.rng.random() < 0.5):
            return self.choice(fits)
        return self.new_input(self.broadcast_partner(shape), self.input_dtype())

    def input_steps(self) -> list[int]:
        return [k for k, s in enumerate(self.steps) if s.op == "input"]

    def as_float(self, x: int) -> int:
        return x if self.dtypes[x] == FLOAT else self.add("to_float", (x,))

    def step(self):
        """One more step: drawn again (up to MAX_TRIES) where torch refuses it; a cast to float64
        or a tanh when nothing fits."""
        before = len(self.steps)
        for _ in range(self.MAX_TRIES):
            x = int(self.rng.integers(len(self.steps))) if self.rng.random() < 0.4 else len(self.steps) - 1
            try:
                return self._step(x)
            except Refused:
                del self.steps[before:], self.shapes[before:], self.dtypes[before:], self.bounds[before:]
        x = len(self.steps) - 1
        return self.add("tanh", (x,)) if self.dtypes[x] == FLOAT else self.add("to_float", (x,))

    KINDS = ("unary", "unary", "binary", "binary", "scalar", "reduce", "movement", "matmul",
             "index", "index", "index", "statistics", "heavy", "dtype")

    def _step(self, x: int) -> int:
        kind = self.choice(self.KINDS)
        if kind == "heavy" and self.has_heavy:
            kind = "index"
        if kind == "dtype" and not self.mixed:
            kind = "binary"
        if kind == "statistics" and not self.last:
            kind = "reduce"
        op_table = {"unary": UNARY, "binary": BINARY, "scalar": SCALAR_OPS}
        if kind in op_table:
            op = self.choice(sorted(op_table[kind]))
            if op in FLOAT_ONLY:
                x = self.as_float(x)
            if kind == "unary":
                if op in ("sin", "cos") and self.steps[x].op != "input":
                    # Only of inputs: sin of a computed 1e200 is ill-conditioned (one ulp of its argument,
                    # which NumPy's and torch's libms may round differently, changes it entirely).
                    x = self.choice([k for k in self.input_steps() if self.dtypes[k] == FLOAT] or [x])
                return self.add(op, (x,))
            if kind == "binary":
                y = self.operand(self.shapes[x])
                if op in FLOAT_ONLY:
                    y = self.as_float(y)
                return self.add(op, (x, y) if self.rng.random() < 0.5 else (y, x))
            scalars = SCALARS if self.dtypes[x] == FLOAT or not self.chance(0.7) else INT_SCALARS
            return self.add(op, (x,), c=self.choice(scalars))
        return getattr(self, kind)(x, self.shapes[x])

    # ---- reductions and statistics ----

    def reduce(self, x: int, shape) -> int:
        op = self.choice(("sum", "mean", "max", "softmax", "log_softmax"))
        if op in FLOAT_ONLY:
            x = self.as_float(x)
        if op in ("softmax", "log_softmax"):
            if not shape:
                return self.add("exp", (x,))
            return self.add(op, (x,), axis=int(self.rng.integers(-len(shape), len(shape))))
        axis = None if not shape or self.rng.random() < 0.3 else int(self.rng.integers(len(shape)))
        if op == "max" and 0 in (shape if axis is None else (shape[axis],)):
            op = "sum"   # max over nothing is an error in NumPy and torch (no identity)
        return self.add(op, (x,), axis=axis, keepdims=self.chance(0.4))

    def statistics(self, x: int, shape) -> int:
        """var or std along an axis or all, with a correction of 0, 1 or 2, or one at least the count
        (N - correction <= 0: inf or NaN as torch gives). Two differences from torch that symgrad
        keeps (symgrad/api/statistics.py says why; open in issue 32's closing note) are not drawn:
        - a correction past the count with an axis: torch's gradient there divides by the negative
          N - correction (finite: [0.9, -0.9] for var([0.3, 1.2], 0, correction=3)), symgrad's by 0;
        - non-finite inputs: torch's gradient 2 g (x - mean) / (N - correction) leaves out the mean's
          path (0 in exact arithmetic), symgrad differentiates it: inf - inf, NaN where torch's is
          +-inf (of a value that is NaN); likewise under an infinite cotangent. So var and std are
          the graph's last step (its cotangent is finite), of a new input with finite values (an
          earlier value may hold a NaN: a pow of a negative base)."""
        x = self.new_input(shape if 0 not in shape and self.chance(0.5) else self.random_shape(), finite=True)
        shape = self.shapes[x]
        axis = None if not shape or self.chance(0.3) else int(self.rng.integers(len(shape)))
        count = int(np.prod(shape if axis is None else (shape[axis],), dtype=int))
        correction = self.choice((0, 1, 1, 2))
        if self.chance(0.25):
            correction = count + (self.choice((0, 1)) if axis is None else 0)
        elif axis is not None and correction > count:
            correction = count
        return self.add(self.choice(("var", "std")), (x,), axis=axis, correction=correction,
                        keepdims=self.chance(0.3))

    # ---- movement ----

    def movement(self, x: int, shape) -> int:
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
            return self.add("tanh", (self.as_float(x),))
        x = self.as_float(x)
        k = shape[-1]
        partners = [j for j, s in enumerate(self.shapes) if len(s) in (1, 2) and s[0] == k and self.dtypes[j] == FLOAT]
        if partners and self.rng.random() < 0.4:
            y = self.choice(partners)
        else:
            y = self.new_input((k,) if self.rng.random() < 0.25 else (k, self.choice(SIZES)))
        return self.add("matmul", (x, y))

    # ---- indexing ----

    def index(self, x: int, shape) -> int:
        op = self.choice(("index", "index", "index", "index", "take", "scatter_add", "concat", "split", "pad"))
        if op == "index" or not shape:
            return self.add("index", (x,), key=self.slice_key(shape))
        axis = int(self.rng.integers(len(shape)))
        n = shape[axis]
        if op == "take":
            if n == 0:
                return self.add("index", (x,), key=self.slice_key(shape))
            indices = tuple(int(i) for i in self.rng.integers(0, n, size=self.choice((1, 2, 3, 4, 0))))
            return self.add("take", (x,), axis=axis, indices=indices)
        if op == "scatter_add":
            size = self.choice((1, 2, 3, 5))
            return self.add("scatter_add", (self.as_float(x),), axis=axis, size=size,
                            indices=tuple(int(i) for i in self.rng.integers(0, size, size=n)))
        if op == "concat":
            parts = [x]
            for _ in range(self.choice((1, 1, 2))):
                other = list(shape)
                other[axis] = self.choice(SIZES)
                same = [k for k, s in enumerate(self.shapes) if len(s) == len(shape) and
                        all(a == b for d, (a, b) in enumerate(zip(s, other)) if d != axis)]
                parts.append(self.choice(same) if same and self.chance(0.4) else
                             self.new_input(other, self.dtypes[x] if self.chance(0.8) else self.input_dtype()))
            self.rng.shuffle(parts)
            return self.add("concat", tuple(parts), axis=axis - len(shape) if self.chance(0.3) else axis)
        if op == "split":
            if self.chance(0.5) or n == 0:
                sections = self.choice((1, 2, 3))
                count = max(1, math.ceil(n / sections))
            else:
                cuts = sorted(int(c) for c in self.rng.integers(0, n + 1, size=self.choice((1, 2))))
                sections = tuple(b - a for a, b in zip([0] + cuts, cuts + [n]))
                count = len(sections)
            pieces = sorted(int(i) for i in self.rng.choice(count, size=min(count, self.choice((1, 2, 2))),
                                                          replace=False))
            return self.add("split", (x,), sections=sections, axis=axis, pieces=tuple(pieces))
        # pad: (left, right) pairs for the last 1 to 3 axes; reflect needs pads below each size
        axes = int(self.rng.integers(1, min(len(shape), 3) + 1))
        mode = self.choice(("constant", "constant", "reflect", "replicate"))
        padding = tuple(int(p) for p in self.rng.integers(0, 3, size=2 * axes))
        value = self.choice((0.0, 1.5, -2.0)) if mode == "constant" else 0.0
        if mode != "constant":
            x = self.as_float(x)
        return self.add("pad", (x,), padding=padding, mode=mode, value=value)

    def slice_key(self, shape) -> tuple:
        """A key of one item per axis: the axis whole, a window touching its start or its end (the
        border an embed zeroes lies on one side only), one inside, a strided one, or an integer
        index; bounds written positive or negative or past the end, steps 1 (or None), 2 or 3;
        now and then an Ellipsis for the leading axes, or a None (a new axis)."""
        key = []
        for n in shape:
            kind = self.choice(("whole", "head", "tail", "tail", "inside", "strided", "index"))
            if kind == "index" and n > 0:
                key.append(int(self.rng.integers(-n, n)))
                continue
            cut = int(self.rng.integers(0, n + 1))
            step = self.choice((None, 1, 1)) if kind != "strided" else self.choice((2, 3))
            ends = {"start": self.choice((None, 0, -n - 2)) if n else None, "stop": self.choice((None, n, n + 2))}
            if kind == "head":
                key.append(slice(ends["start"], self._signed(cut, n), step))
            elif kind == "tail":
                key.append(slice(self._signed(cut, n), ends["stop"], step))
            elif kind in ("inside", "strided") and n > 0:
                lo, hi = sorted(int(i) for i in self.rng.integers(0, n + 1, size=2))
                key.append(slice(self._signed(lo, n), self._signed(hi, n), step))
            else:
                key.append(slice(ends["start"], ends["stop"], step))
        if key and self.chance(0.1):   # the leading axes whole, written as an Ellipsis
            key[:int(self.rng.integers(1, len(key) + 1))] = [Ellipsis]
        if self.chance(0.1):
            key.insert(int(self.rng.integers(len(key) + 1)), None)
        return tuple(key)

    def _signed(self, bound: int, n: int) -> int:
        """`bound`, or the same position counted from the end (negative) half the time."""
        return bound - n if self.chance(0.5) and bound < n else bound

    # ---- convolution, pooling, attention: one per graph ----

    def heavy(self, x: int, shape) -> int:
        self.has_heavy = True
        op = self.choice(("conv1d", "conv2d", "max_pool2d", "avg_pool2d", "attention"))
        draw = {"conv1d": self._conv, "conv2d": self._conv, "max_pool2d": self._pool, "avg_pool2d": self._pool,
                "attention": self._attention}[op]
        return draw(x, shape, op)

    def _spatial_input(self, x: int, shape, ndim: int, channels_from=(1, 2, 3, 4)) -> int:
        """x when it has `ndim` axes of at least 1, else a new float input of that rank."""
        if len(shape) == ndim and 0 not in shape and self.chance(0.7):
            return self.as_float(x)
        sizes = (1, 2, 3) if ndim == 4 else (1, 2)
        spatial = (3, 4, 5, 6, 7, 9) if ndim == 3 else (2, 3, 4, 5, 6)
        return self.new_input((self.choice(sizes), self.choice(channels_from),
                               *(self.choice(spatial) for _ in range(ndim - 2))))

    def _conv(self, x: int, shape, op: str) -> int:
        ndim = 3 if op == "conv1d" else 4
        x = self._spatial_input(x, shape, ndim, channels_from=(1, 2, 3, 4, 6))
        channels, spatial = self.shapes[x][1], self.shapes[x][2:]
        groups = self.choice([g for g in (1, 1, 2, 3) if channels % g == 0])
        out_channels = groups * self.choice((1, 2))
        kernel = tuple(self.choice((1, 2, 3)) for _ in spatial)
        attrs = {"stride": self.choice((1, 1, 2, 3)), "dilation": self.choice((1, 1, 2)), "groups": groups}
        attrs["padding"] = self.choice((0, 0, 1, 2, "same", "valid")) if attrs["stride"] == 1 else self.choice((0, 1, 2))
        if ndim == 4 and self.chance(0.3):
            attrs["stride"] = (attrs["stride"], self.choice((1, 2)))
            if attrs["padding"] == "same":
                attrs["padding"] = 1
        w = self.new_input((out_channels, channels // groups, *kernel))
        args = (x, w) + ((self.new_input((out_channels,)),) if self.chance(0.5) else ())
        return self.add(op, args, **attrs)

    def _pool(self, x: int, shape, op: str) -> int:
        # (N, C, H, W): symgrad refuses torch's unbatched (C, H, W) pooling
        x = self._spatial_input(x, shape, 4)
        kernel = self.choice((1, 2, 3, (2, 3)))
        attrs = {"kernel_size": kernel, "stride": self.choice((None, 1, 2)), "ceil_mode": self.chance(0.3),
                 "padding": self.choice((0, 0, 1)) if min(np.atleast_1d(kernel)) >= 2 else 0}
        if op == "max_pool2d":
            attrs["dilation"] = self.choice((1, 1, 2))
        else:
            attrs["count_include_pad"] = self.chance(0.5)
        sizes = np.array(self.shapes[x][2:]) + 2 * attrs["padding"]
        if np.any(np.broadcast_to(kernel, 2) * attrs.get("dilation", 1) - attrs.get("dilation", 1) + 1 > sizes):
            # torch takes a window larger than the padded input (ceil mode clips it); symgrad refuses
            raise Refused(f"{op}: window {kernel} past the input {self.shapes[x]}")
        return self.add(op, (x,), **attrs)

    def _attention(self, x: int, shape, op: str) -> int:
        """q [.., L, E], k [.., S, E], v [.., S, Ev]: of one shape (symgrad's fused op) or not, causal
        or not, now and then a boolean mask (an input of bool dtype) or a scale.

        Differences from torch at non-finite inputs, open in issue 32's closing note, are not
        drawn: q, k and v are finite inputs. torch adds
        -inf to the masked scores, so a NaN score there (0 * inf, or a NaN) makes its row NaN, and
        its backward multiplies the masked weights (0) by g v^T (0 * inf: NaN), where symgrad leaves
        masked positions out; so masked attention is the graph's last step (a finite cotangent).
        A row of scores that are all -inf (infinite q or k) gets weights 0 in
        torch's safe softmax, NaN in symgrad's fused op, and a NaN gradient in torch where v is
        infinite (0 * inf again), 0 in symgrad's general path. And the fused op's backward takes
        rowsum(dP * P) as rowsum(dO * O) (FlashAttention's identity): equal in real arithmetic, not
        where v is infinite (inf where torch's is inf - inf = NaN)."""
        lead = self.choice(((), (2,), (1, 2), (2, 3)))
        length, source, width = self.choice((1, 2, 3, 5)), self.choice((1, 2, 4)), self.choice((1, 2, 3, 4))
        same = self.chance(0.5)
        if same:
            source = length
        attrs = {"causal": self.last and self.chance(0.5)}
        masked = attrs["causal"] or (self.last and self.mixed and self.chance(0.3))
        q_shape = (*lead, length, width)
        q = self.as_float(x) if tuple(shape) == q_shape and not self.specials and self.chance(0.7) \
            else self.new_input(q_shape, finite=True)
        k = self.new_input((*lead, source, width), finite=True)
        v = self.new_input((*lead, source, width if same else self.choice((1, 2, 3))), finite=True) \
            if self.chance(0.7) else k
        if not same and self.chance(0.3):
            attrs["scale"] = self.choice((0.5, 2.0))
        args = (q, k, v)
        if masked and not attrs["causal"]:
            args += (self.new_input((length, source), "bool"),)
        return self.add("attention", args, **attrs)

    # ---- mixed dtypes: comparisons, where, casts ----

    def dtype(self, x: int, shape) -> int:
        op = self.choice(("compare", "where", "where", "to_float"))
        if op == "to_float":
            return self.add("to_float", (x,))
        if op == "compare" or self.dtypes[x] != "bool":
            cond = self.add(self.choice(sorted(COMPARE)), (x, self.operand(shape)))
            if op == "compare":
                return cond
        else:
            cond = x
        a = self.operand(self.shapes[cond])
        b = self.operand(self.shapes[cond])
        return self.add("where", (cond, a, b))


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


def _torch_probe(step: Step, shapes, dtypes) -> torch.Tensor:
    """torch's result of `step` on ones of its operands' shapes and dtypes: its shape and dtype,
    or torch's refusal (which meta tensors do not always raise: int64 @ float64)."""
    args = [torch.ones(s, dtype=TORCH_DTYPES[d]) for s, d in zip(shapes, dtypes)]
    return OPS[step.op].torch(*args, **step.kw)


def _int_bound(step: Step, bounds, shapes) -> float:
    """The largest magnitude the step's integer result can hold, from its operands' bounds."""
    if not bounds:
        return 1.0
    if step.op in ("mul", "matmul"):
        return math.prod(bounds) * (shapes[0][-1] if step.op == "matmul" and shapes[0] else 1)
    if step.op in ("add", "sub", "concat", "where", "maximum", "minimum", "where_greater"):
        return float(sum(bounds))
    if step.op in ("add_scalar", "rsub_scalar", "mul_scalar"):
        return bounds[0] * 3 + 3
    if step.op in ("sum", "scatter_add"):
        return bounds[0] * max(1, int(np.prod(shapes[0], dtype=int)))
    return max(bounds)


def draw_graph(rng: np.random.Generator) -> FuzzGraph:
    """One random graph of 1 to 6 ops over 1 to 3 inputs (more for a convolution or an attention);
    half of them get special input values, one in four big sizes, one in three mixed dtypes."""
    specials, big, mixed = rng.random() < 0.5, rng.random() < 1 / 4, rng.random() < 1 / 3
    cotangent = ("random", "random", "random", "sum", "mean")[int(rng.integers(5))]
    drawer = _Drawer(rng, specials=bool(specials), big=bool(big), mixed=bool(mixed))
    x = drawer.new_input(drawer.random_shape(), drawer.input_dtype())
    sliced = big and rng.random() < 0.5
    if sliced:
        # Big graphs are there for what constant folding hides in small ones: a slice's gradient
        # (an embed: zeros around a window) of a constant cotangent reaches the lowering only here,
        # and only where the ops after the slice pass the constant on (none, a sum, a reshape):
        # so these graphs seed their gradient with a constant twice in three, and stay short.
        drawer.add("index", (x,), key=drawer.slice_key(drawer.shapes[x]))
        cotangent = ("random", "sum", "mean")[int(rng.integers(3))]
    steps = int(rng.integers(0, 4)) if sliced else int(rng.integers(1, 7))
    for k in range(steps):
        drawer.last = k == steps - 1
        drawer.step()
    return FuzzGraph(tuple(drawer.steps), specials=drawer.specials, cotangent=cotangent)


def draw_graphs(seed: int, count: int) -> list[FuzzGraph]:
    """`count` graphs from one seed: the same seed gives the same graphs."""
    rng = np.random.default_rng(seed)
    return [draw_graph(rng) for _ in range(count)]


def draw_values(graph: FuzzGraph, rng: np.random.Generator) -> list[np.ndarray]:
    """Arrays for the graph's inputs: floats with, for a graph with specials, about a quarter of
    the elements special; integers in [-4, 4]; booleans."""
    arrays = []
    for k in graph.input_steps:
        shape, dtype = graph.steps[k].kw["shape"], graph.steps[k].kw.get("dtype", FLOAT)
        if dtype == "bool":
            arrays.append(np.asarray(rng.random(shape) < 0.5))
            continue
        if dtype != FLOAT:
            arrays.append(np.asarray(rng.integers(-4, 5, size=shape), dtype=dtype))
            continue
        a = rng.standard_normal(shape) * rng.choice([1.0, 1e-3, 30.0])
        if graph.specials and not graph.steps[k].kw.get("finite"):
            mask = rng.random(shape) < 0.25
            a = np.where(mask, rng.choice(SPECIALS, size=shape), a)
        arrays.append(np.asarray(a, dtype=np.float64))
    return arrays


# --------------------------------------------------------------------------
# Building the drawn graph


def build(graph: FuzzGraph, builders: int, inputs: list, nudge: Callable | None = None) -> object:
    """The graph's last value, built from `inputs` (one per input step) with side `builders`
    (0: symgrad, 1: torch). `nudge(k, step, args, value)`, torch only, replaces each computed value,
    and `nudge.use(arg)` each argument of a step (to move the gradient each use contributes)."""
    values = []
    given = iter(inputs)
    for k, step in enumerate(graph.steps):
        if step.op == "input":
            values.append(next(given))
            continue
        args = [values[a] for a in step.args]
        if nudge:
            args = [nudge.use(a) for a in args]
        fn = OPS[step.op].torch if builders else OPS[step.op].sg
        value = fn(*args, **step.kw)
        if builders and isinstance(value, torch.Tensor) and value.numel() == 0:
            # An empty tensor holds no value, so nothing after it depends on what came before it:
            # the gradient through it is exactly 0. torch still chains a zero cotangent back through
            # the ops before it, and 0 times an infinite local derivative is NaN (pow(v, take(sum(
            # v / pow(v, w)), ())) at v = 0); symgrad's is 0, the true one.
            value = value.detach()
        values.append(nudge(k, step, args, value) if nudge else value)
    return values[-1]


def input_specs(graph: FuzzGraph) -> list[tuple]:
    """(shape, dtype) of each input."""
    return [(graph.steps[k].kw["shape"], graph.steps[k].kw.get("dtype", FLOAT)) for k in graph.input_steps]


# --------------------------------------------------------------------------
# One rounding error per step (the torch side, for ill-conditioned comparisons)

TINY = {torch.float64: 5e-324, torch.float32: 1e-45}


def rounding_error(step: Step, args: list, value: torch.Tensor) -> torch.Tensor | None:
    """The size of one rounding error of `step`'s result, elementwise (None: it is computed exactly).

    An elementwise op rounds once (one ulp; "underflow": and a 0 may be a subnormal flushed to 0, as
    torch's vectorised exp does for exp(-745)). A sum of products errs by eps times the op of its
    operands' magnitudes (|x| @ |w|: a result that cancels to ~0 is a rounding of the large terms).
    log_softmax errs by eps times its largest input (x - max - log(sum), the terms of size |x|), GELU
    by eps times |x| (x (1 + erf(x / sqrt 2)) / 2 cancels for negative x: gelu(-28) is 0, not -3e-172);
    softmax by eps times |x - max| relatively (exp of a shifted argument); var by twice eps times the
    mean square, std by the square root of var's error where it is near 0; attention by eps times the
    largest |v| times the largest |score|."""
    kind = OPS[step.op].rounding
    v = value.detach()
    if kind == "exact" or not v.is_floating_point() or v.numel() == 0:
        return None
    if step.op in ("mul_scalar", "div_scalar") and abs(step.kw["c"]) == 1:
        # A product or quotient by +-1 is exact, and moving it by an ulp could undo its operand's
        # move: softplus(-745), 0 in torch's vectorised exp, moved up to 5e-324, was negated and
        # moved back up to 0, so no run gave pow(-5e-324, 1e-8) = NaN, the value symgrad and torch's
        # own scalar path compute (seed 53, 4,000 graphs, batch 12).
        return None
    eps = torch.finfo(v.dtype).eps
    with torch.no_grad():
        if kind in ("round", "underflow"):
            ulp = (torch.nextafter(v.abs(), torch.tensor(math.inf, dtype=v.dtype)) - v.abs())
            return torch.where(v == 0, TINY[v.dtype] if kind == "underflow" else 0.0, ulp)
        absolute = [a.detach().abs() if a.is_floating_point() else a for a in args]
        if kind == "sum":
            return eps * OPS[step.op].torch(*absolute, **step.kw).to(v.dtype)
        x = args[0].detach()
        if kind == "gelu":   # x * (1 + erf(x / sqrt 2)) / 2: the sum cancels for x < 0 (0 below x = -8.4)
            return eps * (v.abs() + x.abs())
        if kind == "softmax":   # and a 0 may be a subnormal flushed (exp(x - max - log(sum)) or exp(x - max) / sum)
            shifted = x - torch.amax(torch.where(x.isnan(), -math.inf, x), dim=step.kw["axis"], keepdim=True)
            return torch.where(v == 0, TINY[v.dtype], eps * v.abs() * (1 + shifted.abs()))
        if kind == "log_softmax":
            return eps * (v.abs() + torch.amax(x.abs(), dim=step.kw["axis"], keepdim=True))
        if kind in ("var", "std"):
            kw = {**step.kw, "correction": 0}
            square = _torch_var(absolute[0], **kw) + _torch_reduce(torch.mean, absolute[0], kw["axis"],
                                                                   kw["keepdims"]) ** 2
            error = 2 * eps * square   # the mean's error, doubled by the square
            return error if kind == "var" else torch.minimum(error.sqrt(), error / (2 * v.abs()))
        if kind == "attention":
            q, k, vv = absolute[:3]
            score = q.amax() * k.amax() * q.shape[-1] * (step.kw.get("scale") or 1 / math.sqrt(q.shape[-1]))
            return eps * vv.amax() * (1 + score) * torch.ones_like(v)
    raise ValueError(f"no rounding error for {step.op} ({kind})")


LIFT_SUBNORMALS = -1   # the nudge pattern that lifts subnormal values to the smallest normal one
# The nudge patterns that move only the backward's roundings (softmax's and log_softmax's own, and
# each gradient contribution's), up or down, the forward values left as torch computed them.
BACKWARD_UP, BACKWARD_DOWN = -2, -3
# The nudge patterns that move neighbouring elements opposite ways (+ - + - along the flat index, and
# - + - +): two equal values computed in different orders (an average pool's windows over the same
# elements, the padding at either end) differ by a few roundings, which a function steep in them
# magnifies; random signs move such a pair alike in one pattern of two.
ALTERNATING_UP, ALTERNATING_DOWN = -4, -5
# The nudge pattern that lifts only the zeros an op may have flushed (an "underflow" op's 0, as
# torch.log1p(5e-324) is) to the smallest subnormal, every other value left as torch computed it:
# moving the ops before it too moves that op's operand off the value it flushed (exp(-744.44) is
# 5e-324; one rounding up it is 1e-323, whose log1p torch gets right).
FLUSHED_ZEROS_LIFTED = -6


class _FromOutput(torch.autograd.Function):
    """softmax's or log_softmax's moved output y, with torch's backward computed from y itself: the
    ops' own backward reads the output they saved, which the move does not reach (a weight 0, the
    flushed 1.2e-324 of exp(-745)/4, times an infinite g - sum(g y) is NaN; at 5e-324 it is inf).

    The backward's result is moved by its own rounding error too (`sign` of eps times the terms
    that cancel): g - p sum(g) cancels to a small number where p is nearly 1 and g is huge (the
    gradient of log(log_softmax(x)) at a dominant x), and another order of the same formula (p as
    exp(x - max) / sum, the product before the division) rounds it a few ulps of g apart."""

    @staticmethod
    def forward(ctx, x, y, kind, axis, up, sign):
        ctx.save_for_backward(y)
        ctx.kind, ctx.axis, ctx.up, ctx.sign = kind, axis, up, sign
        return y.clone()

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        eps = torch.finfo(g.dtype).eps
        if ctx.kind == "softmax":
            total = (g * y).sum(ctx.axis, keepdim=True)
            grad, error = y * (g - total), eps * y.abs() * (g.abs() + total.abs())
        else:
            p = torch.exp(y)   # log_softmax's weights: moved up, one that underflowed is the smallest subnormal
            if ctx.up:
                p = torch.where((p == 0) & (y > -math.inf), TINY[p.dtype], p)
            total = g.sum(ctx.axis, keepdim=True)
            grad, error = g - p * total, eps * (g.abs() + (p * total).abs())
        move = torch.where(torch.isfinite(grad) & torch.isfinite(error), ctx.sign(tuple(grad.shape)).to(g.dtype) * error, 0.0)
        return grad + move, None, None, None, None, None


def _attention_moved_backward(args: list, kw: dict, value: torch.Tensor, up: bool, sign: Callable) -> torch.Tensor:
    """attention's value as torch computed it, its gradient taken through softmax(q k^T * scale + mask) v
    in plain ops, with the softmax's backward moved by its own rounding error (_FromOutput). The
    softmax's backward inside attention cancels as softmax's does: g - sum(g p) is a small difference
    of huge terms where one weight is nearly 1 and dO is huge (the gradient of exp(attention(q, k, v))
    at scores of 60: dP of 6e29, whose one ulp times k moves dq by 1.7%), and torch's math backend
    and symgrad's fused op round it in different orders. Where the plain ops' forward is not finite
    where torch's is (a row whose scores are all masked: 0 in torch's safe softmax), the value is
    left as it is."""
    q, k, v = args[:3]
    mask = args[3] if len(args) > 3 else None
    scale = kw.get("scale") or 1 / math.sqrt(q.shape[-1])
    scores = (q @ k.transpose(-2, -1)) * scale
    length, source = scores.shape[-2:]
    if kw.get("causal"):
        mask = torch.ones(length, source, dtype=torch.bool).tril()
    if mask is not None:
        scores = scores.masked_fill(~torch.as_tensor(mask), -math.inf)
    weights = torch.softmax(scores, dim=-1)
    plain = _FromOutput.apply(scores, weights.detach(), "softmax", -1, up, sign) @ v
    if not torch.equal(torch.isfinite(plain.detach()), torch.isfinite(value.detach())):
        return value
    return value.detach() + (plain - plain.detach())


# torch's GELU constants (ATen's GeluBackward, approximate="tanh"): beta = sqrt(2 / pi), kappa.
GELU_BETA, GELU_KAPPA = math.sqrt(2 / math.pi), 0.044715


class _GeluTanhMovedTanh(torch.autograd.Function):
    """gelu_tanh's value, with torch's own backward formula computed here, its tanh moved by one
    rounding error (`sign` of an ulp, kept within [-1, 1], where tanh lies). torch's backward
    computes tanh(u), u = beta (x + kappa x^3), itself, and the derivative
    (1 + t) / 2 + x (1 - t^2) beta (1 + 3 kappa x^2) / 2 cancels where t is within a rounding of -1:
    at x = -7.16 it is -4.9e-15 with t = -1 + 1.1e-16 (torch's scalar path) and 0 with t = -1 (its
    vectorised path, on 16 elements or more), and times an infinite gradient +inf or NaN. Moving the
    forward's values does not reach that tanh."""

    @staticmethod
    def forward(ctx, x, y, sign):
        ctx.save_for_backward(x)
        ctx.sign = sign
        return y.clone()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        t = torch.tanh(GELU_BETA * (x + GELU_KAPPA * x * x * x))
        ulp = torch.nextafter(t.abs(), torch.tensor(math.inf, dtype=t.dtype)) - t.abs()
        t = (t + ctx.sign(tuple(t.shape)).to(t.dtype) * ulp).clamp(-1.0, 1.0)
        left = 0.5 * (1 + t)
        right = 0.5 * x * (1 - t * t) * GELU_BETA * (1 + 3 * GELU_KAPPA * x * x)
        return g * (left + right), None, None


class _OnGradient(torch.autograd.Function):
    """The identity, whose backward passes `on(g)` for the gradient g it receives. Put on one use
    of a value, it sees (or moves) that use's contribution to the value's gradient, before autograd
    sums the contributions."""

    @staticmethod
    def forward(ctx, x, on):
        ctx.on = on
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.on(g), None


class _OtherZero(torch.autograd.Function):
    """maximum's or minimum's value with the other operand's zero where they tie at +0 and -0 (a
    constant's sign flipped: the gradient passes unchanged). torch itself returns either:
    torch.maximum(+0., -0.) is +0 on a tensor of fewer than 8 elements and -0 on 8 or more (its
    vectorised path returns the second operand of a tie, its scalar path the first), and
    pow(that, -1) is +inf or -inf."""

    @staticmethod
    def forward(ctx, value, tie):
        return torch.where(tie, -value, value)

    @staticmethod
    def backward(ctx, g):
        return g, None


def _other_zero_at_ties(step: Step, args: list, value: torch.Tensor) -> torch.Tensor:
    """`value` (maximum's or minimum's) with the other zero where its operands tie at +0 and -0."""
    if step.op not in ("maximum", "minimum") or not value.is_floating_point():
        return value
    a, b = (torch.broadcast_to(torch.as_tensor(x).detach().to(value.dtype), value.shape) for x in args)
    tie = (a == 0) & (b == 0) & (torch.signbit(a) != torch.signbit(b))
    return _OtherZero.apply(value, tie) if tie.any() else value


def _moved_by_one_rounding(g: torch.Tensor, sign: Callable) -> torch.Tensor:
    """g moved by one rounding error (`sign` of its ulp). Moving each contribution to a value's
    gradient so, a gradient that cancels to 0 in exact arithmetic (x - concat(x, x) summed over the
    broadcast) is the rounding noise it is in any order of summation, not torch's one order's
    noise; times an infinite weight, that noise's sign picks +inf, -inf or NaN."""
    ulp = torch.nextafter(g.abs(), torch.tensor(math.inf, dtype=g.dtype)) - g.abs()
    return g + torch.where(torch.isfinite(g) & (g != 0), sign(tuple(g.shape)).to(g.dtype) * ulp, 0.0)


def nudge_pattern(graph: FuzzGraph, pattern: int) -> Callable:
    """A `nudge` for `build`: each computed float value moved by its rounding error, all up
    (pattern 0), all down (1), or each element either way at random (2 and on, seeded by the
    pattern; ALTERNATING_UP and ALTERNATING_DOWN: neighbours opposite ways along the flat index),
    and maximum's and minimum's ties of +0 and -0 given the other zero (_OtherZero).
    Values stay differentiable (the move is a constant), so the backward reads them.

    FLUSHED_ZEROS_LIFTED moves only the zeros of the "underflow" ops, up to the smallest subnormal.

    LIFT_SUBNORMALS instead moves every subnormal value (0 < |v| < 2.2e-308: softmax's weight
    exp(-710) is 4.5e-309) to the smallest normal one of its sign. A subnormal divisor makes the
    result depend on the order of a formula's operations at overflow: torch's gradient of y/y in
    y forms (y / y) / y = 1/4.5e-309 = inf before multiplying by g, symgrad's g * (y/y) / y does
    not (exactly 0, the true value); neither run is wrong by more than float arithmetic allows.

    BACKWARD_UP and BACKWARD_DOWN move only the backward's roundings. Moving the forward can hide
    the backward's: log_softmax of a dominant element is -4.2e-16, and its rounding error (eps
    times the largest input, 8e-15) moved it to -8.5e-15; the gradient of log of it, 1 / y, is
    then 20x smaller, and so is the cancellation in log_softmax's backward (g - p sum(g), one ulp
    of g), which at the value torch computed moves the result by 0.5. They also move the tanh that
    gelu_tanh's backward computes for itself (_GeluTanhMovedTanh) and the softmax inside attention's
    backward (_attention_moved_backward)."""
    rng = np.random.default_rng(abs(pattern))
    direction = {0: 1.0, 1: -1.0, BACKWARD_UP: 1.0, BACKWARD_DOWN: -1.0}.get(pattern)  # None: random
    alternating = {ALTERNATING_UP: 1.0, ALTERNATING_DOWN: -1.0}.get(pattern)

    def nudge(k, step, args, value):
        if pattern == LIFT_SUBNORMALS:
            if not value.is_floating_point():
                return value
            v = value.detach()
            normal = torch.finfo(v.dtype).tiny
            lifted = torch.where((v != 0) & (v.abs() < normal), torch.sign(v) * normal - v, 0.0)
            return value + lifted.to(value.dtype)
        if pattern == FLUSHED_ZEROS_LIFTED:
            if OPS[step.op].rounding != "underflow" or not value.is_floating_point():
                return value
            v = value.detach()
            return value + torch.where(v == 0, torch.full_like(v, TINY[v.dtype]), torch.zeros_like(v))
        if pattern in (BACKWARD_UP, BACKWARD_DOWN):
            if step.op in ("softmax", "log_softmax") and value.requires_grad:
                return _FromOutput.apply(args[0], value.detach(), step.op, step.kw["axis"], pattern == BACKWARD_UP,
                                         signs)
            if step.op == "gelu_tanh" and value.requires_grad:
                return _GeluTanhMovedTanh.apply(args[0], value.detach(), signs)
            if step.op == "attention" and value.requires_grad:
                return _attention_moved_backward(args, step.kw, value, pattern == BACKWARD_UP, signs)
            return value
        value = _other_zero_at_ties(step, args, value)
        error = rounding_error(step, args, value)
        if error is None:
            return value
        if direction is not None:
            sign = direction
        else:
            sign = signs(tuple(value.shape)).to(value.dtype)
        move = torch.where(torch.isfinite(value.detach()) & torch.isfinite(error), sign * error, 0.0)
        if step.op in ("softmax", "log_softmax") and value.requires_grad:
            return _FromOutput.apply(args[0], (value + move).detach(), step.op, step.kw["axis"], pattern == 0, signs)
        return value + move.to(value.dtype)

    def signs(shape):
        """One rounding's direction per element: all up, all down, alternating, or random (the
        pattern's)."""
        if direction is not None:
            return torch.full(shape, direction, dtype=torch.float64)
        if alternating is not None:
            flat = alternating * (1.0 - 2.0 * (np.arange(int(np.prod(shape, dtype=np.int64))) % 2))
            return torch.from_numpy(flat.reshape(shape))
        return torch.from_numpy(rng.choice([-1.0, 1.0], size=shape))

    def use(arg):
        if pattern == LIFT_SUBNORMALS or not (torch.is_tensor(arg) and arg.requires_grad):
            return arg
        return _OnGradient.apply(arg, lambda g: _moved_by_one_rounding(g, signs))

    nudge.use = use
    return nudge


# --------------------------------------------------------------------------
# Leaving float64's range (the torch side, for results no rounding explains)


def leaves_range(graph: FuzzGraph, inputs: list) -> bool:
    """Whether torch's float64 forward or backward of `graph` leaves the range of the type: a step
    whose result, or whose gradient contribution to an operand, is infinite or NaN at an element
    where the step's float operands are finite and nonzero and (for the contribution) the gradient
    it receives is finite. Such an element overflowed: its exact value is finite, and a result that
    depends on it may be finite too, formed by another formula that stays in range (symgrad's
    composed derivative of v / (v * v) at v = 1e-146 is -1 / v^2, finite; torch's division backward
    forms v / (v * v)^2 = 1e438 first). Zero and infinite operands are poles, not overflow (1 / 0,
    the derivative of sqrt at 0). Steps whose operands do not broadcast to the element (matmul,
    reductions) are not looked at."""
    events = []
    pending: list = []      # the watched uses of the step being built, until `nudge` names the step
    received: dict = {}     # step -> the gradient its result received

    def in_range(args, shape):
        """Elementwise over `shape`: every float operand finite and nonzero (None: no broadcast)."""
        ok = torch.ones(shape, dtype=torch.bool)
        for a in args:
            if torch.is_tensor(a) and a.is_floating_point():
                try:
                    a = torch.broadcast_to(a.detach(), shape)
                except RuntimeError:
                    return None
                ok &= torch.isfinite(a) & (a != 0)
        return ok

    def nudge(k, step, args, value):
        if not (torch.is_tensor(value) and value.is_floating_point()):
            pending.clear()
            return value
        ok = in_range(args, value.shape)
        if ok is not None and (ok & ~torch.isfinite(value.detach())).any():
            events.append(("forward", k))
        for seen in pending:
            seen.step, seen.args = k, args
        pending.clear()
        if value.requires_grad:
            value.register_hook(lambda g, k=k: received.__setitem__(k, g))
        return value

    def use(arg):
        if not (torch.is_tensor(arg) and arg.requires_grad):
            return arg

        def seen(g):
            given = received.get(getattr(seen, "step", None))
            if given is not None and torch.isfinite(given).all():
                ok = in_range(seen.args, g.shape)
                if ok is not None and (ok & ~torch.isfinite(g)).any():
                    events.append(("backward", seen.step))
            return g
        pending.append(seen)
        return _OnGradient.apply(arg, seen)

    nudge.use = use
    xs = [torch.tensor(a, requires_grad=a.dtype == np.float64) for a in inputs[:len(graph.input_steps)]]
    out = build(graph, 1, xs, nudge)
    if out.requires_grad:
        cot = torch.from_numpy(inputs[-1]) if graph.cotangent == "random" else torch.ones_like(out)
        floats = [x for x in xs if x.requires_grad]
        torch.autograd.grad((out * cot).sum(), floats, allow_unused=True)
    return bool(events)
