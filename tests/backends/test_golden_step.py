"""Golden files of the seed softmax-regression step on C: its generated source and its report.

A change to the emitted code or to what the report says shows in review as a diff of
tests/golden/softmax_regression_step.c and softmax_regression_report.txt. When the change is
intended, regenerate them: SYMGRAD_UPDATE_GOLDEN=1 python -m pytest tests/backends/test_golden_step.py
"""

from __future__ import annotations

import re

import pytest

import symgrad as sg

from golden_files import check_golden


@pytest.fixture(scope="module")
def step():
    x, y = sg.input("x", (sg.Dim("B"), 784)), sg.input("y", (sg.Dim("B"),), dtype="int64")
    W, b = sg.param("W", (784, 10)), sg.param("b", (10,))
    return sg.train_step(sg.cross_entropy(x @ W + b, y), [W, b], sg.optim.SGD(lr=0.1), backend="c")


def _stable_report(report) -> str:
    """The report without what varies from run to run: pass times, the summary's compile line and
    the compile-time section."""
    text = str(report).split("\n== compile time ==")[0]
    text = re.sub(r"^compile .*\n(  .*\n)*", "compile <times>\n", text, count=1, flags=re.M)
    return re.sub(r"(-> +\d+) +\d+\.\d+", r"\1  <ms>", text) + "\n"


def test_generated_source_is_the_golden_one(step):
    check_golden("softmax_regression_step.c", step.source)


def test_report_is_the_golden_one(step, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the GEMM's packing buffers are per thread
    report = _stable_report(step.report())
    assert "<ms>" in report and "== memory plan ==" in report
    check_golden("softmax_regression_report.txt", report)
