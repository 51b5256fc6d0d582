"""The one C-style renderer (symgrad.backends.render.renderer): languages as data, statements in templates.

A language is a row of symgrad.backends.render.languages; a statement is data printed by
templates/statements.j2; no Python module of the back end writes C statements as strings.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

import symgrad as sg
from symgrad import passes
from symgrad.backends import c as cbackend
from symgrad.backends import cuda
from symgrad.backends.render.languages import C_OPENMP, CUDA, Language
from symgrad.backends.lower.lowering import lower
from symgrad.backends.render.renderer import Accumulator, Fold, Let, Renderer, Store
from symgrad.backends.render.program import kernel_contexts, render
from symgrad.backends.render.templates import environment
from symgrad.ir.graph import Graph

BACKENDS = Path(sg.__file__).resolve().parent / "backends"
# The expression printers print expressions, not statements; a cffi `cdef` declares the built
# library's ABI to Python (what Python calls), it is not code symgrad emits.
PRINTERS = {"c_printer.py", "cuda_printer.py"}
# What ends a C statement or opens a block inside a string: `;` at its end, before a comment or a
# newline; a `{` ending a line; a pragma.
C_STATEMENT = re.compile(r";(\n|$|\s+/\*)|\{\n|\{$|#pragma")


def _cdef_constants(tree) -> set[int]:
    """ids of the string constants of cffi declarations: assigned to a name holding "cdef"
    (CDEF, _CDEF, ...) or passed to a `.cdef(...)` call."""
    def named_cdef(target) -> bool:
        name = target.id if isinstance(target, ast.Name) else getattr(target, "attr", "")
        return "cdef" in name.lower()

    held = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(named_cdef(t) for t in targets) and node.value is not None:
                held |= {id(n) for n in ast.walk(node.value)}
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "cdef":
            held |= {id(n) for arg in node.args for n in ast.walk(arg)}
    return held


def _docstrings(tree) -> set[int]:
    held = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                held.add(id(first.value))
    return held


def test_no_backend_module_writes_c_statements_as_strings():
    found = []
    for path in sorted(BACKENDS.rglob("*.py")):
        if path.name in PRINTERS:
            continue
        tree = ast.parse(path.read_text(), str(path))
        allowed = _cdef_constants(tree) | _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in allowed \
                    and C_STATEMENT.search(node.value):
                found.append(f"{path.name}:{node.lineno}: {node.value[:60]!r}")
    assert not found, "C statements belong in templates/statements.j2 or the kernel templates:\n" + "\n".join(found)


def test_the_check_sees_a_statement_in_an_f_string():
    """The scan above reads f-strings' literal parts too (what the old renderer's lines were)."""
    tree = ast.parse('line = f"const {t} {name} = {value};  /* {note} */"')
    assert any(isinstance(n, ast.Constant) and C_STATEMENT.search(n.value) for n in ast.walk(tree))


def _macro(name: str, *args):
    return getattr(environment().get_template("statements.j2").module, name)(*args)


def test_statements_print_from_data():
    assert _macro("statement", Let("float", "t3", "expf(v0)", "t3 = exp(x)"), "") == \
        "const float t3 = expf(v0);  /* t3 = exp(x) */"
    assert _macro("statement", Store("out0", "i0 * 3 + i1", "t3"), "") == "out0[i0 * 3 + i1] = t3;"
    argmax = Accumulator("argmax", "acc", "float", "v", lowest="-INFINITY", index="r0 * 5 + r1")
    assert _macro("init", argmax, "    ") == "float acc = -INFINITY;\n    int64_t best = -1;"
    assert _macro("statement", Fold(argmax), "    ").splitlines() == [
        "if (best < 0 || v > acc || (v != v && acc == acc)) {  /* the first maximum; NaN wins */",
        "        acc = v;", "        best = r0 * 5 + r1;", "    }"]
    flagged = Accumulator("max", "m", "double", "t1", lowest="-INFINITY", nan_flag="m_nan", note="max")
    assert _macro("statement", Fold(flagged), "  ").splitlines() == [
        "m = t1 > m ? t1 : m;  /* max */", "  m_nan |= t1 != t1;  /* NaN propagates, as in NumPy */"]
    total = Accumulator("sum", "s", "double", "t0")
    assert _macro("simd", [total, flagged]) == "simd reduction(+:s) reduction(max:m) reduction(|:m_nan)"
    assert _macro("simd", []) == "simd"


def _plan(graph, language=C_OPENMP):
    return lower(passes.optimize(graph), variables=graph.variables, language=language)


def _softmax_graph():
    x, y = sg.input("x", (sg.Dim("B"), 6)), sg.input("y", (sg.Dim("B"),), dtype="int64")
    W = sg.param("W", (6, 4))
    logits = x @ W
    return Graph([x, y], [sg.cross_entropy(logits, y), sg.argmax(logits, axis=1), sg.max(x, axis=0)])


def test_one_renderer_two_languages():
    plan, cu_plan = _plan(_softmax_graph()), _plan(_softmax_graph(), CUDA)  # (each product as its language builds it)
    c_text, cu_text = render(plan, C_OPENMP), render(cu_plan, CUDA)
    assert c_text == cbackend.render_source(plan) and cu_text == cuda.render_source(cu_plan)
    assert "#pragma omp" in c_text and "__global__" not in c_text and " restrict " in c_text
    assert "__global__" in cu_text and "#pragma omp" not in cu_text and "__restrict__" in cu_text
    # the same statement of the same node in both languages
    kernels = kernel_contexts(Renderer(plan, C_OPENMP))
    lets = [s for k in kernels for s in k.get("body", []) if isinstance(s, Let)]
    assert lets and all(f"const {s.ctype} {s.name} = {s.value};" in cu_text for s in lets)


def test_a_language_is_a_row_of_data():
    """Changing a field of the table changes the source the same renderer prints."""
    assert dataclasses.is_dataclass(Language) and Language.__dataclass_params__.frozen
    plan = _plan(_softmax_graph())
    other = dataclasses.replace(C_OPENMP, restrict="__restrict")
    text = render(plan, other)
    assert " restrict " not in text and text.replace("__restrict", "restrict") == render(plan, C_OPENMP)


def test_flat_loops_split_only_the_indices_a_view_reads():
    plan = _plan(_softmax_graph(), CUDA)
    renderer = Renderer(plan, CUDA)
    assert renderer.split([3, 4, 5], "i", {1}) == [
        dict(var="i2", size="5", step="div"), dict(var="i1", size="4", step="last_mod")]
    assert renderer.split([3, 4, 5], "i", {0, 2}) == [
        dict(var="i2", size="5", step="mod"), dict(var="i1", size="4", step="div"),
        dict(var="i0", size="3", step="rest")]
    assert renderer.split([3, 4], "i", set()) == []
    assert Renderer(plan, C_OPENMP).split([3, 4], "i", {0}) == []  # C loops nest instead


def test_cuda_matmul_gets_no_epilogue_it_cannot_run():
    """Decide consults the language: CUDA's template GEMM fuses no epilogue, so its plan has none
    (the relu is a loop); a plan decided for C is no CUDA plan (its product is the runtime's)."""
    x = sg.input("x", (4, 3))
    W = sg.param("W", (3, 2))
    graph = Graph([x], [sg.relu(x @ W)])
    plan = lower(passes.optimize(graph), variables=graph.variables, matmul_epilogues=True, language=CUDA)
    (product,) = [k for k in plan.kernels if k.kind == "matmul"]
    assert product.impl == "template gemm" and not product.epilogue_statements
    assert "__global__" in render(plan, CUDA)
    c_plan = lower(passes.optimize(graph), variables=graph.variables, matmul_epilogues=True)
    with pytest.raises(ValueError, match="decided for another language"):
        render(c_plan, CUDA)
