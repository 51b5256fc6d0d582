"""Mixed precision: torch's CPU autocast policy as a rule over the ops a graph is built from.

    with sg.autocast("bfloat16"):        # every node made inside follows the policy
        loss = model(x, y)
    autocast_graph(outputs, "bfloat16")  # the same policy applied to a graph already built
                                         # (sg.train_step(..., autocast="bfloat16"))

The policy, per op kind (a graph holds primitives: a softmax, a LayerNorm or a loss is sums,
maxima and elementwise ops, so they are governed through their reductions):

- matmul (linear layers, convolutions' GEMMs) and fused attention: the dot-product ops of
  torch's lower-precision list. Their float32 operands are cast to the autocast dtype; the op
  accumulates in float32 and rounds its result to it (the reference and the C kernels compute
  16-bit ops in float32, dtypes.compute_type).
- sum and max over a 16-bit value: their operand is cast to float32, so a reduction and what
  is computed from it (softmax, log_softmax, LayerNorm's statistics, the losses' means) stay
  float32 by torch's type promotion. torch keeps a plain `x.sum()` of a bfloat16 tensor in
  bfloat16; here every reduction is float32 (issue 39's rule), which only adds precision.
- everything else computes in the dtype its operands promote to, as in torch: gelu of a
  bfloat16 matmul stays bfloat16, adding a float32 bias gives float32.

Parameters stay float32 (master weights) and the optimizer's update is float32: a parameter
used by several matmuls gets one cast node, which CSE shares, so it is cast once per step.
Backward graphs are built outside the policy (autodiff turns it off): their dtypes follow the
forward's, as torch's autograd does.
"""

from __future__ import annotations

import contextvars

from . import dtypes as D

# The dot-product ops that take 16-bit operands (torch's lower_precision_fp list, as symgrad
# spells those ops), and the reductions that run in float32.
LOWER_PRECISION = frozenset({"matmul", "attention"})
FLOAT32 = frozenset({"sum", "max"})

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("symgrad_autocast", default=None)


def _check_dtype(dtype) -> str:
    name = D.canonical(dtype) if dtype is not None else None
    if name not in D.HALF_DTYPES:
        raise ValueError(f"autocast: dtype must be one of {', '.join(D.HALF_DTYPES)}, got {dtype!r}")
    return name


class autocast:
    """`with sg.autocast("bfloat16"):` builds the graph under torch's CPU autocast policy (see
    the module's docstring); `enabled=False` turns it off inside an outer one. Usable as a
    decorator too, as torch.autocast."""

    def __init__(self, dtype="bfloat16", enabled: bool = True):
        self.dtype = _check_dtype(dtype) if enabled else None
        self._tokens: list = []

    def __enter__(self):
        self._tokens.append(_ACTIVE.set(self.dtype))
        return self

    def __exit__(self, *exc):
        _ACTIVE.reset(self._tokens.pop())
        return False

    def __call__(self, fn):
        import functools

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)
        return wrapped


def active() -> str | None:
    """The autocast dtype in force while nodes are made, or None."""
    return _ACTIVE.get()


def policy_inputs(op, inputs: tuple, dtype: str) -> tuple:
    """`inputs` of a node of `op` as the policy for `dtype` has them: cast where it says so."""
    from .registry import lookup
    from .value import Value

    if op.name in LOWER_PRECISION:
        target = lambda d: dtype if d == "float32" or (D.is_half(d) and d != dtype) else d  # float64 is left
    elif op.name in FLOAT32:
        target = lambda d: "float32" if D.is_half(d) else d
    else:
        return inputs
    cast = lookup("cast")
    out = []
    for x in inputs:
        want = target(x.dtype)
        if want == x.dtype:
            out.append(x)
        else:  # built directly: make() would apply the policy again
            shape, d = cast.infer((x,), {"dtype": want})
            out.append(Value(cast, (x,), {"dtype": want}, shape, d))
    return tuple(out)


def autocast_graph(outputs, dtype="bfloat16") -> list:
    """`outputs` (graph values) rebuilt under the policy for `dtype`: every node whose inputs
    the policy casts, or whose inputs changed, is made again over its new inputs (type
    promotion decides the rest). Values built under `sg.autocast` come back unchanged."""
    from .value import Value

    dtype = _check_dtype(dtype)
    mapping: dict[int, Value] = {}
    for node in _with_effects_first(list(outputs)):
        inputs = tuple(mapping[id(i)] for i in node.inputs)
        cast_inputs = policy_inputs(node.op, inputs, dtype)
        # A layer's updates (BatchNorm's running statistics) follow the rebuilt forward too.
        effects = tuple((target, mapping[id(new)]) for target, new in node.effects)
        if all(a is b for a, b in zip(cast_inputs, node.inputs)) and \
                all(a[1] is b[1] for a, b in zip(effects, node.effects)):
            mapping[id(node)] = node
        else:
            shape, d = node.op.infer(cast_inputs, node.attrs)
            mapping[id(node)] = Value(node.op, cast_inputs, node.attrs, shape, d, effects)
    return [mapping[id(v)] for v in outputs]


def _with_effects_first(roots: list) -> list:
    """The nodes `roots` compute, each after its inputs and after the new values of the updates
    attached to it (symgrad.effects), which a rebuilt node must carry rebuilt."""
    order, done, stack = [], set(), [(r, False) for r in reversed(roots)]
    while stack:
        node, expanded = stack.pop()
        if id(node) in done:
            continue
        if expanded:
            done.add(id(node))
            order.append(node)
            continue
        stack.append((node, True))
        for dep in (*node.inputs, *(new for _, new in node.effects)):
            if id(dep) not in done:
                stack.append((dep, False))
    return order


class disabled:
    """No autocast inside (autodiff builds backward graphs so)."""

    def __enter__(self):
        self._token = _ACTIVE.set(None)

    def __exit__(self, *exc):
        _ACTIVE.reset(self._token)
        return False
