"""The lowering's decisions as a value: `decide(graph)` says what is fused, which groups finish a
reduction or a matmul in its kernel, the row groups and the kernel order; it is pure, prints as a
readable list, and the lowering builds exactly the kernels it lists, in its order."""

from __future__ import annotations

import dataclasses

import pytest

import symgrad as sg
from symgrad import passes
from symgrad.backends.decide.decisions import Decisions, decide, graph_namer
from symgrad.backends.lower.lowering import lower


def _softmax_regression():
    """The seed softmax-regression step (cross-entropy of x @ W + b), optimized as the C backend does."""
    B = sg.Dim("B")
    x, y = sg.input("x", (B, 784)), sg.input("y", (B,), dtype="int64")
    W, b = sg.param("W", (784, 10)), sg.param("b", (10,))
    step = sg.train_step(sg.cross_entropy(x @ W + b, y), [W, b], sg.optim.SGD(lr=0.1), backend="numpy")
    return passes.optimize(step.graph), step.graph.variables


def _mlp():
    """A two-layer ReLU MLP's training step."""
    sg.manual_seed(0)
    x, y = sg.input("x", (32, 20)), sg.input("y", (32,), dtype="int64")
    model = sg.nn.Sequential(sg.nn.Linear(20, 16), sg.nn.ReLU(), sg.nn.Linear(16, 5))
    step = sg.train_step(sg.cross_entropy(model(x), y), model.parameters(), sg.optim.SGD(lr=0.1), backend="numpy")
    return passes.optimize(step.graph), step.graph.variables


@pytest.fixture(scope="module", params=["softmax_regression", "mlp"])
def case(request):
    graph, variables = {"softmax_regression": _softmax_regression, "mlp": _mlp}[request.param]()
    return request.param, graph, variables


def _nodes(graph, op: str) -> list:
    return [n for n in graph.nodes if n.op.name == op]


def test_softmax_cross_entropy_decisions():
    graph, variables = _softmax_regression()
    d = decide(graph, variables, matmul_epilogues=True)
    name = graph_namer(graph, variables)
    text = str(d)
    # One row group: the row max, exp, row sum, log and the backward's row sum and softmax gradient,
    # the mean loss's full sum split into per-row parts. (The backward's per-element scale, -1 over
    # the count of targets not ignored, where selected, is a member too.)
    (g,) = d.row_groups
    assert [m.op.name for m in g.members if m.op.name != "where_vjp1"][:5] == ["max", "exp", "sum", "log", "sum"]
    (full_sum,) = g.partials
    assert full_sum.op.name == "sum" and full_sum.shape == ()
    assert f"rows (B,) x 10: max {name(g.members[0])}, exp" in text
    # The loss scaling (mul by -1/B) finishes the full sum in its kernel.
    (loss,) = graph.outputs
    assert d.epilogue_of[id(loss)] is full_sum
    assert f"epilogues: {name(loss)} <- sum {name(full_sum)}" in text
    # (x @ W + b) is recomputed where it is read, not stored: the matmul is a kernel of its own.
    (bias_add,) = [n for n in _nodes(graph, "add") if n.inputs[0].op.name == "matmul"]
    assert id(bias_add) in d.recomputed and id(bias_add) in d.fused
    assert "recomputed by each reader: " in text and name(bias_add) in text.split("recomputed by each reader: ")[1]
    # Kernels in order: the count of targets not ignored (ignore_index; the mean divides by it),
    # the forward matmul, the row kernel, the loss, then the updates.
    kernels = d.kernels()
    assert kernels.pop(0).startswith("sum ")
    assert kernels[0] == f"matmul {name(_nodes(graph, 'matmul')[0])}"
    assert kernels[1] == "rows " + " ".join(name(m) for m in g.members)
    assert kernels[2] == f"sum {name(full_sum)} -> {name(loss)}"
    assert sum(line.startswith("matmul") for line in kernels) == 2
    assert "\nkernels, in order:\n  " + "\n  ".join(d.kernels()) in text


def test_mlp_decisions():
    graph, variables = _mlp()
    name = graph_namer(graph, variables)
    d = decide(graph, variables, matmul_epilogues=True)
    # relu(x @ W1.T + b1) runs as the first GEMM stores each element, and relu's backward mask
    # (dh * (h > 0)) as the backward GEMM stores dh.
    relu, mask = _nodes(graph, "relu")[0], next(n for n in graph.nodes if n.op.name != "relu"
                                                 and any(i.op.name == "relu" for i in n.inputs)
                                                 and any(i.op.name == "matmul" for i in n.inputs))
    first_matmul = _nodes(graph, "matmul")[0]
    assert d.epilogue_of[id(relu)] is first_matmul
    assert d.epilogue_of[id(mask)].op.name == "matmul"
    assert f"{name(relu)} <- matmul {name(first_matmul)}" in str(d)
    assert d.kernels()[1] == f"matmul {name(first_matmul)} -> {name(relu)}"  # after the count of kept targets
    assert len(d.row_groups) == 1
    # Without matmul epilogues, only the loss's epilogue stays.
    plain = decide(graph, variables)
    assert [r.op.name for r in plain.epilogue_of.values()] == ["sum"]
    assert plain != d and "matmul_epilogues=False" in str(plain)
    # Without fuse_reduce: no row groups, no epilogues, no reduction prologues.
    unfused = decide(graph, variables, fuse_reduce=False)
    assert unfused.row_groups == () and not unfused.epilogue_of
    assert "row groups: none" in str(unfused) and "epilogues: none" in str(unfused)


def test_decide_is_pure(case):
    _, graph, variables = case
    before = (str(graph), [id(n) for n in graph.nodes], dict(graph.users))
    first = decide(graph, variables, matmul_epilogues=True)
    second = decide(graph, variables, matmul_epilogues=True)
    assert first == second and str(first) == str(second)
    assert first is not second
    after = (str(graph), [id(n) for n in graph.nodes], dict(graph.users))
    assert before[:2] == after[:2] and before[2].keys() == after[2].keys()
    assert all([id(u) for u in before[2][k]] == [id(u) for u in after[2][k]] for k in before[2])
    # Lowering twice decides the same: the plans are the same kernels, named the same.
    assert [k.name for k in lower(graph, variables).kernels] == [k.name for k in lower(graph, variables).kernels]


def test_decisions_are_frozen(case):
    _, graph, variables = case
    d = decide(graph, variables)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.order = ()  # type: ignore[misc]
    with pytest.raises(TypeError):
        d.epilogue_of[0] = None  # type: ignore[index]
    plan = lower(graph, variables)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.kernels[0].name = "renamed"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.workspace[0].name = "ws9"  # type: ignore[misc]


@pytest.mark.parametrize("options", [dict(matmul_epilogues=True), {}, dict(fuse_reduce=False),
                                     dict(recompute=False), dict(schedule=False)])
def test_lowering_builds_the_decided_kernels_in_order(case, options):
    """Every kernel the decisions list, and no other (copies into outputs and variables aside),
    in the decided order: each kernel is named after the node it stores."""
    _, graph, variables = case
    d = decide(graph, variables, **options)
    name = graph_namer(graph, variables)
    plan = lower(graph, variables, **options)
    built = [k.name.rsplit("_", 1)[1] for k in plan.kernels if not k.name.endswith("_copy")]
    decided = [line.split()[1] if line.startswith("rows ") else line.split()[-1] for line in d.kernels()]
    assert built == decided
    assert isinstance(d, Decisions) and plan.choices == list(d.choices)
    assert all(name(n) for n in d.order)
