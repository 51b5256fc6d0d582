"""Build cache: C or CUDA source -> a verified, loaded binary `_symgrad_<hash>` (a cffi extension
module, or a plain shared library opened with cffi's ABI mode).

    build(source, cdef, *, flags=None, kind="c", headers=None, link=None) -> BuiltModule
                                                    (kind "c", "program", "cuda" or "runtime")

`build` compiles `source` with cffi's out-of-line API mode (`ffi.cdef(cdef)`,
`ffi.set_source(name, source)`, its C wrapper compiled and linked by one run of the C
compiler, see symgrad.backends.build.toolchain), or loads the module built
earlier from the same inputs. Layout of the cache directory
(`SYMGRAD_CACHE_DIR`, default `~/.cache/symgrad`):

    _symgrad_<hash><EXT_SUFFIX>    the extension module (e.g. .cpython-311-x86_64-linux-gnu.so)
    lib_symgrad_<hash>.so          a program's plain shared library (kinds "program" and "cuda")
    _symgrad_<hash>.py             beside it: the module that loads it (symgrad/backends/build/importable.py)
    _symgrad_<hash>.c              byte for byte the `source` that was compiled
    _symgrad_<hash>.json           metadata: the full key, sha256 of the .so and of the .c
    _symgrad_<hash>.log            the compiler's output, only after a failed build
    index/<prekey>.json            which module the same source and flags built last (see below)
    locks/_symgrad_<hash>.lock     one fcntl lock per key: concurrent builders take turns
    include/<hash>/<name>.h        `headers` a build includes, by the hash of their text
    programs/<key>.json, .c, .pickle   graph -> source and plan, the program cache (symgrad/backends/build/program_cache.py)
    runtime/<hash>.h, .c, .json    the runtime's rendered header and source, their checksums (symgrad/backends/build/runtime.py)
    compilers/<hash>.json          a compiler's `--version`, and whether it builds with the flags (cache_keys, toolchain)

The binaries sit directly in the cache directory, so with it on `sys.path`
`import _symgrad_<hash>` works in any process without symgrad: an extension module is
imported itself, a plain library through its `.py` (`lib`, `ffi`, `source`, and what the
backend adds through `helpers=`: the C program's `run` on NumPy arrays). The kept .c is
what the compiler's messages and the debug info point at (a `#line` directive
ahead of the source inside cffi's wrapper), so errors name its real lines.

The key (symgrad.backends.build.cache_keys) is the sha256 of everything the binary depends on: the
source, the cdef, the flags, the compiler's identity, the build environment, the cffi, ABI and
symgrad versions, and for `-march=native` the host CPU. Its first 32 hex digits name the module.

Writes are atomic: the module is built in a temporary directory inside the
cache directory and moved into place with `os.replace`, the .so first and the
metadata last, so a reader never sees a half-written file and an entry counts
only once its metadata exists. Before an entry is loaded its metadata is
checked (key and sha256 of the .so); a damaged entry is removed and rebuilt,
never loaded. A module already loaded in this process is reused while its entry is
still on disk; an entry deleted since (the cache directory cleared) is rebuilt.

kind="cuda" (symgrad/backends/cuda.py) uses the same keys, locks, checks and index, with
nvcc instead of cffi's build: `_symgrad_<hash>.cu` is compiled by `nvcc <flags> -o
lib_symgrad_<hash>.so` (flags: DEFAULT_NVCC_FLAGS or `$SYMGRAD_NVCCFLAGS`, plus the
architecture the caller chose), the compiler identity is nvcc's path and `--version`
(`$NVCC` is honoured), and the library, which has no Python C-API, is loaded with
cffi's ABI mode (`ffi.dlopen` with the cdef): `BuiltModule.module` has `.ffi` and `.lib`.

kind="program" (symgrad/backends/c.py's programs) builds a plain shared library with the C compiler
and flags, `lib_symgrad_<hash>.so`, without cffi's wrapper or Python's headers (half the compile
of a model's step), and loads it with cffi's ABI mode as kind "cuda" does (both write the
importable `_symgrad_<hash>.py` beside the library); with `link=`, it
links the runtime library as an extension module does.

kind="runtime" (symgrad/backends/build/runtime.py) builds a plain shared library the same way
with the C compiler and flags, `_symgrad_<hash>.so`, its soname the file's name; Python does
not load it (`BuiltModule.module` is None). A build given `link=` (that library's
BuiltModule) links to it by soname, with `$ORIGIN` (the cache directory) as its run path:
importing the extension loads the library from beside it, wherever the directory is, or
reuses the one already loaded under that soname. The library's key is part of the linking
build's key. `headers` (file name -> text)
are written to `include/<hash>/` and put on the include path; their text is part of the
key too.

Which compiler runs, with which flags, and the errors of a failed build are
symgrad.backends.build.toolchain's (the names callers know from here are re-exported).

With no compiler at all (CC missing), the key cannot be computed; `build` then
loads the module the same source, cdef and flags built last (recorded in
`index/`), after the same integrity checks: a binary does not need its
compiler. Only when there is nothing to load does it raise `CompilerNotFound`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable

from ...settings import cache_dir
from . import ffi, toolchain
from . import importable as importable_module
from .progress import BuildProgress
from .cache_keys import (FORMAT, _cffi_version, _key, _prekey, asked_identity, compiler_identity, nvcc_identity,
                         sha256_json)  # noqa: F401
from .cache_files import (atomic_write, file_lock, file_sha256, keep, now_utc, read_json, read_kept,  # noqa: F401
                          tree_digest)  # (callers use cache.*)
# The toolchain's names the cache's callers (backends, tests, benchmarks) know it by.
from .toolchain import (DEFAULT_FLAGS, NVCC_FAT_BINARY, BuildError, CompilerNotFound, c_string_literal,
                        compiler_command, default_flags, default_nvcc_flags, nvcc_command)  # noqa: F401

_HASH_CHARS = 32
_KINDS = ("c", "program", "cuda", "runtime")


@dataclass(frozen=True)
class BuiltModule:
    """A compiled, verified and imported cache entry."""

    module: ModuleType | None  # the cffi extension module: `.lib` (the C functions) and `.ffi`; None: a runtime
    module_name: str  # "_symgrad_<hash>"; `import` it with `cache_dir` on sys.path
    source_path: Path  # the .c beside the binary, byte for byte the `source` compiled
    library_path: Path  # the .so
    cache_dir: Path


# (cache dir, key) -> BuiltModule: the same key returns the same module object in one process.
_LOADED: dict[tuple[str, str], BuiltModule] = {}
# Threads of one process take turns in `build`: one key must map to one module object.
_LOCK = threading.RLock()


def build(source: str, cdef: str, *, flags: list[str] | None = None, kind: str = "c",
          headers: dict[str, str] | None = None, link: BuiltModule | None = None,
          announce: str | Callable[[], str] | None = None, helpers: str = "") -> BuiltModule:
    """Compile `source` (declarations `cdef`) into a cached extension module, or load it from the cache.

    `flags` default to `default_flags()` (nvcc's for kind "cuda"). `headers` (file name -> text):
    files the source includes; `link`: a kind="runtime" library it calls. `announce`: what is
    compiling (or a function that says it, asked only when a compiler runs), said on stderr when
    a compiler runs longer than a second (symgrad.backends.build.progress); None: nothing is
    said. A kind="program" source that defines SG_PARTS is compiled as that many translation
    units side by side (toolchain.compile_shared). `helpers`: Python text the importable module
    of a kind "program" or "cuda" entry adds (symgrad.backends.importable; derived from the
    entry, so not part of its key: rewritten when it differs). Raises
    `CompilerNotFound` when a build is needed and no compiler runs, `BuildError` when the
    compiler rejects the source.
    """
    if kind not in _KINDS:
        raise ValueError(f"build: unknown kind {kind!r}; expected one of {', '.join(_KINDS)}")
    if not isinstance(source, str) or not isinstance(cdef, str):
        raise TypeError("build: source and cdef must be str")
    if flags is None:
        flags = default_flags() if kind != "cuda" else default_nvcc_flags() + list(NVCC_FAT_BINARY)
    flags = [str(flag) for flag in flags]
    inputs = _Inputs(dict(headers or {}), link, announce, helpers)
    prekey = _prekey(source, cdef, flags, kind, inputs)
    loaded = _loaded(prekey, flags, kind)
    if loaded is not None:
        return loaded
    with _LOCK:
        return _build(source, cdef, flags, kind, inputs, prekey)


def _loaded(prekey: str, flags: list[str], kind: str) -> BuiltModule | None:
    """The module this process loaded already for `prekey`, its files still in place; else None.
    Looked up without _LOCK, which a build holds while its compilers run: a train step's predict
    program, linking the runtime the step's build had loaded, waited for that whole build."""
    try:
        key = _key(prekey, flags, kind)
    except CompilerNotFound:
        return None
    directory = cache_dir()
    loaded = _LOADED.get((str(directory), key))
    return loaded if loaded is not None and _on_disk(_Paths(directory, module_name(key), kind)) else None


def import_ahead() -> None:
    """Import now what a build imports on its way to the compiler (cffi's C backend, whose version
    keys every entry; cffi only parses declarations, once the compilers run). Imported on a build's
    thread in a fresh process, under Python's lock shared with the thread that started it, it
    had a GPT step's compiler start a tenth of a second later (issue 34)."""
    _cffi_version()


@dataclass(frozen=True)
class _Inputs:
    """What a build reads besides its source: the headers it includes, the library it links (and,
    keying nothing, what to announce while it compiles and the helpers its importable module adds)."""
    headers: dict
    link: BuiltModule | None
    announce: str | Callable[[], str] | None = None
    helpers: str = ""

    def key_parts(self) -> dict:
        return {"headers": self.headers, "link": self.link.module_name if self.link else None}

    def include_dir(self, directory: Path) -> Path | None:
        """The directory holding the headers (written there, by their hash, if missing or changed)."""
        if not self.headers:
            return None
        include = directory / "include" / sha256_json(self.headers)[:16]
        for name, text in self.headers.items():
            if file_sha256(include / name) != hashlib.sha256(text.encode()).hexdigest():
                include.mkdir(parents=True, exist_ok=True)
                atomic_write(include / name, text.encode())
        return include


def _build(source: str, cdef: str, flags: list[str], kind: str, inputs: _Inputs, prekey: str) -> BuiltModule:
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    try:
        key = _key(prekey, flags, kind)
    except CompilerNotFound:
        built = _load_without_compiler(directory, prekey, source, kind, cdef, inputs.helpers)
        if built is None:
            raise
        return built

    memo = (str(directory), key)
    name = module_name(key)
    paths = _Paths(directory, name, kind)
    loaded = _LOADED.get(memo)
    if loaded is not None and _on_disk(paths):
        return loaded
    # Not loaded yet, or loaded but its files were deleted since (the cache directory cleared
    # under a running process): verify, or rebuild, the entry on disk.
    python = paths.module_text(cdef, inputs.helpers)
    so_path = _verified(paths, key, source, python)
    if so_path is None:
        with file_lock(paths.lock):
            # Another process may have built it while we waited for the lock.
            so_path = _verified(paths, key, source, python)
            if so_path is None:
                _remove_entry(paths)
                so_path = _compile_entry(paths, key, prekey, source, cdef, flags, kind, inputs)
    _record_index(directory, prekey, name, key)
    # A module loaded before its files were deleted is the same code (the same key): keep using
    # it. Importing the rebuilt file under the same name would only return the first one anyway.
    module = loaded.module if loaded is not None else _open(name, so_path, kind, cdef)
    built = BuiltModule(module, name, paths.source, so_path, directory)
    _LOADED[memo] = built
    return built


def code_digest(root: Path, suffix: str) -> str:
    """`tree_digest` of the files under `root` ending in `suffix`, memoized in the cache's
    fingerprints/ (what keys the program cache and the runtime's rendered text)."""
    return tree_digest(root, suffix, cache_dir() / "fingerprints")


def check_compiler() -> None:
    """What the default backend asks before it chooses C: the compiler's `--version` runs, and it
    builds an empty shared library with the flags (toolchain.probe); raises CompilerNotFound
    saying why not.

    A success is kept in the cache (`compilers/probe-<hash>.json`) under the compiler's identity
    (its binary file, symbolic links followed, and `--version`: cache_keys) and the flags: the
    build took 40-50 ms of every process that left the backend to its default. A failure is not
    kept: a compiler fixed since is asked again. (A system changed under an unchanged compiler,
    its OpenMP library removed, then fails at the first build, with the compiler's message, where
    it fell back to NumPy before; removing `compilers/` from the cache asks again.)"""
    flags = default_flags()
    kept = {"identity": compiler_identity(), "flags": flags, "link": toolchain.openmp_link(flags)}
    path = cache_dir() / "compilers" / f"probe-{sha256_json(kept)[:32]}.json"
    if read_kept(path, kept) is None:
        toolchain.probe()
        keep(path, kept, builds=True)


def module_name(key: str) -> str:
    """The extension module name for a full key hash."""
    return f"_symgrad_{key[:_HASH_CHARS]}"


def cache_info() -> dict:
    """A summary of the cache directory: where it is, its entries and their total size."""
    directory = cache_dir()
    entries = []
    for meta_path in sorted(directory.glob("_symgrad_*.json")):
        meta = read_json(meta_path) or {}
        so_path = directory / str(meta.get("library", ""))
        size = so_path.stat().st_size if so_path.is_file() else 0
        entries.append({"module_name": meta_path.stem, "bytes": size, "flags": meta.get("flags"),
                        "created": meta.get("created")})
    total = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file()) if directory.is_dir() else 0
    return {"path": str(directory), "entries": entries, "total_bytes": total}


def clear_cache() -> int:
    """Delete every cache entry (modules already imported stay usable); returns the count removed."""
    directory = cache_dir()
    if not directory.is_dir():
        return 0
    count = len(list(directory.glob("_symgrad_*.json")))
    for path in directory.iterdir():
        if path.name.startswith(("_symgrad_", "lib_symgrad_", ".tmp-")) or path.name in ("index", "locks", "sympy", "templates",
                                                                          "programs", "steps", "include", "runtime", ffi.DIRECTORY):
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    _LOADED.clear()
    return count


# ---------------------------------------------------------------------------------------------
# entries


class _Paths:
    """Where one entry's files live."""

    def __init__(self, directory: Path, name: str, kind: str = "c"):
        self.directory = directory
        self.name = name
        # A program or runtime entry is a plain shared library, not a Python extension. A program's
        # is imported through the Python module beside it, which its own name would shadow.
        importable = kind in ("program", "cuda")
        self.library = directory / (importable_module.library_file(name) if importable else
                                    name + (sysconfig.get_config_var("EXT_SUFFIX") if kind == "c" else ".so"))
        self.module = directory / (name + ".py") if importable else None
        self.source = directory / (name + (".cu" if kind == "cuda" else ".c"))
        self.meta = directory / (name + ".json")
        self.log = directory / (name + ".log")  # only after a failed build
        self.lock = directory / "locks" / (name + ".lock")

    def module_text(self, cdef: str, helpers: str = "") -> str | None:
        """The text of the importable module that loads the library (None: the entry has none)."""
        if self.module is None:
            return None
        return importable_module.text(self.name, cdef, self.source.name, helpers)


def _on_disk(paths: _Paths) -> bool:
    """Whether the entry's metadata and binary are still in place (two stats; a loaded module's
    entry is only checked this far: its checksum held when it was loaded)."""
    return paths.meta.is_file() and paths.library.is_file()


def _verified(paths: _Paths, key: str, source: str, python: str | None = None) -> Path | None:
    """The entry's .so if its metadata and checksum hold, else None (missing or damaged). The
    kept source and the importable module (`python`, its text) are restored when they differ."""
    meta = read_json(paths.meta)
    if not meta or meta.get("format") != FORMAT or meta.get("key") != key:
        return None
    if meta.get("library") != paths.library.name or file_sha256(paths.library) != meta.get("library_sha256"):
        return None
    # The copies compared byte for byte, not by their hashes (a runtime's 600 KB source: 1 ms of
    # a warm compile).
    if _file_bytes(paths.source) != source.encode():
        # The binary is fine; only the kept copy of the source was lost or edited: restore it.
        atomic_write(paths.source, source.encode())
    if python is not None and _file_bytes(paths.module) != python.encode():
        try:  # lost, edited, or written by another symgrad's helpers
            atomic_write(paths.module, python.encode())
        except OSError:  # a read-only cache: the library loads all the same, symgrad needs no module
            pass
    return paths.library


def _file_bytes(path: Path) -> bytes | None:
    """The bytes of the file at `path`, or None when it cannot be read."""
    try:
        return path.read_bytes()
    except OSError:
        return None


def _compile_entry(paths: _Paths, key: str, prekey: str, source: str, cdef: str, flags: list[str],
                   kind: str, inputs: _Inputs) -> Path:
    """Build into a temp dir inside the cache dir, then move the .so and the metadata into place.

    The source is put in place first: the compiler's messages and the debug info name it, and
    after a failure it stays there for the user to read (without metadata it is no entry).
    """
    atomic_write(paths.source, source.encode())
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{paths.name}-", dir=paths.directory))
    try:
        include = inputs.include_dir(paths.directory)
        try:
            if kind == "c":
                built = _compile(tmp, paths, source, cdef, flags, include=include, link=inputs.link)
            elif kind in ("runtime", "program"):
                link = inputs.link if kind == "program" else None
                units = toolchain.translation_units(source) if kind == "program" else 1
                announce = inputs.announce() if callable(inputs.announce) else inputs.announce
                progress = None if announce is None else \
                    BuildProgress(announce, units=units, jobs=toolchain.jobs(units))
                # A program's declarations, parsed while its compilers run (35 ms of a cold compile)
                declare = (lambda: ffi.declared(cdef)) if kind == "program" else None
                built = toolchain.compile_shared(
                    tmp, paths, flags, include_dirs=[include] if include else [], units=units, progress=progress,
                    link_args=[str(link.library_path), "-Wl,-rpath,$ORIGIN"] if link else [], meanwhile=declare)
            else:
                built = toolchain.compile_nvcc(tmp, paths, flags)
        except BuildError as failed:
            atomic_write(paths.log, failed.log.encode())  # beside the kept source, for the user to read
            raise
        meta = {"format": FORMAT, "kind": kind, "module_name": paths.name, "key": key, "prekey": prekey,
                "library": paths.library.name, "library_sha256": file_sha256(built),
                "source_sha256": hashlib.sha256(source.encode()).hexdigest(), "flags": flags,
                "compiler": asked_identity(kind),
                "cffi": _cffi_version(), "created": now_utc()}
        meta_tmp = tmp / "meta.json"
        meta_tmp.write_text(json.dumps(meta, indent=1, sort_keys=True))
        python = paths.module_text(cdef, inputs.helpers)
        if python is not None:
            atomic_write(paths.module, python.encode())
        # Metadata last: an entry exists only once its checksum is in place.
        os.replace(built, paths.library)
        os.replace(meta_tmp, paths.meta)
        paths.log.unlink(missing_ok=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return paths.library


def _compile(tmp: Path, paths: _Paths, source: str, cdef: str, flags: list[str], include: Path | None = None,
             link: BuiltModule | None = None) -> Path:
    """Build the extension module in `tmp`: cffi writes its C wrapper around the source (API mode),
    the compiler builds it; returns the .so. `include`: a directory on the include path; `link`: a
    runtime library linked by its soname, found at run time beside the extension ($ORIGIN: both
    sit in the cache directory)."""
    import cffi
    from cffi.recompiler import make_c_source

    ffi = cffi.FFI()
    ffi.cdef(cdef)
    wrapper = tmp / (paths.name + ".c")
    # The #line makes the compiler's messages and the debug info point at the kept source file,
    # not at cffi's wrapper around it.
    make_c_source(ffi, paths.name, f"#line 1 {c_string_literal(os.fsencode(paths.source))}\n{source}", str(wrapper))
    link_args = [str(link.library_path), "-Wl,-rpath,$ORIGIN"] if link is not None else []
    return toolchain.compile_shared(tmp, paths, flags, source=wrapper, include_dirs=[include] if include else [],
                                    link_args=link_args, python=True)


def _remove_entry(paths: _Paths) -> None:
    """Delete a damaged entry, metadata first so that concurrent readers see it as absent."""
    for path in (paths.meta, paths.library, paths.source, paths.module):
        if path is not None:
            path.unlink(missing_ok=True)


class DlopenModule:
    """A kind="program" or "cuda" entry loaded with cffi's ABI mode: `.ffi` (with the cdef) and `.lib`
    (the functions)."""

    def __init__(self, name: str, so_path: Path, cdef: str):
        self.__name__ = name
        self.ffi = ffi.declared(cdef)  # shared by every library with these declarations
        self.lib = self.ffi.dlopen(str(so_path))

    def __repr__(self) -> str:
        return f"<symgrad native library {self.__name__}>"


def _open(name: str, so_path: Path, kind: str, cdef: str):
    """The loaded entry: an imported extension module (kind "c"), a dlopened library (kinds "program"
    and "cuda"),
    or nothing (kind "runtime": the programs linking it load it, from beside them, when they are
    imported; each program's dependencies are its own (RTLD_LOCAL), so two runtimes built with
    other flags, which define the same names, never serve each other's programs)."""
    if kind == "runtime":
        return None
    return _load(name, so_path) if kind == "c" else DlopenModule(name, so_path, cdef)


def _load(name: str, so_path: Path) -> ModuleType:
    """Import the extension module at `so_path` under `name`."""
    spec = importlib.util.spec_from_file_location(name, so_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # So that a plain `import _symgrad_<hash>` (pickling, users) finds the same module.
    sys.modules.setdefault(name, module)
    return module


# ---------------------------------------------------------------------------------------------
# no compiler: load what the same inputs built last


def _record_index(directory: Path, prekey: str, name: str, key: str) -> None:
    path = directory / "index" / (prekey + ".json")
    if (read_json(path) or {}).get("key") != key:
        path.parent.mkdir(exist_ok=True)
        atomic_write(path, json.dumps({"module_name": name, "key": key}).encode())


def _load_without_compiler(directory: Path, prekey: str, source: str, kind: str = "c",
                           cdef: str = "", helpers: str = "") -> BuiltModule | None:
    """The module the same source/cdef/flags built last, if it is intact; None otherwise."""
    record = read_json(directory / "index" / (prekey + ".json"))
    if not record or not isinstance(record.get("key"), str):
        return None
    key = record["key"]
    memo = (str(directory), key)
    name = module_name(key)
    paths = _Paths(directory, name, kind)
    if memo in _LOADED and _on_disk(paths):
        return _LOADED[memo]
    so_path = _verified(paths, key, source, paths.module_text(cdef, helpers))
    if so_path is None or (read_json(paths.meta) or {}).get("prekey") != prekey:
        return None
    built = BuiltModule(_open(name, so_path, kind, cdef), name, paths.source, so_path, directory)
    _LOADED[memo] = built
    return built
