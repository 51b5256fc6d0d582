"""Every kernel kind in every language: the source renders, or decide refuses naming the op and
the language (issue 33: capabilities are data, consulted once, in decide).

Each graph below holds one kind (and its variants: a narrow product, batched products with a
broadcast operand, convolutions grouped and of one input channel); for C and CUDA its decisions
are made with the language's row, and then either the whole source renders (CUDA: rendered only,
no device here) or `decide` raised the language's Refusal before any kernel was planned. Nothing
may fail later, in the lowering or the render, and only the pairs in REFUSED may be refused: a
kind that regresses to a refusal fails here.
"""

from __future__ import annotations

import dataclasses

import pytest

import symgrad as sg
from symgrad import passes
from symgrad.backends.decide import half
from symgrad.backends.decide.decisions import decide
from symgrad.backends.driver import source_of
from symgrad.backends.kinds import KINDS
from symgrad.backends.render.languages import C_OPENMP, CUDA, Refusal
from symgrad.tools.distributed import all_reduce
from symgrad.ir.graph import Graph


def _loop():
    x = sg.input("x", (4, 5))
    return Graph([x], [sg.exp(x) * 2 + 1])


def _reduce():
    x = sg.input("x", (4, 5))
    return Graph([x], [sg.sum(x, axis=0), sg.argmax(x, dim=1)])


def _row():
    x = sg.input("x", (sg.Dim("B"), 6))
    return Graph([x], [sg.softmax(x, axis=1)])


def _matmul():
    x, w, v = sg.input("x", (4, 24)), sg.param("w", (24, 32)), sg.param("v", (32, 3))
    return Graph([x], [sg.relu(x @ w) @ v])          # a wide product with an epilogue, a narrow one


def _convolution():
    x = sg.input("x", (2, 16, 8, 8))
    conv = sg.nn.Conv2d(16, 16, 3, padding=1)
    first = sg.nn.Conv2d(1, 6, 5, padding=2)
    y = conv(x)
    loss = sg.sum(y * y) + sg.sum(first(x[:, :1]))
    params = [*conv.parameters(), *first.parameters()]
    return Graph([x], [loss, *sg.grad(loss, params)])


def _batched_matmul():
    a, b = sg.input("a", (2, 3, 5, 7)), sg.param("b", (3, 7, 4))
    c = sg.input("c", (2, 1, 4, 6))
    y = sg.matmul(sg.matmul(a, b), c)               # torch.matmul's batch axes, one of them broadcast
    return Graph([a, c], [y, *sg.grad(sg.sum(y * y), [a, b, c])])


def _grouped_convolution():
    x = sg.input("x", (2, 4, 8, 8))
    grouped = sg.nn.Conv2d(4, 8, 3, padding=1, groups=2)
    first = sg.nn.Conv2d(1, 6, 5, padding=2)         # LeNet's first: one input channel
    loss = sg.sum(grouped(x) ** 2) + sg.sum(first(x[:, :1]) ** 2)
    return Graph([x], [loss, *sg.grad(loss, [x, *grouped.parameters(), *first.parameters()])])


def _gather():
    ids = sg.input("ids", (2, 3), dtype="int64")
    table = sg.param("table", (10, 4))
    out = sg.take(table, ids, axis=0)
    return Graph([ids], [out, sg.grad(sg.sum(out * out), [table])[0]])


def _attention():
    q = sg.input("q", (2, 2, 4, 8))
    out = sg.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    return Graph([q], [out, sg.grad(sg.sum(out * out), [q])[0]])


def _collective():
    x = sg.input("x", (3,))
    return Graph([x], [all_reduce(x)])


GRAPHS = {"loop": _loop, "reduce": _reduce, "row": _row, "matmul": _matmul, "convolution": _convolution,
          "batched matmul": _batched_matmul, "grouped convolution": _grouped_convolution,
          "gather": _gather, "attention": _attention, "collective": _collective}
# The (graph, language) pairs decide refuses; every other pair renders.
REFUSED = {("collective", "CUDA")}


def test_the_graphs_cover_every_kind():
    seen = set()
    for build in GRAPHS.values():
        graph = build()
        plan_kinds = {k.kind for k in _c_plan(graph).kernels}
        seen |= plan_kinds
    assert seen == set(KINDS)


def _c_plan(graph):
    from symgrad.backends.lower.lowering import lower
    return lower(passes.optimize(graph), variables=graph.variables, matmul_epilogues=True, implicit_gemm=True)


@pytest.mark.parametrize("language", [C_OPENMP, CUDA], ids=lambda lang: lang.name)
@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_each_kind_renders_or_is_refused_at_decide(name, language):
    graph = GRAPHS[name]()
    optimized = half.legalize(passes.optimize(graph))
    try:
        decisions = decide(optimized, graph.variables, matmul_epilogues=True, implicit_gemm=True, language=language)
    except Refusal as refusal:
        assert (name, language.name) in REFUSED, f"{language.name} refuses the {name} graph: {refusal}"
        text = str(refusal)
        assert f"language {language.name}" in text and any(n.op.name in text for n in optimized.nodes), text
        with pytest.raises(Refusal):  # the compile refuses the same way, at the same stage
            source_of(graph, language)
        return
    assert (name, language.name) not in REFUSED, f"{language.name} decided the {name} graph it should refuse"
    source = source_of(graph, language)  # renders: no refusal after planning
    assert source and decisions.matmuls.keys() <= {id(n) for n in optimized.nodes}
    assert set(decisions.matmuls.values()) <= set(language.matmuls)


def test_cuda_refuses_a_collective_naming_it():
    with pytest.raises(Refusal, match=r"all_reduce .*CUDA backend has no collectives.*language CUDA"):
        decide(_collective(), language=CUDA)


def test_capabilities_are_the_language_rows_data():
    """A row that builds less refuses more, at decide, naming the op and the language."""
    x = sg.input("x", (3, 4))
    w = sg.param("w", (4, 2))
    graph = Graph([x], [sg.sum(sg.exp(x @ w), axis=1)])
    assert decide(graph, language=C_OPENMP)
    f64_only = dataclasses.replace(C_OPENMP, name="C64", matmul_dtypes=("float64",))
    with pytest.raises(Refusal, match=r"matmul f32\[3,2\]: no C64 matmul for dtype float32 \(language C64\)"):
        decide(graph, language=f64_only)
    no_sums = dataclasses.replace(CUDA, reductions=("max", "argmax"))
    with pytest.raises(Refusal, match=r"sum f32\[3\]: no CUDA lowering for reduction 'sum' \(language CUDA\)"):
        decide(graph, language=no_sums)
    no_narrow = dataclasses.replace(C_OPENMP, matmuls=("gemm",))
    assert set(decide(graph, language=no_narrow).matmuls.values()) == {"gemm"}
    # CUDA's GEMM walks at most CUDA.matmul_batch_axes batch axes of a product in one launch.
    batch = (2,) * (CUDA.matmul_batch_axes + 1)
    deep, v = sg.input("deep", batch + (3, 4)), sg.input("v", batch + (4, 2))
    wide = Graph([deep, v], [deep @ v])
    assert decide(wide, language=C_OPENMP)
    with pytest.raises(Refusal, match=rf"matmul f32\[.*\]: no CUDA matmul over more than "
                                      rf"{CUDA.matmul_batch_axes} batch axes \(language CUDA\)"):
        decide(wide, language=CUDA)
    assert decide(Graph([deep, v], [deep[0] @ v[0]]), language=CUDA)


def test_each_matmul_implementation_is_decided_and_printed():
    """The implementation is a decision: printed with the others, read by the kernel."""
    graph = _convolution()
    optimized = passes.optimize(graph)
    decisions = decide(optimized, graph.variables, matmul_epilogues=True, implicit_gemm=True)
    text = str(decisions)
    impls = set(decisions.matmuls.values())
    assert {"winograd", "direct rows"} <= impls and "matmuls: " in text and "winograd" in text
    plan = _c_plan(graph)
    assert {k.impl for k in plan.kernels if k.kind == "matmul"} == impls
    assert "direct rows" in plan.decisions and "winograd" in plan.decisions
    narrow = decide(passes.optimize(_matmul()))
    assert sorted(narrow.matmuls.values()) == ["gemm", "narrow"]
    assert sorted(decide(passes.optimize(_matmul()), language=CUDA).matmuls.values()) == ["template gemm"] * 2


def test_a_narrow_product_gets_the_layout_its_decision_needs():
    """Decide chose the narrow kernel; an A whose rows and columns are both strided is copied by
    the lowering (not computed by another GEMM than the one decided)."""
    import numpy as np
    x, w = sg.input("x", (8, 12)), sg.param("w", (6, 4))
    a = x[::2, ::2]                                   # (4, 6), strides (24, 2)
    graph = Graph([x], [a @ w])
    plan = _c_plan(graph)
    (product,) = [k for k in plan.kernels if k.kind == "matmul"]
    assert product.impl == "narrow" and product.variant == "dot" and plan.kernels[0].report_kind == "copy"
    xv = np.random.default_rng(0).standard_normal((8, 12)).astype(np.float32)
    got = sg.function([x], [a @ w], backend="c")(xv)[0]
    want = sg.function([x], [a @ w], backend="numpy")(xv)[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
