"""Large host arrays whose pages are mapped when they are made, not one by one at their first touch.

A fresh large NumPy array (memory the C library maps from the system: np.zeros, np.empty, a copy)
gets its pages one at a time, at the first write to each: a trap into the kernel for every 4 KiB.
On a virtual machine a trap is dear (about 7 us on the 2-core machines here): the nanoGPT-size
step's 246 MiB workspace cost its first call 0.4 s of page faults, against 0.07 s to map it in one
mmap call with MAP_POPULATE, where the kernel fills the page tables itself. The buffers a step is
sure to write (its workspace, the optimizer's state) are made here.
"""

from __future__ import annotations

import mmap

import numpy as np

# Below this many bytes np.zeros: the C library's heap hands out pages it has mapped already.
POPULATE_MIN_BYTES = 1 << 20
_POPULATE = getattr(mmap, "MAP_POPULATE", None)   # Linux only


def zeros(shape, dtype) -> np.ndarray:
    """np.zeros(shape, dtype), C-ordered, its pages mapped now where the system can (Linux) and the
    array is large: anonymous memory from mmap with MAP_POPULATE, page-aligned, zero-filled by the
    kernel, unmapped when the array and its views are gone."""
    dtype = np.dtype(dtype)
    shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(n) for n in shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if _POPULATE is None or nbytes < POPULATE_MIN_BYTES:
        return np.zeros(shape, dtype)
    try:
        region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _POPULATE)
    except (OSError, ValueError):
        return np.zeros(shape, dtype)
    return np.frombuffer(region, dtype).reshape(shape)


def copy(value) -> np.ndarray:
    """A C-ordered copy of `value` (np.array(value, copy=True, order="C")), made in `zeros`' memory."""
    value = np.asarray(value)
    out = zeros(value.shape, value.dtype)
    np.copyto(out, value)
    return out
