"""The graph region each kernel of a plan came from: a layer's name where the model has one.

Values the passes and autodiff compute carry no module path; the variables do (sg.nn names a
parameter by its module path, `h.0.attn.c_attn.weight`, and an optimizer's state after its
parameter, `h.0.attn.c_attn.weight.exp_avg`). So a value's region is found from the variables
around it in the graph:

- a value that reads variables directly is in their module (the dotted prefix they share:
  `x @ W.T + b` of `fc1` is in `fc1`; the optimizer's update of `fc1.weight`, too);
- any other value looks both ways, to the modules of the nearest variable-reading values it is
  computed from (`up`) and of those computed from it or updating a variable with it (`down`),
  each with its distance in the graph. One that directly feeds one module's variable-reading
  values is in that module (a weight's gradient, read by the weight's update); else one between
  two parts of a layer is in the deepest module a part up and a part down share (the attention
  between `attn.c_attn` and `attn.c_proj` is in `attn`); else it is in the nearer side's module,
  down on a tie (a layer norm's mean is in its layer, whose weight reads it three values on).

A variable's module is its parameter's name without the last part (`fc1.weight` -> `fc1`); a
parameter of no module (`W`) is its own region; hyperparameters (the learning rate) belong to
none. A kernel is in the region of the value it is named after (`k25_add_t23`: t23, as
`print(step.optimized_graph)` names it); a kernel named after no value (a copy) in that of the
first value its comment lines name. Values in no region are in "" (printed as "(top)").
"""

from __future__ import annotations

import re

from ..decide.decisions import graph_namer
from ..plan import Plan

TOP = ""  # the region of values no variable places
_NAMED = re.compile(r"_(t\d+)$")
_FIRST = re.compile(r"\b(t\d+)\b")


def module_of(name: str) -> str:
    """`h.0.attn.c_attn.weight` -> `h.0.attn.c_attn`; a name with no module is its own region."""
    return name.rpartition(".")[0] or name


def common(regions) -> str:
    """The dotted prefix the regions share: `h.0.attn.c_attn`, `h.0.attn.c_proj` -> `h.0.attn`."""
    parts = None
    for region in regions:
        names = region.split(".") if region else []
        if parts is None:
            parts = names
            continue
        k = 0
        while k < min(len(parts), len(names)) and parts[k] == names[k]:
            k += 1
        parts = parts[:k]
    return ".".join(parts or [])


def variable_regions(variables) -> dict[str, str]:
    """Variable name -> its module: a parameter's own; other state (an optimizer's, a gradient
    buffer) its parameter's, the longest parameter name its own name extends; running statistics
    and random streams of no parameter, their own module. Hyperparameters are left out."""
    params = sorted((v.name for v in variables if v.attrs.get("role") == "param"), key=len, reverse=True)
    regions = {}
    for v in variables:
        role = v.attrs.get("role")
        if role == "hyper" or v.name is None:
            continue
        owner = v.name if role == "param" else next((p for p in params if v.name.startswith(p + ".")), None)
        if owner is None and role in ("state", "rng", "grad"):
            owner = v.name
        if owner is not None:
            regions[v.name] = module_of(owner)
    return regions


def _nearest(candidates: list) -> tuple | None:
    """(distance, regions) of the nearest of `candidates` ((distance, regions) pairs), one step on."""
    if not candidates:
        return None
    nearest = min(d for d, _ in candidates)
    return nearest + 1, frozenset().union(*(r for d, r in candidates if d == nearest))


def _choose(up: tuple | None, down: tuple | None) -> str:
    """A value's region from the nearest variable-reading values before it (`up`) and after it
    (`down`), each (distance, regions)."""
    if down is not None and down[0] == 1 and len(down[1]) == 1:
        return next(iter(down[1]))  # it feeds one layer's variables directly: a weight's gradient
    if up is not None and down is not None:
        shared = [common([a, b]) for a in up[1] for b in down[1]]
        deepest = max(shared, key=lambda r: (r.count(".") + bool(r), r))
        if deepest:
            return deepest  # between two parts of one layer: attention between its projections
    side = down if up is None or (down is not None and down[0] <= up[0]) else up
    return common(sorted(side[1])) if side is not None else TOP


def value_regions(graph, variables) -> dict[int, str]:
    """id(value) -> its region, for every value of `graph` (see the module's docstring)."""
    by_name = variable_regions(variables)
    nodes = graph.nodes
    seed: dict[int, str] = {}
    for n in nodes:
        read = [by_name[i.name] for i in n.inputs if i.op.name == "variable" and i.name in by_name]
        if n.op.name == "variable" and n.name in by_name:
            read.append(by_name[n.name])
        if read:
            seed[id(n)] = common(read)
    up: dict[int, tuple | None] = {}
    for n in nodes:  # inputs first
        up[id(n)] = (0, frozenset([seed[id(n)]])) if id(n) in seed else \
            _nearest([up[id(i)] for i in n.inputs if up.get(id(i)) is not None])
    updating: dict[int, list] = {}
    for target, new in graph.updates:
        if target.name in by_name:
            updating.setdefault(id(new), []).append((0, frozenset([by_name[target.name]])))
    users = graph.users
    down: dict[int, tuple | None] = {}
    for n in reversed(nodes):  # users first
        down[id(n)] = (0, frozenset([seed[id(n)]])) if id(n) in seed else \
            _nearest([down[id(u)] for u in users[id(n)] if down.get(id(u)) is not None] + updating.get(id(n), []))
    return {id(n): seed[id(n)] if id(n) in seed else _choose(up[id(n)], down[id(n)]) for n in nodes}


def kernel_regions(plan: Plan) -> list[str]:
    """The region of each kernel of `plan`, in the plan's order."""
    graph = plan.graph
    name = graph_namer(graph, plan.variable_nodes)
    by_label = {name(n): n for n in graph.nodes}
    regions = value_regions(graph, plan.variable_nodes)
    out = []
    for k in plan.kernels:
        match = _NAMED.search(k.name)
        label = match.group(1) if match else next((m.group(1) for line in k.lines for m in _FIRST.finditer(line)
                                                   if m.group(1) in by_label), None)
        node = by_label.get(label)
        out.append(regions.get(id(node), TOP) if node is not None else TOP)
    return out
