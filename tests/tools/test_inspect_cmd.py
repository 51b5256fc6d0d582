"""symgrad/tools/inspect.py: the `symgrad inspect` convention (a file with build())."""

import io

import pytest

from symgrad.tools.inspect import run_inspect

MODEL = '''
import symgrad as sg

def build():
    B = sg.Dim("B")
    x, y = sg.input("x", (B, 4)), sg.input("y", (B,), dtype="int64")
    model = sg.nn.Sequential(sg.nn.Linear(4, 5), sg.nn.Tanh(), sg.nn.Linear(5, 3))
    return sg.cross_entropy(model(x), y), model.parameters(), sg.optim.Adam(lr=0.01)
'''


def test_inspect_prints_graphs_and_writes_files(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(MODEL)
    out = io.StringIO()
    written = run_inspect(path, tmp_path / "out", backend="numpy", file=out)
    text = out.getvalue()
    for title in ("== forward graph ==", "== forward + backward graph", "== backward chain"):
        assert title in text
    assert "AccumulateGrad(0.weight)" in text and "TanhBackward" in text
    dot = written["dot"].read_text()
    assert dot.startswith("digraph symgrad") and "2.bias.exp_avg" in dot
    assert "matmul" in written["source"].read_text()


def test_inspect_explains_a_bad_file(tmp_path):
    path = tmp_path / "nobuild.py"
    path.write_text("x = 1\n")
    with pytest.raises(ValueError, match=r"must define build\(\)"):
        run_inspect(path, tmp_path / "out", backend="numpy")
    with pytest.raises(FileNotFoundError, match="no such file"):
        run_inspect(tmp_path / "missing.py", tmp_path / "out")


def test_cli_inspect_runs_the_example(tmp_path, capsys):
    from pathlib import Path

    from symgrad.tools.cli import main

    example = Path(__file__).resolve().parents[2] / "examples" / "inspect_softmax.py"
    assert main(["inspect", str(example), "--out", str(tmp_path), "--backend", "numpy"]) == 0
    text = capsys.readouterr().out
    assert "== forward graph ==" in text and "AccumulateGrad(W)" in text
    assert (tmp_path / "graph.dot").read_text().startswith("digraph symgrad")
    assert main(["inspect", str(tmp_path / "missing.py"), "--out", str(tmp_path)]) == 1
