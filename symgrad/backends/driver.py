"""The compile driver: one sequence for every native backend (C/OpenMP and CUDA).

    compile_program(graph, language, build, optimize=True) -> Compilation

optimize (symgrad.passes) -> decide and lower (symgrad.backends.lower.lowering.lower) -> render
(symgrad.backends.render.program, with the language's row of symgrad.backends.render.languages)
-> build (the backend's `build(source)`: cffi for C, nvcc for CUDA, both through the build
cache). The program cache (symgrad.backends.build.program_cache) is consulted first and keeps
what a compile made (source, optimized graph, pass report, plan, arena), so a hit skips the
three Python stages and a program made from it has everything a fresh one has.

A backend keeps only what differs: how it builds and how it calls what it built
(symgrad.backends.c, symgrad.backends.cuda, on the base symgrad.backends.native).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from .. import passes
from ..ir.graph import Graph
from ..ir.ops import label_checks
from .decide import half
from .kinds.matmul import bf16_gemm_applies
from .lower import lowering
from .build import program_cache
from .build.collector import cyclic_gc_paused
from .build.cache import BuiltModule
from .render.languages import Language
from .lower.memory import ArenaSpec
from .render.program import render
from .report import timed


@dataclass
class Compilation:
    """What compiling one graph for one language gave: the stages' results (from the program
    cache or made now), then the built module, and how long each stage took (a program-cache
    hit has "lookup" and "build" only)."""

    entry: program_cache.Entry
    key: str | None           # the program-cache key (None: the graph has no fingerprint)
    timings: dict
    from_program_cache: bool  # the passes, the lowering and the render were skipped
    built: BuiltModule | None = None
    from_cache: bool | None = None  # the build cache had the binary: no compiler ran
    unstored: Callable[[], None] | None = None  # prepare(..., store=False): the program-cache write left to do
    # Dim binding key -> the first call's arena (native.ArenaAhead), made while the compiler ran
    ahead: dict = field(default_factory=dict)

    def store(self) -> None:
        """Write what the stages made to the program cache, where `prepare` left that to the caller."""
        write, self.unstored = self.unstored, None
        if write is not None:
            write()


def label_inputs(graph: Graph) -> list:
    """(input position, number of classes, ignored label or None) of each class-label input of
    `graph` (before the passes, which drop the class_labels nodes that mark them): what a host
    program's entry checks before it computes anything."""
    return [(position, node.attrs["num_classes"], node.attrs.get("ignore_index"))
            for position, node in label_checks(graph)]


def compile_stages(graph: Graph, language: Language, optimize: bool = True,
                   timings: dict | None = None) -> program_cache.Entry:
    """The passes, the lowering and the render of `graph` for `language`, timed into `timings`."""
    with cyclic_gc_paused():
        return _stages(graph, language, optimize, {} if timings is None else timings)


def _stages(graph: Graph, language: Language, optimize: bool, timings: dict) -> program_cache.Entry:
    half.refuse_half_leaves(graph, language.name)
    with timed(timings, "passes"):
        pass_report: dict = {}
        optimized = passes.optimize(graph, report=pass_report) if optimize else graph
        optimized = half.legalize(optimized)  # 16-bit floats: kernels compute in float32 (backends/decide/half.py)
        # ... and the bfloat16 GEMMs round float32 operands themselves: the casts before them folded
        optimized = half.fold_operand_casts(optimized, lambda node: bf16_gemm_applies(node, language))
    with timed(timings, "lower"):
        # variables: the given graph's, so every variable keeps its slot after the passes; fused
        # epilogues and gathered patches where the language builds them (its capabilities, read by decide).
        plan = lowering.lower(optimized, variables=graph.variables, matmul_epilogues=True, implicit_gemm=True,
                              language=language)
        arena = ArenaSpec.of(plan)
    with timed(timings, "render"):
        source = render(plan, language, label_inputs(graph))
    return program_cache.Entry(source, list(plan.dims), arena, optimized, pass_report, plan)


def prepare(graph: Graph, language: Language, optimize: bool = True, store: bool = True) -> Compilation:
    """The stages of compiling `graph` for `language`, before the build: from the program cache,
    else run (and stored there; with `store=False` by the caller's `Compilation.store()`, which
    can write it while the compiler runs: pickling a 12-layer GPT's plan takes 0.1 s).

    Only what changes the source keys the program cache (the graph, the language, `optimize`,
    the compiler's code): compiler flags change the binary, which the build cache keys.
    """
    if not isinstance(graph, Graph):
        raise TypeError(f"backend {language.name.lower()!r}: expected a symgrad Graph, got {type(graph).__name__}")
    timings: dict[str, float] = {}
    with timed(timings, "lookup"), cyclic_gc_paused():  # unpickling a plan makes objects as the stages do
        key = program_cache.key(graph, language.name.lower(), optimize=optimize)
        entry = program_cache.load(key, graph, remake=lambda: compile_stages(graph, language, optimize))
    hit = entry is not None
    compilation = Compilation(entry, key, timings, hit)
    if entry is None:
        compilation.entry = entry = compile_stages(graph, language, optimize, timings)
        compilation.unstored = lambda: program_cache.store(key, graph, entry)
        if store:
            compilation.store()
    return compilation


def build(compilation: Compilation, build_module: Callable[[str], BuiltModule]) -> Compilation:
    """The last stage: `build_module(source)` (the backend's compiler, through the build cache), timed."""
    started = time.time()
    with timed(compilation.timings, "build"):
        compilation.built = build_module(compilation.entry.source)
    try:
        # The library predates this build call: it came from the cache, no compiler ran.
        compilation.from_cache = compilation.built.library_path.stat().st_mtime < started
    except OSError:  # a module that is no file of the cache (a test's stand-in)
        compilation.from_cache = None
    return compilation


def compile_program(graph: Graph, language: Language, build_module: Callable[[str], BuiltModule],
                    optimize: bool = True) -> Compilation:
    """Compile `graph` for `language` and build it: `prepare`, then `build`."""
    return build(prepare(graph, language, optimize), build_module)


def source_of(graph: Graph, language: Language) -> str:
    """The source `graph` compiles to in `language` (passes on); nothing is built or cached."""
    if not isinstance(graph, Graph):
        raise TypeError(f"expected a symgrad Graph, got {type(graph).__name__}")
    return compile_stages(graph, language).source
