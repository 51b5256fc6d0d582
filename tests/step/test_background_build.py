"""A train step's predict program compiles on a thread of its own (symgrad.backends.native.Building):
its passes run inside sg.train_step, its compiler while the first steps run. The step trains at
once; predict() waits for the build, or raises what it raised; a fork waits for it; its compilers
run at a lower priority than the steps."""

import multiprocessing
import os
import shutil
import sys
import threading
import time

import numpy as np
import pytest

import symgrad as sg
from symgrad import nn
from symgrad.backends import c as c_backend
from symgrad.backends import native
from symgrad.backends.build import toolchain

IN, OUT, BATCH = 5, 3, 8


def _built(name: str, seed: int = 0, hidden: int = 7):
    """A small classifier's step (C) with predict=, its model's eval logits, and a batch. The program
    cache knows a graph by its structure, not its names: a test that needs its predict program
    compiled afresh gives a `hidden` size no other test uses."""
    sg.manual_seed(seed)
    model = nn.Sequential(nn.Linear(IN, hidden), nn.Tanh(), nn.Linear(hidden, OUT)).double()
    x, y = sg.input(f"{name}_x", (BATCH, IN), "float64"), sg.input(f"{name}_y", (BATCH,), "int64")
    loss = nn.functional.cross_entropy(model(x), y)
    step = sg.train_step(loss, model.parameters(), sg.optim.SGD(lr=0.1), backend="c", predict=model(x))
    rng = np.random.default_rng(seed)
    return step, model, {f"{name}_x": rng.standard_normal((BATCH, IN)), f"{name}_y": rng.integers(0, OUT, BATCH)}


@pytest.fixture
def slow_second_build(monkeypatch):
    """Every CProgram build after the first (the step's) waits half a second before it compiles,
    and records its thread's nice value (None off Linux) and how its compilers would be run."""
    seen, real, calls = [], c_backend.CProgram._build, []

    def build(self, *args, **kwargs):
        calls.append(self)
        if len(calls) > 1:
            tid = threading.get_native_id()
            seen.append((os.getpriority(os.PRIO_PROCESS, tid) if sys.platform.startswith("linux") else None,
                         toolchain._prioritized(["cc", "-c"])))
            time.sleep(0.5)
        return real(self, *args, **kwargs)
    monkeypatch.setattr(c_backend.CProgram, "_build", build)
    return seen


def test_the_step_trains_while_predict_builds(slow_second_build):
    step, model, batch = _built("bg_a")
    predict = step._programs["predict"]
    assert "_program" not in predict.__dict__   # still building: train_step did not wait for it
    loss = step(**batch)
    assert np.isfinite(loss)
    logits = step.predict(bg_a_x=batch["bg_a_x"])   # waits for the build
    x = sg.input("bg_a_ref_x", (BATCH, IN), "float64")
    want = sg.function([x], [model(x)], backend="numpy")(batch["bg_a_x"])[0]
    # The trained parameters, shared. atol: a logit near 0 (-4.9e-5) is a sum of terms near 1, and
    # C and NumPy add them in different orders (an ulp of the terms apart).
    np.testing.assert_allclose(logits, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())
    assert slow_second_build, "the predict program's build did not go through CProgram._build"


@pytest.mark.skipif(shutil.which("nice") is None, reason="no nice program to run the compilers under")
def test_the_compilers_of_a_background_build_yield_to_the_steps(slow_second_build):
    """Its compilers run niced; the thread itself does not (holding Python's lock at a lower
    priority, it would keep the steps waiting), nor do this thread's compilers."""
    step, _, batch = _built("bg_b")
    step.predict(bg_b_x=batch["bg_b_x"])
    (thread_nice, command), = slow_second_build
    assert command == [shutil.which("nice"), "-n", str(native.BUILD_NICE), "cc", "-c"]
    if thread_nice is not None:
        assert thread_nice == os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert toolchain._prioritized(["cc", "-c"]) == ["cc", "-c"]


def test_a_failed_build_raises_from_predict(monkeypatch):
    real, calls = c_backend.CProgram._build, []

    def build(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("the compiler broke")
        return real(self, *args, **kwargs)
    monkeypatch.setattr(c_backend.CProgram, "_build", build)
    step, _, batch = _built("bg_c", seed=1)
    assert np.isfinite(step(**batch))   # the step itself was built before
    with pytest.raises(RuntimeError, match="the compiler broke"):
        step.predict(bg_c_x=batch["bg_c_x"])


def _child_predicts(step, x, queue):
    queue.put(step.predict(bg_d_x=x))


def test_a_fork_waits_for_the_build(slow_second_build):
    """A child forked while the build runs gets the built program, not a thread it lacks."""
    step, _, batch = _built("bg_d")
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child_predicts, args=(step, batch["bg_d_x"], queue))
    child.start()   # waits for the build first (Building.release_all)
    got = queue.get(timeout=120)
    child.join(timeout=120)
    assert child.exitcode == 0
    assert not native.Building._running
    np.testing.assert_array_equal(got, step.predict(bg_d_x=batch["bg_d_x"]))


def test_a_warm_predict_program_is_loaded_at_once(slow_second_build):
    """Where the program cache holds it (and so the build cache its library), no thread: loading
    it costs less than a thread competing with the first steps for the cores."""
    _built("bg_e")[0].predict(bg_e_x=np.zeros((BATCH, IN)))
    step, _, batch = _built("bg_e")   # the same graphs again
    assert step._programs["predict"]._building._thread is None   # built before train_step returned
    assert np.isfinite(step(**batch))


def test_the_steps_build_runs_while_the_predict_passes_run(monkeypatch):
    """The step's own compiler runs on a thread at full priority while sg.train_step runs the
    predict program's passes; train_step returns once the step is built."""
    from symgrad.backends import driver
    events, real_build, real_stages = [], c_backend.CProgram._build, driver.compile_stages

    def build(self, *args, **kwargs):
        first = not any(e[0] == "build" for e in events)
        events.append(("build", threading.current_thread().name, toolchain._prioritized(["cc"]), time.perf_counter()))
        if first:
            time.sleep(0.5)   # the step's build: long enough for the predict passes to start meanwhile
        built = real_build(self, *args, **kwargs)
        events.append(("built", time.perf_counter()))
        return built

    def stages(*args, **kwargs):
        events.append(("stages", time.perf_counter()))
        return real_stages(*args, **kwargs)
    monkeypatch.setattr(c_backend.CProgram, "_build", build)
    monkeypatch.setattr(driver, "compile_stages", stages)
    step, _, batch = _built("bg_f", seed=2)
    assert "_program" in step.__dict__   # waited for before train_step returned
    step_build = next(e for e in events if e[0] == "build")
    assert step_build[1] == "symgrad-build" and step_build[2] == ["cc"]   # a thread, not niced
    step_built = next(e[1] for e in events if e[0] == "built")
    predict_stages = [e[1] for e in events if e[0] == "stages"][1]   # the step's stages come first
    assert predict_stages < step_built
    assert np.isfinite(step(**batch))


def test_a_failed_step_build_raises_from_train_step(monkeypatch):
    real, calls = c_backend.CProgram._build, []

    def build(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the compiler broke on the step")
        return real(self, *args, **kwargs)
    monkeypatch.setattr(c_backend.CProgram, "_build", build)
    with pytest.raises(RuntimeError, match="the compiler broke on the step"):
        _built("bg_g", seed=3)


@pytest.fixture
def predict_build_starts(monkeypatch):
    """When each predict program's build went to its compilers, by the name of its input (a build
    an earlier test left held may start during this one: told apart by its name)."""
    starts, real = {}, c_backend.CProgram._build

    def build(self, *args, **kwargs):
        if not self.graph.variables or all(v.attrs["role"] == "param" for v in self.graph.variables):
            starts.setdefault(self.graph.inputs[0].name, time.perf_counter())  # no optimizer state: predict's
        return real(self, *args, **kwargs)
    monkeypatch.setattr(c_backend.CProgram, "_build", build)
    return starts


def test_the_predict_compilers_wait_for_the_first_step_to_end(monkeypatch, predict_build_starts):
    """Held (Building's `held`): the predict program's compilers start once the step's first call has
    ended, the first step having the cores to itself; then predict() gets the trained program."""
    monkeypatch.setattr(native.Building, "HELD_AT_MOST", 60.0)
    step, model, batch = _built("bg_j", seed=3, hidden=11)
    time.sleep(0.3)
    assert "bg_j_x" not in predict_build_starts   # held, although its passes are done
    step(**batch)
    ended = time.perf_counter()
    logits = step.predict(bg_j_x=batch["bg_j_x"])
    assert predict_build_starts["bg_j_x"] >= ended
    x = sg.input("bg_j_ref_x", (BATCH, IN), "float64")
    want = sg.function([x], [model(x)], backend="numpy")(batch["bg_j_x"])[0]
    np.testing.assert_allclose(logits, want, rtol=1e-12, atol=1e-12 * np.abs(want).max())


def test_a_held_build_starts_when_asked_for_or_after_a_while(monkeypatch, predict_build_starts):
    """predict() before any step releases the held build at once (it does not wait HELD_AT_MOST);
    a step never called leaves it held HELD_AT_MOST seconds, then it builds by itself."""
    monkeypatch.setattr(native.Building, "HELD_AT_MOST", 60.0)
    step, _, batch = _built("bg_k", seed=4, hidden=12)
    asked = time.perf_counter()
    assert step.predict(bg_k_x=batch["bg_k_x"]).shape == (BATCH, OUT)
    assert time.perf_counter() - asked < 30 and "bg_k_x" in predict_build_starts
    monkeypatch.setattr(native.Building, "HELD_AT_MOST", 0.2)
    step, _, _ = _built("bg_l", seed=5, hidden=13)
    building = step._programs["predict"]._building
    building._thread.join(timeout=60)   # not result(): that would release it
    assert not building._thread.is_alive() and "bg_l_x" in predict_build_starts


def test_the_collector_is_back_on_while_train_step_waits_for_the_build(monkeypatch):
    """sg.train_step pauses Python's cyclic collector while it builds the graph and runs the passes
    (they allocate millions of objects that live on), and turns it back on before it waits for the
    step's compiler: the collector's first pass over those objects runs while gcc does."""
    import gc
    real, seen = c_backend.CProgram._build, []

    def build(self, *args, **kwargs):
        built = real(self, *args, **kwargs)
        time.sleep(0.3)   # train_step is waiting for this build by now
        seen.append(gc.isenabled())
        return built
    monkeypatch.setattr(c_backend.CProgram, "_build", build)
    assert gc.isenabled()
    sg.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, 9), nn.Tanh(), nn.Linear(9, OUT)).double()
    x, y = sg.input("gc_x", (BATCH, IN), "float64"), sg.input("gc_y", (BATCH,), "int64")
    step = sg.train_step(nn.functional.cross_entropy(model(x), y), model.parameters(), sg.optim.SGD(lr=0.1),
                         backend="c")
    assert gc.isenabled()
    if not step.program.from_program_cache:  # (a cache kept from an earlier session loads it at once)
        assert seen == [True]


def test_the_collector_is_back_on_while_the_step_compiles_beside_its_predict_program(monkeypatch):
    """With a predict program too: its build links the runtime that the step's build loaded, and
    finds it without waiting for the step's build, which holds the build cache's lock while its
    compiler runs. (It waited: train_step turned the collector back on only once gcc was done, and
    the collector's first pass, 0.05 s at 12 GPT layers, came after it instead of beside it.)"""
    import gc
    real, seen = toolchain._run_all, []

    def run_all(*args, **kwargs):
        real(*args, **kwargs)   # the compilers started (train_step goes on) and ran
        time.sleep(0.3)         # a longer compiler, under the build cache's lock
        seen.append(gc.isenabled())
    monkeypatch.setattr(toolchain, "_run_all", run_all)
    sg.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, 11), nn.Tanh(), nn.Linear(11, OUT)).double()
    x, y = sg.input("gcp_x", (BATCH, IN), "float64"), sg.input("gcp_y", (BATCH,), "int64")
    step = sg.train_step(nn.functional.cross_entropy(model(x), y), model.parameters(), sg.optim.SGD(lr=0.1),
                         backend="c", predict=model(x))
    if not step.program.from_program_cache and seen:   # (a compiler ran: no cache kept it from earlier)
        assert seen[0] is True
