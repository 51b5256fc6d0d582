"""The seven element types of the IR and how they combine.

A dtype is a plain string ("float32", ...) everywhere in the IR; this module
owns the table that maps it to NumPy, to C, and to its short printed name.

The two 16-bit floats (bfloat16, float16) are storage types, as in torch: arithmetic on them
runs in float32 (their compute type) and each result is rounded to nearest even on the way
back. NumPy holds them through `ml_dtypes` (the package JAX uses).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

HALF_DTYPES = ("bfloat16", "float16")
FLOAT_DTYPES = ("float32", "float64") + HALF_DTYPES
INT_DTYPES = ("int32", "int64")
DTYPES = FLOAT_DTYPES + INT_DTYPES + ("bool",)

# Printed in the text form of a graph, like a jaxpr: f32[B,10].
SHORT_NAMES = {"float32": "f32", "float64": "f64", "bfloat16": "bf16", "float16": "f16",
               "int32": "i32", "int64": "i64", "bool": "bool"}

# The C type of each dtype's values in kernels; CUDA uses the same spelling. A 16-bit float is a
# float there that holds a value of the narrower type exactly: every conversion to it rounds
# (backends/expressions.convert), and the C backend computes other ops on it in float32
# (backends/decide/half.py).
C_TYPES = {"float32": "float", "float64": "double", "bfloat16": "float", "float16": "float",
           "int32": "int32_t", "int64": "int64_t", "bool": "uint8_t"}

# The NumPy dtype of each IR dtype; ml_dtypes supplies bfloat16.
_NUMPY = {"float32": np.dtype(np.float32), "float64": np.dtype(np.float64),
          "bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16),
          "int32": np.dtype(np.int32), "int64": np.dtype(np.int64), "bool": np.dtype(np.bool_)}

DEFAULT_FLOAT = "float32"


# The IR name of each NumPy dtype that has one: a NumPy dtype's name and its text are Python
# properties, which took most of a GPT's time to make its parameters (a variable per leaf name).
_BY_NUMPY = {numpy: name for name, numpy in _NUMPY.items()}


def canonical(dtype) -> str:
    """Return the IR name of `dtype`, given a name, a NumPy dtype or a NumPy type."""
    if isinstance(dtype, str) and dtype in DTYPES:
        return dtype
    if isinstance(dtype, np.dtype) and dtype in _BY_NUMPY:
        return _BY_NUMPY[dtype]
    if str(dtype) in ("torch.bfloat16", "torch.float16"):  # torch's dtype objects, without importing torch
        return str(dtype)[len("torch."):]
    try:
        name = np.dtype(dtype).name
    except TypeError as exc:
        raise TypeError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}") from exc
    if name not in DTYPES:
        raise TypeError(f"unsupported dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return name


def to_numpy(dtype: str) -> np.dtype:
    """The NumPy dtype of an IR dtype (bfloat16: ml_dtypes.bfloat16)."""
    return _NUMPY[dtype]


def native_itemsize(dtype: str) -> int:
    """The bytes of one element in a compiled kernel's buffers: a 16-bit float is held in a
    float (C_TYPES), so 4; every other dtype its NumPy size."""
    return 4 if dtype in HALF_DTYPES else _NUMPY[dtype].itemsize


def is_float(dtype: str) -> bool:
    """True for the floating dtypes (float32, float64, bfloat16, float16): those that carry gradients."""
    return dtype in FLOAT_DTYPES


def is_half(dtype: str) -> bool:
    """True for the 16-bit floats, which store values but compute in float32."""
    return dtype in HALF_DTYPES


def compute_type(dtype: str) -> str:
    """The dtype arithmetic on `dtype` runs in: float32 for a 16-bit float (torch's opmath type),
    the dtype itself otherwise."""
    return "float32" if dtype in HALF_DTYPES else dtype


# torch's categories of dtype, lowest first. Across categories the higher one decides a result's
# kind; within one the wider dtype wins.
CATEGORIES = {"bool": 0, "int32": 1, "int64": 1, "float32": 2, "float64": 2, "bfloat16": 2, "float16": 2}
WIDTHS = {"bool": 1, "int32": 4, "int64": 8, "float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}


def promote_types(a: str, b: str) -> str:
    """torch.promote_types: the dtype that holds both kinds, `a`'s or `b`'s.

    The higher category wins, and within one the wider dtype: int32 with float32 is float32 and
    int64 with float32 is float32 too, where NumPy widens both to float64. bfloat16 with float16
    is float32 (neither holds the other: one has the range, the other the precision).
    """
    if CATEGORIES[a] != CATEGORIES[b]:
        return a if CATEGORIES[a] > CATEGORIES[b] else b
    if a != b and {a, b} == set(HALF_DTYPES):
        return "float32"
    return a if WIDTHS[a] >= WIDTHS[b] else b


def _priority_and_dtype(operand) -> tuple[int, str]:
    """(0, dtype) for a tensor with dimensions, (1, dtype) for a 0-d one, (2, dtype) for a Python
    scalar: bool, int64 for an int, the default float for a float (as torch types them)."""
    if isinstance(operand, (bool, np.bool_)):
        return 2, "bool"
    if isinstance(operand, (int, np.integer)):
        return 2, "int64"
    if isinstance(operand, (float, np.floating)):
        return 2, DEFAULT_FLOAT
    if hasattr(operand, "dtype") and hasattr(operand, "shape"):
        return (1 if len(operand.shape) == 0 else 0), canonical(operand.dtype)
    raise TypeError(f"result_type: cannot type {type(operand).__name__} {operand!r}")


def result_type(*operands) -> str:
    """The dtype of an elementwise result over `operands`, by torch's rules (torch.result_type).

    An operand is a graph value (anything with .dtype and .shape, its shape () making it 0-d) or
    a Python scalar. Operands fall in three classes, each promoted within itself: tensors with
    dimensions, 0-d tensors, Python scalars. The tensors with dimensions decide the result; a
    lower class takes part only when its category (bool < integer < float) is higher than the
    classes above it, and then gives its own dtype. So an int32 tensor with a float32 tensor is
    float32; beside an int32 tensor a 0-d int64 changes nothing, a 0-d float64 gives float64 and
    a Python float the default float32; beside a float32 tensor no 0-d value or scalar matters.
    """
    if not operands:
        raise TypeError("result_type: needs at least one operand")
    classes: list = [None, None, None]
    for operand in operands:
        priority, dtype = _priority_and_dtype(operand)
        classes[priority] = dtype if classes[priority] is None else promote_types(classes[priority], dtype)
    result = None
    for dtype in reversed(classes):  # scalars, then 0-d, then tensors: each overrides a category no higher
        if dtype is not None and (result is None or CATEGORIES[dtype] >= CATEGORIES[result]):
            result = dtype
    return result
