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


def test_what_a_paused_block_made_is_settled_not_examined_and_its_cycles_still_collected():
    """Back on, the collector would examine every object the block made at its next allocation (a
    12-layer GPT's train_step: 200,000 objects, 60-100 ms, none of them garbage). They go to the
    oldest generation unexamined instead: no collection follows the block's end. A cycle the block
    left is still collected (by the next full collection), and objects the caller froze stay frozen."""
    import weakref

    from symgrad.backends.build.collector import cyclic_gc_paused

    class Node:
        pass

    collections = []

    def seen(phase, info):
        if phase == "start":
            collections.append(info["generation"])
    gc.collect()
    gc.callbacks.append(seen)
    try:
        with cyclic_gc_paused():
            made = [[k] for k in range(20_000)]   # well past the youngest generation's threshold
            cycle = Node()
            cycle.self = cycle
            gone = weakref.ref(cycle)
            del cycle
        after = [[k] for k in range(500)]       # allocations that would start a collection
        assert collections == []
    finally:
        gc.callbacks.remove(seen)
    assert gone() is not None and len(made) + len(after) == 20_500
    gc.collect()
    assert gone() is None
    del made, after
    gc.freeze()
    try:
        count = gc.get_freeze_count()
        with cyclic_gc_paused():
            made = [[k] for k in range(1000)]
        assert gc.get_freeze_count() == count and len(made) == 1000
    finally:
        gc.unfreeze()
