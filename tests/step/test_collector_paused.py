"""sg.train_step builds its graph (autodiff, the optimizer's updates) and compiles with Python's
cyclic garbage collector paused (symgrad.backends.build.collector.cyclic_gc_paused): the millions of objects
a model's graph and plan make live on, and every full collection would walk them all. The
collector is back as it was after the call, whether it returned or raised."""

import gc

import numpy as np
import pytest

import symgrad as sg
from symgrad.step import step_cache


def _loss(name: str):
    x, y = sg.input(f"{name}_x", (4, 3), "float64"), sg.input(f"{name}_y", (4,), "int64")
    w = sg.param(f"{name}_w", (3, 2), dtype="float64", init=np.full((3, 2), 0.5))
    return sg.cross_entropy(x @ w, y), w


def test_the_collector_is_off_while_a_step_is_built_and_back_on_after(monkeypatch):
    seen = []
    updates = sg.optim.SGD.updates
    monkeypatch.setattr(sg.optim.SGD, "updates", lambda self, *args: seen.append(gc.isenabled()) or updates(self, *args))
    # Made afresh: a step cache holding this step (a cache directory reused) would skip the optimizer.
    monkeypatch.setattr(step_cache, "load", lambda *args: None)
    assert gc.isenabled()
    loss, w = _loss("paused")
    step = sg.train_step(loss, [w], sg.optim.SGD(lr=0.1), backend="c")
    assert seen == [False] and gc.isenabled()
    assert np.isfinite(step(paused_x=np.ones((4, 3)), paused_y=np.zeros(4, np.int64)))


def test_a_refused_step_and_a_caller_s_own_pause_leave_the_collector_as_they_found_it():
    loss, w = _loss("refused")
    with pytest.raises(TypeError, match="optimizer must be an sg.optim optimizer"):
        sg.train_step(loss, [w], optimizer="sgd", backend="c")
    assert gc.isenabled()
    gc.disable()
    try:
        sg.train_step(loss, [w], sg.optim.SGD(lr=0.1), backend="numpy")
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_cycle_the_paused_block_left_is_freed_by_the_collections_that_follow():
    """The collector back on, its ordinary young collections free a cycle made inside the block,
    without anyone calling gc.collect(): a training loop that allocates only short-lived objects
    afterwards never runs a full collection, so a cycle moved out of the young generations
    (gc.freeze then gc.unfreeze, once tried here) would have stayed alive with what it holds."""
    import weakref

    from symgrad.backends.build.collector import cyclic_gc_paused

    class Node:
        pass

    gc.collect()
    with cyclic_gc_paused():
        made = [[k] for k in range(20_000)]
        cycle = Node()
        cycle.self, cycle.payload = cycle, np.ones(1000)
        gone = weakref.ref(cycle)
        del cycle
        assert gone() is not None   # not collected while paused
    for _ in range(50):             # a loop's short-lived allocations, a few young collections' worth
        short = [[k] for k in range(300)]
    assert gone() is None and len(made) == 20_000 and len(short) == 300
