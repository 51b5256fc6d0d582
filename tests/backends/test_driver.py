"""The compile driver (symgrad.backends.driver): one sequence for C and CUDA, through one program
cache whose hits carry everything a program needs, so nothing runs again later."""

import shutil

import numpy as np
import pytest

import symgrad as sg
from symgrad.api.cells import current_value
from symgrad import passes
from symgrad.backends import c as cbackend
from symgrad.backends.build import cache
from symgrad.backends import cuda, driver
from symgrad.backends.lower import lowering
from symgrad.backends.render.languages import C_OPENMP, CUDA
from symgrad.backends.native import NativeProgram
from symgrad.backends.numpy_backend import evaluate
from symgrad.step.compiled import VariableStorage
from symgrad.ir import dtypes as D
from symgrad.ir.graph import Graph

NVCC = shutil.which(cache.nvcc_command()[0])


def _clear_programs():
    shutil.rmtree(cache.cache_dir() / "programs", ignore_errors=True)


def _step_graph(B=None):
    """A small training step's graph, built afresh each call (matmul, bias, relu, cross-entropy, Adam)."""
    B = B or sg.Dim("B")
    x = sg.input("x", (B, 5))
    y = sg.input("y", (B,), dtype="int64")
    W = sg.param("W", (5, 4), init=np.linspace(-1, 1, 20, dtype=np.float32).reshape(5, 4))
    b = sg.param("b", (4,), init="zeros")
    loss = sg.cross_entropy(sg.relu(x @ W + b), y)
    return sg.train_step(loss, [W, b], sg.optim.Adam(lr=0.1), backend="numpy").graph


def _forbid_stages(monkeypatch):
    """Make the passes, the lowering and the render raise: a hit must not reach them."""
    def refuse(*args, **kwargs):
        raise AssertionError("a program-cache hit ran a compile stage")

    monkeypatch.setattr(passes, "optimize", refuse)
    monkeypatch.setattr(lowering, "lower", refuse)
    monkeypatch.setattr(driver, "render", refuse)


def _report_sections(report):
    """A report without its compile times (in its summary and its own section): passes, kernels,
    save/recompute, memory plan."""
    return "\n\n".join(str(section) for name, section in report.sections.items() if name != "compile_time")


def test_a_hit_runs_no_stage_and_still_has_plan_report_and_memory_plan(monkeypatch):
    _clear_programs()
    miss = cbackend.compile(_step_graph())
    assert not miss.from_program_cache
    _forbid_stages(monkeypatch)
    graph = _step_graph()
    hit = cbackend.compile(graph)
    assert hit.from_program_cache and hit.source == miss.source
    assert set(hit.timings) == {"lookup", "build"}
    # What a fresh compile has, loaded: the plan of this very graph (its leaves are the graph's own).
    assert [type(k).__name__ for k in hit.plan.kernels] == [type(k).__name__ for k in miss.plan.kernels]
    assert hit.plan.variable_nodes == list(graph.variables)
    assert hit.plan.dims == list(graph.dims)
    assert str(hit.optimized) == str(miss.optimized)
    assert hit.pass_report == miss.pass_report
    assert _report_sections(hit.report()) == _report_sections(miss.report())
    assert "program cache hit" in hit.report()
    assert hit.memory_plan.offsets == miss.memory_plan.offsets and hit.memory_plan.assumed
    # And it computes what the reference computes.
    rng = np.random.default_rng(0)
    xb, yb = rng.standard_normal((6, 5)).astype(np.float32), rng.integers(0, 4, 6)
    B = graph.dims[0]
    variables = {v.name: np.asarray(current_value(v), D.to_numpy(v.dtype)) for v in graph.variables}
    expected, updates = evaluate(graph, [xb, yb], {k: a.copy() for k, a in variables.items()}, {B: 6})
    got = hit.run([xb, yb], {B: 6}, variables)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5)
    for (target, _), new in zip(graph.updates, updates):
        np.testing.assert_allclose(variables[target.name], new, rtol=1e-5, atol=1e-6)
    assert hit.memory_plan.bindings == {B: 6} and not hit.memory_plan.assumed


def test_c_and_cuda_go_through_the_one_driver(monkeypatch):
    stages = []
    real = driver.compile_stages

    def recording(graph, language, optimize=True, timings=None):
        stages.append(language)
        return real(graph, language, optimize, timings)

    monkeypatch.setattr(driver, "compile_stages", recording)
    x = sg.input("x", (3, 4))
    graph = Graph([x], [sg.softmax(x * 1.5, axis=1)])
    assert cbackend.c_source(graph) == driver.source_of(graph, C_OPENMP)
    assert cuda.cuda_source(graph) == driver.source_of(graph, CUDA)
    assert stages == [C_OPENMP, C_OPENMP, CUDA, CUDA]
    assert issubclass(cbackend.CProgram, NativeProgram) and issubclass(cuda.CudaProgram, NativeProgram)
    # The matmul epilogue is a property of the language's GEMM, decided in one place.
    assert C_OPENMP.epilogues and not CUDA.epilogues


@pytest.mark.skipif(NVCC is None, reason="needs nvcc")
def test_a_build_only_cuda_compile_hits_the_program_cache_the_second_time(monkeypatch):
    _clear_programs()
    first = cuda.compile(_step_graph(), build_only=True)
    assert not first.from_program_cache and {"passes", "lower", "render"} <= set(first.timings)
    _forbid_stages(monkeypatch)
    graph = _step_graph()
    second = cuda.compile(graph, build_only=True)
    assert second.from_program_cache and set(second.timings) == {"lookup", "build"}
    assert second.source == first.source and second.module_name == first.module_name
    assert second.from_cache  # nvcc did not run either
    assert second.plan.variable_nodes == list(graph.variables)
    assert _report_sections(second.report()) == _report_sections(first.report())
    assert second.memory_plan.offsets == first.memory_plan.offsets
    # The C program of the same graph is another entry: the language keys the cache.
    monkeypatch.undo()
    assert not cbackend.compile(_step_graph()).from_program_cache


def test_cuda_variable_sharing_is_state_of_the_storage_not_of_the_module():
    assert not any(isinstance(value, dict) for value in vars(cuda._Shared).values())
    storage = VariableStorage(w=np.zeros(2))
    group = cuda._Shared.of(storage)
    assert cuda._Shared.of(storage) is group and storage.sharing is group
    assert cuda._Shared.of({"w": np.zeros(2)}) is not cuda._Shared.of({"w": np.zeros(2)})


def test_run_checks_the_arrays_in_one_place():
    x = sg.input("x", (4,))
    w = sg.param("w", (4,), init=np.ones(4, np.float32))
    program = cbackend.compile(Graph([x], [x * w]))
    with pytest.raises(ValueError, match="input 'x': expected a C-contiguous float32 array of shape \\(4,\\)"):
        program.run([np.ones(8, np.float32)[::2]], {}, {"w": np.ones(4, np.float32)})
    with pytest.raises(TypeError, match="expected 1 inputs, got 2"):
        program.run([np.ones(4, np.float32)] * 2, {}, {"w": np.ones(4, np.float32)})
    frozen = np.ones(4, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="variable 'w': expected a writeable C-contiguous float32"):
        program.run([np.ones(4, np.float32)], {}, {"w": frozen})


_NEW_PROCESS_HIT = """
import json, os, sys
sys.path[:0] = [sys.argv[1], os.path.dirname(sys.argv[1])]  # this test's folder and tests/ (helpers)
import pytest
from symgrad.backends import c as cbackend
from test_driver import _forbid_stages, _report_sections, _step_graph
with pytest.MonkeyPatch.context() as monkeypatch:
    _forbid_stages(monkeypatch)
    program = cbackend.compile(_step_graph())
    print(json.dumps({"hit": program.from_program_cache, "report": _report_sections(program.report()),
                      "graph": str(program.optimized), "kernels": len(program.plan.kernels)}))
"""


def test_a_hit_in_a_new_process_has_everything_without_running_a_stage():
    """In a process whose passes never ran (no derived op made yet), the stored plan still loads."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    _clear_programs()
    miss = cbackend.compile(_step_graph())
    tests = Path(__file__).resolve().parent
    done = subprocess.run([sys.executable, "-c", _NEW_PROCESS_HIT, str(tests)], cwd=tests.parents[1],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"the child failed ({done.returncode}):\n{done.stderr[-3000:]}"
    child = json.loads(done.stdout.strip().splitlines()[-1])
    assert child["hit"]
    assert child["report"] == _report_sections(miss.report())
    assert child["graph"] == str(miss.optimized) and child["kernels"] == len(miss.plan.kernels)
