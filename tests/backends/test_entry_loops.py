"""Which runs of an entry point's calls become loops (symgrad.backends.render.entry_loops), over
plain data: keys (what a call must match) and slots (its arguments)."""

from __future__ import annotations

from symgrad.backends.render.entry_loops import Loop, arguments, fold


def _layers(rounds: int, first: int = 0, step: int = 3):
    """`rounds` layers of three calls: f(ws[a], var[b]), g(ws[a + 1], ws[a + 2], context) with a
    status check, h(var[b + 1]); each layer's buffers `step` slots past the one before's."""
    keys, slots = [], []
    for r in range(rounds):
        a, b = first + step * r, 100 + 2 * r
        keys += [("f", False, ("workspace", "variables")), ("g", True, ("workspace", "workspace", "context")),
                 ("h", False, ("variables",))]
        slots += [[("workspace", a), ("variables", b)], [("workspace", a + 1), ("workspace", a + 2), "context"],
                  [("variables", b + 1)]]
    return keys, slots


def test_layers_of_the_same_calls_are_one_loop_with_stepping_arguments():
    keys, slots = _layers(6)
    loops = fold(keys, slots)
    assert loops == [Loop(first=0, period=3, rounds=6)]
    assert arguments(slots, loops[0]) == [
        [("step", "workspace", 0, 3), ("step", "variables", 100, 2)],
        [("step", "workspace", 1, 3), ("step", "workspace", 2, 3), "context"],
        [("step", "variables", 101, 2)]]


def test_calls_around_the_layers_stay_as_they_are():
    head = ([("embed", False, ())], [[]])
    keys, slots = _layers(5, first=10)
    keys, slots = head[0] + keys + [("loss", False, ())], head[1] + slots + [[]]
    assert fold(keys, slots) == [Loop(first=1, period=3, rounds=5)]


def test_a_layer_whose_buffers_do_not_step_evenly_is_left_out():
    """A first layer reading another temporary (the embedding's), and a parameter that skips a
    slot: the loop covers the rounds that step evenly, the rest stay calls."""
    keys, slots = _layers(7)
    slots[0] = [("workspace", 50), ("variables", 100)]     # the first layer reads ws50
    loops = fold(keys, slots)
    assert loops == [Loop(first=3, period=3, rounds=6)]
    keys = [("step", False, ("variables",))] * 16
    counters = [17, 20, 23, 26, 29, 32, 36, 39, 42, 45, 48, 51, 54, 57, 60, 63]  # a skip after 32
    assert fold(keys, [[("variables", v)] for v in counters]) == [Loop(first=6, period=1, rounds=10)]


def test_a_storage_or_a_literal_that_changes_breaks_the_rounds():
    keys = [("f", False, ("workspace",))] * 12
    slots = [[("workspace", k)] for k in range(12)]
    slots[6] = [("variables", 6)]
    assert fold(keys, slots, min_saved=4) == [Loop(first=0, period=1, rounds=6), Loop(first=7, period=1, rounds=5)]
    keys = [("f", False, ("workspace", "constants"))] * 12
    slots = [[("workspace", k), "c0" if k < 8 else "c1"] for k in range(12)]
    assert fold(keys, slots, min_saved=4) == [Loop(first=0, period=1, rounds=8)]


def test_short_runs_and_unfoldable_calls_stay_unrolled():
    keys, slots = _layers(2)
    assert fold(keys, slots) == []                         # spares 3 lines: fewer than MIN_SAVED
    assert fold(keys, slots, lines=[1, 2, 1] * 2, min_saved=4) == [Loop(first=0, period=3, rounds=2)]
    keys, slots = _layers(6)
    keys[4] = None                                         # a call the caller must see alone
    loops = fold(keys, slots)
    assert all(not (lp.first <= 4 < lp.end) for lp in loops) and loops
