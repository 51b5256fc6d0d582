"""The sympy printer for CUDA kernels: the C printer plus CUDA's table of differences.

Device code has the C99 math library (`expf`, `logf`, `tanhf`, `fmaxf`, ...
for float, the unsuffixed names for double), so most expressions print as
they do for C. What differs is written here as data:

- Only functions of the CUDA Math API are accepted; anything else (a host-only
  libm extension) raises `CPrintError` instead of failing later in nvcc.
- The precise functions are used, never the fast intrinsics (`__expf`,
  `__logf`, `__fdividef`): their ulp errors would break parity with the NumPy
  reference (float32 within 1e-4) and with the C backend. nvcc is run without
  `--use_fast_math` for the same reason (symgrad/backends/cuda.py).
"""

from __future__ import annotations

import re

from .c_printer import CPrintError, KernelPrinter

# The CUDA Math API functions the printer may call (double names; float ones add "f").
# https://docs.nvidia.com/cuda/cuda-math-api/ : every entry is a __device__ function.
CUDA_MATH = frozenset("""
    exp exp2 exp10 expm1 log log2 log10 log1p pow sqrt cbrt rsqrt hypot
    sin cos tan asin acos atan atan2 sinh cosh tanh asinh acosh atanh
    erf erfc erfinv erfcinv tgamma lgamma fabs fmax fmin fdim floor ceil trunc round rint nearbyint
    fmod remainder copysign fma
""".split())
_CALL = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)\s*\(")
# Macros the C printer emits for literals, allowed beside the math functions.
_MACROS = frozenset({"INT64_C"})


def device_function_ok(name: str) -> bool:
    """Whether `name` (as printed, `f` suffix for float) is a precise CUDA device function or symgrad's own."""
    if name.startswith("__"):
        return False  # fast intrinsics: refused on purpose (see the module docstring)
    if name.startswith("sg_"):
        return True  # symgrad's own __device__ helpers, defined in the program (e.g. sg_random_bits)
    return name in CUDA_MATH or (name.endswith("f") and name[:-1] in CUDA_MATH)


class CudaKernelPrinter(KernelPrinter):
    """KernelPrinter for CUDA device code (same literals and operators; device math functions only).

    sympy reaches function calls by several routes (_print_Function, _print_math_func,
    _print_Pow, ...), so the check runs once on the finished text: every `name(` in it
    must be a CUDA device math function or a literal macro.
    """

    def doprint(self, expr, assign_to=None):
        text = super().doprint(expr, assign_to)
        for name in _CALL.findall(text):
            if name not in _MACROS and not device_function_ok(name):
                raise CPrintError(f"cannot print `{expr}` for CUDA: {name} is not a CUDA device "
                                  f"math function")
        return text


def printer(dtype: str) -> CudaKernelPrinter:
    """A CUDA printer for arithmetic in `dtype` (a fresh one each time: printers keep state)."""
    return CudaKernelPrinter(dtype)
