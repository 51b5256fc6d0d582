"""Program cache: a graph's fingerprint -> the source it compiles to, so a warm compile skips
the passes, the lowering and the rendering.

The build cache (symgrad/backends/cache.py) saves the compiler run; this one
saves the Python stages before it, which dominate a compile whose module is
already built (tens of milliseconds of sympy work). An entry is a JSON file

    programs/<key>.json   {"format", "source", "dims", "arena", "sha256"}

under the cache directory. The key is the sha256 of the graph's structural
fingerprint (symgrad.ir.fingerprint), the backend and its options, and the
compiler's own code: every symgrad source file and template, and the sympy
version. A change to the passes, the lowering or a template therefore misses,
and the program is compiled afresh; the entry then only holds what the build
cache would rebuild anyway. The source found is still built through the
build cache, whose key and integrity checks stay the authority on binaries.

A graph without a fingerprint (an attribute that is a Python object) is
compiled every time. A damaged or foreign entry reads as a miss and is
overwritten: "sha256" is a checksum over the rest of the entry (canonical JSON,
as the build cache keys its entries), so a changed byte anywhere, in the source
or in a size, fails it. The arena's sizes are checked once more at every new Dim
binding against the compiled code's own (symgrad.backends.c), so that even an
entry forged with a matching checksum cannot make the workspace too small.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import sympy

from ..ir.fingerprint import fingerprint
from ..ir.graph import Graph
from . import cache
from .memory import ArenaSpec

FORMAT = 2  # 2: the entry carries its checksum
_PACKAGE = Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=None)
def code_fingerprint() -> str:
    """The sha256 of the compiler itself: symgrad's sources, its templates and the sympy version."""
    from .templates import template_dir

    digest = hashlib.sha256(f"sympy {sympy.__version__}\n".encode())
    for root, pattern in ((_PACKAGE, "*.py"), (Path(template_dir()), "*.j2")):
        for path in sorted(root.rglob(pattern)):
            digest.update(f"{path.relative_to(root)} {path.stat().st_size}\n".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


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


def _path(key: str) -> Path:
    return cache.cache_dir() / "programs" / f"{key}.json"


def load(key: str | None, graph: Graph) -> dict | None:
    """The entry stored under `key`, with its Dims resolved against `graph`; None on a miss.

    Returns {"source": str, "dims": [Dim symbols], "arena": ArenaSpec}.
    """
    if key is None:
        return None
    entry = cache.read_json(_path(key))
    if entry is None or entry.get("format") != FORMAT:
        return None
    # The checksum covers everything else in the entry: the source, the Dims, every size.
    if entry.pop("sha256", None) != cache.sha256_json(entry):
        return None
    by_name = {str(d): d for d in graph.dims}
    try:
        dims = [by_name[name] for name in entry["dims"]]
        return {"source": entry["source"], "dims": dims, "arena": ArenaSpec.from_json(entry["arena"], by_name)}
    except (KeyError, TypeError, ValueError, sympy.SympifyError):
        return None


def store(key: str | None, source: str, dims: list, arena: ArenaSpec) -> None:
    """Record what `key` compiles to (nothing when it is None); a failed write only costs a miss."""
    if key is None:
        return
    path = _path(key)
    entry = {"format": FORMAT, "dims": [str(d) for d in dims], "arena": arena.to_json(), "source": source}
    entry["sha256"] = cache.sha256_json(entry)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        cache.atomic_write(path, json.dumps(entry).encode())
    except OSError:
        pass
