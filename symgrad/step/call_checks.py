"""What a call and a graph are checked for before anything runs, in one place for every backend.

An input array is checked against its graph input (type, dtype, shape, then contiguity,
Dim consistency) and a graph's leaf names against each other, in Python, so a refused
call changes nothing and never reaches native code. A torch CPU tensor is read as the NumPy
array that shares its memory (`host_array`); torch itself is never imported here.
"""

from __future__ import annotations

import sys
from typing import Iterable

import numpy as np
import sympy

from ..ir import dtypes as D
from ..ir import shapes as S
from ..ir.graph import Graph, same_named_leaves, toposort
from ..ir.ops import range_words
from ..ir.value import Value


def bind_inputs(inputs: Iterable[Value], arrays: Iterable) -> dict:
    """Check each array against its input's dtype and shape; return the Dim bindings.

    Raises TypeError (not an array, wrong dtype) or ValueError (rank, size,
    inconsistent Dim, not C-contiguous), naming the input and both shapes. Every shape is
    checked before any contiguity: a wrong shape is the first thing to fix.
    """
    bindings: dict = {}
    pending, strided = [], []
    for node, array in zip(inputs, arrays):
        expected = f"{S.format_shape(node.shape)} ({node.dtype})"
        if not isinstance(array, np.ndarray):
            raise TypeError(f"input {node.name!r}: expected a numpy array of shape {expected}, "
                            f"got {type(array).__name__}")
        refuse_subclass(f"input {node.name!r}", array)
        got = f"{list(array.shape)} ({array.dtype})"
        if array.dtype != D.to_numpy(node.dtype):
            raise TypeError(f"input {node.name!r}: expected dtype {node.dtype}, got {array.dtype} "
                            f"(shape {expected} expected, {got} given); convert with .astype({'ml_dtypes' if node.dtype == 'bfloat16' else 'np'}.{node.dtype})")
        if array.ndim != node.ndim:
            raise ValueError(f"input {node.name!r}: expected shape {expected}, got {got}")
        if not array.flags.c_contiguous:
            strided.append((node, array))
        for axis, (size, actual) in enumerate(zip(node.shape, array.shape)):
            if isinstance(size, int):
                if size != actual:
                    raise ValueError(f"input {node.name!r}: expected shape {expected}, got {got} "
                                     f"(axis {axis} must be {size})")
            elif isinstance(size, sympy.Symbol):
                if actual < 1:
                    raise ValueError(f"input {node.name!r}: Dim {size} must be at least 1, got shape {got}")
                if size in bindings and bindings[size] != actual:
                    raise ValueError(f"input {node.name!r}: expected shape {expected}, got {got}: "
                                     f"{size} is {bindings[size]} from an earlier input, here {actual}")
                bindings[size] = actual
            else:
                pending.append((node, axis, size, actual, expected, got))
    for node, axis, size, actual, expected, got in pending:
        value = S.evaluate(size, bindings)
        if value != actual:
            raise ValueError(f"input {node.name!r}: expected shape {expected}, got {got} "
                             f"(axis {axis} is {size} = {value})")
    for node, array in strided:
        raise ValueError(f"input {node.name!r}: array of shape {list(array.shape)} is not C-contiguous; "
                         f"pass np.ascontiguousarray(...)")
    return bindings


# Ops whose integer result holds their first input's values, moved or retyped.
_SAME_VALUES = ("reshape", "transpose", "expand", "cast", "class_labels")


def _value_range(v: Value):
    """(lowest, highest) value of an integer value the graph computes, as expressions of its Dims,
    where they are exact: an arange (iota) moved, shifted and scaled by constants; else None."""
    op = v.op.name
    if op == "iota":
        return sympy.Integer(0), sympy.sympify(v.shape[v.attrs["axis"]]) - 1
    if op in _SAME_VALUES and v.inputs:
        return _value_range(v.inputs[0])
    if op in ("add", "sub", "mul") and len(v.inputs) == 2:
        a, b = v.inputs
        if op != "sub" and a.op.name == "const":
            a, b = b, a
        if b.op.name != "const" or b.shape != () or isinstance(b.attrs["value"], (float, bool)):
            return None
        inner, c = _value_range(a), sympy.sympify(b.attrs["value"])
        if inner is None:
            return None
        low, high = inner
        if op == "add":
            return low + c, high + c
        if op == "sub":
            return low - c, high - c
        if c.is_nonnegative:
            return low * c, high * c
        if c.is_negative:
            return high * c, low * c
    return None


def computed_label_ranges(graph: Graph) -> list:
    """(class_labels node, lowest, highest) for each label check on indices the graph computes
    with a known range, such as a position embedding's arange(T): compiled code does not check
    those, so a call checks the range against its Dims (`check_label_ranges`) before it runs."""
    inputs = {id(v) for v in graph.inputs}
    found = []
    for node in graph.nodes:
        if node.op.name != "class_labels":
            continue
        source = node.inputs[0]
        while source.op.name in ("reshape", "transpose", "expand"):
            source = source.inputs[0]
        if id(source) in inputs:
            continue  # an input's labels: checked value by value (symgrad.ir.ops.check_labels)
        bounds = _value_range(node.inputs[0])
        if bounds is not None:
            found.append((node, *bounds))
    return found


def check_label_ranges(ranges: list, bindings: dict) -> None:
    """Raise ValueError for computed indices that reach outside [0, num_classes) at these Dims:
    the caller, the value reached, the Dims that make it, and what the range is (an embedding's
    rows, a table's entries, classes)."""
    for node, low_expr, high_expr in ranges:
        low, high = S.evaluate(low_expr, bindings), S.evaluate(high_expr, bindings)
        size = S.evaluate(node.attrs["num_classes"], bindings)
        if high < low or (low >= 0 and high < size):
            continue  # empty, or inside
        reached = high if high >= size else low
        symbols = sympy.sympify(low_expr).free_symbols | sympy.sympify(high_expr).free_symbols
        given = ", ".join(f"{d} = {bindings[d]}" for d in sorted(symbols, key=str) if d in bindings)
        where = f" with {given}" if given else ""
        hint = (" (a sequence longer than the embedding's table?)"
                if node.attrs["caller"] == "embedding" else "")
        raise ValueError(f"{node.attrs['caller']}: {node.attrs['arg']} (computed in the graph) reaches "
                         f"{reached}{where}, outside [0, {size}){range_words(node, size)}{hint}")


def host_array(what: str, value):
    """`value` as the compiled code reads it: a torch CPU tensor becomes the NumPy array sharing
    its memory (a C-contiguous copy where it is strided, as `.contiguous()` makes); anything else
    is returned as it is, for `bind_inputs` to check. A tensor on another device (cuda, mps,
    meta) is refused, naming `.cpu()`. torch stays optional: a tensor's type lives in torch's
    modules, so torch is loaded whenever one is passed, and is looked up, not imported."""
    if not type(value).__module__.startswith("torch"):
        return value
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(value, torch.Tensor):
        return value
    if value.device.type != "cpu":
        raise TypeError(f"{what}: a torch tensor on device {str(value.device)!r}; compiled code reads host "
                        f"memory: pass tensor.cpu() (a copy in CPU memory), or a NumPy array")
    if value.layout != torch.strided:
        raise TypeError(f"{what}: a torch tensor of layout {value.layout}; pass a dense one (tensor.to_dense())")
    tensor = value.detach() if value.requires_grad else value
    if tensor.is_conj() or tensor.is_neg():  # lazy conjugate or negative views: their values, resolved
        tensor = tensor.resolve_conj().resolve_neg()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    try:
        return tensor.numpy()
    except (TypeError, RuntimeError) as exc:  # a dtype NumPy lacks (bfloat16), a tensor subclass
        raise TypeError(f"{what}: torch tensor of dtype {value.dtype} has no NumPy array ({exc}); convert it "
                        f"with tensor.to(<the input's dtype>)") from None


def refuse_positional(graph: Graph, what: str, call: str, count: int) -> None:
    """Raise the TypeError of a call (`what`, spelled `call`) that takes its arrays by name and was
    given `count` by position: the names it takes, and the call written with them."""
    names = [v.name for v in graph.inputs]
    spelled = ", ".join(f"{n}=..." for n in names)
    raise TypeError(f"{what} takes its inputs by name {names}: {call}({spelled}); "
                    f"got {count} positional argument{'s' if count != 1 else ''}")


def refuse_subclass(what: str, array) -> None:
    """Refuse an ndarray subclass whose raw data is not what it means (a masked array's mask, a
    matrix's algebra): the backends compute on the raw data. A memory map is its data: accepted."""
    if isinstance(array, np.ndarray) and type(array) is not np.ndarray and not isinstance(array, np.memmap):
        kind = f"{type(array).__module__}.{type(array).__name__}"
        raise TypeError(f"{what}: expected a plain numpy.ndarray, got {kind}, an ndarray subclass whose "
                        f"raw data the compiled code would read without its meaning; pass a plain array "
                        f"(a masked array's .filled(value), np.asarray(matrix))")


def collect_inputs(values: Iterable[Value]) -> list[Value]:
    """The input nodes the values depend on, in the order they were created."""
    return sorted((n for n in toposort(values) if n.op.name == "input"), key=lambda n: n.attrs["serial"])


def leaf_kind(leaf: Value) -> str:
    """What a graph leaf is, in words: "input", or its variable role (symgrad.api.sources.ROLES)."""
    return leaf.attrs.get("role", leaf.op.name)


def check_unique_names(graph: Graph) -> None:
    """Raise ValueError naming the two leaves when different inputs or variables share a name."""
    pair = same_named_leaves(graph)
    if pair is not None:
        other, v = pair
        raise ValueError(f"two different graph leaves are named {v.name!r} ({leaf_kind(other)} "
                         f"{other.type_str} and {leaf_kind(v)} {v.type_str}); names must be unique")


def gradient_buffer_name(param: Value) -> str:
    """The name under which `step.accumulate()` sums `param`'s gradient for `step.apply()`."""
    return f"{param.name}.grad"


def check_no_gradient_buffer_names(variables: Iterable[Value], params: list[Value], what: str) -> None:
    """Refuse a variable named as a param's gradient buffer: the step's programs share their
    variables by name, so accumulate() would sum into it and apply() would step the param by it."""
    buffers = {gradient_buffer_name(p): p for p in params}
    for v in variables:
        param = buffers.get(v.name)
        if param is not None:
            raise ValueError(f"{what}: {leaf_kind(v)} {v.name!r} has the name of the gradient buffer of "
                             f"param {param.name!r}, which step.accumulate() and step.apply() use; "
                             f"rename the {leaf_kind(v)}")


def arrays_by_name(graph: Graph, batch: dict, what: str) -> list:
    """The arrays of `batch` in the graph's input order; a TypeError naming missing and extra names."""
    names = [v.name for v in graph.inputs]
    missing = [n for n in names if n not in batch]
    extra = [n for n in batch if n not in names]
    if missing or extra:
        raise TypeError(f"{what} takes inputs {names}: "
                        + (f"missing {missing}" if missing else "")
                        + ("; " if missing and extra else "")
                        + (f"unexpected {extra}" if extra else ""))
    return [batch[n] for n in names]


def check_array(what: str, array, dtype, shape: tuple, writeable: bool = False) -> None:
    """Refuse anything but a C-contiguous ndarray of `dtype` and `shape` (and writeable, for an
    array the compiled code writes into): what a native program checks of the arrays it is
    handed directly, with shapes from the caller's Dim bindings. A ValueError naming `what`."""
    if not isinstance(array, np.ndarray) or (array.dtype is not dtype and array.dtype != dtype) \
            or array.shape != shape or not array.flags.c_contiguous or (writeable and not array.flags.writeable):
        kind = "a writeable C-contiguous" if writeable else "a C-contiguous"
        raise ValueError(f"{what}: expected {kind} {dtype} array of shape {shape}, "
                         f"got {getattr(array, 'dtype', type(array).__name__)} {getattr(array, 'shape', '')}")


def check_arrays(what: str, nodes: list, arrays: list, shapes: list) -> None:
    """`check_array` for each of `arrays` against its graph leaf (`what`: "input" or "variable"),
    after their number."""
    if len(arrays) != len(nodes):
        raise TypeError(f"expected {len(nodes)} {what}s, got {len(arrays)}")
    for node, shape, array in zip(nodes, shapes, arrays):
        check_array(f"{what} {node.name!r}", array, D.to_numpy(node.dtype), shape)
