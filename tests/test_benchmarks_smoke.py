"""Smoke test of the benchmark harness (benchmarks/): tiny model, two timed steps.

Runs the real command line (--quick path with exact step counts) on PyTorch
eager and symgrad NumPy (plus symgrad C when its backend exists), never
torch.compile or JAX, which take far too long for CI. With exact step
counts every system trains the same number of steps from the same weights,
so their losses must agree: that checks the harness times the same model
everywhere, not just that it prints numbers.
"""

import contextlib
import dataclasses
import importlib.util
import io
import json
import math

import pytest

from benchmarks import bench_step, compile_latency, models, report, systems, timing

# symgrad-C joins as soon as its backend module exists; from then on a build
# failure there fails this test (the cell would read "error").
HAS_C = importlib.util.find_spec("symgrad.backends.c") is not None
SYSTEMS = ["symgrad-numpy", "torch-eager"] + (["symgrad-c"] if HAS_C else [])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One harness run on the tiny model; returns (printed text, JSON dict)."""
    path = tmp_path_factory.mktemp("bench") / "out.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = bench_step.main(["--models", "T", "--quick", "--blocks", "2", "--steps", "1",
                                  "--warmup", "0", "--systems", ",".join(SYSTEMS),
                                  "--no-latency", "--json", str(path)])
    assert status == 0
    return printed.getvalue(), json.loads(path.read_text())


def test_json_has_one_row_per_model_and_one_cell_per_system(run):
    _, result = run
    assert result["systems"] == SYSTEMS
    assert [row["key"] for row in result["rows"]] == ["T"]
    row = result["rows"][0]
    assert set(row["cells"]) == set(SYSTEMS)
    assert row["flops_per_step"] == 6 * 8 * (16 * 12 + 12 * 12 + 12 * 4)
    assert row["target"] is None and row["meets_target"] is None
    assert result["meta"]["threads"] == 2 and result["meta"]["plan"]["blocks"] == 2


def test_measured_cells_are_positive_finite(run):
    _, result = run
    for name, cell in result["rows"][0]["cells"].items():
        assert cell["status"] == "ok", (name, cell.get("reason"))
        assert cell["blocks"] == 2 and cell["steps_per_block"] == 1 and cell["warmup_steps"] == 1
        for key in ("us_per_step", "us_min", "us_max", "gflops", "first_s"):
            assert math.isfinite(cell[key]) and cell[key] > 0, (name, key, cell[key])
        assert cell["us_min"] <= cell["us_per_step"] <= cell["us_max"]
        expected = 6 * 8 * (16 * 12 + 12 * 12 + 12 * 4) / (cell["us_per_step"] * 1e-6) / 1e9
        assert cell["gflops"] == pytest.approx(expected)
    assert report.all_finite_positive(result["rows"])


def test_every_system_trains_the_same_model(run):
    # 1 + 2 * 1 steps each from the same weights on the same batch.
    _, result = run
    cells = result["rows"][0]["cells"]
    first = {name: c["loss_first"] for name, c in cells.items()}
    last = {name: c["loss_last"] for name, c in cells.items()}
    assert max(first.values()) - min(first.values()) < 1e-5, first
    assert max(last.values()) - min(last.values()) < 1e-5, last
    assert all(last[n] < first[n] for n in last), (first, last)   # the update steps downhill


def test_printed_tables_have_the_columns_and_the_row(run):
    text, _ = run
    header = "| model | " + " | ".join(SYSTEMS) + " | symgrad-c / fastest other |"
    assert header in text
    assert "| model | GFLOP/step | " + " | ".join(SYSTEMS) + " |" in text
    row = next(line for line in text.splitlines() if line.startswith("| T b8 |"))
    assert len(row.strip("|").split("|")) == len(SYSTEMS) + 2


def test_ratio_is_symgrad_c_over_the_fastest_other_system():
    model = models.SMOKE["T"]
    ok = lambda us: report.ok_cell(model, {"us_per_step": us})  # noqa: E731
    cells = {"symgrad-c": ok(50.0), "symgrad-numpy": ok(10.0), "torch-eager": ok(200.0),
             "torch-compile": report.failed_cell("error", "InductorError: no compiler"),
             "jax-jit": ok(100.0)}
    row = report.make_row(dataclasses.replace(model, target=0.6), cells)
    assert row["fastest_other"] == "jax-jit"           # symgrad-numpy is not an "other"
    assert row["ratio"] == pytest.approx(0.5) and row["meets_target"] is True
    text = report.render_steps([row], list(cells), {})
    assert "error: InductorError: no compiler [1]" in text
    assert "0.50 vs jax-jit (target <= 0.6: met)" in text


def test_unavailable_system_is_reported_with_its_reason(monkeypatch):
    def missing(model):
        raise systems.Unavailable("jax is not installed")
    monkeypatch.setitem(systems.SYSTEMS, "jax-jit", missing)
    (row,) = bench_step.run_steps([models.SMOKE["T"]], ["jax-jit", "symgrad-numpy"],
                                  bench_step.make_plan(bench_step.parse_args(
                                      ["--quick", "--blocks", "1", "--steps", "1", "--warmup", "0"])),
                                  log=lambda s: None)
    assert row["cells"]["jax-jit"] == {"status": "unavailable", "reason": "jax is not installed"}
    assert row["cells"]["symgrad-numpy"]["status"] == "ok"


def test_model_selection():
    assert [m.key for m in models.select("A,B,C")] == ["A64", "A256", "B128", "C512"]
    assert [m.key for m in models.select("c512, a64")] == ["C512", "A64"]
    assert models.MODELS["C512"].flops == 3 * 6 * 512 * 1024 * 1024
    with pytest.raises(ValueError, match="unknown model 'D'"):
        models.select("A,D")


def test_compile_latency_worker_protocol(tmp_path):
    # The fresh-process path on the NumPy backend (no compiler: fast), cold then warm.
    cold = compile_latency.run_once("symgrad", str(tmp_path), backend="numpy", model="T")
    assert cold["status"] == "ok", cold
    assert 0 < cold["compile_s"] <= cold["first_step_s"] < 60 and cold["import_s"] > 0
    # the compile proper: the seconds inside sg.train_step, part of the time to the loaded module
    assert 0 < cold["train_step_s"] <= cold["compile_s"]
    text = compile_latency.render({"model": "T", "repeats": 1, "symgrad_backend": "numpy",
                                   "measures": "x", "symgrad": {**cold, "cold_s": 1.0, "warm_s": 0.01,
                                                                "cold_compile_s": 0.5, "warm_compile_s": 0.005,
                                                                "cold_train_step_s": 0.25,
                                                                "warm_train_step_s": 0.004},
                                   "torch": {"status": "ok", "cold_s": 10.0, "warm_s": 2.0},
                                   "cold_ratio": 0.1, "cold_meets_target": True,
                                   "warm_meets_target": True})
    assert "| symgrad / torch.compile | 0.100 (target <= 0.2) met | 10.0 ms (target <= 50 ms) met |" in text
    assert "| symgrad (numpy), sg.train_step alone | 0.250 s | 0.004 s |" in text


def _counting_runner(name: str, log: list, fail_at: int | None = None) -> systems.Runner:
    calls = []

    def step():
        calls.append(1)
        if fail_at is not None and len(calls) >= fail_at:
            raise RuntimeError(f"{name} broke at call {len(calls)}")
        log.append(name)
        return float(len(calls))
    return systems.Runner(step, float)


def test_systems_are_timed_in_turns_in_a_rotating_order():
    log: list = []
    runners = {n: _counting_runner(n, log) for n in ("a", "b", "c")}
    plan = timing.Plan(blocks=4, steps=2, warmup_steps=1, warmup_s=0.0, settle_s=0.0)
    results = timing.measure_side_by_side(runners, plan)
    assert set(results) == {"a", "b", "c"}
    assert all(r["blocks"] == 4 and r["steps_per_block"] == 2 and r["us_per_step"] > 0
               for r in results.values())
    timed = log[3:]   # after each runner's one first call
    blocks = [timed[i] for i in range(0, len(timed), 2)]
    assert all(timed[i] == timed[i + 1] for i in range(0, len(timed), 2))   # whole blocks
    assert blocks == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]


def test_after_the_settle_pause_one_untimed_step_wakes_the_system_before_its_block():
    """A pause lets the other systems' threads sleep; this system's own are woken by one step that
    the block does not time (a sleeping thread pool costs milliseconds to wake on a VM)."""
    log: list = []
    runners = {n: _counting_runner(n, log) for n in ("a", "b")}
    plan = timing.Plan(blocks=3, steps=2, warmup_steps=1, warmup_s=0.0, settle_s=0.001)
    results = timing.measure_side_by_side(runners, plan)
    assert all(r["steps_per_block"] == 2 for r in results.values())
    timed = log[2:]   # after each runner's one first call
    assert len(timed) == 2 * 3 * (1 + 2)
    assert all(timed[i] == timed[i + 1] == timed[i + 2] for i in range(0, len(timed), 3))   # wake + block


def test_a_system_failing_between_blocks_is_an_error_cell_the_others_are_timed():
    log: list = []
    runners = {"good": _counting_runner("good", log), "bad": _counting_runner("bad", log, fail_at=4)}
    errors = {}
    plan = timing.Plan(blocks=3, steps=2, warmup_steps=1, warmup_s=0.0, settle_s=0.0)
    results = timing.measure_side_by_side(runners, plan, on_error=lambda n, e: errors.setdefault(n, str(e)))
    assert list(results) == ["good"] and len(log) - log.count("bad") == 1 + 3 * 2
    assert errors == {"bad": "bad broke at call 4"}


def test_checkouts_ratio_is_the_median_of_the_per_round_ratios_to_the_first():
    from pathlib import Path
    from benchmarks.checkouts import table
    base, new = [10.0, 20.0, 10.0], [11.0, 18.0, 30.0]   # ratios 1.1, 0.9, 3.0: the median is 1.1
    rows = table("gpt:small", [Path("old"), Path("new")], [base, new]).splitlines()
    assert rows[0] == "| gpt:small | old | 10.000 | 1.000 |"
    assert rows[1] == "| gpt:small | new | 18.000 | 1.100 |"


def test_gemm_autocast_runners_compute_the_bfloat16_product_as_torch_does():
    """benchmarks.gemm --autocast bfloat16: symgrad's product of a layer's three products (forward,
    and both transposed ones of the backward) agrees with torch.mm under torch.autocast, and the
    table reports their ratio."""
    import numpy as np

    from benchmarks import gemm
    rng = np.random.default_rng(1)
    rows = []
    for p in gemm._layer("tiny", 24, 40, 72):
        runners = gemm.autocast_runners(p, rng, "bfloat16")
        ours, theirs = runners["symgrad"].step(), runners["torch"].step().float().numpy()
        np.testing.assert_allclose(ours, theirs, rtol=2e-2, atol=2e-2 * np.sqrt(p.K))
        rows.append({"label": p.label, "M": p.M, "K": p.K, "N": p.N, "symgrad": 2.0, "torch": 4.0})
    text = gemm.render([{"threads": 1, "flags": ["-O3"], "peak_gflops": 10.0, "autocast": "bfloat16",
                         "products": rows}])
    assert "| symgrad / torch |" in text and text.count("| 0.50 |") == 3
