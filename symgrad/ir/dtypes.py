"""The five element types of the IR and how they combine.

A dtype is a plain string ("float32", ...) everywhere in the IR; this module
owns the table that maps it to NumPy, to C, and to its short printed name.
"""

from __future__ import annotations

import numpy as np

FLOAT_DTYPES = ("float32", "float64")
INT_DTYPES = ("int32", "int64")
DTYPES = FLOAT_DTYPES + INT_DTYPES + ("bool",)

# Printed in the text form of a graph, like a jaxpr: f32[B,10].
SHORT_NAMES = {"float32": "f32", "float64": "f64", "int32": "i32", "int64": "i64", "bool": "bool"}

# The C type of each dtype; CUDA uses the same spelling.
C_TYPES = {"float32": "float", "float64": "double", "int32": "int32_t", "int64": "int64_t", "bool": "uint8_t"}

DEFAULT_FLOAT = "float32"


def canonical(dtype) -> str:
    """Return the IR name of `dtype`, given a name, a NumPy dtype or a NumPy type."""
    if isinstance(dtype, str) and dtype in DTYPES:
        return dtype
    try:
        name = np.dtype(dtype).name
    except TypeError as exc:
        raise TypeError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}") from exc
    if name not in DTYPES:
        raise TypeError(f"unsupported dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return name


def to_numpy(dtype: str) -> np.dtype:
    """The NumPy dtype of an IR dtype."""
    return np.dtype("bool" if dtype == "bool" else dtype)


def is_float(dtype: str) -> bool:
    """True for float32 and float64: the dtypes that carry gradients."""
    return dtype in FLOAT_DTYPES


def promote(*dtypes: str) -> str:
    """The dtype of an elementwise result over tensors of `dtypes` (NumPy's rules)."""
    return canonical(np.result_type(*(to_numpy(d) for d in dtypes)))


def scalar_dtype(value, partner: str) -> str:
    """The dtype a Python scalar takes beside a tensor of dtype `partner`.

    Python scalars are weakly typed, as in PyTorch and JAX: `x * 2.0` keeps
    x's float32, and a float scalar beside an integer tensor gives float32.
    """
    if isinstance(value, (bool, np.bool_)):
        return partner
    if isinstance(value, (int, np.integer)):
        # bool beside an int is arithmetic, not logic: `mask + 1` counts (int64, as torch).
        return "int64" if partner == "bool" else partner
    return partner if is_float(partner) else DEFAULT_FLOAT
