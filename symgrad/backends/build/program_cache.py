"""Program cache: a graph's fingerprint -> everything compiling it made, so a warm compile
skips the passes, the lowering and the rendering, and a program loaded from it has all that a
fresh compile has (its optimized graph, pass report and kernel plan: `.plan`, `.report()` and
`.memory_plan` re-run nothing).

The build cache (symgrad/backends/build/cache.py) saves the compiler run; this one
saves the Python stages before it, which dominate a compile whose module is
already built (tens of milliseconds of sympy work). It serves every backend
the compile driver (symgrad.backends.driver) builds: C and CUDA. An entry is three files

    programs/<key>.json     {"format", "dims", "arena", "source", "compiled", "sha256"}
    programs/<key>.c        the source (C or CUDA), byte for byte; "source" is its sha256
    programs/<key>.pickle   (optimized graph, pass report, kernel plan); "compiled" is its sha256

(the source kept as plain text: inside the JSON, decoding its escapes and checksumming it in
canonical form took 5 of a warm 12-layer GPT's 45 ms).

under the cache directory. The key is the sha256 of the graph's structural
fingerprint (symgrad.ir.fingerprint), the backend and its options, and the
compiler's own code: every symgrad source file and template, and the sympy
version. A change to the passes, the lowering or a template therefore misses,
and the program is compiled afresh. The source found is still built through the
build cache, whose key and integrity checks stay the authority on binaries.

The pickle refers to the graph being compiled instead of copying it (symgrad.ir.graph_pickle):
a node of that graph is stored as its position in `graph.nodes`, a Dim by its name, an op by
its registry name. Loaded against the graph built again, the optimized graph and the plan share
its leaves, as a fresh compile's do.
Like the binaries beside it, the pickle is trusted as far as the cache directory is.

A graph without a fingerprint (an attribute that is a Python object) is
compiled every time. A damaged or foreign entry reads as a miss and is
overwritten: "sha256" is a checksum over the rest of the entry (canonical JSON,
as the build cache keys its entries), "source" and "compiled" the sha256 of the other two
files, so a changed byte anywhere, in the source, a size or the plan, fails it (the
pickle's when it is first read: its stages are then compiled again and the entry
rewritten). The arena's sizes are
checked once more at every new Dim binding against the compiled code's own
(symgrad.backends.native), so that even an entry forged with a matching checksum
cannot make the workspace too small.
"""

from __future__ import annotations

import functools
import hashlib
import json
import pickle
import threading
from pathlib import Path
from typing import Callable

import sympy

from ...ir import graph_pickle
from ...ir.fingerprint import fingerprint
from ...ir.graph import Graph
from . import cache, runtime
from .collector import cyclic_gc_paused
from ..lower.memory import ArenaSpec

FORMAT = 7  # 2: the entry carries its checksum; 3: and the pickled optimized graph, pass report and plan;
            # 4: the modules moved into sub-packages (the pickles name the new ones); 5: the pickler
            # moved to symgrad.ir.graph_pickle; 6: its references reduced, not persistent ids;
            # 7: the source in a file of its own


class Entry:
    """What compiling a graph made: all a program needs, whether compiled now or loaded.

    source, dims (Dim symbols, in the order of the entry point's dims argument) and arena (the
    temporaries' sizes and lifetimes, symgrad.backends.lower.memory) are what running the program
    needs. optimized (the graph after the passes; the graph itself with optimize=False),
    pass_report (symgrad.passes.optimize's) and plan (the kernel plan the source renders,
    symgrad.backends.lower.lowering.Plan) describe it: an entry loaded from the cache unpickles
    them when one is first read (`stages`), since a warm compile that only runs the program never
    does (15 of the small GPT's 130 ms).
    """

    def __init__(self, source: str, dims: list, arena: ArenaSpec, optimized: Graph | None = None,
                 pass_report: dict | None = None, plan=None, stages: Callable[[], tuple] | None = None):
        self.source, self.dims, self.arena = source, dims, arena
        self._stages = None if stages is not None else (optimized, pass_report, plan)
        self._load = stages
        self._lock = threading.Lock()

    def _made(self) -> tuple:
        """(optimized, pass_report, plan), unpickled on the first call where the entry was loaded."""
        if self._stages is None:
            with self._lock:  # a program's build thread and its caller may ask at once
                if self._stages is None:
                    self._stages, self._load = self._load(), None
        return self._stages

    optimized = property(lambda self: self._made()[0], doc="the graph after the passes")
    pass_report = property(lambda self: self._made()[1], doc="what each pass did")
    plan = property(lambda self: self._made()[2], doc="the kernel plan the source renders")


@functools.lru_cache(maxsize=None)
def code_fingerprint() -> str:
    """The sha256 of the compiler itself: symgrad's sources and templates, and the sympy version."""
    return hashlib.sha256(f"sympy {sympy.__version__}\n{runtime.code_digest()}".encode()).hexdigest()


def key(graph: Graph, backend: str, **options) -> str | None:
    """The cache key of compiling `graph` on `backend` with `options`, or None if it has none."""
    structure = fingerprint(graph)
    if structure is None:
        return None
    try:
        described = json.dumps(options, sort_keys=True)
    except TypeError:  # an option that is not plain data: compile without the cache
        return None
    parts = f"{FORMAT}\n{backend}\n{described}\n{code_fingerprint()}\n{structure}"
    return hashlib.sha256(parts.encode()).hexdigest()


def _path(key: str, suffix: str = ".json") -> Path:
    return cache.cache_dir() / "programs" / f"{key}{suffix}"


def load(key: str | None, graph: Graph, remake: Callable[[], Entry] | None = None) -> Entry | None:
    """The entry stored under `key`, its Dims and nodes resolved against `graph`; None on a miss.

    Its optimized graph, pass report and plan are read, checked and unpickled when first asked for
    (a warm step that only runs never does: reading and hashing a 12-layer GPT's 1.1 MB pickle
    took 1.5 ms); should that fail then (a pickle damaged or removed since, or one that does not
    load: never seen, the key holding the compiler's code and the graph's structure), `remake()`
    compiles the graph again, its stages are taken (the same, by the same code) and the entry is
    stored again; without `remake` the error is raised."""
    if key is None:
        return None
    entry = cache.read_json(_path(key))
    if entry is None or entry.get("format") != FORMAT:
        return None
    # The checksum covers everything else in the entry: the Dims, every size, the source's and the pickle's hash.
    if entry.pop("sha256", None) != cache.sha256_json(entry):
        return None
    try:
        source = _path(key, ".c").read_bytes()
    except OSError:
        return None
    if hashlib.sha256(source).hexdigest() != entry.get("source") or not _path(key, ".pickle").is_file():
        return None
    by_name = {str(d): d for d in graph.dims}
    try:
        dims = [by_name[name] for name in entry["dims"]]
        arena = ArenaSpec.from_json(entry["arena"], by_name)
    except Exception:  # noqa: BLE001  (anything a foreign or stale entry raises is a miss)
        return None

    def stages() -> tuple:
        with cyclic_gc_paused():  # unpickling makes objects as the stages do
            try:
                compiled = _path(key, ".pickle").read_bytes()
                if hashlib.sha256(compiled).hexdigest() != entry.get("compiled"):
                    raise pickle.UnpicklingError(f"the program cache's {_path(key, '.pickle')} was damaged")
                return tuple(graph_pickle.loads(compiled, graph)[1])
            except Exception:  # noqa: BLE001
                if remake is None:
                    raise
                made = remake()
                store(key, graph, made)  # the entry repaired: the next process reads it back
                return made.optimized, made.pass_report, made.plan
    try:
        text = source.decode()
    except UnicodeDecodeError:
        return None
    return Entry(text, dims, arena, stages=stages)


def store(key: str | None, graph: Graph, entry: Entry) -> None:
    """Record what `key` compiles to (nothing when it is None, or when the plan refers to something
    that cannot be stored by reference); a failed write only costs a miss."""
    if key is None:
        return
    try:
        # The optimized graph's nodes first, in order: each node's inputs are then already stored
        # when it is, so a deep graph does not nest the pickler's recursion.
        compiled = graph_pickle.dumps((entry.optimized.nodes, (entry.optimized, entry.pass_report, entry.plan)), graph)
    except (pickle.PicklingError, TypeError, AttributeError, RecursionError):
        return
    source = entry.source.encode()
    record = {"format": FORMAT, "dims": [str(d) for d in entry.dims], "arena": entry.arena.to_json(),
              "source": hashlib.sha256(source).hexdigest(), "compiled": hashlib.sha256(compiled).hexdigest()}
    record["sha256"] = cache.sha256_json(record)
    path = _path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        cache.atomic_write(_path(key, ".pickle"), compiled)  # the others first: the JSON makes the entry
        cache.atomic_write(_path(key, ".c"), source)
        cache.atomic_write(path, json.dumps(record).encode())
    except OSError:
        pass
