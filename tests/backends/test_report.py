"""step.report() as an object (issue 37): a summary that fits a screen, then sections printable
alone, with the numbers behind its tables; and the printed graph's header wrapped."""

from __future__ import annotations

import pytest

import symgrad as sg
from symgrad.backends.report import SUMMARY_WIDTH, Report, Section, kernel_work
from symgrad.ir.printing import HEADER_WIDTH

IN, HIDDEN, OUT = 12, 32, 5


@pytest.fixture(scope="module")
def step():
    sg.manual_seed(0)
    model = sg.nn.Sequential(sg.nn.Linear(IN, HIDDEN), sg.nn.ReLU(), sg.nn.Linear(HIDDEN, OUT))
    x, y = sg.input("x", (sg.Dim("B"), IN)), sg.input("y", (sg.Dim("B"),), dtype="int64")
    return sg.train_step(sg.cross_entropy(model(x), y), model.parameters(), sg.optim.Adam(lr=1e-3), backend="c")


def test_print_starts_with_a_summary_that_fits_a_screen(step):
    report = step.report()
    assert isinstance(report, Report)
    text = str(report)
    assert text.startswith("== summary ==\n") and text.index("== passes ==") > len(str(report.summary))
    lines = str(report.summary).splitlines()
    assert len(lines) <= 40 and max(map(len, lines)) <= SUMMARY_WIDTH, str(report.summary)
    for needle in ("step memory", "at its peak", "the largest buffers", "compile ", "passes: ", "kernels: ",
                   "report.kernels"):
        assert needle in str(report.summary), needle
    assert repr(report) == str(report.summary)  # at a prompt: the summary alone


def test_each_section_prints_alone_and_the_whole_holds_them_all(step):
    report = step.report()
    for name, title in (("passes", "passes"), ("kernels", "kernels"), ("decisions", "save / recompute"),
                        ("memory", "memory plan"), ("compile_time", "compile time")):
        section = getattr(report, name)
        assert isinstance(section, Section) and str(section).startswith(f"== {title} ==\n")
        assert str(section) in str(report) and str(section) in report  # `in` reads the whole text
    with pytest.raises(AttributeError, match="no section 'profile'.*kernels"):
        report.profile
    assert (report + "\nmore").endswith("\nmore") and ("more\n" + report).startswith("more\n")


def test_the_tables_hold_the_plan_numbers(step):
    report, program = step.report(), step.program
    assert [r["name"] for r in report.kernel_rows] == [k.name for k in program.plan.kernels]
    products = [r for r in report.kernel_rows if r["kind"] in ("matmul", "fused matmul")]
    batch = program.memory_plan.bindings[next(iter(program.memory_plan.bindings))]
    # the forward's first product, x @ W1.T: 2 * B * IN * HIDDEN, plus its fused epilogue's ops per element
    assert any(2 * batch * IN * HIDDEN <= r["flops"] <= (2 * IN + 4) * batch * HIDDEN for r in products)
    mp = program.memory_plan
    assert [(r["bytes"], r["offset"], (r["first"], r["last"])) for r in report.buffer_rows] == \
        list(zip(mp.sizes, mp.offsets, mp.live))
    assert sum(report.step_memory.values()) > report.arena_bytes == mp.arena_bytes
    assert report.nodes == (len(program.graph.nodes), len(program.optimized.nodes))
    assert all(kernel_work(k, mp.bindings)[1] > 0 for k in program.plan.kernels)


def test_numpy_gives_a_report_too():
    x = sg.input("x", (3,))
    report = sg.function([x], sg.exp(x), backend="numpy").report()
    assert isinstance(report, Report) and "no passes" in report and not report.sections


def test_a_long_graph_header_wraps_and_a_short_one_does_not():
    x = sg.input("x", (sg.Dim("B"), 4))
    params = [sg.param(f"layer{k}.weight", (4, 4)) for k in range(20)]
    h = x
    for W in params:
        h = h @ W
    long_lines = str(sg.function([x], sg.sum(h), backend="numpy").graph).splitlines()
    assert max(map(len, long_lines)) <= HEADER_WIDTH + 2  # " {" closes the last header line
    header = long_lines[:long_lines.index(next(line for line in long_lines if line.startswith("  t")))]
    assert header[0] == "graph(x: f32[B,4])" and header[1].startswith("  vars(layer0.weight: f32[4,4], ")
    assert header[-1].endswith("layer19.weight: f32[4,4]) {") and len(header) > 2
    short = str(sg.function([x], sg.sum(x @ params[0]), backend="numpy").graph).splitlines()[0]
    assert short == "graph(x: f32[B,4]) vars(layer0.weight: f32[4,4]) {"
