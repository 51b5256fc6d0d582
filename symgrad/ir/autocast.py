"""Mixed precision: torch's CPU autocast policy as a rule over the ops a graph is built from.

    with sg.autocast("bfloat16"):        # every node made inside follows the policy
        loss = model(x, y)
    autocast_graph(outputs, "bfloat16")  # the same policy applied to a graph already built
                                         # (sg.train_step(..., autocast="bfloat16"); symgrad.ir.autocast_graph)

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


def check_dtype(dtype) -> str:
    name = D.canonical(dtype) if dtype is not None else None
    if name not in D.HALF_DTYPES:
        raise ValueError(f"autocast: dtype must be one of {', '.join(D.HALF_DTYPES)}, got {dtype!r}")
    return name


class autocast:
    """`with sg.autocast("bfloat16"):` builds the graph under torch's CPU autocast policy (see
    the module's docstring); `enabled=False` turns it off inside an outer one. Usable as a
    decorator too, as torch.autocast."""

    def __init__(self, dtype="bfloat16", enabled: bool = True):
        self.dtype = check_dtype(dtype) if enabled else None
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


def target_dtype(op_name: str, operand: str, dtype: str) -> str:
    """The dtype the policy for `dtype` gives an operand of dtype `operand` of an `op_name` node
    (`operand` itself where it casts nothing; symgrad.ir.value.policy_inputs makes the casts)."""
    if op_name in LOWER_PRECISION:
        return dtype if operand == "float32" or (D.is_half(operand) and operand != dtype) else operand  # float64 stays
    if op_name in FLOAT32:
        return "float32" if D.is_half(operand) else operand
    return operand


class disabled:
    """No autocast inside (autodiff builds backward graphs so)."""

    def __enter__(self):
        self._token = _ACTIVE.set(None)

    def __exit__(self, *exc):
        _ACTIVE.reset(self._token)
        return False
