"""The view algebra's axis merge (written once, used by loop, reduction and row kernels) and the
in-place sweep's retargets, which build new kernels and leave the old ones as they were."""

from __future__ import annotations

import sympy

import symgrad as sg
from symgrad.backends.lower.inplace import apply_retargets
from symgrad.backends.lower.lowering import lower
from symgrad.backends.plan import kernel_reads, kernel_writes
from symgrad.backends.views import (Buffer, View, collapse, contiguous_strides, merge_axes, merge_loop_axes,
                                    merge_strided_axes, replace)


def test_merge_axes_joins_axes_every_operand_steps_through_as_one():
    # A contiguous (2, 3, 4) array is one loop; beside a read with its last two axes transposed,
    # no two axes step as one for both operands.
    shape = (2, 3, 4)
    assert merge_axes(shape, [contiguous_strides(shape)]) == ((24,), [(1,)])
    assert merge_axes(shape, [contiguous_strides(shape), (12, 1, 3)]) == ((2, 3, 4), [(12, 4, 1), (12, 1, 3)])
    # ...and beside a read broadcast along the first axis, the last two merge.
    assert merge_axes(shape, [contiguous_strides(shape), (0, 4, 1)]) == ((2, 12), [(12, 1), (0, 1)])
    # Size-1 axes are dropped first; a broadcast (stride 0) axis stays apart from a strided one.
    assert merge_axes((5, 1, 7), [(7, 99, 1), (0, 0, 1)]) == ((5, 7), [(7, 1), (0, 1)])
    # Symbolic sizes merge as products.
    B = sympy.Symbol("B", positive=True, integer=True)
    sizes, strides = merge_axes((B, 10), [(10, 1)])
    assert sympy.simplify(sizes[0] - 10 * B) == 0 and strides == [(1,)]
    # No operand at all: every axis steps as one.
    assert merge_axes((2, 3), []) == ((6,), [])


def test_the_three_spellings_agree():
    shape, strides = (4, 1, 6, 5), [(30, 0, 5, 1), (0, 0, 5, 1)]
    merged_shape, merged = collapse(shape, strides)
    pairs = merge_loop_axes([(s, tuple(st[a] for st in strides)) for a, s in enumerate(shape)])
    assert [s for s, _ in pairs] == list(merged_shape)
    assert [tuple(st[k] for _, st in pairs) for k in range(len(strides))] == merged
    sizes, (only,) = merge_axes(shape, [strides[0]])
    assert merge_strided_axes(list(zip(shape, strides[0]))) == list(zip(sizes, only)) == [(120, 1)]
    assert merge_loop_axes([(3, ()), (4, ())]) == [(12, ())]


def test_retargets_build_new_kernels_and_leave_the_old_ones():
    x, y = sg.input("x", (8, 6)), sg.input("y", (8,), dtype="int64")
    W = sg.param("W", (6, 4))
    step = sg.train_step(sg.cross_entropy(sg.tanh(x @ W), y), [W], sg.optim.SGD(lr=0.1), backend="numpy")
    plan = lower(step.graph)
    assert len(plan.workspace) >= 2
    temp = plan.workspace[0]  # the others move down one place
    users = [k for k in plan.kernels if any(b is temp for b in [*kernel_reads(k), *kernel_writes(k)])]
    assert users
    before = [(k, [b.name for b in [*kernel_reads(k), *kernel_writes(k)]]) for k in plan.kernels]
    new = Buffer("elsewhere", "output", 9, temp.dtype, temp.numel)
    kernels, workspace = apply_retargets(plan.kernels, plan.workspace, {id(temp): (temp, new)})
    # The old kernels still read and write what they did.
    assert [(k, [b.name for b in [*kernel_reads(k), *kernel_writes(k)]]) for k, _ in before] == before
    assert all(not any(b is temp for b in [*kernel_reads(k), *kernel_writes(k)]) for k in kernels)
    assert sum(any(b is new for b in [*kernel_reads(k), *kernel_writes(k)]) for k in kernels) == len(users)
    # Every temporary moved down one place, so exactly the kernels using no temporary stay the same
    # objects; the new ones use the renumbered buffers of the new workspace.
    for old, k in zip(plan.kernels, kernels):
        assert (k is old) == all(b.storage != "workspace" for b in [*kernel_reads(old), *kernel_writes(old)])
        assert all(any(b is w for w in workspace) for b in [*kernel_reads(k), *kernel_writes(k)]
                   if b.storage == "workspace")
    # The workspace lost the temporary and is numbered from ws0 again.
    assert temp not in workspace and [b.name for b in workspace] == [f"ws{k}" for k in range(len(workspace))]
    assert [b.index for b in workspace] == list(range(len(workspace)))


def test_a_strided_view_reshapes_without_a_copy_where_numpy_does():
    """reshape_view regroups the axes of a strided view as NumPy's no-copy reshape does (a slice's
    last axis split into heads), and refuses where the elements are not one axis in memory: on
    600 random slices and transposes of an array, every view it returns reads what NumPy's reshape
    holds, and it returns one for every case NumPy reshapes as a view."""
    import itertools
    import random

    import numpy as np

    from symgrad.backends.views import View, reshape_view
    rng = random.Random(5)
    base = np.arange(4096)
    found = 0
    for _ in range(600):
        full = [rng.choice([1, 2, 3, 4, 6]) for _ in range(rng.randint(1, 4))]
        arr = base[:int(np.prod(full))].reshape(full)[tuple(slice(0, rng.randint(1, f)) for f in full)]
        if rng.random() < 0.5:
            arr = arr.transpose(rng.sample(range(arr.ndim), arr.ndim))
        view = View("buffer", arr.shape, "int64", tuple(s // 8 for s in arr.strides),
                    (arr.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // 8)
        sizes, rest = [], arr.size
        while rest > 1 and len(sizes) < 4:
            size = rng.choice([d for d in range(2, rest + 1) if rest % d == 0])
            sizes, rest = sizes + [size], rest // size
        sizes.insert(rng.randint(0, len(sizes)), 1)
        got = reshape_view(view, tuple(sizes))
        assert (got is not None) == np.shares_memory(arr.reshape(sizes), arr), (arr.shape, arr.strides, sizes)
        if got is not None:
            found += 1
            read = [base[got.offset + sum(i * s for i, s in zip(index, got.strides))]
                    for index in itertools.product(*map(range, sizes))]
            np.testing.assert_array_equal(np.reshape(read, sizes), arr.reshape(sizes))
    assert found > 300
    # The transformer's case: (B, T, 3C)[..., C:2C] as (B, T, H, D).
    qkv = View("buffer", (8, 64, 128), "float32", (64 * 384, 384, 1), 128)
    assert reshape_view(qkv, (8, 64, 4, 32)).strides == (64 * 384, 384, 32, 1)


def test_replace_is_dataclasses_replace_for_the_plans_dataclasses():
    import dataclasses
    import pytest
    buf = Buffer("ws3", "workspace", 3, "float32", 12)
    view = View("buffer", (3, 4), "float32", (4, 1), buffer=buf)
    for changes in ({}, {"shape": (12,), "strides": (1,)}, {"offset": 2, "literal": 1.5}):
        mine, theirs = replace(view, **changes), dataclasses.replace(view, **changes)
        assert mine is not view and type(mine) is View and vars(mine) == vars(theirs)
    assert vars(view)["shape"] == (3, 4)   # the original is left as it was
    with pytest.raises(TypeError, match="View has no field"):
        replace(view, shpe=(12,))
