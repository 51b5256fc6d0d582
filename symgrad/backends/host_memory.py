"""Large host arrays in huge pages where the system has them, mapped when they are made.

A fresh large NumPy array (memory the C library maps from the system: np.zeros, np.empty, a copy)
gets its pages at the first write to each, a trap into the kernel a page. On a virtual machine a
trap is dear: on the 2-core machines here, a fresh 246 MiB array took 0.1-0.6 s to touch, and the
nanoGPT-size step's workspace paid that inside its first call. Here a large array is one anonymous
mmap, advised into transparent huge pages (2 MiB: NumPy advises its own large arrays so, and the
step over 4 KiB pages ran 4-5% slower, from the translation misses) and populated in one madvise
call (MADV_POPULATE_WRITE, Linux 5.14 and later): 0.03-0.04 s for the same 246 MiB. Where the system
lacks either, the array is what it would have been: pages at first touch, in 4 KiB pages. The
buffers a step is sure to write (its workspace, the optimizer's state) are made here.
"""

from __future__ import annotations

import math
import mmap

import numpy as np

# Below this many bytes np.zeros: the C library's heap hands out pages it has mapped already.
POPULATE_MIN_BYTES = 1 << 20
_ANONYMOUS = getattr(mmap, "MAP_ANONYMOUS", None)   # with MAP_PRIVATE: huge pages need a private map
_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)    # Linux only
# madvise(MADV_POPULATE_WRITE): fault every page in now, writable (Linux 5.14; the mmap module names it
# from Python 3.13 on, so Linux's value is given here). MAP_POPULATE would map 4 KiB pages before
# the huge-page advice could apply.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def zeros(shape, dtype) -> np.ndarray:
    """np.zeros(shape, dtype), C-ordered; a large one (POPULATE_MIN_BYTES and up) on Linux is an
    anonymous private mmap, page-aligned, advised into huge pages and faulted in now, zero-filled
    by the kernel, unmapped when the array and its views are gone."""
    dtype = np.dtype(dtype)
    shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(n) for n in shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if _ANONYMOUS is None or _HUGEPAGE is None or nbytes < POPULATE_MIN_BYTES:
        return np.zeros(shape, dtype)
    try:
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | _ANONYMOUS)
    except (OSError, ValueError):
        return np.zeros(shape, dtype)
    for advice in (_HUGEPAGE, MADV_POPULATE_WRITE):
        try:
            region.madvise(advice)
        except OSError:  # a kernel without huge pages or without the advice: pages at first touch
            pass
    return np.frombuffer(region, dtype).reshape(shape)


def copy(value) -> np.ndarray:
    """A C-ordered copy of `value` (np.array(value, copy=True, order="C")), made in `zeros`' memory."""
    (out,) = copies([value])
    return out


# Where `copies` places each array in its region: a cache line apart, as the GEMMs' panels are.
ALIGN = 64


def copies(values) -> list[np.ndarray]:
    """C-ordered copies of `values`, one region of `zeros`' memory holding them all (each at a
    multiple of ALIGN bytes): an optimizer's state for a hundred parameters is one map, in huge
    pages, faulted in at once, not a hundred heap blocks whose pages the first step faults one
    by one (a 12-layer GPT small's AdamW moments: 4,600 faults, 0.08 s of a first step on the
    machines here). A view keeps the whole region mapped."""
    values = [np.asarray(v) for v in values]
    offsets, total = [], 0
    for value in values:
        offsets.append(total)
        total += -(-value.nbytes // ALIGN) * ALIGN
    region = zeros(max(total, 1), np.uint8)
    out = []
    for value, offset in zip(values, offsets):
        array = region[offset:offset + value.nbytes].view(value.dtype).reshape(value.shape)
        if not _zero_broadcast(value):  # (the fresh memory holds those already)
            np.copyto(array, value)
        out.append(array)
    return out


def _zero_broadcast(value: np.ndarray) -> bool:
    """Whether `value` is one element of all zero bytes broadcast (an optimizer's moments start so);
    a negative zero is not."""
    return value.size > 1 and not any(value.strides) and not value.reshape(-1)[:1].view(np.uint8).any()
