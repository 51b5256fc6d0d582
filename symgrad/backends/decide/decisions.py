"""What the lowering decides, as one printable value: `decide(graph) -> Decisions`.

Before any kernel is built, a pure function of the graph decides which
elementwise nodes are computed inside another kernel (fused chains,
reduction prologues, cheap values recomputed by each reader), which
elementwise groups finish a reduction or a matmul in its kernel (epilogues),
which row reductions and maps run as one row kernel (row groups), which
attention outputs are stored in the order their reader's transpose wants, and
the order the kernels run in. `str(decisions)` reads as a list of those choices;
symgrad.backends.lower.lowering builds the kernels from it.

    fused into their reader: t10 t11
    recomputed by each reader: t4 t6
    epilogues: t13 <- sum t12
    stored by their reader's loop: none
    patches read in place: none
    matmuls: t3 gemm
    attention statistics stored for their gradient: none
    attention outputs stored heads last: none
    row groups:
      rows (B,) x 10: max t5, exp t7, sum t8, log t9 | partial sums t12 | reads t3 b
    kernels, in order:
      matmul t3
      rows t5 t7 t8 t9
      sum t12 -> t13
      ...
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType

from ...ir import shapes as S
from ...ir.graph import Graph
from ...ir.printing import Namer
from ...ir.value import Value
from ..lower.concat import parts_in_place
from ..kinds import BY_OP
from ..kinds import matmul as matmul_kind
from ..kinds.attention import heads_last, shared_stats
from ..render.languages import C_OPENMP, Language
from .fusion import (choose_epilogues, choose_matmul_epilogues, choose_recompute, choose_stores_in_reader, fused_chains,
                     materializes, use_counts)
from .patches import patch_takes
from .rows import RowGroup, choose_row_groups
from .schedule import graph_order, schedule as schedule_kernels


def graph_namer(graph: Graph, variables) -> Namer:
    """The names the printed graph, the report and the generated code give the values: inputs,
    then `variables` (the caller's variable slots), then the nodes in graph order."""
    name = Namer()
    for v in [*graph.inputs, *variables, *graph.nodes]:
        name(v)
    return name


@dataclass(frozen=True, eq=False)
class Decisions:
    """Fusion, epilogues, row groups, save-or-recompute and kernel order of one graph's lowering.

    Nodes are held by identity (`id(node)`): two decisions over the same graph compare equal when
    they decide the same for the same nodes.
    """

    graph: Graph
    variables: tuple        # the variable nodes given buffers, in order
    options: tuple          # (option, value) pairs decide was called with
    fused: frozenset        # ids of the elementwise nodes computed inside their readers' kernels
    recomputed: frozenset   # those of `fused` read by several kernels, each computing it again
    choices: tuple          # save / recompute records of forward values (dicts), for the report
    epilogue_of: MappingProxyType  # id(elementwise root) -> the reduction or matmul whose kernel computes it
    row_groups: tuple       # RowGroup: each one row kernel
    order: tuple            # every node, in the order the lowering visits them (kernels run in this order)
    patches: frozenset = frozenset()  # ids of the takes whose patch matrix matmuls read in place (patches.py)
    # id(embed) -> the sum whose buffer it stores its part into (concat.py)
    parts: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    # id(matmul) -> its implementation (symgrad.backends.kinds.matmul.IMPLEMENTATIONS)
    matmuls: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    # id(attention_grad) -> the attention whose softmax statistics it reads (kinds/attention.py)
    attention_stats: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    # ids of the attention nodes whose output is stored (B, T, H, E), as the transpose reading it wants
    heads_last: frozenset = frozenset()
    # id(loop root) -> the values its loop computes and stores besides its own (fusion.choose_stores_in_reader);
    # those values are among `fused`
    stores: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    # The language decided for (its name is among `options`): what the kinds' lowerings read of it,
    # such as the fused attention's walk and scratch (languages.Language.attention).
    language: Language = C_OPENMP
    # graph_namer(graph, variables), made once (naming a 12-layer GPT's nodes took 10 ms a time): `namer()`
    primed: Namer | None = field(default=None, compare=False, repr=False)

    def namer(self) -> Namer:
        """graph_namer(graph, variables): a copy of the one decide made, for the caller to extend."""
        return self.primed.copy() if self.primed is not None else graph_namer(self.graph, self.variables)

    @cached_property
    def stats_stored(self) -> frozenset:
        """ids of the attention nodes whose kernel stores its softmax statistics for a gradient."""
        return frozenset(id(forward) for forward in self.attention_stats.values())

    @cached_property
    def epilogued(self) -> frozenset:
        """ids of the reductions and matmuls whose kernel is emitted with its epilogue's root."""
        return frozenset(id(r) for r in self.epilogue_of.values())

    @cached_property
    def row_of(self) -> dict:
        """id(member or alias) -> its row group."""
        return {id(n): g for g in self.row_groups for n in [*g.members, *g.aliases]}

    @cached_property
    def row_partial(self) -> dict:
        """id(full sum split into per-row parts) -> the row group storing the parts."""
        return {id(p): g for g in self.row_groups for p in g.partials}

    @cached_property
    def sums_in_place(self) -> frozenset:
        """ids of the sums whose parts store themselves into their buffer: no kernel of their own."""
        return frozenset(id(root) for root in self.parts.values())

    @cached_property
    def _parts_by_root(self) -> dict:
        """id(sum) -> the embeds whose parts it stores in place, in graph order (one pass over the graph)."""
        by_root: dict[int, list] = {}
        for n in self.graph.nodes:
            root = self.parts.get(id(n))
            if root is not None:
                by_root.setdefault(id(root), []).append(n)
        return by_root

    def parts_of(self, root: Value) -> list:
        """The embeds whose parts sum `root` stores in place, in graph order."""
        return list(self._parts_by_root.get(id(root), ()))

    def materializes(self, node: Value) -> bool:
        """Whether `node` gets a kernel and a buffer of its own (row group members aside)."""
        return materializes(node, self.fused, self.epilogued) and id(node) not in self.sums_in_place

    def _key(self) -> tuple:
        return (id(self.graph), tuple(map(id, self.variables)), self.options, self.fused, self.recomputed,
                self.choices, tuple((root, id(r)) for root, r in self.epilogue_of.items()),
                tuple(g.ids() for g in self.row_groups), tuple(map(id, self.order)), self.patches,
                tuple((part, id(root)) for part, root in self.parts.items()), tuple(self.matmuls.items()),
                tuple((grad, id(forward)) for grad, forward in self.attention_stats.items()), self.heads_last,
                tuple((root, tuple(map(id, values))) for root, values in self.stores.items()))

    def __eq__(self, other) -> bool:
        return isinstance(other, Decisions) and self._key() == other._key()

    __hash__ = None  # type: ignore[assignment]  -- holds dicts: equal by content, not hashable

    def kernels(self) -> list[str]:
        """One line per kernel, in the order they run: `matmul t2`, `sum t8 -> t9` (with its
        epilogue up to t9), `rows t5 t7 t8` (a row group's members, at its first member)."""
        name = self.namer()
        lines, seen = [], set()
        for n in self.order:
            g = self.row_of.get(id(n))
            if g is not None:
                if id(g) not in seen:
                    seen.add(id(g))
                    lines.append("rows " + " ".join(name(m) for m in g.members))
            elif id(n) in self.epilogue_of:
                r = self.epilogue_of[id(n)]
                lines.append(f"{r.op.name} {name(r)} -> {name(n)}")
            elif self.materializes(n):
                also = self.stores.get(id(n), ())
                lines.append(f"{n.op.name} {name(n)}" + (" (also stores " + " ".join(map(name, also)) + ")"
                                                           if also else ""))
        return lines

    def __str__(self) -> str:
        name = self.namer()
        position = {id(n): k for k, n in enumerate(self.graph.nodes)}
        by_id = {id(n): n for n in self.graph.nodes}

        def names(ids) -> str:
            return " ".join(name(by_id[i]) for i in sorted(ids, key=position.__getitem__)) or "none"
        options = ", ".join(f"{k}={v}" for k, v in self.options)
        stored = {id(v) for values in self.stores.values() for v in values}
        lines = [f"decisions ({options})",
                 f"fused into their reader: {names(self.fused - self.recomputed - stored)}",
                 f"recomputed by each reader: {names(self.recomputed)}"]
        epilogues = sorted(self.epilogue_of.items(), key=lambda item: position[item[0]])
        lines.append("epilogues: " + (", ".join(f"{name(by_id[root])} <- {r.op.name} {name(r)}"
                                                 for root, r in epilogues) or "none"))
        lines.append("stored by their reader's loop: " + (", ".join(
            f"{' '.join(name(v) for v in values)} <- {name(by_id[root])}"
            for root, values in sorted(self.stores.items(), key=lambda item: position[item[0]])) or "none"))
        lines.append(f"patches read in place: {names(self.patches)}")
        matmuls = sorted(self.matmuls.items(), key=lambda item: position[item[0]])
        lines.append("matmuls: " + (", ".join(f"{name(by_id[node])} {impl}" for node, impl in matmuls) or "none"))
        stats = sorted(self.attention_stats.items(), key=lambda item: position[item[0]])
        lines.append("attention statistics stored for their gradient: " + (", ".join(
            f"{name(forward)} -> {name(by_id[grad])}" for grad, forward in stats) or "none"))
        lines.append(f"attention outputs stored heads last: {names(self.heads_last)}")
        sums = [root for root in self.graph.nodes if id(root) in self.sums_in_place]
        lines.append("sums stored in place: " + (", ".join(
            f"{name(root)} <- " + " ".join(name(n) for n in self.parts_of(root))
            for root in sums) or "none"))
        lines.append("row groups:" + ("" if self.row_groups else " none"))
        lines += [f"  {_group_line(g, name)}" for g in self.row_groups]
        lines.append("kernels, in order:")
        lines += [f"  {line}" for line in self.kernels()]
        return "\n".join(lines)


def _group_line(g: RowGroup, name) -> str:
    """`rows (B,) x 10: max t5, sub t6, sum t8 | partial sums t11 | views t7 | reads t4`."""
    rows = "(" + ", ".join(map(str, g.rows)) + ("," if len(g.rows) == 1 else "") + ")"
    text = f"rows {rows} x {g.size}: " + ", ".join(f"{m.op.name} {name(m)}" for m in g.members)
    for words, part in (("partial sums", g.partials), ("views", g.aliases), ("reads", g.leaves)):
        if part:
            text += f" | {words} " + " ".join(name(n) for n in part)
    return text


def refuse(graph: Graph, language: Language, variables=()) -> None:
    """Raise the language's refusal (languages.Refusal: the op, the node and the language) for the
    first node of `graph` whose kernel kind says the language cannot build it, or the first of
    `variables` of a symbolic size where the language allocates variables up front."""
    for v in variables if language.sized_variables else ():
        if not all(isinstance(S.as_size(size), int) for size in v.shape):
            raise language.refusal(v, f"variable {v.name!r}: a symbolic size cannot be allocated up front")
    for node in graph.nodes:
        kind = BY_OP.get(node.op.kind)
        why = kind.refuse(node, language) if kind is not None and kind.refuse is not None else None
        if why is not None:
            raise language.refusal(node, why)


def decide(graph: Graph, variables=None, fuse_reduce: bool = True, recompute: bool = True,
           schedule: bool = True, matmul_epilogues: bool = False, implicit_gemm: bool = False,
           language: Language = C_OPENMP) -> Decisions:
    """The lowering's decisions for `graph` (the options are `lower`'s), for `language` (what it can
    build: languages.Language; a node it cannot raises its Refusal here); reads the graph, changes
    nothing.

    In this order, each step seeing the ones before: elementwise chains fused into their one
    reader; cheap values read by several kernels recomputed in each (`recompute`); reductions'
    epilogues and row groups (`fuse_reduce`; a reduction in a row group keeps no epilogue of its
    own); matmul epilogues (`matmul_epilogues`, where the language's matmuls compute them); the
    variables' new values a later loop computes and stores with its own (AdamW's moments, in the
    parameter's update: fusion.choose_stores_in_reader); the kernel order (`schedule`: few bytes
    live, else the graph's own order); the convolution patches
    its matmuls gather as they pack them (`implicit_gemm`, where the language builds those:
    symgrad.backends.decide.patches); each matmul's implementation (symgrad.backends.kinds.matmul); the
    attention statistics a gradient reads from its forward's kernel.
    """
    variables = tuple(graph.variables if variables is None else variables)
    refuse(graph, language, variables)
    matmul_epilogues = matmul_epilogues and language.epilogues
    implicit_gemm = implicit_gemm and {"patch gemm", "direct rows"} <= set(language.matmuls)
    variables = tuple(graph.variables if variables is None else variables)
    primed = graph_namer(graph, variables)
    name = primed.copy()
    uses = use_counts(graph)
    chains = fused_chains(graph, uses, fuse_reduce)
    fused, choices = choose_recompute(graph, uses, chains, fuse_reduce, name) if recompute else (chains, [])
    epilogue_of = choose_epilogues(graph, uses, fused) if fuse_reduce else {}
    groups = choose_row_groups(graph, fused, epilogue_of) if fuse_reduce else ()
    in_groups = {id(n) for g in groups for n in [*g.members, *g.aliases]}
    # A reduction in a group, or one whose epilogue root a group computes, is no epilogue: the
    # group's kernel computes the root, so a reduction outside it is a kernel of its own before it.
    epilogue_of = {root: r for root, r in epilogue_of.items() if id(r) not in in_groups and root not in in_groups}
    if matmul_epilogues:
        epilogue_of.update(choose_matmul_epilogues(graph, uses, fused, epilogue_of, in_groups))
    epilogued = {id(r) for r in epilogue_of.values()}
    parts = parts_in_place(graph, uses, fused, epilogued | set(epilogue_of) | in_groups)
    taken = epilogued | set(epilogue_of) | in_groups | set(parts) | {id(root) for root in parts.values()}
    stores = choose_stores_in_reader(graph, uses, fused, taken)
    recomputed = frozenset(fused) - frozenset(chains)
    unstored, fused = fused, set(fused) | {id(v) for values in stores.values() for v in values}
    order = schedule_kernels(graph, fused, epilogued, groups, stores) if schedule else graph_order(graph, groups)
    if order is None and stores:  # the stores' waits for old values closed a cycle: each value its own loop
        stores, fused = {}, unstored
        order = schedule_kernels(graph, fused, epilogued, groups)
    if order is None:  # the updates' own waits in a cycle: the graph's order (a copy saves each value)
        order = graph_order(graph, groups)
    options = (("fuse_reduce", fuse_reduce), ("recompute", recompute), ("schedule", schedule),
               ("matmul_epilogues", matmul_epilogues), ("implicit_gemm", implicit_gemm), ("language", language.name))
    patches = patch_takes(graph) if implicit_gemm else frozenset()
    matmuls = matmul_kind.choose(graph, language, patches, epilogued)
    return Decisions(graph, variables, options, frozenset(fused), recomputed,
                     tuple(choices), MappingProxyType(epilogue_of), tuple(groups), tuple(order), patches,
                     MappingProxyType(parts), MappingProxyType(matmuls), MappingProxyType(shared_stats(graph)),
                     language=language, heads_last=heads_last(graph), stores=MappingProxyType(stores),
                     primed=primed)
