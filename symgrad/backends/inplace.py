"""Memory sweeps over lowered kernels: outputs and variables written in place of temporaries.

After the kernels are built, two rewrites save a copy each: an output that
is the whole of a temporary (a reshape of it) is written by the temporary's
kernel directly (`alias_output`), and a variable's new value computed by a
loop that reads the variable only at the element it writes is stored into
the variable itself (`write_in_place`). Each rewrite retargets a buffer:
kernels are rebuilt with `plan.swap_buffers` (dataclasses.replace), never
changed; the functions take the kernels, the workspace and the views and
return new ones.
"""

from __future__ import annotations

from dataclasses import replace

from .plan import LoopKernel, kernel_reads, kernel_writes, swap_buffers
from .views import Buffer, View, _same, is_contiguous


def retarget(kernels: list, workspace: list, views: dict, old: Buffer, new: Buffer) -> tuple:
    """(kernels, workspace, views) with every use of the temporary `old` made a use of `new`, and
    `old` gone from the workspace. Kernels and views that do not use `old` stay the same objects."""
    kernels = [swap_buffers(k, {id(old): new}) if any(b is old for b in [*kernel_reads(k), *kernel_writes(k)])
               else k for k in kernels]
    views = {key: replace(view, buffer=new) if view.buffer is old else view for key, view in views.items()}
    return kernels, [b for b in workspace if b is not old], views


def alias_output(kernels: list, workspace: list, views: dict, view: View, out: Buffer) -> tuple | None:
    """(kernels, workspace, views) with the temporary that `view` reads written as the output buffer
    `out` instead, or None where that cannot be.

    Applies when the output reads the whole temporary contiguously from its start (a
    reshape, an added or removed size-1 axis); transposes and broadcasts still need a copy.
    """
    if view.kind != "buffer" or view.buffer.storage != "workspace" or view.buffer.dtype != out.dtype \
            or not is_contiguous(view) or not (isinstance(view.offset, int) and view.offset == 0) \
            or not _same(view.buffer.numel, out.numel):
        return None
    return retarget(kernels, workspace, views, view.buffer, out)


def write_in_place(kernels: list, workspace: list, views: dict, finals: list, variable_buffer: dict) -> tuple:
    """Let the loop computing a variable's new value store it into the variable directly.

    finals: (target variable node, new value node, view of the new value) per update;
    variable_buffer: id(target) -> its Buffer. Safe when the loop reads the variable only at the
    element it writes (same strides), no later kernel reads the variable's old value, and the new
    value is a temporary of its own (not an output, not another update's value). Returns
    (kernels, workspace, views, ids of the targets so written).
    """
    counts: dict[int, int] = {}
    for _, new, _ in finals:
        counts[id(new)] = counts.get(id(new), 0) + 1
    direct: set[int] = set()
    for target, new, view in finals:
        var = variable_buffer[id(target)]
        buf = view.buffer
        if view.kind != "buffer" or buf.storage != "workspace" or counts[id(new)] != 1 \
                or view is not views.get(id(new)) or not is_contiguous(view) \
                or not (isinstance(view.offset, int) and view.offset == 0):
            continue
        if any(other is not view and other.buffer is buf for _, _, other in finals):
            continue  # another update reads this temporary too
        producer = next((i for i, k in enumerate(kernels) if any(b is buf for b in kernel_writes(k))), None)
        if producer is None or not isinstance(kernels[producer], LoopKernel):
            continue
        kernel = kernels[producer]
        if any(any(b is var for b in kernel_reads(k)) for k in kernels[producer + 1:]):
            continue
        aligned = all(o.view.buffer is not var or (
            all(_same(a, b) for a, b in zip(o.view.strides, kernel.out_view.strides))
            and isinstance(o.view.offset, int) and o.view.offset == 0) for o in kernel.operands)
        if not aligned:
            continue
        kernels, workspace, views = retarget(kernels, workspace, views, buf, var)
        direct.add(id(target))
    return kernels, workspace, views, direct


def renumber_workspace(kernels: list, workspace: list) -> tuple:
    """(kernels, workspace) with the temporaries numbered ws0, ws1, ... again, closing the gaps the
    retargeted ones left."""
    renumbered = {id(b): replace(b, index=k, name=f"ws{k}") for k, b in enumerate(workspace) if b.index != k}
    if not renumbered:
        return kernels, workspace
    return [swap_buffers(k, renumbered) for k in kernels], [renumbered.get(id(b), b) for b in workspace]
