"""Depth costs calls, not code: kernels that differ only in their buffers share one C function,
and a large program is compiled as translation units side by side (symgrad.backends.render.kernel_functions,
render.program, toolchain).

A model of N identical layers is built here at two depths: its C holds the same functions whatever
the depth, each layer's kernels calling them with their own buffers, and the numbers agree with
the NumPy reference. The same model, rendered in several units (UNIT_LINES lowered), builds
through the parallel path and computes the same numbers; its source still compiles as one file.
"""

from __future__ import annotations

import io
import re
import subprocess
import time

import numpy as np
import pytest

import symgrad as sg
from symgrad.backends.render import kernel_functions, program as render_program, templates
from symgrad.backends.render.expressions import comment
from symgrad.backends.render.renderer import Let, Store
from symgrad.backends.build import runtime, toolchain
from symgrad.backends.build.progress import BuildProgress

WIDTH, BATCH = 24, 6


def _mlp(depth: int, name: str):
    """An MLP of `depth` identical layers, its loss and the gradients of its weights."""
    x = sg.input(f"{name}_x", (BATCH, WIDTH), dtype="float64")
    weights = [sg.param(f"{name}_w{k}", (WIDTH, WIDTH), dtype="float64") for k in range(depth)]
    h = x
    for w in weights:
        h = sg.tanh(h @ w) * 0.5
    loss = sg.mean(h * h)
    return [x], [loss, *sg.grad(loss, weights)]


def _functions(source: str) -> list[str]:
    return re.findall(r"^SG_KERNEL void (k\w+)\(.*\)$\n\{", source, re.M)


@pytest.fixture(scope="module")
def depths():
    """The model at depths 4 and 8 on C and NumPy, with inputs (4 has layers inside, past the first and
    the last, whose kernels differ)."""
    rng = np.random.default_rng(0)
    built = {}
    for depth in (4, 8):
        inputs, outputs = _mlp(depth, f"d{depth}")
        feed = [rng.standard_normal((BATCH, WIDTH))]
        c, reference = (sg.function(inputs, outputs, backend=b) for b in ("c", "numpy"))
        built[depth] = (c, reference, feed)
    return built


def test_a_deeper_model_adds_calls_not_functions(depths):
    shallow, deep = (depths[d][0] for d in (4, 8))
    assert len(deep.program.plan.kernels) > len(shallow.program.plan.kernels) + 3 * 4
    assert len(_functions(deep.source)) == len(_functions(shallow.source))
    grouped = kernel_functions.calls(deep.source, [k.name for k in deep.program.plan.kernels])
    assert len(grouped) == len(_functions(deep.source))
    assert max(len(users) for users in grouped.values()) >= 6   # an inner layer's kernel, called once per inner layer
    report = str(deep.report().kernels)
    assert f"{len(grouped)} distinct kernels (C functions)" in report
    assert re.search(r"^  k\w+ +x[6-9] ", report, re.M), report


@pytest.mark.parametrize("depth", [4, 8])
def test_shared_functions_compute_each_layers_numbers(depths, depth):
    c, reference, feed = depths[depth]
    for got, want in zip(c(*feed), reference(*feed)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


def test_kernels_differing_in_a_constant_do_not_share():
    """Same shapes and buffers, another literal: two functions (the comparison keeps every
    identifier and number but the kernel's own names)."""
    x = sg.input("x", (5, 7), dtype="float64")
    fn = sg.function([x], [sg.exp(x) * 2.5, sg.exp(x) * 3.5, sg.exp(x + 1.0) * 2.5], backend="c")
    assert len(_functions(fn.source)) == len(fn.program.plan.kernels)


def test_kernels_differing_only_in_their_count_share_a_function_taking_it():
    """Every parameter's optimizer update is the same code over its own size: one function with
    the element count an argument (kinds.loop.with_count_argument). A kernel whose code no other
    shares keeps its constant count (a known trip count vectorizes with no remainder loop)."""
    sizes = [(7,), (5, 3), (11,)]
    xs = [sg.input(f"count_x{k}", shape, dtype="float64") for k, shape in enumerate(sizes)]
    lone = sg.input("count_lone", (4,), dtype="float64")
    outputs = [sg.exp(x) * 2.5 - 1.0 for x in xs] + [sg.exp(lone) * 3.5]
    fn, reference = (sg.function([*xs, lone], outputs, backend=b) for b in ("c", "numpy"))
    assert len(_functions(fn.source)) == 2
    counted = re.findall(r"^SG_KERNEL void (k\w+)\(.*, int64_t n\)$\n\{\n(?:.*\n)*?    for \(int64_t i0 = 0; i0 < n; ",
                         fn.source, re.M)
    assert len(counted) == 1, fn.source
    for count in (7, 15, 11):
        assert re.search(rf"^    {counted[0]}\(.*, {count}\);", fn.source, re.M), count
    assert "i0 < 4;" in fn.source   # the lone kernel's constant
    assert "on their buffers and element counts" in fn.source
    rng = np.random.default_rng(3)
    feed = [rng.standard_normal(shape) for shape in sizes] + [rng.standard_normal(4)]
    for got, want in zip(fn(*feed), reference(*feed)):
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=0)


def test_canonical_form_renames_only_the_kernels_own_names():
    text = "SG_KERNEL void k3_add_t9(const float* restrict ws1, float* restrict var2)\n{\n" \
           "    const float t9 = ws1[0] + c4[0];  /* t9: ... */\n    var2[0] = t9;\n}"
    other = text.replace("k3_add_t9", "k8_add_t20").replace("t9", "t20").replace("ws1", "ws7") \
                .replace("var2", "var5")
    assert kernel_functions.canonical(text, "k3_add_t9", ["ws1", "var2"]) == \
        kernel_functions.canonical(other, "k8_add_t20", ["ws7", "var5"])
    # a free name (the constant table c4) is part of what the function computes
    assert kernel_functions.canonical(text, "k3_add_t9", ["ws1", "var2"]) != \
        kernel_functions.canonical(other.replace("c4", "c5"), "k8_add_t20", ["ws7", "var5"])
    assert kernel_functions.shared([text, other, text], ["k3_add_t9", "k8_add_t20", "k3_add_t9"],
                                   [["ws1", "var2"], ["ws7", "var5"], ["ws1", "var2"]]) == [0, 0, 0]


def _context(name="k3_add_t9", inputs=("ws1",), out="var2", local="t9", literal="1.0f", note="t9: ...", args=None):
    """A loop kernel's template context as kinds render it, cut down to what sharing_key reads."""
    params = [dict(ctype="float", name=b, const=b != out, pointer=True, restrict=True) for b in (*inputs, out)]
    body = [Let("float", local, f"{inputs[0]}[i0] + {literal}", comment(note)), Store(out, "i0", local)]
    return dict(kind="loop", name=name, params=params, args=args or [*inputs, out], body=body,
                comments=[comment(f"{local} = add({inputs[0]}, 1)")])


def test_a_sharing_key_is_the_context_without_comments_names_or_call():
    key = kernel_functions.sharing_key
    base = key(_context())
    # another layer's kernel: its own name, buffers, node local, comments and call arguments
    assert key(_context("k8_add_t20", ("ws7",), "var5", "t20", note="t20: other", args=["ws7", "var5"])) == base
    assert key(_context(literal="2.0f")) != base                 # another constant: another function
    assert key(_context(inputs=("c4",))) == base                 # a parameter, whatever its name
    different_order = _context()
    different_order["params"].reverse()                          # the same names in other roles
    assert key(different_order) != base
    as_code = _context()
    as_code["body"][0] = Let("float", "t9", "ws1[i0] + 1.0f", "t9: ...")   # a str is code, a Comment is not
    assert key(as_code) != base
    assert key(dict(_context(), extra=np.float32(1))) is None   # a value whose text may not say it all


def test_kernels_with_one_sharing_key_are_rendered_once(depths, monkeypatch):
    """The deep model's program renders one kernel per sharing key (its other kernels call that
    one's function), and its source is the one every kernel rendered and compared gives."""
    from symgrad.backends.render.languages import C_OPENMP
    deep = depths[8][0].program
    rendered = []
    monkeypatch.setattr(render_program, "render_template",
                        lambda template, **context: rendered.append(template) or templates.render(template, **context))
    monkeypatch.setattr(render_program, "VERIFY_SHARING", False)
    source = render_program.render(deep.plan, C_OPENMP)
    kernels = [k for k in rendered if not k.startswith("program/")]
    assert len(deep.plan.kernels) > 2 * len(kernels) >= 2 * len(_functions(source))
    assert source == deep.source   # as rendered in full when the fixture compiled it (VERIFY_SHARING)


def test_the_check_finds_kernels_with_one_key_and_different_sources(depths, monkeypatch):
    from symgrad.backends.render.languages import C_OPENMP
    monkeypatch.setattr(render_program, "sharing_key", lambda context: "one key for all")
    with pytest.raises(AssertionError, match="have one sharing key and different sources"):
        render_program.render(depths[4][0].program.plan, C_OPENMP)


def test_partition_balances_the_units():
    sizes = [500, 400, 300, 200, 100, 100]
    units = kernel_functions.partition(sizes, 2)
    loads = [sum(s for s, u in zip(sizes, units) if u == unit) for unit in range(2)]
    assert sorted(loads) == [800, 800]
    assert render_program.unit_count(10) == 1
    assert render_program.unit_count(render_program.TWO_UNIT_LINES - 1) == 1
    assert render_program.unit_count(render_program.TWO_UNIT_LINES) == 2   # both cores of two
    assert render_program.unit_count(render_program.UNIT_LINES * 2 - 1) == 2
    assert render_program.unit_count(render_program.UNIT_LINES * 3) == 4
    assert render_program.unit_count(10 ** 9) == render_program.MAX_UNITS


@pytest.fixture(scope="module")
def in_units():
    """The depth-6 model rendered as translation units (UNIT_LINES lowered for it)."""
    patch = pytest.MonkeyPatch()
    patch.setattr(render_program, "UNIT_LINES", 20)
    try:
        inputs, outputs = _mlp(6, "units")
        fn = sg.function(inputs, outputs, backend="c")
    finally:
        patch.undo()
    return fn, sg.function(inputs, outputs, backend="numpy")


def test_a_program_in_units_computes_the_same_numbers(in_units):
    fn, reference = in_units
    units = toolchain.translation_units(fn.source)
    assert units > 1 and f"#if SG_IN_PART({units - 1})" in fn.source
    feed = [np.random.default_rng(1).standard_normal((BATCH, WIDTH))]
    for got, want in zip(fn(*feed), reference(*feed)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


def test_the_source_in_units_is_still_one_c_file(in_units, tmp_path):
    """Without -DSG_PART the file is one translation unit that any C compiler builds."""
    fn, _ = in_units
    (tmp_path / "program.c").write_text(fn.source)
    (tmp_path / runtime.HEADER).write_text(runtime.header())
    done = subprocess.run([*toolchain.compiler_command(), "-O0", "-std=c11", "-fopenmp", "-fsyntax-only",
                           "-I", str(tmp_path), str(tmp_path / "program.c")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_long_build_says_what_it_compiles():
    quiet, shown, bar = io.StringIO(), io.StringIO(), _Terminal()
    BuildProgress("a C program: 9 kernels in 3 functions", units=4, jobs=2, stream=quiet, delay=60).tick()
    assert quiet.getvalue() == ""   # not yet a second: nothing said
    progress = BuildProgress("a C program: 9 kernels in 3 functions", units=4, jobs=2, stream=shown, delay=0)
    for _ in range(3):
        progress.tick()
    progress.end()
    assert shown.getvalue() == ("symgrad: compiling a C program: 9 kernels in 3 functions "
                                "(4 translation units on 2 jobs)...\n")
    progress = BuildProgress("x", units=2, jobs=2, stream=bar, delay=0)
    progress.tick()
    progress.unit_done()
    progress.end()
    assert bar.getvalue().startswith("\rsymgrad: compiling x (2 translation units on 2 jobs) [")
    assert "1/2" in bar.getvalue() and bar.getvalue().endswith(" s\n") and "done in" in bar.getvalue()


def test_a_compile_is_announced_unless_quiet(capfd, monkeypatch):
    from symgrad.backends.build import progress as build_progress
    monkeypatch.setattr(build_progress, "DELAY", 0.0)
    monkeypatch.delenv("SYMGRAD_QUIET", raising=False)  # a run that silences builds would hide the line
    x = sg.input("x", (3, 11), dtype="float64")
    # Constants of this run's own: a program the cache holds (a cache directory reused) runs no compiler.
    fresh = time.time_ns() % 1_000_003 * 1e-9
    sg.function([x], [sg.sin(x) * (1.25 + fresh)], backend="c", quiet=True)
    assert "symgrad: compiling" not in capfd.readouterr().err
    sg.function([x], [sg.sin(x) * (1.5 + fresh)], backend="c")
    assert "symgrad: compiling a C program: 1 kernels in 1 functions (1 translation unit)" in capfd.readouterr().err
    monkeypatch.setenv("SYMGRAD_QUIET", "1")
    sg.function([x], [sg.sin(x) * (1.75 + fresh)], backend="c")
    assert "symgrad: compiling" not in capfd.readouterr().err


def _entry(source: str) -> str:
    return source[source.index("int symgrad_run("):]


def test_a_deeper_model_adds_loop_rounds_not_lines(depths):
    """The inner layers' calls are loops over the layers (entry_loops): the entry point of the model
    twice as deep is about as long, and its loops' rounds count the layers."""
    deep = depths[8][0]
    lines = {d: _entry(depths[d][0].source).count("\n") for d in (4, 8)}
    assert lines[8] <= lines[4] + 12, lines
    rounds = [int(n) for n in re.findall(r"for \(int64_t l = 0; l < (\d+); \+\+l\)", _entry(deep.source))]
    assert rounds and max(rounds) >= 6, rounds
    # a call that may stop the entry names its round's kernel from a table: the kernels in run order
    tables = re.findall(r"static const char\* const stopped_\w+\[(\d+) \* (\d+)\] = \{.*?\n(.*?)\n    \};",
                        deep.source, re.S)
    order = [k.name for k in deep.program.plan.kernels]
    for count, stops, rows in tables:
        names = re.findall(r'"(k\w+)"', rows)
        assert len(names) == int(count) * int(stops)
        assert [order.index(n) for n in names] == sorted(order.index(n) for n in names)
    assert tables


def test_an_entry_in_loops_computes_the_bits_of_one_unrolled(depths, monkeypatch):
    """The same depth-8 model with no loops found (its calls written out one by one) computes the
    same bits: the loops only say which buffers each call gets."""
    c, _, feed = depths[8]
    monkeypatch.setattr(render_program.entry_loops, "fold", lambda *args, **kwargs: [])
    inputs, outputs = _mlp(8, "unrolled")   # other names: another program, not the cached one
    unrolled = sg.function(inputs, outputs, backend="c")
    assert "for (int64_t l = 0;" not in _entry(unrolled.source)
    for got, want in zip(c(*feed), unrolled(*feed)):
        np.testing.assert_array_equal(got, want)
