"""Counter-based random numbers: Philox4x32-10 as an elementwise op, identical on every backend.

A counter-based generator is a pure function of (key, counter): no hidden
state advances from element to element, so any backend, on any number of
threads, computes the same bits for the same element. The op

    random_bits(seed, step, stream, index) -> int64 in [0, 2**32)

is word 0 of Philox4x32-10 (Salmon et al., SC'11; Random123's constants)
with key = (low, high 32 bits of seed) and counter = (low, high 32 bits of
index, low 32 bits of step, low 32 bits of stream). `index` is the element's
flat (row-major) position, `step` a counter the training step increments,
`stream` tells apart the random tensors drawn within one step.

The op is elementwise: its sympy expression is the function `random_bits`
applied to the four operands, which prints itself to C as a call of
`sg_random_bits` (templates/program/random.h.j2) and evaluates in NumPy through
`philox_bits`. It has no derivative.
"""

from __future__ import annotations

import itertools

import numpy as np
import sympy

from . import effects
from . import functional as F
from ..ir import shapes as S
from ..ir.elementwise import ARGS, define
from ..ir.registry import lookup
from ..ir.value import Value, make
from .sources import variable

# Philox4x32 multipliers and Weyl key increments (Random123, philox.h).
PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)
PHILOX_ROUNDS = 10
_MASK32 = np.uint64(0xFFFFFFFF)


def philox4x32(counter, key, rounds: int = PHILOX_ROUNDS) -> tuple:
    """Philox4x32-`rounds` of four counter words and two key words (uint32 values, any shapes).

    Vectorised over NumPy arrays; returns the four output words as uint64
    arrays holding 32-bit values. Checked against Random123's known answers.
    """
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & _MASK32 for c in counter)
    k0, k1 = (np.asarray(k, dtype=np.uint64) & _MASK32 for k in key)
    m0, m1 = np.uint64(PHILOX_M[0]), np.uint64(PHILOX_M[1])
    w0, w1 = np.uint64(PHILOX_W[0]), np.uint64(PHILOX_W[1])
    shift = np.uint64(32)
    for _ in range(rounds):
        # A 32x32 -> 64-bit product never overflows uint64.
        p0, p1 = m0 * c0, m1 * c2
        c0, c1, c2, c3 = (p1 >> shift) ^ c1 ^ k0, p1 & _MASK32, (p0 >> shift) ^ c3 ^ k1, p0 & _MASK32
        k0, k1 = (k0 + w0) & _MASK32, (k1 + w1) & _MASK32
    return c0, c1, c2, c3


def philox_bits(seed, step, stream, index) -> np.ndarray:
    """The NumPy reference of the `random_bits` op (int64 arrays in, int64 in [0, 2**32) out)."""
    # int64 -> uint64 keeps the bit pattern (two's complement), as C's cast does.
    seed_u, step_u, stream_u, index_u = np.broadcast_arrays(
        *(np.asarray(a, dtype=np.int64).astype(np.uint64) for a in (seed, step, stream, index)))
    shift = np.uint64(32)
    out = philox4x32((index_u, index_u >> shift, step_u, stream_u), (seed_u, seed_u >> shift))[0]
    return out.astype(np.int64)


class random_bits(sympy.Function):  # noqa: N801  (printed name of the op's expression)
    """The sympy face of the op: stays unevaluated, prints as a C call, lambdifies to NumPy."""

    nargs = 4
    is_integer = True
    is_nonnegative = True
    # lambdify looks for `_imp_` on a function class and calls it with NumPy arrays.
    _imp_ = staticmethod(philox_bits)

    def _call(self, printer) -> str:
        return "sg_random_bits(" + ", ".join(printer._print(a) for a in self.args) + ")"

    def _ccode(self, printer):
        return self._call(printer)

    _cxxcode = _ccode
    _cudacode = _ccode


RANDOM_BITS = define("random_bits", random_bits(*ARGS[:4]), 4, "promote", differentiable=False,
                     doc="random_bits(seed, step, stream, index): Philox4x32-10 word 0, int64 in [0, 2**32)")


def flat_index(shape) -> Value:
    """An int64 value of `shape` holding each element's row-major position."""
    shape = S.as_shape(shape)
    if not shape:
        return F.constant(0, "int64")
    index = None
    stride: object = 1
    for axis in reversed(range(len(shape))):
        term = make(lookup("iota"), shape=shape, axis=axis, dtype="int64")
        if stride != 1:
            term = term * (stride if isinstance(stride, int) else F.constant(stride, "int64"))
        index = term if index is None else term + index
        stride = stride * shape[axis]
    return index


class Generator:
    """A seeded random stream for graph code (torch.Generator's role).

    Two int64 state variables, `<name>.seed` and `<name>.counter`, hold the
    seed and the step counter; every training step that draws from the
    generator increments the counter, so each step gets fresh bits. Reseed
    a compiled step with `step.state["rng.seed"] = 123`.
    """

    def __init__(self, seed: int = 0, name: str = "rng"):
        if not isinstance(seed, (int, np.integer)) or not -2 ** 63 <= int(seed) < 2 ** 64:
            raise ValueError(f"Generator: seed must be an integer that fits in 64 bits, got {seed!r}")
        seed = int(seed)
        seed = seed - 2 ** 64 if seed >= 2 ** 63 else seed  # a uint64 seed, stored as its int64 bit pattern
        self.name = name
        self.seed = variable(f"{name}.seed", np.array(seed, dtype=np.int64), role="rng")
        self.counter = variable(f"{name}.counter", np.array(0, dtype=np.int64), role="rng")
        self._advance = self.counter + 1  # one Value, so every draw of a step shares one update
        self._streams = itertools.count()

    def bits(self, shape) -> Value:
        """Uniform random int64 values in [0, 2**32) of `shape`, fresh on every step and every call."""
        stream = F.constant(next(self._streams), "int64")
        out = F.apply_elementwise(RANDOM_BITS, [self.seed, self.counter, stream, flat_index(shape)])
        return effects.attach(out, [(self.counter, self._advance)])

    def bernoulli(self, shape, p_keep: float) -> Value:
        """A bool value of `shape`, true with probability `p_keep` (to 2**-32)."""
        if not 0.0 <= p_keep <= 1.0:
            raise ValueError(f"bernoulli: probability must be in [0, 1], got {p_keep}")
        # Comparing integers keeps the mask exact and identical on every backend.
        threshold = int(round(p_keep * 2 ** 32))
        return F.less(self.bits(shape), F.constant(threshold, "int64"))


_default = Generator(0)


def default_generator() -> Generator:
    """The generator layers draw from unless given one."""
    return _default


def manual_seed(seed: int) -> Generator:
    """Make a fresh default generator with `seed`; layers built afterwards draw from it."""
    global _default
    _default = Generator(seed)
    return _default
