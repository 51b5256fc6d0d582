"""step.profile(): per-kernel times from the profiling build, FLOPs and bytes, regions, the trace.

One small MLP train step (C) is compiled and profiled once for the module; the timing checks are
loose on purpose (a shared 2-core machine): each kernel call lies inside its step's call, so the
kernels' sum is at most the wall time, and it is at least half of it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import symgrad as sg
from symgrad.backends import peaks as peaks_module
from symgrad.backends.lower import regions
from symgrad.backends.driver import label_inputs
from symgrad.backends.render.languages import C_OPENMP
from symgrad.backends.lower.lowering import LoopKernel, MatmulKernel
from symgrad.backends.profile import Profile, kernel_costs, profile_program
from symgrad.backends.render.program import render
from symgrad.ir import shapes as S

pytestmark = pytest.mark.skipif("c" not in __import__("tests.conftest", fromlist=["BACKENDS"]).BACKENDS,
                                reason="no C compiler")

STEPS = 8
BATCH, IN, HIDDEN, OUT = 64, 128, 256, 10


@pytest.fixture(scope="module")
def mlp():
    sg.manual_seed(0)
    B = sg.Dim("B")
    x = sg.input("x", (B, IN))
    y = sg.input("y", (B,), dtype="int64")
    model = sg.nn.Sequential(sg.nn.Linear(IN, HIDDEN), sg.nn.ReLU(), sg.nn.Linear(HIDDEN, OUT))
    loss = sg.cross_entropy(model(x), y)
    step = sg.train_step(loss, params=list(model.parameters()), optimizer=sg.optim.Adam(lr=1e-3), backend="c")
    rng = np.random.default_rng(0)
    batch = dict(x=rng.standard_normal((BATCH, IN), dtype=np.float32), y=rng.integers(0, OUT, BATCH))
    return step, batch


@pytest.fixture(scope="module")
def profiled(mlp, tmp_path_factory):
    step, batch = mlp
    before = {name: step.params[name] for name in step.params}
    state = {name: step.state[name] for name in step.state}
    path = tmp_path_factory.mktemp("profile") / "trace.json"
    result = step.profile(steps=STEPS, trace=str(path), **batch)
    return result, path, before, state


def test_rows_name_every_kernel_once_per_step(mlp, profiled):
    step, _ = mlp
    result, *_ = profiled
    assert isinstance(result, Profile)
    names = [k.name for k in step.program.plan.kernels]
    assert sorted(r.name for r in result.rows) == sorted(names)
    assert all(r.calls == STEPS for r in result.rows)
    assert all(r.seconds >= 0 and 0 <= r.share <= 1 for r in result.rows)
    assert [r.seconds for r in result.rows] == sorted((r.seconds for r in result.rows), reverse=True)
    for name in names:  # the names step.source calls (a function of its own, or another's, commented)
        assert f"{name}(" in step.source or f"  /* {name} */" in step.source
    assert result[names[0]].name == names[0]


def test_kernel_time_lies_within_the_wall_time(profiled):
    result, *_ = profiled
    assert result.kernel_seconds <= result.entry_seconds <= result.wall
    assert sum(r.share for r in result.rows) == pytest.approx(result.ratio)
    assert len(result.step_walls) == len(result.step_kernel_seconds) == STEPS
    assert sum(result.step_kernel_seconds) / STEPS == pytest.approx(result.kernel_seconds)
    ratios = [k / w for k, w in zip(result.step_kernel_seconds, result.step_walls)]
    assert all(r <= 1 for r in ratios)
    # At least half of a call is in its kernels (the rest: the entry point and the Python call);
    # the median step's, so that a call descheduled in Python on a busy machine does not decide.
    assert sorted(ratios)[STEPS // 2] >= 0.5, str(result)


def test_flops_and_bytes_are_the_kernels_own(mlp, profiled):
    step, _ = mlp
    result, *_ = profiled
    plan = step.program.plan
    bindings = {d: BATCH for d in plan.dims}
    products = []
    for k in plan.kernels:
        row = result[k.name]
        if isinstance(k, MatmulKernel):
            M, N, K = (int(S.evaluate(v, bindings)) for v in (k.M, k.N, k.K))
            assert row.flops == 2 * M * N * K + len(k.epilogue_statements) * M * N
            assert row.bound in ("compute", "memory")
            products.append(2 * M * N * K)
        if isinstance(k, LoopKernel) and k.name.endswith("_copy"):
            assert row.flops == 0
        assert row.bytes > 0
    # forward, input gradient and weight gradient of each Linear (the first one's input gradient is not needed)
    assert sorted(products) == sorted([2 * BATCH * IN * HIDDEN] * 2 + [2 * BATCH * HIDDEN * OUT] * 3)
    by_name = dict(zip((k.name for k in plan.kernels), kernel_costs(plan, bindings)))
    assert all(by_name[r.name] == (r.flops, r.bytes) for r in result.rows)


def test_regions_are_the_layers(mlp, profiled):
    step, _ = mlp
    result, *_ = profiled
    names = {r.name for r in result.regions}
    assert {"0", "2"} <= names  # Sequential's Linear layers; ReLU has no parameters of its own
    products = [k for k in step.program.plan.kernels if isinstance(k, MatmulKernel)]
    # Each product in the layer whose weight it reads or whose weight's gradient it makes: the
    # first layer's forward and weight gradient, the second's forward, input and weight gradients.
    placed = [result[k.name].region for k in products]
    assert sorted(placed) == ["0", "0", "2", "2", "2"]
    assert sum(r.kernels for r in result.regions) == len(result.rows)


def test_table(profiled):
    result, path, *_ = profiled
    text = str(result)
    lines = text.splitlines()
    assert lines[0].startswith(f"profile of TrainStep: {STEPS} steps")
    assert lines[1].startswith("peaks: ") and "GFLOP/s FMA" in lines[1] and "GB/s memory" in lines[1]
    assert "region / kernel" in text and "ms/step" in text and "of peak" in text
    assert lines[-2].startswith("outside kernels") and lines[-1] == f"trace: {path}"
    shown = [line for line in lines if line.startswith("  k")]
    assert len(shown) == min(20, len(result.rows))
    short = result.table(3)
    assert len([line for line in short.splitlines() if line.startswith("  k")]) == 3
    assert f"the other {len(result.rows) - 3} kernels" in short


def test_trace_is_chrome_trace_events(mlp, profiled):
    step, _ = mlp
    result, path, *_ = profiled
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    steps = [e for e in events if e.get("cat") == "step"]
    names = {k.name for k in step.program.plan.kernels}
    assert len(kernels) == STEPS * len(names) and len(steps) == STEPS
    for e in kernels + steps:
        assert e["ph"] == "X" and {"name", "ts", "dur", "pid", "tid"} <= e.keys()
        assert e["dur"] >= 0 and e["ts"] >= 0
    assert {e["name"] for e in kernels} == names
    assert len({(e["pid"], e["tid"]) for e in kernels}) == 1  # one row: the calling thread
    meta = [e for e in events if e["ph"] == "M"]
    assert {e["name"] for e in meta} == {"process_name", "thread_name"}
    for s in steps:  # each kernel call inside its step's call
        inside = [e for e in kernels if e["args"]["step"] == s["args"]["step"]]
        assert len(inside) == len(names)
        assert all(s["ts"] - 1e-3 <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1e-3 for e in inside)


def test_profiling_leaves_the_step_as_it_was(mlp, profiled):
    step, batch = mlp
    _, _, before, state = profiled
    for name, value in before.items():
        np.testing.assert_array_equal(step.params[name], value)
    for name, value in state.items():
        np.testing.assert_array_equal(step.state[name], value)
    assert "sg_profile" not in step.source
    step(**batch)  # the normal build still runs


def test_profiling_build_times_each_kernel_call(mlp):
    step, _ = mlp
    program = step.program
    plan = program.plan
    assert render(plan, C_OPENMP, label_inputs(program.graph)) == step.source
    timed = render(plan, C_OPENMP, label_inputs(program.graph), profile=True)
    assert timed.count("sg_profile_record(") == len(plan.kernels) + 1 + 1  # each call, the whole call, the helper
    assert timed.count("sg_profile_start = sg_profile_now();") == len(plan.kernels)


def test_function_profile_by_position():
    x = sg.input("x", (32, 64))
    w = sg.param("w", (64, 48), init="normal")
    f = sg.function([x], sg.relu(x @ w), backend="c")
    result = f.profile(np.ones((32, 64), np.float32), steps=3)
    assert result.name == "CompiledFunction" and result.steps == 3
    assert sum(r.flops for r in result.rows) >= 2 * 32 * 64 * 48
    assert all(r.calls == 3 for r in result.rows)
    assert {r.region for r in result.rows} == {"w"}  # a parameter of no module is its own region


def test_refusals(mlp):
    step, batch = mlp
    with pytest.raises(ValueError, match="steps must be a positive int"):
        step.profile(steps=0, **batch)
    with pytest.raises(TypeError, match="by name or by position"):
        step.profile(batch["x"], y=batch["y"])
    x = sg.input("x", (4, 3))
    f = sg.function([x], sg.exp(x), backend="numpy")
    with pytest.raises(ValueError, match="C programs; this one is 'numpy'"):
        f.profile(np.ones((4, 3), np.float32))

    class Cuda:
        backend = "cuda"
    with pytest.raises(ValueError, match="C programs; this one is 'cuda'"):
        profile_program(Cuda(), lambda: None, {})


def test_peaks_measured_once_and_kept(monkeypatch):
    first = peaks_module.peaks()
    assert first.gflops > 0 and first.gbs > 0 and first.threads >= 1 and first.balance > 0
    monkeypatch.setattr(peaks_module, "measure", lambda lib: pytest.fail("measured again"))
    assert peaks_module.peaks() == first
    assert str(first).startswith("peaks: ")


def test_region_rules():
    assert regions.common(["h.0.attn.c_attn", "h.0.attn.c_proj"]) == "h.0.attn"
    assert regions.common(["wte", "wpe"]) == ""
    assert regions.module_of("h.0.mlp.c_fc.weight") == "h.0.mlp.c_fc" and regions.module_of("W") == "W"
    # Attention between two projections of one layer is in that layer; its inputs' own kernels in theirs.
    x = sg.input("x", (2, 4, 8))
    qkv = sg.param("blk.attn.qkv.weight", (8, 24), init="normal")
    proj = sg.param("blk.attn.proj.weight", (8, 8), init="normal")
    q, k, v = sg.split(x @ qkv, 8, dim=-1)
    y = sg.scaled_dot_product_attention(q, k, v, is_causal=True) @ proj
    from symgrad.ir.graph import Graph
    graph = Graph([x], [y])
    found = regions.value_regions(graph, graph.variables)
    attention = next(n for n in graph.nodes if n.op.name == "attention")
    assert found[id(attention)] == "blk.attn"
    assert found[id(y)] == "blk.attn.proj"
