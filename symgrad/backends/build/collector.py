"""Python's cyclic garbage collector around a compile.

    cyclic_gc_paused()   a context: the collector off inside, as it was after

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

    Back on, its next collection examines what the block made (a 12-layer GPT's train_step:
    200,000 objects, 60-100 ms) and frees the cycles among them. Handing them to the oldest
    generation unexamined instead (gc.freeze, gc.unfreeze) was tried: that generation's collection
    only runs when enough objects were promoted into it the usual way, which a steady training
    loop may never do, so a cycle the block left (or any young garbage of the process's) could
    stay alive for good."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()

