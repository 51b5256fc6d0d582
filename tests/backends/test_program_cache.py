"""The program cache: a graph compiled before skips passes, lowering and rendering, and only
a graph that compiles to the same code ever hits."""

import pickle
import shutil

import numpy as np
import pytest

import symgrad as sg
from symgrad.backends import driver
from symgrad.backends.build import cache, program_cache
from symgrad.ir import graph_pickle
from symgrad.backends.numpy_backend import evaluate
from symgrad.ir.fingerprint import fingerprint
from symgrad.ir.graph import Graph

from helpers import MySquare


def _clear_programs():
    shutil.rmtree(cache.cache_dir() / "programs", ignore_errors=True)


def _regression(B=None, W0=None, lr=0.5):
    """The seed softmax regression train step's pieces, built afresh each call."""
    B = B or 16
    x = sg.input("x", (B, 6))
    y = sg.input("y", (B,), dtype="int64")
    W = sg.param("W", (6, 3), init=np.zeros((6, 3), np.float32) if W0 is None else W0)
    b = sg.param("b", (3,), init="zeros")
    loss = sg.cross_entropy(x @ W + b, y)
    return loss, [W, b], lr


def _step(B=None, W0=None, **options):
    loss, params, lr = _regression(B, W0)
    return sg.train_step(loss, params=params, optimizer=sg.optim.SGD(lr=lr), backend="c", **options)


def _batch(n=16, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 6)).astype(np.float32), rng.integers(0, 3, n)


# ---- the fingerprint -----------------------------------------------------------------------

def _graph(scale=2.0, shape=(4, 5), axis=1, name="x"):
    x = sg.input(name, shape)
    return Graph([x], [sg.sum(sg.exp(x * scale), axis=axis)])


def test_identical_graphs_built_twice_share_a_fingerprint():
    assert fingerprint(_graph()) == fingerprint(_graph())


@pytest.mark.parametrize("change", [dict(scale=3.0), dict(shape=(4, 6)), dict(axis=0), dict(name="z")])
def test_any_change_that_reaches_the_code_changes_the_fingerprint(change):
    assert fingerprint(_graph(**change)) != fingerprint(_graph())


def test_equal_values_that_compile_apart_fingerprint_apart_within_one_graph():
    """0.0 and -0.0 are equal in Python, and different code (x + 0.0 is not x at x = -0.0): a graph
    adding both differs from one adding 0.0 twice."""
    x = sg.input("x", (4,))
    zeros = lambda second: Graph([x], [x + sg.constant(0.0), x + sg.constant(second)])  # noqa: E731
    assert fingerprint(zeros(-0.0)) != fingerprint(zeros(0.0))


def test_initial_values_are_data_not_code():
    first, _, _ = _regression(W0=np.ones((6, 3), np.float32))
    second, _, _ = _regression(W0=np.full((6, 3), 7, np.float32))
    assert fingerprint(Graph([], [first])) == fingerprint(Graph([], [second]))


def test_user_ops_of_one_name_with_other_expressions_differ(monkeypatch):
    # Two processes may define one name differently; here, a registry without the first one.
    from symgrad.ir import registry

    x = sg.input("x", (3,))
    first = fingerprint(Graph([x], [sg.elementwise("fp_probe", lambda a: a ** 2)(x)]))
    monkeypatch.delitem(registry.REGISTRY, "fp_probe")
    second = fingerprint(Graph([x], [sg.elementwise("fp_probe", lambda a: a ** 3)(x)]))
    assert first is not None and second is not None and first != second


def test_symgrads_own_ops_are_named_not_printed(monkeypatch):
    """An op `import symgrad` registered is its code (which the caches' keys hold): the fingerprint
    names it without sympy's printer (a millisecond an op in a new process). A user's op, registered
    later, is printed: its formula is no code of symgrad's."""
    from symgrad.ir import fingerprint as fingerprints
    from symgrad.ir.registry import lookup

    x = sg.input("x", (3,))
    user = sg.elementwise("fp_user_probe", lambda a: a ** 2 + 1)
    assert lookup("exp").builtin and lookup("tanh").builtin and not user.op.builtin

    def printed(expr):
        raise AssertionError(f"srepr({expr}) called")
    monkeypatch.setattr(fingerprints.sympy, "srepr", printed)
    assert fingerprint(Graph([x], [sg.tanh(sg.exp(x))])) is not None
    with pytest.raises(AssertionError, match="srepr"):
        fingerprint(Graph([x], [user(x)]))


def test_a_custom_function_graph_has_no_fingerprint():
    x = sg.input("x", (3,))
    assert fingerprint(Graph([x], [MySquare.apply(x)])) is None


# ---- the cache -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def miss_and_hit():
    """One step compiled with an empty program cache, then the same graph built and compiled again."""
    _clear_programs()
    return _step(), _step()


def test_the_second_compile_hits_and_skips_the_python_stages(miss_and_hit):
    miss, hit = miss_and_hit
    assert not miss.program.from_program_cache and hit.program.from_program_cache
    assert {"passes", "lower", "render"} <= set(miss.program.timings)
    assert not {"passes", "lower", "render"} & set(hit.program.timings)
    assert hit.source == miss.source
    assert hit.program.module_name == miss.program.module_name


def test_a_hit_trains_exactly_like_the_miss(miss_and_hit):
    miss, hit = miss_and_hit
    for k in range(3):
        xb, yb = _batch(seed=k)
        assert hit(x=xb, y=yb) == miss(x=xb, y=yb)
    for name in ("W", "b"):
        np.testing.assert_array_equal(hit.params[name], miss.params[name])


def test_a_hit_reports_what_the_miss_reported(miss_and_hit):
    miss, hit = miss_and_hit
    # Everything but the timings: node counts, kernels, save/recompute choices, memory plan.
    sections = lambda report: [report.passes.lines[0]] + [str(getattr(report, name))  # noqa: E731
                                                          for name in ("kernels", "decisions", "memory")]
    assert sections(hit.report()) == sections(miss.report())
    assert "program cache hit" in hit.report()
    assert hit.program.memory_plan.offsets == miss.program.memory_plan.offsets


def test_a_hit_graph_lowers_again(miss_and_hit):
    """The optimized graph of a hit answers every question a fresh one does: its cached `users`,
    keyed by the compiling process's id()s, is not stored (lowering a hit's graph again raised
    KeyError once a shared cache held the entry: test_rowwise on the GPU machine's warm cache)."""
    from symgrad.backends.lower.lowering import lower
    miss, hit = miss_and_hit
    assert hit.program.from_program_cache
    optimized = hit.program.optimized
    assert set(optimized.use_counts()) == {id(n) for n in optimized.nodes}
    kinds = lambda plan: [type(k).__name__ for k in plan.kernels]  # noqa: E731
    assert kinds(lower(hit.program.optimized, fuse_reduce=False)) == \
        kinds(lower(miss.program.optimized, fuse_reduce=False))


def test_a_hit_unpickles_its_plan_only_when_asked(miss_and_hit):
    """Building and running a hit needs the source, the Dims and the arena; the optimized graph,
    pass report and plan stay pickled until read, then are the miss's."""
    miss, _ = miss_and_hit
    hit = _step()
    hit(x=_batch()[0], y=_batch()[1])
    assert hit.program.from_program_cache and hit.program._program_entry._stages is None
    assert [k.name for k in hit.program.plan.kernels] == [k.name for k in miss.program.plan.kernels]
    assert hit.program._program_entry._stages is not None
    assert len(hit.program.optimized.nodes) == len(miss.program.optimized.nodes)


def test_a_pickle_damaged_before_it_is_read_is_compiled_again(miss_and_hit, monkeypatch):
    """A hit reads its pickle only when its plan is first asked for, and checks it then: a byte
    changed in between (another process, a disk) is never unpickled; the stages are compiled
    again, once, and the entry rewritten, so the next hit reads its plan back."""
    miss, _ = miss_and_hit
    hit = _step()
    assert hit.program.from_program_cache
    damaged = []
    for path in (cache.cache_dir() / "programs").glob("*.pickle"):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x40
        path.write_bytes(bytes(data))
        damaged.append(bytes(data))
    assert damaged
    unpickled, remade = [], []
    loads, stages = graph_pickle.loads, driver.compile_stages
    monkeypatch.setattr(graph_pickle, "loads", lambda data, graph: unpickled.append(data) or loads(data, graph))
    monkeypatch.setattr(driver, "compile_stages", lambda *args, **kwargs: remade.append(1) or stages(*args, **kwargs))
    assert [k.name for k in hit.program.plan.kernels] == [k.name for k in miss.program.plan.kernels]
    assert not set(unpickled) & set(damaged) and remade == [1]
    again = _step()
    assert again.program.from_program_cache and len(again.program.plan.kernels) == len(miss.program.plan.kernels)
    assert remade == [1] and unpickled   # read back from the rewritten pickle


def test_a_pickle_that_fails_to_load_is_compiled_again(miss_and_hit, monkeypatch):
    """Should the checked pickle fail to unpickle when first read, the graph's stages are run again
    (the same code on the same graph: the same plan), and reading it raises nothing."""
    miss, _ = miss_and_hit
    hit = _step()
    assert hit.program.from_program_cache

    def broken(self):
        raise pickle.UnpicklingError("a stand-in for an entry that does not load")
    monkeypatch.setattr(graph_pickle._Unpickler, "load", broken)
    assert [k.name for k in hit.program.plan.kernels] == [k.name for k in miss.program.plan.kernels]
    assert "program cache hit" in hit.report()


def test_other_options_or_other_compiler_code_miss(miss_and_hit, monkeypatch):
    assert not _step(optimize=False).program.from_program_cache
    monkeypatch.setattr(program_cache, "code_fingerprint", lambda: "a changed compiler")
    assert not _step().program.from_program_cache


def test_a_damaged_entry_is_a_miss_and_is_rewritten(miss_and_hit):
    miss, _ = miss_and_hit
    loss, _, _ = _regression()
    entries = list((cache.cache_dir() / "programs").glob("*.json"))
    assert entries
    for path in entries:
        path.write_text('{"format": 1, "source": 3')
    again = _step()
    assert not again.program.from_program_cache and again.source == miss.source
    assert _step().program.from_program_cache


def test_symbolic_sizes_survive_the_cache():
    _clear_programs()
    B = sg.Dim("B")
    first, hit = _step(B=B), _step(B=B)
    assert hit.program.from_program_cache and hit.program.dims == list(hit.graph.dims)
    for n in (5, 16):
        xb, yb = _batch(n, seed=n)
        assert hit(x=xb, y=yb) == pytest.approx(first(x=xb, y=yb), rel=0, abs=0)
        assert hit.program.memory_plan.bindings == {B: n}


def test_a_hit_function_matches_the_numpy_reference():
    _clear_programs()
    x = sg.input("x", (7, 5))
    f = lambda: sg.function([x], [sg.softmax(x * 3 - 1, axis=1)], backend="c")  # noqa: E731
    f()
    hit = f()
    assert hit.program.from_program_cache
    xb = np.random.default_rng(3).standard_normal((7, 5)).astype(np.float32)
    (expected,), _ = evaluate(hit.graph, [xb], {}, {})
    np.testing.assert_allclose(hit(xb)[0], expected, rtol=1e-5, atol=1e-6)


# ---- damaged and forged entries --------------------------------------------------------------

def _entry_path():
    (path,) = (cache.cache_dir() / "programs").glob("*.json")
    return path


def _damage(change, *, forge=False):
    """Apply `change` to the one stored entry; `forge` also recomputes its checksum."""
    import json

    path = _entry_path()
    entry = json.loads(path.read_text())
    change(entry)
    if forge:
        entry.pop("sha256")
        entry["sha256"] = cache.sha256_json(entry)
    path.write_text(json.dumps(entry))


def test_a_changed_byte_in_the_stored_source_is_a_miss_not_a_build_error():
    _clear_programs()
    miss = _step()

    source = _entry_path().with_suffix(".c")
    text = source.read_text()
    at = text.index("int symgrad_run(")
    source.write_text(text[:at] + "X" + text[at + 1:])
    again = _step()
    assert not again.program.from_program_cache and again.source == miss.source
    assert _step().program.from_program_cache  # the entry was rewritten


_BIG_BATCH_CHILD = """
import json, os, sys
sys.path[:0] = [sys.argv[1], os.path.dirname(sys.argv[1])]  # this test's folder and tests/ (helpers)
import symgrad as sg
from test_program_cache import _batch, _step
step = _step(B=sg.Dim("B"))
xb, yb = _batch(4096, seed=7)
losses = [step(x=xb, y=yb) for _ in range(2)]
print(json.dumps({"hit": step.program.from_program_cache, "losses": losses, "W": step.params["W"].tolist()}))
"""


@pytest.mark.parametrize("forge", [False, True], ids=["damaged", "forged-checksum"])
def test_shrunk_arena_sizes_never_undersize_the_workspace_in_a_new_process(forge):
    import json
    import subprocess
    import sys
    from pathlib import Path

    _clear_programs()
    _step(B=sg.Dim("B"))

    def shrink(entry):
        entry["arena"]["nbytes"] = [1 for _ in entry["arena"]["nbytes"]]

    _damage(shrink, forge=forge)
    tests = Path(__file__).resolve().parent
    done = subprocess.run([sys.executable, "-c", _BIG_BATCH_CHILD, str(tests)], cwd=tests.parents[1],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"the child failed ({done.returncode}):\n{done.stderr[-3000:]}"
    child = json.loads(done.stdout.strip().splitlines()[-1])
    # A damaged entry misses; a forged one hits, and its sizes are the compiled code's.
    assert child["hit"] == forge
    loss, params, lr = _regression(sg.Dim("B"))
    reference = sg.train_step(loss, params=params, optimizer=sg.optim.SGD(lr=lr), backend="numpy")
    xb, yb = _batch(4096, seed=7)
    np.testing.assert_allclose(child["losses"], [reference(x=xb, y=yb) for _ in range(2)], rtol=1e-5)
    np.testing.assert_allclose(child["W"], reference.params["W"], rtol=1e-4, atol=1e-6)
    # Either way the entry now holds the true sizes again.
    assert all(size != 1 for size in json.loads(_entry_path().read_text())["arena"]["nbytes"])


def _cache_files() -> dict:
    """Every file of the cache directory: path -> (size, mtime in ns, contents)."""
    root = cache.cache_dir()
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_forged_arena_is_rewritten_at_the_build_and_a_call_writes_nothing():
    """The build checks a hit's arena against the compiled code and rewrites a forged entry; calls,
    of any batch size, leave the cache directory as the build left it (issue 33: a call only runs)."""
    import json

    _clear_programs()
    _step(B=sg.Dim("B"))

    def shrink(entry):
        entry["arena"]["nbytes"] = [1 for _ in entry["arena"]["nbytes"]]

    _damage(shrink, forge=True)
    step = _step(B=sg.Dim("B"))
    assert step.program.from_program_cache
    assert all(size != 1 for size in json.loads(_entry_path().read_text())["arena"]["nbytes"])
    before = _cache_files()
    for n in (16, 300, 16):
        step(x=_batch(n)[0], y=_batch(n)[1])
    assert _cache_files() == before


def test_a_step_built_in_the_background_is_stored_while_its_compiler_runs(monkeypatch):
    """With predict=, the step's program and the predict program build on threads. The step's is
    written to the program cache on its thread, once its compilers have started (driver.prepare(
    store=False), Compilation.store, toolchain.while_compiling); the predict program's, built beside
    the first steps, before its thread starts. The same graph built again hits for both."""
    import threading
    from symgrad.backends import c as cbackend

    def build():
        x, y = sg.input("x", (16, 6)), sg.input("y", (16,), dtype="int64")
        W, b = sg.param("W", (6, 3), init=np.zeros((6, 3), np.float32)), sg.param("b", (3,), init="zeros")
        logits = x @ W + b
        return sg.train_step(sg.cross_entropy(logits, y), params=[W, b], optimizer=sg.optim.SGD(lr=0.5),
                             backend="c", predict=logits)

    started, stored = [], []
    store = program_cache.store

    class Recorded(cbackend.Building):
        def __init__(self, *args, **kwargs):
            started.append(len(stored))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(cbackend, "Building", Recorded)
    threads = []
    monkeypatch.setattr(program_cache, "store", lambda *a: stored.append(len(started)) or
                        threads.append(threading.current_thread().name) or store(*a))
    _clear_programs()
    first = build()
    assert not first.program.from_program_cache and not first.program_for("predict").program.from_program_cache
    # the step's on its build's thread, after its build started; predict's here, before its build (the
    # two may come in either order: the step's compilers may start after predict's passes end)
    assert len(started) == 2 and started[0] == 0
    assert sorted(zip(threads, stored)) == [("MainThread", 1), ("symgrad-build", 1)]
    again = build()
    assert again.program.from_program_cache and again.program_for("predict").program.from_program_cache
    batch = _batch()
    assert np.isclose(first(x=batch[0], y=batch[1]), again(x=batch[0], y=batch[1]))
