"""symgrad.backends.host_memory: large host arrays in transparent huge pages, mapped when they are made
(madvise MADV_HUGEPAGE, then MADV_POPULATE_WRITE on a thread of its own), not one page at a time at their
first touch; and the C step's workspace and optimizer state made there. Checked by the process's resident pages and the
kernel's account of the mapping (/proc/self/smaps), not by timing."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest

import symgrad as sg
from symgrad import nn
from symgrad.backends import host_memory
from symgrad.backends.build import program_cache
from symgrad.backends.lower.memory import memory_plan

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
def test_a_large_array_is_resident_once_populated_and_a_small_one_comes_from_the_heap():
    before = _resident_bytes()
    array = host_memory.zeros((16, 1 << 20), np.float32)   # 64 MiB, faulted in on a thread
    host_memory.populated()
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
def test_an_array_for_memory_about_to_be_written_is_resident_when_made():
    """now=True (a step's workspace at its call): faulted in before zeros returns, not beside the
    step's own threads."""
    before = _resident_bytes()
    array = host_memory.zeros((16, 1 << 20), np.float32, now=True)   # 64 MiB
    assert _resident_bytes() - before >= 0.9 * array.nbytes
    assert array.flags.c_contiguous and array.flags.writeable and not array.any()


@populates
def test_what_is_written_while_the_pages_are_faulted_in_stays():
    """The caller writes a fresh array at once, while its thread is still faulting the pages in (a
    step's first call may): the advice faults pages in and never clears one already written."""
    arrays = [host_memory.zeros((32, 1 << 20), np.float32) for _ in range(2)]   # 2 x 128 MiB
    for k, array in enumerate(arrays):
        array[:, ::1024] = np.arange(32 * 1024, dtype=np.float32).reshape(32, 1024) + k   # a value per 4 KiB page
    host_memory.populated()
    for k, array in enumerate(arrays):
        assert np.array_equal(array[:, ::1024], np.arange(32 * 1024, dtype=np.float32).reshape(32, 1024) + k)
        assert not array[:, 1::1024].any()


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


def _region(array: np.ndarray):
    """The object at the end of `array`'s chain of bases (an mmap, or NumPy's own allocation)."""
    base = array
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return base.obj if isinstance(base, memoryview) else base


def test_copies_are_c_ordered_copies_of_their_own_a_cache_line_apart_in_two_regions():
    """The values that start as zeros broadcast in one region, which nothing writes while its pages
    are faulted in; the values written in another."""
    rng = np.random.default_rng(0)
    values = [rng.standard_normal((300, 500)).T,                          # Fortran-ordered float64
              np.broadcast_to(np.float32(0.0), (256, 1024)),                # an optimizer's moment: 1 MiB
              np.broadcast_to(np.float32(-0.0), (3, 5)),                    # copied: its bytes are not zero
              np.float32(2.5), np.arange(7, dtype=np.int64), np.zeros(0, np.float32),
              np.broadcast_to(np.int32(3), (4, 4))]
    copied = host_memory.copies(values)
    assert len(copied) == len(values)
    for value, array in zip(values, copied):
        np.testing.assert_array_equal(array, value)
        assert array.shape == np.shape(value) and array.dtype == np.asarray(value).dtype
        assert array.flags.c_contiguous and array.flags.writeable
        assert array.ctypes.data % host_memory.ALIGN == 0
    assert np.signbit(copied[2]).all()
    written = {id(_region(a)) for k, a in enumerate(copied) if k != 1}
    assert len(written) == 1 and id(_region(copied[1])) not in written   # two regions ...
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert _mapped_at_once(copied[0]) and _mapped_at_once(copied[1])   # ... mapped at once (over a MiB each)
    copied[1][:] = 7.0                                      # and no two overlap
    np.testing.assert_array_equal(copied[0], values[0])
    np.testing.assert_array_equal(copied[4], values[4])
    assert (copied[6] == 3).all() and copied[3] == 2.5


def test_an_optimizer_s_state_for_many_small_parameters_is_one_region():
    """Adam's moments of sixteen 160 KB weights: each under POPULATE_MIN_BYTES, together over it.
    Each its own heap block, their pages came one fault at a time in the first step (a 12-layer GPT
    small's: 4,600 faults); now they are views of one region, mapped at once."""
    sg.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(200, 200) for _ in range(8)])
    x = sg.input("many_x", (4, 200))
    step = sg.train_step((model(x) ** 2).mean(), model.parameters(), sg.optim.Adam(lr=1e-3), backend="numpy")
    state = [array for name, array in step._storage.items() if name not in step._cells and array.size > 1]
    assert len(state) == 32 and all(a.nbytes < host_memory.POPULATE_MIN_BYTES for a in state)
    assert len({id(_region(a)) for a in state}) == 1
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert _mapped_at_once(state[0])
    before = {name: array.copy() for name, array in step._storage.items() if name not in step._cells}
    step(many_x=np.ones((4, 200), np.float32))
    changed = [name for name, array in step._storage.items() if name in before and not np.array_equal(array, before[name])]
    assert len(changed) >= 32   # every moment written in place, each in its own bytes


def test_a_program_sharing_a_step_s_storage_copies_only_the_variables_it_adds():
    """step.program_for("apply") before any accumulate(): its gradient buffers are new, Adam's
    moments are the step's own arrays, not copies; the region holding the new buffers holds
    nothing else (a copy of the moments there stayed mapped as long as the buffers lived)."""
    sg.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 4))
    x, y = sg.input("shared_x", (8, 64)), sg.input("shared_y", (8,), dtype="int64")
    step = sg.train_step(nn.functional.cross_entropy(model(x), y), model.parameters(), sg.optim.Adam(lr=0.01),
                         backend="numpy")
    before = dict(step._storage)
    step.program_for("apply")
    assert all(step._storage[name] is array for name, array in before.items())
    added = [array for name, array in step._storage.items() if name not in before]
    assert len(added) == 4   # the four parameters' gradient buffers
    regions = {id(_region(a)): _region(a) for a in added}
    aligned = sum(-(-a.nbytes // host_memory.ALIGN) * host_memory.ALIGN for a in added)
    assert sum(r.nbytes for r in regions.values()) <= aligned


@populates
def test_the_c_steps_workspace_and_optimizer_state_are_mapped_at_once():
    """A step whose workspace and Adam moments are over a MiB each: both are host_memory's, faulted in
    as they are made, not by the step's writes (a virtual machine's page faults cost the nanoGPT-size step's
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
    # ... and its placement went to the program cache with the arena: a warm compile of this graph
    # loads it and places nothing (memory.ArenaSpec.placed).
    entry = program_cache.load(program._program_key, program.graph)
    assert entry.arena.placed == (64, tuple(ahead[()].plan.offsets))
    planned = ahead[()].plan  # (its runtime scratch region counted by the call, not the plan)
    assert vars(memory_plan(entry.arena, {}, 64)) == {**vars(planned), "scratch_bytes": 0}
