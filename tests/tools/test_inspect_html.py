"""`symgrad inspect FILE --html PAGE` (issue 37): one self-contained page that parses, embeds every
picture (no external src or href) and whose tables hold the report's numbers."""

from __future__ import annotations

import io
import os
import stat
from html.parser import HTMLParser

import pytest

from symgrad.tools.cli import main
from symgrad.tools.inspect import example_inputs, run_inspect

MODEL = '''
import symgrad as sg

def build():
    B = sg.Dim("B")
    x, y = sg.input("x", (B, 6)), sg.input("y", (B,), dtype="int64")
    model = sg.nn.Sequential(sg.nn.Linear(6, 8), sg.nn.Tanh(), sg.nn.Linear(8, 3))
    return sg.cross_entropy(model(x), y), model.parameters(), sg.optim.Adam(lr=0.01)
'''


class Page(HTMLParser):
    """What the tests read from a page: its tags' links, its svg and img tags, its tables' cells."""

    def __init__(self):
        super().__init__()
        self.links, self.tags, self.tables, self.stack = [], [], {}, []
        self._cell, self._table = None, None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append(tag)
        self.links += [(tag, k, v) for k, v in attrs.items() if k in ("src", "href", "xlink:href") and v]
        if tag == "table":
            self._table = self.tables.setdefault(attrs.get("class", ""), [])
        elif tag == "tr" and self._table is not None:
            self._table.append([])
        elif tag == "td":
            self._cell = ""

    def handle_endtag(self, tag):
        if tag == "td" and self._table is not None:
            self._table[-1].append(self._cell)
            self._cell = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data


def _parse(text: str) -> Page:
    page = Page()
    page.feed(text)
    page.close()
    return page


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("inspect") / "model.py"
    path.write_text(MODEL)
    return path


@pytest.fixture(scope="module")
def page(model_file):
    out = io.StringIO()
    written = run_inspect(model_file, model_file.parent / "out", backend="c", file=out,
                          html=model_file.parent / "out" / "page.html")
    assert f"wrote html: {written['html']}" in out.getvalue()
    return written


def _report(model_file):
    """The report of the same step the page shows (the program and build caches give it back)."""
    import runpy

    import symgrad as sg

    loss, params, optimizer = runpy.run_path(str(model_file))["build"]()
    return sg.train_step(loss, params, optimizer, backend="c").report()


def test_the_page_parses_and_embeds_every_picture(page):
    text = page["html"].read_text()
    parsed = _parse(text)
    assert text.startswith("<!DOCTYPE html>") and parsed.tags.count("svg") >= 1
    assert parsed.links == [] and "img" not in parsed.tags  # nothing loaded from elsewhere
    assert "<script" not in text
    for anchor in ('id="summary"', 'id="graph"', 'id="memory"', 'id="kernels"', 'id="compile"'):
        assert anchor in text
    if page["svg"] is None:  # no Graphviz here: the DOT text instead of the picture
        assert "digraph symgrad" in text and "is not installed" in text


def test_the_tables_hold_the_report_numbers(page, model_file):
    report = _report(model_file)
    tables = _parse(page["html"].read_text()).tables
    kernels = [row for row in tables["kernels"] if row]
    assert [(int(r[0]), r[1], r[2], int(r[3]), int(r[4]), r[5]) for r in kernels] == \
        [(r["index"], r["name"], r["kind"], r["flops"], r["bytes"], r["does"]) for r in report.kernel_rows]
    buffers = [row for row in tables["buffers"] if row]
    assert [(r[0], r[1], int(r[2]), int(r[3]), int(r[4]), int(r[5])) for r in buffers] == \
        [(b["name"], b["value"], b["bytes"], b["offset"], b["first"], b["last"]) for b in report.buffer_rows]
    memory = {r[0]: int(r[1]) for r in tables["step-memory"] if r}
    assert memory == report.step_memory
    stages = [r[0] for r in tables["compile-time"] if r]  # this compile's stages (the second one hit the caches)
    # The step graph made by autodiff ("graph") or found in the step cache ("step_cache").
    assert "build" in stages and len({"graph", "step_cache"} & set(stages)) == 1
    assert set(stages) <= {"graph", "step_cache", "lookup", "passes", "lower", "render", "build"}
    timeline = page["html"].read_text().split('class="timeline"')[1].split("</svg>")[0]
    assert timeline.count('class="buffer"') == len(report.buffer_rows) > 0
    assert str(report.summary).splitlines()[1] in page["html"].read_text()


def test_graphviz_svg_is_inlined_without_links(model_file, tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "dot"  # a stand-in for Graphviz: writes an SVG with a prolog and a link
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\nout="$4"\ncat > "$out" <<EOF\n<?xml version="1.0"?>\n<!DOCTYPE svg>\n'
                    '<svg xmlns="http://www.w3.org/2000/svg" xmlns:xlink="http://www.w3.org/1999/xlink">'
                    '<a xlink:href="https://example.com/x"><g id="node1"><text>matmul</text></g></a></svg>\nEOF\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    written = run_inspect(model_file, tmp_path / "out", backend="c", file=io.StringIO(), html=tmp_path / "p.html")
    text = written["html"].read_text()
    parsed = _parse(text)
    assert written["svg"] is not None and '<g id="node1"><text>matmul</text></g>' in text
    assert parsed.links == [] and "<?xml" not in text and "example.com" not in text


def test_the_command_and_its_options(model_file, tmp_path, capsys):
    page = tmp_path / "cli.html"
    assert main(["inspect", str(model_file), "--out", str(tmp_path / "o"), "--html", str(page)]) == 0
    assert page.is_file() and f"wrote html: {page}" in capsys.readouterr().out
    assert main(["inspect", str(model_file), "--out", str(tmp_path / "o"), "--profile", "3"]) == 1
    assert "give --html PAGE too" in capsys.readouterr().err
    assert main(["inspect", str(model_file), "--html", str(page), "--dim", "B"]) == 1
    assert "NAME=SIZE" in capsys.readouterr().err


def test_profiled_inputs_are_valid_for_any_model(model_file):
    import runpy

    import symgrad as sg

    loss, params, optimizer = runpy.run_path(str(model_file))["build"]()
    step = sg.train_step(loss, params, optimizer, backend="numpy")
    arrays = example_inputs(step.graph, {"B": 5})
    assert arrays["x"].shape == (5, 6) and arrays["x"].dtype.name == "float32"
    assert arrays["y"].shape == (5,) and not arrays["y"].any()
    assert example_inputs(step.graph)["x"].shape[0] == 16


def test_the_page_holds_the_profile_when_asked(model_file, tmp_path, capsys):
    page = tmp_path / "p.html"
    assert main(["inspect", str(model_file), "--out", str(tmp_path / "out"), "--html", str(page),
                 "--profile", "3", "--dim", "B=8"]) == 0
    text = page.read_text()
    parsed = _parse(text)
    assert 'id="profile"' in text and "profile of" in text and parsed.links == []
    profiled = {row[0] for row in parsed.tables["profile"] if row}  # its first column: the kernel names
    assert profiled == {row[1] for row in parsed.tables["kernels"] if row}
