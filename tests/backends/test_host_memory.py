"""symgrad.backends.host_memory: large host arrays in transparent huge pages, mapped when they are made
(madvise MADV_HUGEPAGE, then MADV_POPULATE_WRITE), not one page at a time at their first touch; and the
C step's workspace and optimizer state made there. Checked by the process's resident pages and the
kernel's account of the mapping (/proc/self/smaps), not by timing."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest

import symgrad as sg
from symgrad import nn
from symgrad.backends import host_memory

populates = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="the madvise advice is Linux's")
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * mmap.PAGESIZE


def _mapping(address: int) -> dict[str, str]:
    """The kernel's account of the mapping holding `address` (its /proc/self/smaps fields)."""
    fields, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(end, 16) for end in head.split("-"))
            inside = low <= address < high
        elif inside:
            fields[head.rstrip(":")] = line.split()[1]
    return fields


def _mapped_at_once(array: np.ndarray) -> bool:
    """Whether `array`'s memory is an mmap region of host_memory's (the end of its chain of bases)."""
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(base.obj if isinstance(base, memoryview) else base, mmap.mmap)


@populates
def test_a_large_array_is_resident_when_made_and_a_small_one_comes_from_the_heap():
    before = _resident_bytes()
    array = host_memory.zeros((16, 1 << 20), np.float32)   # 64 MiB
    assert _resident_bytes() - before >= 0.9 * array.nbytes   # np.zeros's pages come at first touch
    assert array.shape == (16, 1 << 20) and array.dtype == np.float32
    assert array.flags.c_contiguous and array.flags.writeable and not array.any()
    array[3, 5] = 1.5
    assert array.sum() == 1.5
    before = _resident_bytes()
    lazy = np.zeros((16, 1 << 20), np.float32)
    assert _resident_bytes() - before < 0.1 * lazy.nbytes   # what host_memory is for
    assert not _mapped_at_once(host_memory.zeros(100, np.float64))


@populates
def test_a_large_array_may_use_huge_pages():
    """The mapping is advised into transparent huge pages (THPeligible: the advice took, whether or
    not the kernel found 2 MiB pages free). NumPy advises its own large arrays so; the nanoGPT-size
    step ran 4-5% slower over a workspace of 4 KiB pages (from the translation misses)."""
    if not THP.exists() or "[never]" in THP.read_text():
        pytest.skip("transparent huge pages are off on this system")
    array = host_memory.zeros((8, 1 << 20), np.float32)   # 32 MiB
    assert _mapping(array.ctypes.data).get("THPeligible") == "1"


def test_copy_is_a_c_ordered_copy_of_its_own():
    source = np.arange(600 * 700, dtype=np.float64).reshape(600, 700).T   # 3.4 MB, Fortran-ordered
    copied = host_memory.copy(source)
    np.testing.assert_array_equal(copied, source)
    assert copied.flags.c_contiguous and copied.dtype == source.dtype
    copied[0, 0] = -1.0
    assert source[0, 0] == 0.0
    filled = host_memory.copy(np.broadcast_to(np.float32(0.5), (1024, 1024)))
    assert filled.flags.writeable and (filled == 0.5).all()
    # A broadcast zero (an optimizer's moments) is the fresh memory as it comes; a negative zero,
    # whose bytes are not all zero, is copied (its sign kept), at either size of allocation.
    for shape in ((1024, 1024), (7, 5)):
        zeros = host_memory.copy(np.broadcast_to(np.float32(0.0), shape))
        assert zeros.flags.writeable and zeros.shape == shape and (zeros == 0).all()
        negative = host_memory.copy(np.broadcast_to(np.float32(-0.0), shape))
        assert np.signbit(negative).all()


@populates
def test_the_c_steps_workspace_and_optimizer_state_are_mapped_at_once():
    """A step whose workspace and Adam moments are over a MiB each: both are host_memory's, resident
    before the step writes them (a virtual machine's page faults cost the nanoGPT-size step's
    first call 0.4 s)."""
    sg.manual_seed(0)
    model = nn.Sequential(nn.Linear(600, 600), nn.Tanh(), nn.Linear(600, 10))
    x, y = sg.input("hm_x", (1024, 600)), sg.input("hm_y", (1024,), dtype="int64")
    step = sg.train_step(nn.functional.cross_entropy(model(x), y), model.parameters(), sg.optim.Adam(lr=1e-3),
                         backend="c")
    moments = [array for name, array in step._storage.items()
               if name not in step._cells and array.nbytes >= host_memory.POPULATE_MIN_BYTES]
    assert len(moments) == 2 and all(_mapped_at_once(m) for m in moments)   # the weight's m and v
    rng = np.random.default_rng(0)
    assert np.isfinite(step(hm_x=rng.standard_normal((1024, 600), dtype=np.float32),
                            hm_y=rng.integers(0, 10, 1024)))
    (layout,) = step.program._layouts.values()
    workspace = layout[3]
    assert workspace.nbytes >= 1024 * 600 * 4 and _mapped_at_once(workspace)


def test_a_steps_first_arena_is_planned_and_mapped_while_its_compiler_runs():
    """A train step whose shapes are all known: its first call's arena was planned and its memory
    mapped on the build's thread while the compiler ran (a 12-layer GPT's first step spent 0.1 s
    on them), and that call's layout holds that very plan and memory. A program the caches held
    ran no compiler: its first call plans the arena itself."""
    sg.manual_seed(0)
    model = nn.Sequential(nn.Linear(23, 29), nn.Tanh(), nn.Linear(29, 3))  # shapes no other test compiles
    x, y = sg.input("ahead_x", (64, 23)), sg.input("ahead_y", (64,), dtype="int64")
    step = sg.train_step(nn.functional.cross_entropy(model(x), y), model.parameters(), sg.optim.SGD(lr=0.1),
                         backend="c")
    program = step.program
    ahead = dict(program._ahead)
    rng = np.random.default_rng(0)
    assert np.isfinite(step(ahead_x=rng.standard_normal((64, 23), dtype=np.float32), ahead_y=rng.integers(0, 3, 64)))
    (layout,) = program._layouts.values()
    if program.from_cache:  # a cache kept from an earlier session: no compiler ran, nothing was made ahead
        assert not ahead
        return
    assert list(ahead) == [()] and not program._ahead  # made for the one binding, taken by its first call
    assert program.memory_plans[()] is ahead[()].plan and layout[3] is ahead[()].memory
    assert layout[3].nbytes == ahead[()].plan.arena_bytes + 64
