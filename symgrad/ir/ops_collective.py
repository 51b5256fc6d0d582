"""Collectives: `all_reduce` (kind collective), a value summed over the processes of a step.

    all_reduce(x)        x summed, element by element, over every process running the step

In one process, or a program run without a communicator, it is x itself. Under
sg.distributed every rank runs the same program, so the ranks reach their
collectives in one order; the program hands each one to the caller's hook
(sg_context.collective in C, the interpreter's `collective`), which sums the
values over the ranks in place before the next kernel reads them. Its VJP is
all_reduce of the cotangent: each rank's output depends on every rank's input,
so x's gradient on a rank sums the cotangents of every rank (torch's
SyncBatchNorm backward, written once here for any graph).

A collective's value is never constant (constant folding leaves it alone: a
constant summed over N ranks is N times itself).
"""

from __future__ import annotations

import numpy as np

from . import dtypes as D
from .registry import COLLECTIVE, OpDef, register
from .value import make


def _all_reduce_infer(inputs, attrs):
    (x,) = inputs
    if not D.is_float(x.dtype):
        raise TypeError(f"all_reduce: expects a float value, got {x.type_str}")
    return x.shape, x.dtype


def _all_reduce_numpy(args, node, env):
    value = np.array(args[0], dtype=D.to_numpy(node.dtype), order="C")  # a copy the hook may overwrite
    hook = getattr(env, "collective", None)
    if hook is not None:
        hook(value.reshape(-1))
    return value


def _all_reduce_vjp(node, cotangent, wants):
    return (all_reduce(cotangent),)


def all_reduce(x):
    """x summed over the processes running the step (x itself in one process); differentiable."""
    return make(ALL_REDUCE_OP, (x,))


ALL_REDUCE_OP = register(OpDef("all_reduce", COLLECTIVE, _all_reduce_infer, _all_reduce_numpy, _all_reduce_vjp,
                               doc="the value summed over the processes of a data-parallel step"))
