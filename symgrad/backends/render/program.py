"""A whole program's source: the kernels (symgrad.backends.render.renderer) inside the language's program.

`render(plan, language, labels)` is the one entry: it renders the kernels, then
the program template of the language (templates/program/program.c.j2 or
templates/program/program.cu.j2) with what the entry point needs as data: the Dims,
each buffer's name, C type, storage slot and label, the workspace's sizes, the
constants' literals. The C program is a library called with host pointers; the
CUDA program owns device memory in a state the caller holds. What is printed
around these names (pointer casts, size checks, copies) is the templates'.
"""

from __future__ import annotations

import numpy as np
import sympy

from ...ir import dtypes as D
from ...ir.integer import HELPERS as INTEGER_HELPERS
from ...ir.printing import graph_text
from .c_printer import format_literal
from .expressions import comment, shape_comment
from . import entry_loops
from .kernel_functions import canonical, partition, shared, sharing_key
from .languages import (C_BAD_LABEL, C_ENTRY, C_PROFILE_COUNT, C_PROFILE_EVENTS, C_SCRATCH_BYTES, C_SET_THREADS,
                        C_SIGNATURE, C_WORKSPACE_SIZES, CUDA_ALIGN, CUDA_SIGNATURE, PARALLEL_MIN, Language)
from ..kinds import KINDS, kind_of
from ..plan import Plan, gradients_final_after
from .renderer import Renderer
from .templates import render as render_template

CONST_ROW = 8  # literals per line of a constant table
NAMES_ROW = 4  # kernel names per line of a loop's table of them
# A program is compiled as several translation units side by side once its kernel functions have
# UNIT_LINES lines per unit (below that, the compiler's start and the shared preamble, parsed by
# every unit, cost more than they save), at most MAX_UNITS; two units, one a core on a machine of
# two, from TWO_UNIT_LINES. A second unit costs the preamble again (about 0.03 s of one core)
# and halves gcc's wall time on the functions at -O3 (about 0.035 s per 100 lines): model B's
# step (390 lines of functions) built in 0.18-0.19 s against 0.27-0.29 s as one unit, model A's
# (170 lines) in 0.12-0.14 against 0.14-0.18 s (issue 34).
UNIT_LINES = 1000
TWO_UNIT_LINES = 100
MAX_UNITS = 8
# gcc's time for a line of the entry point (calls and declarations, at -O0) against a line of kernel
# functions (at -O3): about an eighth (a 12-layer GPT small's 1,248-line entry and its preamble
# built in 0.41 s alone; each unit of ~820 lines of functions took 1.2-1.6 s).
ENTRY_LINE_COST = 8
TABLE_MIN = 16     # more workspace temporaries than this, of constant sizes: their bytes are a table
HEADER_LINES = 80  # a graph printed in more lines than this is summarized in the source's header


def render(plan: Plan, language: Language, labels: list = (), profile: bool = False) -> str:
    """The source of `plan` in `language`; `labels`: (input position, number of classes) of the
    class-label inputs the C entry checks before it computes anything. `profile`: the profiling
    build (templates/program/profile.h.j2, C only), whose entry times each kernel call; without it the
    source has no trace of profiling."""
    renderer = Renderer(plan, language)
    kernels = kernel_contexts(renderer)
    if language.memory == "device":
        if profile:
            raise ValueError(f"a profiling build is C's only; {language.name} programs have none")
        return _device_program(renderer, kernels)
    return _host_program(renderer, kernels, labels, profile)


def kernel_contexts(renderer: Renderer) -> list[dict]:
    """The template context of every kernel of the renderer's plan, in schedule order, each made by
    its kind's render (symgrad.backends.kinds.KINDS)."""
    return [kind_of(k).render(renderer, k) for k in renderer.plan.kernels]


def _buffer(renderer: Renderer, b, **more) -> dict:
    """What a template needs of a buffer: its name, slot, C type, element count and label."""
    return dict(name=b.name, index=b.index, ctype=D.C_TYPES[b.dtype], numel=renderer.ex.size(b.numel),
                label=comment(b.label), **more)


def _const(b) -> dict:
    """A constant table: its literals, CONST_ROW a line."""
    items = [format_literal(v.item(), b.dtype) for v in np.asarray(b.value).reshape(-1)]
    rows = [items[i:i + CONST_ROW] for i in range(0, len(items), CONST_ROW)]
    return dict(name=b.name, index=b.index, ctype=D.C_TYPES[b.dtype], size=max(len(items), 1), rows=rows or [["0"]],
                comment=comment(f"constant {b.label}: {list(np.shape(b.value))}"))


def integer_helpers(features) -> list[str]:
    """The division and shift helpers (templates/program/integer.h.j2) the kernels call, in definition order."""
    return [name for name in INTEGER_HELPERS if name in features]


def _header(plan: Plan) -> list[str]:
    """The graph the program computes, at the top of its source: whole when it is short; for a
    model (thousands of nodes, which would make the header most of the file and grow it with
    every layer) its inputs and a count, the nodes being commented at the kernels computing them."""
    graph = plan.graph
    text = graph_text(graph, max_lines=HEADER_LINES)
    if text is not None:
        lines = text.splitlines()
    else:
        lines = [f"graph({', '.join(f'{v.name}: {v.type_str}' for v in graph.inputs)})",
                 f"  {len(graph.variables)} variables (the entry's variables[k] below) and {len(graph.nodes)} nodes:",
                 "  print(step.optimized_graph) shows them; each kernel is commented with the nodes it computes"]
    return [comment(line) for line in lines]


def _host_program(renderer: Renderer, kernels: list, labels: list, profile: bool = False) -> str:
    """A library over host pointers (C): the entry casts each slot to its buffer, checks the labels."""
    plan, ex = renderer.plan, renderer.ex
    shapes = {("inputs", b.index): plan.graph.inputs[b.index].shape for b in plan.inputs}
    shapes.update({("variables", b.index): plan.variable_nodes[b.index].shape for b in plan.variables})
    shapes.update({("outputs", b.index): plan.graph.outputs[b.index].shape for b in plan.outputs})
    pointers = [_buffer(renderer, b, storage=storage, const=storage == "inputs",
                        shape=f"{D.SHORT_NAMES[b.dtype]}{shape_comment(shapes[storage, b.index])}")
                for group, storage in ((plan.inputs, "inputs"), (plan.variables, "variables"), (plan.outputs, "outputs"))
                for b in group]
    workspace = [dict(_buffer(renderer, b), numel=ex.paren(b.numel)) for b in plan.workspace]
    workspace_table = _workspace_table(plan.workspace)
    checks = []
    for position, classes, ignore in labels:
        buf = next(b for b in plan.inputs if b.index == position)
        checks.append(dict(labels=buf.name, numel=ex.size(sympy.Mul(*plan.graph.inputs[position].shape)),
                           classes=ex.size(classes), comment=comment(buf.label),
                           ignore=None if ignore is None else int(ignore)))
    arguments = [f"dims[{k}] = {comment(d)}" for k, d in enumerate(plan.dims)]
    arguments += [f"inputs[{b.index}] = {comment(b.label)}: {D.SHORT_NAMES[b.dtype]}"
                  f"{shape_comment(plan.graph.inputs[b.index].shape)}" for b in plan.inputs]
    arguments += [f"variables[{b.index}] = {comment(b.label)}: "
                  f"{D.SHORT_NAMES[b.dtype]}{shape_comment(plan.variable_nodes[b.index].shape)}" for b in plan.variables]
    arguments += [f"outputs[{b.index}]: {D.SHORT_NAMES[b.dtype]}{shape_comment(plan.graph.outputs[b.index].shape)}"
                  for b in plan.outputs]
    arguments += [f"workspace + offsets[k]: temporary ws<k> ({len(plan.workspace)} buffers)"]
    listed = len(arguments) <= HEADER_LINES
    if not listed:  # a model's hundreds of buffers: listed once, where the entry point declares them
        arguments = [*arguments[:len(plan.dims)], f"inputs[k], variables[k], outputs[k]: the {len(pointers)} buffers "
                     f"the entry point declares first,", "  each commented with its name and shape", arguments[-1]]
    final = gradients_final_after(plan)  # the entry tells its caller when each gradient is final
    kernels = [dict(k, final=[dict(index=slot, label=comment(plan.variables[slot].label))
                              for slot in final.get(position, ())]) for position, k in enumerate(kernels)]
    functions = _functions(kernels)
    entry = _entry(plan, kernels)
    calls = [k for item in entry for k in ([item["kernel"]] if "kernel" in item else item["loop"]["body"])]
    named = {arg for k in calls for arg in k["args"]}
    for b in workspace:  # a temporary only loops step through is reached by its slot, not a name
        b["declared"] = b["name"] in named
    entry_lines = len(pointers) + sum(b["declared"] for b in workspace) + sum(map(_call_lines, calls))
    units = _units(functions, entry_lines)
    from ...version import __version__
    from ..build.runtime import HEADER
    features = renderer.features
    return render_template(
        renderer.lang.program, version=__version__, header=_header(plan), entry=C_ENTRY, arguments=arguments,
        parallel_min=PARALLEL_MIN, int_pow="int_pow" in features, random="random" in features,
        integer_helpers=integer_helpers(features),
        fast_exp="fast_exp" in features, fast_erf="fast_erf" in features, fast_log="fast_log" in features, gemm="gemm" in features, attention="attention" in features, bad_label=C_BAD_LABEL, label_checks=checks,
        consts=[_const(c) for c in plan.consts], runtime_header=HEADER, kernels=kernels, signature=C_SIGNATURE,
        dims=[comment(d) for d in plan.dims], pointers=pointers, workspace=workspace, shapes_at_pointers=not listed,
        workspace_dims=sorted(ex.dims_used(b.numel for b in plan.workspace)), workspace_table=workspace_table,
        workspace_sizes=C_WORKSPACE_SIZES, set_threads=C_SET_THREADS, qualifiers=renderer.lang.helper_qualifiers,
        scratch_sizes=C_SCRATCH_BYTES, scratch=_scratch_calls(kernels),
        profile=profile, profile_events=C_PROFILE_EVENTS, profile_count=C_PROFILE_COUNT, kernel_count=len(kernels),
        functions=functions, units=units, calls=entry, loops=any("loop" in item for item in entry))


def _entry(plan: Plan, kernels: list) -> list[dict]:
    """The entry point's calls, in run order: {"kernel": k} for a call made once, {"loop": ...} for
    a run of calls repeated round after round, each round on its own buffers (entry_loops), its
    body's arguments computed from the round l."""
    storages = ((plan.inputs, "inputs"), (plan.variables, "variables"), (plan.outputs, "outputs"),
                (plan.workspace, "workspace"))
    slot_of = {b.name: (storage, b.index) for group, storage in storages for b in group}
    name_of = {slot: name for name, slot in slot_of.items()}
    slots = [[slot_of.get(arg, arg) for arg in k["args"]] for k in kernels]
    # a call stands for another in a later round with the same function, status check, storages and
    # other arguments; one that tells the caller a gradient is final is never in a loop
    keys = [None if k["final"] else
            (k["call"], bool(k.get("status")), tuple(a[0] if isinstance(a, tuple) else a for a in ss))
            for k, ss in zip(kernels, slots)]
    entry, at = [], 0
    for lp in [*entry_loops.fold(keys, slots, list(map(_call_lines, kernels))), None]:
        stop = len(kernels) if lp is None else lp.first   # the calls made once before the loop (or the end)
        entry += [dict(kernel=dict(k, position=p, comment=k["name"] if k["call"] != k["name"] else None))
                  for p, k in enumerate(kernels[at:stop], at)]
        if lp is not None:
            entry.append(dict(loop=_loop(kernels, lp, entry_loops.arguments(slots, lp), name_of)))
            at = lp.end
    return entry


def _call_lines(k: dict) -> int:
    """The entry's lines for a kernel's call: the call, and its status check."""
    return 1 + bool(k.get("status"))


def _loop(kernels: list, lp, arguments: list[list], name_of: dict) -> dict:
    """A loop's template context: its body (round 0's kernels with their arguments as C
    expressions of l) and, for the calls that may stop the entry, the table of the kernel each
    round's stop names."""
    table = f"stopped_{kernels[lp.first]['name']}"
    body, stops = [], []
    for j, (k, args) in enumerate(zip(kernels[lp.first:lp.first + lp.period], arguments)):
        body.append(dict(k, args=[_argument(a, name_of) for a in args], comment=k["name"], position=lp.first + j,
                         stop=len(stops)))
        if k.get("status"):
            stops.append(j)
    for k in body:  # the C string naming round l's kernel where its call stops the entry
        k["stopped"] = f"{table}[l]" if len(stops) == 1 else f"{table}[{len(stops)} * l + {k['stop']}]"
    names = [f'"{kernels[lp.first + j + lp.period * r]["name"]}"' for r in range(lp.rounds) for j in stops]
    return dict(first=kernels[lp.first]["name"], last=kernels[lp.end - 1]["name"], rounds=lp.rounds,
                period=lp.period, body=body, stops=len(stops), names_table=table,
                names=[names[i:i + NAMES_ROW] for i in range(0, len(names), NAMES_ROW)])


def _argument(argument, name_of: dict) -> str:
    """A loop call's argument in C: a fixed buffer by its name, a stepping one by its slot."""
    if isinstance(argument, str):
        return argument
    if argument[0] == "fixed":
        return name_of[argument[1:]]
    _, storage, index, step = argument
    stride = "l" if abs(step) == 1 else f"{abs(step)} * l"
    slot = stride if index == 0 and step > 0 else f"{index} {'+' if step > 0 else '-'} {stride}"
    return f"SG_WS({slot})" if storage == "workspace" else f"{storage}[{slot}]"


def _workspace_table(workspace: list) -> list[list[str]] | None:
    """The workspace temporaries' bytes as rows of a C table (CONST_ROW a row), where there are
    more than TABLE_MIN of them and no size depends on a Dim; else None: a line each, which
    names the temporary's node. A model's hundreds of temporaries then take a line per eight,
    not one each: the entry point's declarations already name what each holds."""
    sizes = [b.numel for b in workspace]
    if len(sizes) <= TABLE_MIN or not all(isinstance(n, (int, sympy.Integer)) for n in sizes) \
            or [b.index for b in workspace] != list(range(len(workspace))):
        return None
    items = [str(int(b.numel) * D.native_itemsize(b.dtype)) for b in workspace]  # as C holds them
    return [items[i:i + CONST_ROW] for i in range(0, len(items), CONST_ROW)]


def _scratch_calls(kernels: list) -> list[dict]:
    """The runtime calls whose scratch the caller sizes (symgrad_scratch_bytes): one per distinct
    call, its function and sizes, as the first kernel making it has them; `more`: how many later
    kernels make the same call (every layer's products of one shape: a deeper model, no longer
    a function)."""
    distinct: dict[tuple, dict] = {}
    for k in kernels:
        if k.get("gemm"):
            sizes = tuple(loop["size"] for loop in k.get("batch") or ())
            key = (k["gemm"], k["M"], k["N"], k["K"], k.get("share_min"), k.get("parallel_min"), sizes)
            if key in distinct:
                distinct[key]["more"] += 1
            else:
                distinct[key] = dict(k, more=0)
    return list(distinct.values())


def unit_count(lines: int) -> int:
    """How many translation units a program whose kernel functions have `lines` lines is built
    as: one below TWO_UNIT_LINES, else a power of two (whatever the machine's cores, 2, 4, 8, ...,
    the units then share them out evenly), at most MAX_UNITS."""
    units = 1 if lines < TWO_UNIT_LINES else 2
    while units < MAX_UNITS and lines >= UNIT_LINES * units:
        units *= 2
    return units


def _functions(kernels: list) -> list[dict]:
    """The program's kernel functions (kernel_functions.shared: one per distinct kernel, commented
    with the other kernels that call it; `_counts_as_arguments`: one per code differing only in
    its element count); sets each kernel's `call`, the function it calls."""
    texts, representative = _texts(kernels)
    rendered = [position for position, text in enumerate(texts) if text is not None]
    among = shared([texts[p] for p in rendered], [kernels[p]["name"] for p in rendered],
                   [[param["name"] for param in kernels[p]["params"]] for p in rendered])
    function_of = {p: rendered[c] for p, c in zip(rendered, among)}
    calls = _counts_as_arguments(kernels, texts, [function_of[r] for r in representative])
    others: dict[int, list[str]] = {}
    for position, (k, call) in enumerate(zip(kernels, calls)):
        k["call"] = kernels[call]["name"]
        if call != position:
            others.setdefault(call, []).append(k["name"])
    return [dict(text=text, kernel=k, uses=_also_called_for(others.get(position, []), "count" in k))
            for position, (k, text, call) in enumerate(zip(kernels, texts, calls)) if call == position]


# Render every kernel and check its source against the first of its sharing key's, and that every
# context has a key (tests/conftest.py turns it on: every program the tests compile is checked).
VERIFY_SHARING = False


def _texts(kernels: list) -> tuple[list, list[int]]:
    """Each kernel's source, rendered for the first kernel of each sharing key (kernel_functions.
    sharing_key) and None for the others; and each kernel's first of its key, whose function it
    calls. VERIFY_SHARING: every kernel rendered, its source checked against that first one's."""
    first: dict[str, int] = {}
    texts, representative = [], []
    for position, k in enumerate(kernels):
        key = sharing_key(k)
        if key is None and VERIFY_SHARING:
            raise AssertionError(f"kernel {k['name']}: its context has no sharing key")
        seen = position if key is None else first.setdefault(key, position)
        representative.append(seen)
        if seen == position:
            texts.append(render_template(k["template"], k=k).strip("\n"))
            continue
        texts.append(None)
        if VERIFY_SHARING:
            ours = canonical(render_template(k["template"], k=k).strip("\n"), k["name"],
                             [p["name"] for p in k["params"]])
            theirs = canonical(texts[seen], kernels[seen]["name"], [p["name"] for p in kernels[seen]["params"]])
            if ours != theirs:
                raise AssertionError(f"kernels {kernels[seen]['name']} and {k['name']} have one sharing key "
                                     f"and different sources")
    return texts, representative


def _counts_as_arguments(kernels: list[dict], texts: list[str], calls: list[int]) -> list[int]:
    """`calls` (each kernel's function, by position) with the functions whose code is the same but
    for its element count merged into one taking the count as an argument (their kind's `sized`
    context): the optimizer's update was one function per parameter size, and merging them took
    GPT small from 98 functions to 82, gcc's time following the functions. A function no other shares code with keeps its constant
    count: a known trip count vectorizes with no remainder loop. The merged kernels' contexts and
    texts are replaced in place; only the functions are rendered again, not every kernel."""
    groups: dict[str, list[tuple[int, str]]] = {}
    for position in sorted(set(calls)):
        variant = _sized(kernels[position])
        if variant is not None:
            text = render_template(variant["template"], k=variant).strip("\n")
            key = canonical(text, variant["name"], [p["name"] for p in variant["params"]])
            groups.setdefault(key, []).append((position, text))
    merged: dict[int, int] = {}   # a function's position -> the position of the one taking its place
    for group in groups.values():
        if len(group) > 1:   # different counts: equal ones were one function already
            first, texts[first] = group[0]
            merged.update((position, first) for position, _ in group)
    for position, call in enumerate(calls):
        if call in merged:
            kernels[position] = _sized(kernels[position])
    return [merged.get(call, call) for call in calls]


def _sized(context: dict) -> dict | None:
    """The kernel's context with its element count an argument (its kind's `sized`), or None (a
    template of its own, reduce_columns, has no row in KINDS)."""
    row = KINDS.get(context["kind"])
    return row.sized(context) if row is not None and row.sized is not None else None


def _units(functions: list[dict], entry_lines: int) -> int:
    """The number of translation units the functions are compiled in (unit_count), each
    function's unit set (partition by lines, a function's own and those of the preamble's helpers
    it is compiled with, its kernel's `helper_lines`; unit 0 holding the entry point too:
    `entry_lines` at -O0, each about an eighth of a kernel line at -O3)."""
    lines = [f["text"].count("\n") + 1 for f in functions]
    units = unit_count(sum(lines))
    sizes = [n + f["kernel"].get("helper_lines", 0) for n, f in zip(lines, functions)]
    for f, unit in zip(functions, partition(sizes, units, fixed=entry_lines // ENTRY_LINE_COST)):
        f["unit"] = unit
    return units


def _also_called_for(names: list[str], counted: bool = False) -> list[str]:
    """The comment line over a function other kernels call too: how many. Each call of the entry
    point names its kernel, so the list is not repeated here, where it would grow with depth.
    `counted`: the function takes its element count as an argument too."""
    if not names:
        return []
    on = "on their buffers and element counts" if counted else "on their buffers"
    if len(names) == 1:
        return [f"Also called for {names[0]}, the same code {on}"]
    return [f"Also called for {len(names)} more kernels ({names[0]}, ...) {on}, each named at its call"]


def _device_program(renderer: Renderer, kernels: list) -> str:
    """A program holding device memory (CUDA): variables and constants allocated once, inputs and
    outputs copied per call, the workspace laid out by the caller."""
    plan = renderer.plan
    # Typed pointers for the buffers the launches pass (only those: nvcc warns about unused ones).
    used = {arg for k in kernels for arg in k["args"]}
    pointers = [_buffer(renderer, b, field=field, const=const)
                for group, field, const in ((plan.inputs, "inputs", True), (plan.variables, "variables", False),
                                            (plan.consts, "consts", True), (plan.outputs, "outputs", False))
                for b in group if b.name in used or not renderer.lang.declare_used_only]
    variables = []
    for b in plan.variables:  # (of known sizes: decide refuses others where the language holds variables)
        variables.append(dict(name=b.name, index=b.index, label=comment(b.label),
                              bytes=int(b.numel) * D.to_numpy(b.dtype).itemsize))
    arguments = [f"dims[{k}] = {comment(d)}" for k, d in enumerate(plan.dims)]
    arguments += [f"inputs[{b.index}] (host) = {comment(b.label)}: "
                  f"{D.SHORT_NAMES[b.dtype]}{shape_comment(plan.graph.inputs[b.index].shape)}" for b in plan.inputs]
    arguments += [f"outputs[{b.index}] (host): {D.SHORT_NAMES[b.dtype]}{shape_comment(plan.graph.outputs[b.index].shape)}"
                  for b in plan.outputs]
    arguments += [f"variable {b.index} (device) = {comment(b.label)}: "
                  f"{D.SHORT_NAMES[b.dtype]}{shape_comment(plan.variable_nodes[b.index].shape)}" for b in plan.variables]
    arguments += [f"offsets[k]: byte offset of temporary ws<k> in the workspace ({len(plan.workspace)} buffers, "
                  f"multiples of {CUDA_ALIGN}); arena_bytes: the workspace's size"]
    from ...version import __version__
    features = renderer.features
    return render_template(
        renderer.lang.program, version=__version__, header=_header(plan), arguments=arguments,
        int_pow="int_pow" in features, random="random" in features, argmax="argmax" in features,
        integer_helpers=integer_helpers(features),
        rows="rows" in features, gemm="gemm" in features, attention="attention" in features,
        qualifiers=renderer.lang.helper_qualifiers, batch_axes=renderer.lang.matmul_batch_axes,
        consts=[_const(c) for c in plan.consts], kernels=kernels, variables=variables,
        inputs=[_buffer(renderer, b) for b in plan.inputs], outputs=[_buffer(renderer, b) for b in plan.outputs],
        workspace=[_buffer(renderer, b) for b in plan.workspace], signature=CUDA_SIGNATURE,
        dims=[comment(d) for d in plan.dims], pointers=pointers,
        workspace_pointers=[_buffer(renderer, b) for b in plan.workspace
                            if b.name in used or not renderer.lang.declare_used_only],
        align=CUDA_ALIGN)
