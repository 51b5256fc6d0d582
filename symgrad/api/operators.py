"""The functions graph code is built with: what a Value's operators and torch-named methods call
(`x + y`, `x[1:]`, `x // 2`, `x.var()`), and what the ops' VJP rules are written in.

symgrad.ir.value holds the operators but not the functions (the IR sits below the API): this
module gathers them, symgrad.api.functional's and those of the API modules built on it, and hands
itself down once, as `symgrad` is imported (`provide_functions`), as JAX binds its Tracer's
operators from jax.numpy. It sits above every API module it gathers, so none of them imports
another from above.
"""

from __future__ import annotations

import sys

from . import functional as _functional
from ..ir.value import provide_functions

# symgrad.api.functional's functions, those outside its __all__ too (the VJP rules build with make_slice, take, ...).
globals().update({name: value for name, value in vars(_functional).items() if not name.startswith("_")})

# x[...] (Value.__getitem__) dispatches here; symgrad.api.indexing builds on symgrad.api.functional.
from .indexing import chunk, getitem, narrow, split  # noqa: E402
# a // b, a % b, a & b, ... and their Value methods; symgrad.api.integer builds on symgrad.api.functional.
from .integer import (bitwise_and, bitwise_left_shift, bitwise_not, bitwise_or, bitwise_right_shift, bitwise_xor,
                      floor_divide, fmod, remainder)
from .integer import div as divide  # noqa: E402  (torch.divide: div with rounding_mode; `div` is a / b)
from .losses import cross_entropy, mse_loss, nll_loss  # noqa: E402
# What Value's other torch-named methods forward to.
from .indices import permute, swapaxes, tril, triu  # noqa: E402
from .pointwise import ceil, clip, erf, floor, log1p, masked_fill, round, sign, trunc  # noqa: E402
from .pooling import flatten  # noqa: E402
from .statistics import logsumexp, prod, std, var  # noqa: E402

provide_functions(sys.modules[__name__])
