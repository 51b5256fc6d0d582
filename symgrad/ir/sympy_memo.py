"""A persistent memo of sympy results, so a fresh process skips sympy's slow work.

Deriving a partial derivative (sympy.diff, simplify, solve for the output-form rewrite)
costs tens of milliseconds per op, paid again by every new process: most of a warm compile.
Results are stored as `sympy.srepr` text in one JSON file per kind in the build cache
directory (`$SYMGRAD_CACHE_DIR/sympy/`), keyed by the caller's key text (the input
expression's srepr and parameters) and tagged with a hash of the code that computes them
(the caller's source file) and sympy's version: a change to either starts a new memo
rather than reading stale results.

A result stored is kept in this process at once and written by `flush`: a compile calls it
while its compiler runs (symgrad.backends.c), and the process calls it at its exit. Writing each one as it
came (a GPT's 28, each the whole file again) cost 35 ms of a cold compile. Writes are atomic (a
temporary file, then os.replace); concurrent writers may drop each other's new entries, which are
then computed again. An unreadable or corrupt file or entry is ignored. The cache directory is
trusted as the compiled modules it holds are: entries are read back with `eval` over sympy's
namespace only, and must rebuild to sympy objects.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path

import sympy

from ..settings import cache_dir

_LOCK = threading.Lock()
# What srepr text names: sympy's namespace, and the classes srepr prints that it does not export
# (a Piecewise's pairs: without them every Piecewise entry failed to read back and was derived again).
_SYMPY_NAMES = {**vars(sympy), "ExprCondPair": sympy.functions.elementary.piecewise.ExprCondPair}


def _names() -> dict:
    """What srepr text names: sympy's namespace, then symgrad's own sympy Functions (trunc,
    floor_divide, bitwise_and, random_bits, is_nan, ...), which win where a name is sympy's too (sympy's
    `trunc` is a polynomial's). Collected at the first read, when `import symgrad` has defined them
    all; without them every entry naming one failed to read back and was derived again."""
    global _names_found
    if _names_found is not None:
        return _names_found
    names = dict(_SYMPY_NAMES)
    from sympy.logic.boolalg import BooleanFunction
    pending = [*sympy.Function.__subclasses__(), *BooleanFunction.__subclasses__()]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if (cls.__module__ or "").startswith("symgrad."):  # an undefined Function's (sympy.Function("f")) is None
            names[cls.__name__] = cls
    _names_found = names
    return names


_names_found: dict | None = None
_FILES: dict[tuple, dict] = {}  # (kind, path) -> entries of this process, loaded on first use
_UNWRITTEN: set = set()         # the (kind, path) of _FILES holding entries `flush` has not written
_TEXTS: dict[tuple, dict] = {}  # (kind, path) -> each entry's srepr text, made once (by `flush`)


_TAGS: dict[str, str | None] = {}  # source file -> its tag: the code of a running process does not change


def _path(kind: str, source: str) -> Path | None:
    if source not in _TAGS:  # reading and hashing the file on every lookup took 2 ms of a warm grad
        try:
            code = Path(source).read_bytes()
        except OSError:
            code = None
        _TAGS[source] = None if code is None else hashlib.sha256(code + sympy.__version__.encode()).hexdigest()[:16]
    tag = _TAGS[source]
    return None if tag is None else cache_dir() / "sympy" / f"{kind}-{tag}.json"


def _entries(kind: str, source: str) -> tuple[Path | None, dict]:
    path = _path(kind, source)
    entries = _FILES.get((kind, path))
    if entries is None:  # first use, or the cache directory changed (tests)
        entries = {}
        if path is not None:
            try:
                loaded = json.loads(path.read_text())
                entries = loaded if isinstance(loaded, dict) else {}
            except (OSError, ValueError):
                entries = {}
        _FILES[(kind, path)] = entries
    return path, entries


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def lookup(kind: str, source: str, key: str):
    """The stored result for `key` (text naming the input exactly), or None to compute it.

    source: the file whose code computes the results (its hash tags the memo).
    """
    with _LOCK:
        text = _entries(kind, source)[1].get(_digest(key))
    if isinstance(text, sympy.Basic):  # stored by this process
        return text
    if not isinstance(text, str):
        return None
    try:
        # Rebuild the tree exactly as stored: evaluating would re-canonicalise it
        # (a Rational times an Add distributes), undoing the form that was chosen.
        with sympy.evaluate(False):
            value = eval(text, {"__builtins__": {}}, _names())  # noqa: S307 - srepr text we wrote
    except Exception:  # noqa: BLE001 - a corrupt entry is computed again
        return None
    return value if isinstance(value, sympy.Basic) else None


def store(kind: str, source: str, key: str, value: sympy.Basic) -> None:
    """Record a result: read back by `lookup` in this process at once, written by `flush`."""
    with _LOCK:
        path, entries = _entries(kind, source)
        digest = _digest(key)
        entries[digest] = value
        _TEXTS.get((kind, path), {}).pop(digest, None)
        if path is not None:
            _UNWRITTEN.add((kind, path))


def flush() -> None:
    """Write the results stored since the last flush (srepr text, one JSON file per kind);
    failing to write (a read-only cache) is ignored."""
    with _LOCK:
        pending = [(key, _FILES[key]) for key in _UNWRITTEN if key in _FILES]
        _UNWRITTEN.clear()
        for (kind, path), entries in pending:
            text = _TEXTS.setdefault((kind, path), {})
            for digest, value in entries.items():
                if digest not in text:
                    text[digest] = sympy.srepr(value) if isinstance(value, sympy.Basic) else value
            tmp = None
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{kind}-", suffix=".tmp")
                with os.fdopen(fd, "w") as f:
                    json.dump(text, f)
                os.replace(tmp, path)
            except OSError:
                if tmp is not None:
                    try:
                        os.unlink(tmp)
                    except OSError:
                        pass


atexit.register(flush)
