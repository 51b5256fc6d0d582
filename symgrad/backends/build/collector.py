"""Python's cyclic garbage collector around a compile.

    cyclic_gc_paused()       a context: the collector off inside, its objects settled after
    settle_young_objects()   every tracked object into the oldest generation, unexamined

The compile's stages, and the building of a step's graph, allocate millions of small objects
that stay alive and make few cycles; the collector would walk them again and again.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager


@contextmanager
def cyclic_gc_paused():
    """Python's cyclic garbage collector off for the block (back on after, if it was on).

    The stages allocate millions of small objects that stay alive (nodes, views, kernels, text)
    and make few cycles; every full collection walks the whole heap, and their number grows with
    what is allocated: a sixth of the stages' time on a 12-layer GPT, for about 1 MB of garbage.
    Building a step's graph (autodiff, the optimizer's updates) is the same kind of work, and
    `sg.train_step` pauses it too.

    Turned back on, the collector would examine everything the block made at its next allocation
    (a 12-layer GPT's train_step: 200,000 objects, 60-100 ms, freeing none of them). They are
    handed to the oldest generation instead (gc.freeze then gc.unfreeze: two list splices), where
    the next full collection meets them, as it meets every long-lived object; what cycles the
    block left are collected then. Objects the caller froze stay frozen: with any, nothing moves."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            settle_young_objects()
            gc.enable()


def settle_young_objects() -> None:
    """Move every object the collector tracks into its oldest generation, unexamined (see
    `cyclic_gc_paused`); nothing where the process holds frozen objects of its own."""
    if gc.get_freeze_count() == 0:
        gc.freeze()
        gc.unfreeze()
