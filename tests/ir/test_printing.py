"""Seeing the graph: the let-binding text form, the backward chain, and DOT."""

import io
import re

import numpy as np

import symgrad as sg


def _small_graph():
    B = sg.Dim("B")
    x = sg.input("x", (B, 4))
    W = sg.param("W", (4, 3))
    b = sg.param("b", (3,))
    loss = sg.mean(sg.relu(x @ W + b))
    return x, W, b, loss


def test_text_form_golden():
    """The forward graph reads as a program: one let-binding per node, with shapes."""
    x, W, b, loss = _small_graph()
    f = sg.function([x], [loss], backend="numpy")
    assert str(f.graph) == """\
graph(x: f32[B,4]) vars(W: f32[4,3], b: f32[3]) {
  t0: f32[B,3] = matmul(x, W)
  t1: f32[B,3] = add(t0, b)
  t2: f32[B,3] = relu(t1)
  t3: f32[] = sum[axes=(0,1), keepdims=False](t2)
  t4: f32[] = mul(t3, 1/(3*B))
  return (t4,)
}"""
    assert repr(f.graph) == str(f.graph)
    # A program's source header asks for the text only where it fits (8 lines here): a model's
    # thousands of nodes are counted, not printed.
    from symgrad.ir.printing import graph_text
    assert graph_text(f.graph, max_lines=8) == str(f.graph)
    assert graph_text(f.graph, max_lines=7) is None


def test_print_graph_of_a_training_graph(capsys):
    """print(graph) of forward + backward: every line a well-formed binding, every name defined first."""
    x, W, b, loss = _small_graph()
    gW, gb = sg.grad(loss, [W, b])
    graph = sg.Graph([x], [loss, gW, gb])
    print(graph)
    text = capsys.readouterr().out.strip()
    lines = text.splitlines()
    assert lines[0] == "graph(x: f32[B,4]) vars(W: f32[4,3], b: f32[3]) {"
    assert lines[-1] == "}"
    assert re.fullmatch(r"  return \(t\d+, t\d+, t\d+\)", lines[-2])
    defined = {"x", "W", "b"}
    binding = re.compile(r"  (t\d+): (f32|f64|i64|bool)\[[^\]]*\] = ([a-z_0-9]+)(\[.*\])?\((.*)\)")
    # An op sympy derived (a VJP, a simplified chain) prints as its formula over operand names.
    formula = re.compile(r"  (t\d+): (f32|f64|i64|bool)\[[^\]]*\] = (.*)")
    ops, formulas = [], []
    for line in lines[1:-2]:
        m = binding.fullmatch(line)
        if m and m.group(3) != "Piecewise":
            operands = list(filter(None, m.group(5).split(", ")))
            ops.append(m.group(3))
        else:
            m = formula.fullmatch(line)
            assert m, f"not a let-binding: {line!r}"
            operands = re.findall(r"\bt\d+\b", m.group(3))
            formulas.append(m.group(3))
        for operand in operands:
            assert operand in defined or re.fullmatch(r"[-0-9.e/()*B]+", operand), \
                f"{operand!r} used before it is defined in {line!r}"
        defined.add(m.group(1))
    assert {"matmul", "transpose", "sum", "reshape"} <= set(ops)
    assert any(re.fullmatch(r"Piecewise\(\(0, t\d+ <= 0\), \(t\d+, True\)\)", f) for f in formulas)  # relu's VJP
    # The gradient of W is a matmul of x's transpose with relu's derived VJP.
    assert "f32[4,3] = matmul(" in text


def test_print_graph_backward_chain_of_pow_of_mul(capsys):
    """sg.print_graph(loss) for loss=(x*y)**2: Pow, then Mul, then two AccumulateGrad leaves."""
    x = sg.input("x", ())
    y = sg.input("y", ())
    sg.print_graph((x * y) ** 2)
    lines = capsys.readouterr().out.rstrip("\n").splitlines()
    assert len(lines) == 4
    depth = [(len(line) - len(line.lstrip(" "))) // 2 for line in lines]
    names = [line.strip() for line in lines]
    assert names[0].startswith("Pow") and depth[0] == 0
    assert names[1].startswith("Mul") and depth[1] == 1
    assert names[2:] == ["AccumulateGrad(x)", "AccumulateGrad(y)"] and depth[2:] == [2, 2]


def test_backward_chain_skips_constants_and_integers():
    x = sg.input("x", (3,))
    t = sg.input("t", (3,), dtype="int64")
    chain = sg.backward_chain(sg.sum(sg.exp(x) * 2 + sg.cast(t, "float32")))
    assert chain.splitlines()[0].startswith("Sum")
    assert "AccumulateGrad(x)" in chain
    assert "AccumulateGrad(t)" not in chain and "Const" not in chain
    out = io.StringIO()
    sg.print_graph(sg.sum(x), file=out)
    assert out.getvalue() == "SumBackward\n  AccumulateGrad(x)\n"


def test_to_dot_is_graphviz_text():
    x, W, b, loss = _small_graph()
    gW, gb = sg.grad(loss, [W, b])
    dot = sg.Graph([x], [loss, gW, gb]).to_dot()
    assert dot.startswith("digraph")
    assert dot.rstrip().endswith("}")
    assert dot.count("{") == dot.count("}")
    edges = re.findall(r"^\s*(n\d+) -> (n\d+|out\d+);$", dot, re.M)
    nodes = set(re.findall(r"^\s*(n\d+) \[label=", dot, re.M))
    assert len(edges) >= 10
    for src, dst in edges:
        assert src in nodes and (dst in nodes or dst.startswith("out"))
    assert 'label="x: f32[B,4]"' in dot and "matmul" in dot
    # Every label's quotes are balanced: the text is escaped for DOT.
    for line in dot.splitlines():
        assert line.count('"') % 2 == 0


def test_source_of_numpy_program_is_graph_text():
    x, W, b, loss = _small_graph()
    f = sg.function([x], [loss], backend="numpy")
    assert f.source == str(f.graph)
    assert f.module is None
    assert np.isfinite(f(np.ones((2, 4), np.float32)))


def test_a_formula_prints_as_sympy_prints_it_over_the_operand_names():
    # printing.formula prints each formula once over placeholder names and puts the names in after:
    # its text must be sympy's own over the names (sympy orders terms and factors by their symbols'
    # names), for every op's expression and its derivatives, whatever the names.
    import random
    from types import SimpleNamespace

    import sympy

    from symgrad.ir import elementwise, printing
    from symgrad.ir.registry import ELEMENTWISE, REGISTRY

    expressions = []
    for op in REGISTRY.values():
        if op.kind == ELEMENTWISE and op.expr is not None and op.arity:
            expressions.append((op.expr, op.arity))
            if op.vjp is elementwise.elementwise_vjp:   # derived by sympy (floor's and ceil's are zero)
                expressions += [(elementwise.partial_derivative(op, i), op.arity) for i in range(op.arity)]
    names = ["t9", "t12", "t100", "t1", "x", "b", "h.0.ln_1.weight", "0.5", "-1", "1/B", "t99"]
    rng = random.Random(0)
    for expr, arity in expressions:
        for _ in range(8):
            texts = [rng.choice(names) for _ in range(arity)]
            inputs = [SimpleNamespace(text=t) for t in texts]
            node = SimpleNamespace(op=SimpleNamespace(expr=expr), inputs=inputs)
            shown = [t if t.replace(".", "_").isidentifier() else f"({t})" for t in texts]
            want = str(expr.xreplace({elementwise.ARGS[k]: sympy.Symbol(t) for k, t in enumerate(shown)}))
            assert printing.formula(node, lambda v: v.text) == want
    assert len(expressions) > 50


def test_a_namer_copy_has_the_names_and_goes_on_alone():
    """The lowering and the printed decisions extend copies of the namer decide primed once
    (symgrad.backends.decide.decisions.Decisions.namer) instead of naming every node again."""
    from symgrad.ir.printing import Namer
    x, W, b, loss = _small_graph()
    graph = sg.function([x], [loss], backend="numpy").graph
    first = Namer()
    names = [first(n) for n in graph.nodes]
    copy = first.copy()
    assert [copy(n) for n in graph.nodes] == names
    extra = sg.exp(x)
    assert copy(extra) == first(extra) and copy.names is not first.names   # the same next name, each its own
