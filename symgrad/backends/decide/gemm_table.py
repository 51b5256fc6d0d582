"""The runtime's GEMM table: which runtime function computes a matmul, read by decide and the kinds.

Which of the runtime's GEMMs computes a product is a choice of decide (a convolution's patches are
read in place only where the blocked GEMM, not a narrow kernel, takes its product); the runtime's
build (symgrad.backends.build.runtime) renders every function this table can name.
"""

from __future__ import annotations

import numpy as np
import sympy

from ...narrow_limit import NARROW_N

#: The narrow kernels' most columns per block: 6 columns x 2 rows ("dot") or 12 columns ("tn") of
#: vector accumulators stay within AVX2's 16 registers.
NARROW_MOST = {"dot": 6, "tn": 12}

# Cache blocks of the GEMM, per dtype: the KC x NR B sliver stays in L1, the MC x KC A block (MC a
# multiple of every target's MR) in L2, the KC x NC B panel in L3.
GEMM = {"float32": dict(suffix="f32", MC=72, KC=256, NC=2048),
        "float64": dict(suffix="f64", MC=72, KC=256, NC=1024)}


def narrow_columns(kind: str, n: int) -> int:
    """The columns per block of a narrow kernel of `kind` ("dot" or "tn") for N = `n` columns:
    blocks made equal, so that every accumulator does useful work."""
    blocks = -(-n // NARROW_MOST[kind])
    return -(-n // blocks)


def gemm_function(dtype: str, n, sam, sak) -> tuple[str, str]:
    """The runtime function computing C[M x N] = A @ B for a product of `dtype` with N = `n`
    columns and A read through strides (`sam`, `sak`), and its kind: "gemm" (the register-tiled
    GEMM), or a narrow-N kernel where that beats it, "dot" or "tn".

    Narrow means N (known at compile time) at most NARROW_N: the general kernel's 16-column tile
    would compute mostly padding. "dot" needs A's rows contiguous in K, "tn" its columns contiguous
    in M (a transposed operand); any other layout keeps the general kernel.
    """
    suffix = GEMM[dtype]["suffix"]
    if concrete(n) and 1 <= int(n) <= NARROW_N:
        for kind, stride in (("dot", sak), ("tn", sam)):
            if concrete(stride) and int(stride) == 1:
                return f"sg_gemm_{kind}{narrow_columns(kind, int(n))}_{suffix}", kind
    return f"sg_gemm_{suffix}", "gemm"


def concrete(value) -> bool:
    """Whether `value` is a known integer (a Python or NumPy int, or a sympy Integer)."""
    return isinstance(value, (int, np.integer)) or (isinstance(value, sympy.Basic) and value.is_Integer)
