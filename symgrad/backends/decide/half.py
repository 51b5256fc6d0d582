"""16-bit floats in the compiled backends: every op that computes on one, in float32.

    legalize(graph) -> Graph

A kernel keeps a bfloat16 or float16 value in a C float that holds it exactly
(dtypes.C_TYPES); a conversion to one rounds to nearest even
(expressions.convert). Elementwise statements already compute in float32 and
round their result (elementwise.compute_dtype), and a copy (reshape,
transpose, expand, slice, take) moves values unchanged. Every other op that
reads or makes a 16-bit float is rewritten here to compute in float32, its
result rounded once, as torch's CPU kernels do:

    matmul(a: bf16, b: bf16): bf16  ->  cast(matmul(cast(a, f32), cast(b, f32)), bf16)

so the kernel kinds (GEMM, reductions, attention, gathers) never see a
16-bit dtype. The casts to float32 are exact. Graph inputs, variables and
outputs stay as the caller gave them: the compiled call checks refuse 16-bit
ones (`refuse_half_leaves`), since the native buffers hold floats.
"""

from __future__ import annotations

import numpy as np

from ...ir import dtypes as D
from ...ir.graph import Graph
from ...ir.registry import ATTENTION, ELEMENTWISE, MATMUL, MOVEMENT, lookup
from ...ir.value import Value, make

# Ops that only move values: a 16-bit value passes through them unchanged.
_COPIES = frozenset({"take"})
# Kinds whose kernels read a 16-bit operand in place, as a float: the GEMMs and fused attention
# (the float32 path; backends/decide/half.py's docstring).
_READS_HALF = frozenset({MATMUL, ATTENTION})


def _touches_half(node: Value) -> bool:
    return D.is_half(node.dtype) or any(D.is_half(i.dtype) for i in node.inputs)


def _cast(x: Value, dtype: str) -> Value:
    return x if x.dtype == dtype else make(lookup("cast"), (x,), dtype=dtype)


def _in_float32(node: Value) -> Value:
    """`node` computed over float32 copies of its 16-bit inputs, its result rounded back."""
    if node.op.name == "const":
        value = np.asarray(node.attrs["value"]).astype(np.float32)
        wide = make(node.op, (), **{**node.attrs, "value": value, "dtype": "float32"})
    elif node.op.kind in _READS_HALF:
        # The kernel reads the 16-bit operands as the floats they are held in (no copy); its
        # float32 result is what the shape rule gives over float32 operands.
        shape, dtype = node.op.infer(tuple(_cast(i, D.compute_type(i.dtype)) for i in node.inputs), node.attrs)
        wide = Value(node.op, node.inputs, node.attrs, shape, dtype)
    else:
        wide = make(node.op, tuple(_cast(i, D.compute_type(i.dtype)) for i in node.inputs), **node.attrs)
    if wide.shape != node.shape or wide.dtype not in (node.dtype, D.compute_type(node.dtype)):
        raise TypeError(f"{node.op.name}: computing it in float32 gives {D.SHORT_NAMES[wide.dtype]}"
                        f"{list(wide.shape)} where the graph has {D.SHORT_NAMES[node.dtype]}{list(node.shape)}")
    return _cast(wide, node.dtype)


def needs_legalize(node: Value) -> bool:
    """Whether `node` computes on a 16-bit float in a way the kernels do not: not elementwise,
    not a copy, not a data leaf."""
    if node.op.kind in (ELEMENTWISE, MOVEMENT) or node.op.name in _COPIES or node.op.name in ("input", "variable"):
        return False
    return _touches_half(node)


def legalize(graph: Graph) -> Graph:
    """`graph` with every op that computes on a 16-bit float (see `needs_legalize`) rewritten to
    compute in float32 and round its result: the same values, in kernels of float32 only."""
    if not any(needs_legalize(n) for n in graph.nodes):
        return graph
    from ...passes.rewrite import rebuild  # the passes' graph copier (a backend module may use it)
    return rebuild(graph, lambda node: _in_float32(node) if needs_legalize(node) else node)


def fold_operand_casts(graph: Graph, bf16_gemm) -> Graph:
    """`graph` with each cast to bfloat16 that only bfloat16 GEMMs read (directly or through movement
    ops) folded into them: the products read the float32 values and round them as they read them
    (the runtime's sg_gemm_bf16_round_*), the same numbers without the cast's pass over memory or
    the buffer it kept from the forward to the backward (an autocast step's every weight and
    GEMM input). Such a product is marked `operands="bfloat16"` (kinds.matmul.reads_bfloat16);
    its float32 operands are the ones it rounds. `bf16_gemm(node)`: whether the language computes
    the product `node` by the runtime's bfloat16 GEMM (kinds.matmul.bf16_gemm_applies)."""
    casts = [n for n in graph.nodes if n.op.name == "cast" and n.dtype == "bfloat16" and n.inputs[0].dtype == "float32"]
    if not casts:
        return graph
    users = graph.users
    outputs = {id(v) for v in graph.outputs} | {id(v) for pair in graph.updates for v in pair}

    def only_products(node: Value) -> bool:
        """Whether every use of `node` is, through movement ops, an operand of a bfloat16 GEMM."""
        if id(node) in outputs or not users[id(node)]:
            return False
        return all(only_products(u) if u.op.kind == MOVEMENT else
                   u.op.kind == MATMUL and bf16_gemm(u) for u in users[id(node)])

    folded = {id(n) for n in casts if only_products(n)}
    if not folded:
        return graph
    mapping: dict[int, Value] = {}
    for node in graph.nodes:  # inputs before users: each node's inputs are already mapped
        inputs = tuple(mapping.get(id(i), i) for i in node.inputs)
        if id(node) in folded:
            mapping[id(node)] = inputs[0]
        elif all(i is o for i, o in zip(inputs, node.inputs)):  # (== on values builds a graph)
            continue
        elif node.op.kind == MOVEMENT and any(i.dtype != o.dtype for i, o in zip(inputs, node.inputs)):
            moved = make(node.op, inputs, **node.attrs)  # moves a folded cast's float32 input
            mapping[id(node)] = Value(moved.op, moved.inputs, moved.attrs, moved.shape, moved.dtype, node.effects)
        elif node.op.kind == MATMUL and any(i.dtype != o.dtype for i, o in zip(inputs, node.inputs)):
            mapping[id(node)] = Value(node.op, inputs, {**node.attrs, "operands": "bfloat16"}, node.shape, node.dtype,
                                      node.effects)
        else:
            mapping[id(node)] = Value(node.op, inputs, node.attrs, node.shape, node.dtype, node.effects)
    def new(v: Value) -> Value:
        return mapping.get(id(v), v)
    return Graph(graph.inputs, [new(v) for v in graph.outputs], [(new(t), new(n)) for t, n in graph.updates])


def refuse_half_leaves(graph: Graph, backend: str) -> None:
    """Raise TypeError naming the first input, variable or output of a 16-bit float: the native
    buffers of `backend` hold floats, so such values live only inside a compiled step."""
    for kind, values in (("input", graph.inputs), ("variable", graph.variables), ("output", graph.outputs)):
        for v in values:
            if D.is_half(v.dtype):
                name = getattr(v, "name", None) or v.op.name
                raise TypeError(f"{backend} backend: {kind} {name!r} is {v.dtype} {list(v.shape)}; a compiled "
                                f"step keeps {v.dtype} inside the graph only (sg.autocast): give it float32 "
                                f"and cast inside the graph, or use backend='numpy'")


def report_lines(graph: Graph, bindings: dict, optimized: Graph | None = None) -> list[str]:
    """The report's mixed-precision line: the casts to 16-bit floats in the graph as built (the
    autocast policy's, and the user's), the operands of bfloat16 GEMMs that read float32 values
    in the `optimized` graph (casts folded into them), and the bytes its 16-bit values take
    against float32. Empty for a graph with none."""
    from ...ir import shapes as S
    from ...ir.registry import SOURCE

    casts: dict[str, int] = {}
    sixteen = 0
    for node in graph.nodes:
        if node.op.name == "cast" and D.is_half(node.dtype) and not D.is_half(node.inputs[0].dtype):
            casts[node.dtype] = casts.get(node.dtype, 0) + 1
        if D.is_half(node.dtype) and node.op.kind not in (SOURCE, MOVEMENT):
            sixteen += int(np.prod(S.evaluate_shape(node.shape, bindings), dtype=np.int64)) * 2
    if not casts and not sixteen:
        return []
    back = sum(1 for n in graph.nodes if n.op.name == "cast" and D.is_half(n.inputs[0].dtype))
    inserted = ", ".join(f"{n} to {dtype}" for dtype, n in sorted(casts.items()))
    rounded = sum(1 for n in (optimized.nodes if optimized is not None else ()) if n.op.kind == MATMUL
                  and n.attrs.get("operands") == "bfloat16" for i in n.inputs if i.dtype == "float32")
    folded = f" ({rounded} GEMM operands read in float32 instead and rounded by the GEMM)" if rounded else ""
    return [f"mixed precision: {inserted or 'no'} casts{folded}, {back} back to wider floats; 16-bit values "
            f"{_bytes(sixteen)} a step, {_bytes(sixteen)} saved against float32 in 16-bit storage "
            f"(the C kernels hold them in floats for now: 0 B saved in this program's memory)"]


def _bytes(n: int) -> str:
    for scale, unit in ((2 ** 30, "GiB"), (2 ** 20, "MiB"), (2 ** 10, "KiB")):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
