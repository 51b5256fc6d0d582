"""`sg.gradcheck`: analytic gradients against central finite differences, in float64.

Like torch.autograd.gradcheck: the analytic Jacobian (one VJP per output
element, compiled by the chosen backend) is compared element by element
with the numerical one, (f(x + eps) - f(x - eps)) / 2 eps. A mismatch names
the input, its element and the output element; it then checks every op's
VJP in the graph on its own (a random directional derivative, evaluated by
the NumPy reference) and names the op, or the custom Function, whose
backward disagrees.
"""

from __future__ import annotations

import inspect
from typing import Callable, Sequence

import numpy as np

from ..autodiff import grad, unbroadcast
from ..ir.interpret import Env
from ..step.call_checks import bind_inputs
from ..api.cells import current_value
from ..step.compiled import function
from ..api.functional import constant
from ..ir import dtypes as D
from ..ir.graph import Graph, toposort
from ..ir.registry import SOURCE
from ..ir.value import Value
from ..api.sources import input as make_input


class GradcheckError(RuntimeError):
    """Raised by gradcheck when analytic and numerical gradients disagree."""


def _trace(fn: Callable, arrays: list) -> tuple[list[Value], list[Value]]:
    """Graph inputs (named after fn's parameters) for the arrays, and fn's outputs on them."""
    try:
        names = [p for p in inspect.signature(fn).parameters][:len(arrays)]
    except (TypeError, ValueError):
        names = []
    names += [f"input{k}" for k in range(len(names), len(arrays))]
    values = [make_input(n, a.shape, a.dtype.name) for n, a in zip(names, arrays)]
    out = fn(*values)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    for k, o in enumerate(outs):
        if not isinstance(o, Value):
            raise TypeError(f"gradcheck: the function returned a {type(o).__name__} at output {k}, not a graph value")
    return values, outs


def _as_arrays(inputs) -> list:
    if isinstance(inputs, np.ndarray):
        inputs = [inputs]
    arrays = []
    for k, a in enumerate(inputs):
        a = np.asarray(a)
        if a.dtype.kind == "f":
            a = a.astype(np.float64)  # finite differences need float64
        arrays.append(np.ascontiguousarray(a))
    return arrays


def gradcheck(fn_or_graph, inputs, eps: float = 1e-6, atol: float = 1e-5, rtol: float = 1e-3,
              backend: str = "numpy", raise_exception: bool = True) -> bool:
    """Check the gradients of `fn_or_graph` at `inputs` against finite differences.

    fn_or_graph: a function of graph values returning a value (or a tuple
    of them), traced on float64 inputs of the arrays' shapes; or an
    `sg.Graph` whose float inputs are float64. Every float input is checked,
    for every output element. Returns True; on a mismatch raises
    GradcheckError naming the input, the element and the first op whose
    VJP disagrees with finite differences (or returns False when
    raise_exception=False).
    """
    arrays = _as_arrays(inputs)
    if isinstance(fn_or_graph, Graph):
        graph_inputs, outputs = list(fn_or_graph.inputs), list(fn_or_graph.outputs)
        if len(graph_inputs) != len(arrays):
            raise ValueError(f"gradcheck: the graph takes {len(graph_inputs)} inputs, got {len(arrays)} arrays")
        for node, a in zip(graph_inputs, arrays):
            if D.is_float(node.dtype) and node.dtype != "float64":
                raise TypeError(f"gradcheck: input {node.name!r} is {node.dtype}; finite differences need "
                                f"float64 inputs (build the graph with dtype='float64')")
            if a.dtype.kind == "f" and not D.is_float(node.dtype):
                raise TypeError(f"gradcheck: input {node.name!r} is {node.dtype}, got a float array")
        arrays = [a.astype(D.to_numpy(n.dtype)) for n, a in zip(graph_inputs, arrays)]
    elif callable(fn_or_graph):
        graph_inputs, outputs = _trace(fn_or_graph, arrays)
    else:
        raise TypeError(f"gradcheck: expected a function or an sg.Graph, got {type(fn_or_graph).__name__}")
    bindings = bind_inputs(graph_inputs, arrays)
    checked = [k for k, v in enumerate(graph_inputs) if D.is_float(v.dtype)]
    outputs = [o for o in outputs if D.is_float(o.dtype)]
    if not checked or not outputs:
        raise ValueError("gradcheck: needs at least one float input and one float output")

    forward = function(graph_inputs, outputs, backend=backend)
    base = [np.asarray(o, dtype=np.float64) for o in forward(*arrays)]
    numeric = _numerical_jacobians(forward, arrays, checked, base, eps)
    for j, out in enumerate(outputs):
        analytic = _analytic_jacobian(out, graph_inputs, arrays, checked, base[j].shape, backend, j)
        for k in checked:
            a, n = analytic[k], numeric[j][k]
            bad = np.abs(a - n) > atol + rtol * np.abs(n)
            if bad.any():
                o, i = np.unravel_index(int(np.argmax(bad)), bad.shape)
                node = graph_inputs[k]
                message = (f"gradcheck: gradient of output {j} with respect to input {node.name!r} (input {k}) "
                           f"disagrees at input element {_index(i, arrays[k].shape)}, output element "
                           f"{_index(o, base[j].shape)}: analytic {a[o, i]:.10g}, numerical {n[o, i]:.10g} "
                           f"(allowed |difference| {atol + rtol * abs(n[o, i]):.3g})")
                suspects = _localise(outputs, graph_inputs, arrays, checked, bindings, eps, atol, rtol)
                message += ("; " + suspects[0]) if suspects else \
                    "; every op's VJP agrees with finite differences on its own"
                if raise_exception:
                    raise GradcheckError(message)
                return False
    return True


def _index(flat: int, shape: tuple) -> tuple:
    return tuple(int(i) for i in np.unravel_index(flat, shape)) if shape else ()


def _numerical_jacobians(forward, arrays: list, checked: list[int], base: list, eps: float) -> list[dict]:
    """jac[j][k]: (output j size, input k size) by central differences."""
    jac = [{k: np.zeros((b.size, arrays[k].size)) for k in checked} for b in base]
    for k in checked:
        for i in range(arrays[k].size):
            values = []
            for sign in (1.0, -1.0):
                shifted = [a.copy() for a in arrays]
                shifted[k].reshape(-1)[i] += sign * eps
                values.append([np.asarray(o, dtype=np.float64).reshape(-1) for o in forward(*shifted)])
            for j in range(len(base)):
                jac[j][k][:, i] = (values[0][j] - values[1][j]) / (2 * eps)
    return jac


def _analytic_jacobian(out: Value, graph_inputs: list[Value], arrays: list, checked: list[int],
                       out_shape: tuple, backend: str, j: int) -> dict:
    """Rows of d out / d input k, one compiled VJP call per output element."""
    cotangent = make_input(f"gradcheck_cotangent_{j}", out.shape, out.dtype)
    grads = grad(out, [graph_inputs[k] for k in checked], grad_output=cotangent)
    vjp = function([*graph_inputs, cotangent], grads, backend=backend)
    size = int(np.prod(out_shape, dtype=np.int64))
    jac = {k: np.zeros((size, arrays[k].size)) for k in checked}
    for o in range(size):
        seed = np.zeros(size, dtype=D.to_numpy(out.dtype))
        seed[o] = 1.0
        rows = vjp(*arrays, seed.reshape(out_shape))
        for k, row in zip(checked, rows):
            jac[k][o] = np.asarray(row, dtype=np.float64).reshape(-1)
    return jac


# ---- localisation: each op's VJP on its own ----------------------------------

def _evaluate(roots: Sequence[Value], context: tuple, overrides: dict | None = None) -> dict:
    """Values of every node `roots` need, by id, with `overrides` (id -> array) taking precedence."""
    # A fresh Env per evaluation: Env caches shapes by id(), and the VJP graphs
    # built while localising die and leave their ids to new nodes.
    env = Env(*context)
    overrides = overrides or {}
    values: dict[int, np.ndarray] = {}
    for node in toposort(list(roots)):
        if id(node) in overrides:
            values[id(node)] = overrides[id(node)]
        else:
            values[id(node)] = np.asarray(node.op.numpy([values[id(i)] for i in node.inputs], node, env))
    return values


def _describe(node: Value) -> str:
    if node.op.name == "custom":
        return f"{node.attrs['function'].name} (a custom Function's backward)"
    return f"op {node.op.name!r}"


def _localise(outputs, graph_inputs, arrays, checked, bindings, eps, atol, rtol) -> list[str]:
    """Messages for each node whose VJP disagrees with finite differences, nearest the inputs first."""
    variables = {}
    nodes = toposort(outputs)
    for n in nodes:
        if n.op.name == "variable":
            variables[n] = current_value(n)  # what the compiled functions read: a parameter's value now
    context = (bindings, dict(zip(graph_inputs, arrays)), variables)
    values = _evaluate(outputs, context)
    # Only values downstream of a checked input carry a gradient.
    depends = {id(graph_inputs[k]) for k in checked}
    for n in nodes:
        if any(id(i) in depends for i in n.inputs):
            depends.add(id(n))
    rng = np.random.default_rng(0)
    found = []
    for node in nodes:
        if (node.op.kind == SOURCE or node.op.vjp is None or node.op.name == "stop_gradient"
                or id(node) not in depends or node.dtype != "float64"):
            continue
        first = 1 if node.op.name == "custom" else 0  # a custom node's input 0 is its (untraced) result
        wants = tuple(k >= first and id(i) in depends and i.dtype == "float64"
                      for k, i in enumerate(node.inputs))
        if not any(wants):
            continue
        u = rng.standard_normal(np.shape(values[id(node)]))
        directions = {}
        for k, i in enumerate(node.inputs):
            if wants[k] and id(i) not in directions:
                directions[id(i)] = rng.standard_normal(np.shape(values[id(i)]))

        def perturbed(t: float) -> np.ndarray:
            if node.op.name == "custom":
                # The custom node's value is its forward, recomputed from its perturbed operands.
                over = {key: values[key] + t * d for key, d in directions.items()}
                return _evaluate([node], context, over)[id(node)]
            args = [values[id(i)] + t * directions[id(i)] if wants[k] else values[id(i)]
                    for k, i in enumerate(node.inputs)]
            return np.asarray(node.op.numpy(args, node, Env(*context)))

        numerical = float(np.sum(u * (perturbed(eps) - perturbed(-eps)))) / (2 * eps)
        try:
            cts = node.op.vjp(node, constant(u.astype(D.to_numpy(node.dtype)), node.dtype), wants)
        except Exception as exc:  # a user's backward may fail outright: that is the finding
            found.append(f"the VJP of {_describe(node)} raised {type(exc).__name__}: {exc}")
            continue
        analytic = 0.0
        for k, (i, ct) in enumerate(zip(node.inputs, cts)):
            if not wants[k] or ct is None:
                continue
            ct = unbroadcast(ct, i.shape)
            analytic += float(np.sum(_evaluate([ct], context)[id(ct)] * directions[id(i)]))
        if abs(analytic - numerical) > atol + rtol * abs(numerical):
            found.append(f"the VJP of {_describe(node)} disagrees with finite differences on its own "
                         f"(random directional derivative: analytic {analytic:.10g}, numerical {numerical:.10g})")
    return found
