"""Memory sweeps over lowered kernels: outputs and variables written in place of temporaries.

After the kernels are built, two rewrites save a copy each: an output that
is the whole of a temporary (a reshape of it) is written by the temporary's
kernel directly (`aliases_output`), and a variable's new value computed by
a loop that reads the variable only at the element it writes is stored into
the variable itself (`write_in_place`). Each decides a retarget, temporary
-> output or variable buffer; `retarget_views` makes later kernels read the
new buffer, and `apply_retargets` rebuilds the kernels once at the end with
`plan.swap_buffers` (views.replace: kernels are never changed), the
temporaries renumbered.

A retarget only ever moves a workspace temporary onto an output or a
variable, so the checks of a later decision (which kernel writes a
temporary, which kernels read a variable) see the same buffers whether the
earlier retargets are applied to the kernels yet or not.
"""

from __future__ import annotations


from ..plan import kernel_reads, kernel_writes, swap_buffers
from ..views import Buffer, View, _same, is_contiguous, replace


def retarget_views(views: dict, old: Buffer, new: Buffer) -> dict:
    """`views` with every view of the temporary `old` reading `new` instead."""
    return _retarget_all(views, {id(old): new})


def _retarget_all(views: dict, swap: dict) -> dict:
    """`views` with every view of a temporary in `swap` (id -> new buffer) reading its new buffer:
    one pass over the views for all of a sweep's retargets, not one per retarget."""
    if not swap:
        return views
    return {key: replace(view, buffer=swap[id(view.buffer)]) if id(view.buffer) in swap else view
            for key, view in views.items()}


def aliases_output(view: View, out: Buffer) -> bool:
    """Whether the kernel storing the temporary that `view` reads can store the output `out` instead:
    the output reads the whole temporary contiguously from its start (a reshape, an added or
    removed size-1 axis); transposes and broadcasts still need a copy."""
    return view.kind == "buffer" and view.buffer.storage == "workspace" and view.buffer.dtype == out.dtype \
        and is_contiguous(view) and isinstance(view.offset, int) and view.offset == 0 \
        and _same(view.buffer.numel, out.numel)


def write_in_place(kernels: list, views: dict, finals: list, variable_buffer: dict) -> tuple:
    """Let the loop computing a variable's new value store it into the variable directly.

    finals: (target variable node, new value node, view of the new value) per update;
    variable_buffer: id(target) -> its Buffer. Safe when the loop reads the variable only at the
    element it writes (same strides), no later kernel reads the variable's old value, and the new
    value is a temporary of its own (not an output, not another update's value). Returns
    (views, retargets: id(temporary) -> (temporary, variable), ids of the targets so written).
    """
    counts: dict[int, int] = {}
    for _, new, _ in finals:
        counts[id(new)] = counts.get(id(new), 0) + 1
    # Who writes each buffer first, who reads it last, which updates read it: asked per update, so
    # found once (the kernels do not change in this sweep; a model has an update per parameter).
    producer_of: dict[int, int] = {}
    last_reader: dict[int, int] = {}
    for i, k in enumerate(kernels):
        for b in kernel_writes(k):
            producer_of.setdefault(id(b), i)
        for b in kernel_reads(k):
            last_reader[id(b)] = i
    update_views: dict[int, list] = {}
    for _, _, view in finals:
        update_views.setdefault(id(view.buffer), []).append(view)
    retargets: dict[int, tuple] = {}
    direct: set[int] = set()
    for target, new, view in finals:
        var = variable_buffer[id(target)]
        buf = view.buffer
        # (A view of a temporary retargeted earlier in this sweep reads the variable by now: it
        # is no longer the value's view. The views are retargeted once, after the sweep.)
        if view.kind != "buffer" or buf.storage != "workspace" or counts[id(new)] != 1 \
                or view is not views.get(id(new)) or id(buf) in retargets or not is_contiguous(view) \
                or not (isinstance(view.offset, int) and view.offset == 0):
            continue
        if any(other is not view for other in update_views[id(buf)]):
            continue  # another update reads this temporary too
        producer = producer_of.get(id(buf))
        if producer is None or kernels[producer].kind != "loop":  # (a loop kernel writes its views whole)
            continue
        kernel = kernels[producer]
        if last_reader.get(id(var), -1) > producer:
            continue  # a later kernel reads the variable's old value
        stored = next(v for b, v, _ in kernel.stores() if b is buf)  # (a loop may store several values)
        aligned = all(o.view.buffer is not var or (
            all(_same(a, b) for a, b in zip(o.view.strides, stored.strides))
            and isinstance(o.view.offset, int) and o.view.offset == 0) for o in kernel.operands)
        if not aligned:
            continue
        retargets[id(buf)] = (buf, var)
        direct.add(id(target))
    return _retarget_all(views, {key: var for key, (_, var) in retargets.items()}), retargets, direct


def apply_retargets(kernels: list, workspace: list, retargets: dict) -> tuple:
    """(kernels, workspace) with each retargeted temporary (id -> (temporary, new buffer)) replaced
    by its new buffer and gone from the workspace, and the temporaries left numbered ws0, ws1, ...
    again; one rebuild of the kernels that use any of them."""
    swap = {key: new for key, (_, new) in retargets.items()}
    workspace = [b for b in workspace if id(b) not in swap]
    for k, b in enumerate(workspace):
        if b.index != k:
            swap[id(b)] = replace(b, index=k, name=f"ws{k}")
    if not swap:
        return kernels, workspace
    return [swap_buffers(k, swap) for k in kernels], [swap.get(id(b), b) for b in workspace]
