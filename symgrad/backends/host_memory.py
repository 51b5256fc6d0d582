"""Large host arrays in huge pages where the system has them, mapped when they are made.

A fresh large NumPy array (memory the C library maps from the system: np.zeros, np.empty, a copy)
gets its pages at the first write to each, a trap into the kernel a page. On a virtual machine a
trap is dear: on the 2-core machines here, a fresh 246 MiB array took 0.1-0.6 s to touch, and the
nanoGPT-size step's workspace paid that inside its first call. Here a large array is one anonymous
mmap, advised into transparent huge pages (2 MiB: NumPy advises its own large arrays so, and the
step over 4 KiB pages ran 4-5% slower, from the translation misses) and populated by madvise
(MADV_POPULATE_WRITE, Linux 5.14 and later, a huge page a call): 0.03-0.04 s for the same 246 MiB.
The calls run on a thread of its own, Python's lock released, while the caller goes on: a warm
`sg.train_step` would otherwise wait 4-20 ms (0.3 s in some processes) for pages its first step
only writes later; memory written next (a step's workspace at its call) is populated before it
is returned.
Where the system lacks either, the array is what it would have been: pages at first touch, in
4 KiB pages. The buffers a step is sure to write (its workspace, the optimizer's state) are made here.

    zeros(shape, dtype)   np.zeros, a large one mapped at once (its pages faulted in on a thread,
                          or before it returns: now=True)
    copy(value), copies(values)   C-ordered copies in that memory
    populated()           wait until every array made so far is faulted in
"""

from __future__ import annotations

import math
import mmap
import os
import threading

import numpy as np

# Below this many bytes np.zeros: the C library's heap hands out pages it has mapped already.
POPULATE_MIN_BYTES = 1 << 20
_ANONYMOUS = getattr(mmap, "MAP_ANONYMOUS", None)   # with MAP_PRIVATE: huge pages need a private map
_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)    # Linux only
# madvise(MADV_POPULATE_WRITE): fault every page in now, writable (Linux 5.14; the mmap module names it
# from Python 3.13 on, so Linux's value is given here). MAP_POPULATE would map 4 KiB pages before
# the huge-page advice could apply.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
# Bytes faulted in by one madvise call: a huge page (`_populate`). Each call holds the process's
# memory map; a library loaded meanwhile waited up to 16 ms behind 8 MiB calls.
POPULATE_CHUNK = 2 << 20


def zeros(shape, dtype, now: bool = False) -> np.ndarray:
    """np.zeros(shape, dtype), C-ordered; a large one (POPULATE_MIN_BYTES and up) on Linux is an
    anonymous private mmap, page-aligned, advised into huge pages and faulted in by a thread started
    now (`populated` waits for it), zero-filled by the kernel, unmapped when the array and its views
    are gone. `now`: faulted in before the call returns (still without Python's lock), for memory
    about to be written: a step's workspace at its call, whose threads and the faulting thread
    took the residual network's warm first step from 0.16 to 0.24 s."""
    dtype = np.dtype(dtype)
    shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(n) for n in shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if _ANONYMOUS is None or _HUGEPAGE is None or nbytes < POPULATE_MIN_BYTES:
        return np.zeros(shape, dtype)
    try:
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | _ANONYMOUS)
    except (OSError, ValueError):
        return np.zeros(shape, dtype)
    try:
        region.madvise(_HUGEPAGE)
    except OSError:  # a kernel without huge pages: 4 KiB pages
        pass
    if now:
        _populate(region)
        return np.frombuffer(region, dtype).reshape(shape)
    thread = threading.Thread(target=_populate, args=(region,), name="symgrad-populate", daemon=True)
    with _POPULATING_LOCK:  # (the threads that ended dropped: a long process makes many arrays)
        try:
            thread.start()
        except RuntimeError:  # no thread to be had (a limit, the interpreter's exit): pages at first touch
            pass
        else:
            _POPULATING[:] = [*(t for t in _POPULATING if t.is_alive()), thread]
    return np.frombuffer(region, dtype).reshape(shape)


# The threads faulting in the regions `zeros` mapped, until `populated` joins them.
_POPULATING: list[threading.Thread] = []
_POPULATING_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    """A forked child has none of its parent's threads."""
    global _POPULATING_LOCK
    _POPULATING_LOCK = threading.Lock()
    _POPULATING.clear()


if hasattr(os, "register_at_fork"):
    # A process forks once its regions are faulted in (`populated`): a child copied amid a thread's
    # import of ctypes could find that import's lock held forever.
    os.register_at_fork(before=lambda: populated(), after_in_child=_after_fork_in_child)


def _populate(region: mmap.mmap) -> None:
    """madvise(MADV_POPULATE_WRITE) over `region`, POPULATE_CHUNK bytes a call, through ctypes, which
    releases Python's lock for each call (mmap.madvise holds it: the caller would wait as long).
    A call holds the process's memory map for reading, so a map made meanwhile (a library loaded,
    another array) waits for the chunk, not the whole region (150 MiB: 20-100 ms). The thread holds
    the region, so it stays mapped until it ends. A kernel without the advice (before Linux 5.14)
    refuses it: pages at first touch. Writes to the region meanwhile are safe: the advice only
    faults pages in."""
    try:
        import ctypes  # here, not at import: 2 ms that a process making no large array never spends
    except ImportError:  # a Python without ctypes: pages at first touch
        return
    madvise = ctypes.CDLL(None).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    address = ctypes.c_char.from_buffer(region)
    try:
        start, end = ctypes.addressof(address), ctypes.addressof(address) + len(region)
        for chunk in range(start, end, POPULATE_CHUNK):
            if madvise(chunk, min(POPULATE_CHUNK, end - chunk), MADV_POPULATE_WRITE) != 0:
                break
    finally:
        del address  # the region's buffer released: closing it may raise no BufferError


def populated() -> None:
    """Wait until every array `zeros` made so far is faulted in (what a measure of resident memory needs
    first; a step never does: a page not faulted in yet is faulted in by its first write)."""
    with _POPULATING_LOCK:
        threads = list(_POPULATING)
    for thread in threads:
        thread.join()


def copy(value) -> np.ndarray:
    """A C-ordered copy of `value` (np.array(value, copy=True, order="C")), made in `zeros`' memory."""
    (out,) = copies([value])
    return out


# Where `copies` places each array in its region: a cache line apart, as the GEMMs' panels are.
ALIGN = 64


def copies(values) -> list[np.ndarray]:
    """C-ordered copies of `values` in `zeros`' memory, each at a multiple of ALIGN bytes of one of
    two regions: an optimizer's state for a hundred parameters is one map, in huge pages, faulted
    in at once, not a hundred heap blocks whose pages the first step faults one by one (a 12-layer
    GPT small's AdamW moments: 4,600 faults, 0.08 s of a first step on the machines here). The
    values that start as zeros broadcast (the moments) share a region that nothing here writes, the
    others (each parameter's step count) one of their own: written into while the thread faulting
    the first one in still ran, the pages of a 12-layer GPT's moments were faulted twice at once,
    4-20 ms of a warm sg.train_step. A view keeps its whole region mapped."""
    values = [np.asarray(v) for v in values]
    zero = [_zero_broadcast(v) for v in values]
    out: list = [None] * len(values)
    for fresh in (True, False):
        chosen = [k for k, z in enumerate(zero) if z is fresh]
        offsets, total = [], 0
        for k in chosen:
            offsets.append(total)
            total += -(-values[k].nbytes // ALIGN) * ALIGN
        if not chosen:
            continue
        region = zeros(max(total, 1), np.uint8)
        for k, offset in zip(chosen, offsets):
            value = values[k]
            out[k] = region[offset:offset + value.nbytes].view(value.dtype).reshape(value.shape)
            if not fresh:  # (the fresh memory holds the zeros already)
                np.copyto(out[k], value)
    return out


def _zero_broadcast(value: np.ndarray) -> bool:
    """Whether `value` is one element of all zero bytes broadcast (an optimizer's moments start so);
    a negative zero is not."""
    return value.size > 1 and not any(value.strides) and not value.reshape(-1)[:1].view(np.uint8).any()
