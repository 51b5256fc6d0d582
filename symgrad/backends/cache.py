"""Build cache: C source -> an importable cffi extension module `_symgrad_<hash>`.

    build(source, cdef, *, flags=None, kind="c", headers=None, link=None) -> BuiltModule
                                                    (kind "c", "cuda" or "runtime")

`build` compiles `source` with cffi's out-of-line API mode (`ffi.cdef(cdef)`,
`ffi.set_source(name, source)`, `ffi.compile()`), or loads the module built
earlier from the same inputs. Layout of the cache directory
(`SYMGRAD_CACHE_DIR`, default `~/.cache/symgrad`):

    _symgrad_<hash><EXT_SUFFIX>    the extension module (e.g. .cpython-311-x86_64-linux-gnu.so)
    _symgrad_<hash>.c              byte for byte the `source` that was compiled
    _symgrad_<hash>.json           metadata: the full key, sha256 of the .so and of the .c
    _symgrad_<hash>.log            the compiler's output, only after a failed build
    index/<prekey>.json            which module the same source and flags built last (see below)
    locks/_symgrad_<hash>.lock     one fcntl lock per key: concurrent builders take turns
    include/<hash>/<name>.h        `headers` a build includes, by the hash of their text
    programs/<key>.json            graph -> source, the program cache (symgrad/backends/program_cache.py)

The binaries sit directly in the cache directory, so with it on `sys.path`
`import _symgrad_<hash>` works in any process without symgrad. The kept .c is
what the compiler's messages and the debug info point at (a `#line` directive
ahead of the source inside cffi's wrapper), so errors name its real lines.

The key is the sha256 of the source, the cdef, the flags, the compiler's
identity (its resolved path and `--version` output, asked once per process;
`CC` is honoured), the CFLAGS/CPPFLAGS/LDFLAGS/LDSHARED environment setuptools uses,
the cffi version, the extension ABI suffix and the symgrad version; with
`-march=native` also the CPU model and feature flags, since such a binary is
only valid on CPUs like the one that built it. Its first 32 hex digits name the
module.

Writes are atomic: the module is built in a temporary directory inside the
cache directory and moved into place with `os.replace`, the .so first and the
metadata last, so a reader never sees a half-written file and an entry counts
only once its metadata exists. Before an entry is loaded its metadata is
checked (key and sha256 of the .so); a damaged entry is removed and rebuilt,
never loaded. A module already loaded in this process is reused while its entry is
still on disk; an entry deleted since (the cache directory cleared) is rebuilt.

kind="cuda" (symgrad/backends/cuda.py) uses the same keys, locks, checks and index, with
nvcc instead of cffi's build: `_symgrad_<hash>.cu` is compiled by `nvcc <flags> -o
_symgrad_<hash>.so` (flags: DEFAULT_NVCC_FLAGS or `$SYMGRAD_NVCCFLAGS`, plus the
architecture the caller chose), the compiler identity is nvcc's path and `--version`
(`$NVCC` is honoured), and the library, which has no Python C-API, is loaded with
cffi's ABI mode (`ffi.dlopen` with the cdef): `BuiltModule.module` has `.ffi` and `.lib`.

kind="runtime" (symgrad/backends/runtime.py) builds a plain shared library the same way
with the C compiler and flags: `cc <flags> -shared -fPIC -o _symgrad_<hash>.so`, its
soname the file's name; it is loaded with cffi's ABI mode (no cdef) and RTLD_LOCAL. A
build given `link=` (that library's BuiltModule) links to it by soname, with `$ORIGIN`
(the cache directory) as its run path, so the extension finds it wherever the directory
is; the library's key is part of the linking build's key. `headers` (file name -> text)
are written to `include/<hash>/` and put on the include path; their text is part of the
key too.

With no compiler at all (CC missing), the key cannot be computed; `build` then
loads the module the same source, cdef and flags built last (recorded in
`index/`), after the same integrity checks: a binary does not need its
compiler. Only when there is nothing to load does it raise `CompilerNotFound`.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import json
import os
import platform
import secrets
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

DEFAULT_FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c11", "-fno-math-errno")
# Bumped whenever the layout or the metadata changes, so old entries are never misread.
FORMAT = 1
_HASH_CHARS = 32
_KINDS = ("c", "cuda", "runtime")
# kind="cuda": nvcc builds a plain shared library (no Python C-API) that cffi loads in ABI mode.
# No --use_fast_math: its approximate expf/logf/division would break parity with the reference.
DEFAULT_NVCC_FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC")
# With no device to ask for its architecture: a fat binary for Ampere and Hopper.
NVCC_FAT_BINARY = ("-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90")
_ENV_FLAG_VARS = ("CFLAGS", "CPPFLAGS", "LDFLAGS", "LDSHARED")


class CompilerNotFound(RuntimeError):
    """No working C compiler: says which one was looked for and how to fix it."""


class BuildError(RuntimeError):
    """The compiler rejected the source: carries its output tail and the kept source path."""

    def __init__(self, message: str, *, log: str = "", source_path: Path | None = None):
        super().__init__(message)
        self.log = log
        self.source_path = source_path


@dataclass(frozen=True)
class BuiltModule:
    """A compiled, verified and imported cache entry."""

    module: ModuleType  # the cffi extension module: `.lib` (the C functions) and `.ffi`
    module_name: str  # "_symgrad_<hash>"; `import` it with `cache_dir` on sys.path
    source_path: Path  # the .c beside the binary, byte for byte the `source` compiled
    library_path: Path  # the .so
    cache_dir: Path


# (cache dir, key) -> BuiltModule: the same key returns the same module object in one process.
_LOADED: dict[tuple[str, str], BuiltModule] = {}
# compiler command -> identity string; asking `cc --version` once per process is enough.
_COMPILER_IDS: dict[str, str] = {}
# Threads of one process take turns in `build`: cffi's compile chdirs into its tmpdir and we
# redirect fds 1/2 (both process-wide), and one key must map to one module object.
_LOCK = threading.RLock()


def cache_dir() -> Path:
    """The cache directory: `$SYMGRAD_CACHE_DIR`, else `~/.cache/symgrad`."""
    configured = os.environ.get("SYMGRAD_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "symgrad"


def default_flags() -> list[str]:
    """Compiler flags: `$SYMGRAD_CFLAGS` (shell-split) if set, else `DEFAULT_FLAGS`.

    No -ffast-math: it lets gcc assume there are no NaNs or infinities, which breaks
    the NumPy semantics (log(0) = -inf, nan propagation) the backends must match.
    """
    configured = os.environ.get("SYMGRAD_CFLAGS")
    return shlex.split(configured) if configured is not None else list(DEFAULT_FLAGS)


def compiler_command() -> list[str]:
    """The C compiler setuptools will run: `$CC`, else the one Python was built with."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shlex.split(cc)


def default_nvcc_flags() -> list[str]:
    """nvcc flags before the architecture: `$SYMGRAD_NVCCFLAGS` (shell-split) if set, else
    `DEFAULT_NVCC_FLAGS`."""
    configured = os.environ.get("SYMGRAD_NVCCFLAGS")
    return shlex.split(configured) if configured is not None else list(DEFAULT_NVCC_FLAGS)


def nvcc_command() -> list[str]:
    """The CUDA compiler: `$NVCC`, else `nvcc` on PATH, else /usr/local/cuda/bin/nvcc."""
    configured = os.environ.get("NVCC")
    if configured:
        return shlex.split(configured)
    return [shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"]


def compiler_identity() -> str:
    """Resolved path and `--version` output of the C compiler; raises `CompilerNotFound`."""
    return _identity(compiler_command(), _compiler_not_found)


def nvcc_identity() -> str:
    """Resolved path and `--version` output of nvcc (kind="cuda"); raises `CompilerNotFound`."""
    return _identity(nvcc_command(), _nvcc_not_found)


def _identity(command: list[str], not_found) -> str:
    cache_key = shlex.join(command)
    if cache_key in _COMPILER_IDS:
        return _COMPILER_IDS[cache_key]
    resolved = shutil.which(command[0]) if command else None
    if resolved is None:
        raise not_found(command, "was not found")
    try:
        done = subprocess.run([resolved, *command[1:], "--version"], capture_output=True, text=True,
                              timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise not_found(command, f"could not be run ({exc})") from None
    if done.returncode != 0:
        raise not_found(command, f"failed to run: `--version` exited with {done.returncode}:\n"
                                 f"{_tail(done.stderr or done.stdout)}")
    identity = f"{resolved}\n{done.stdout.strip()}"
    _COMPILER_IDS[cache_key] = identity
    return identity


def build(source: str, cdef: str, *, flags: list[str] | None = None, kind: str = "c",
          headers: dict[str, str] | None = None, link: BuiltModule | None = None) -> BuiltModule:
    """Compile `source` (declarations `cdef`) into a cached extension module, or load it from the cache.

    `flags` default to `default_flags()` (nvcc's for kind "cuda"). `headers` (file name -> text):
    files the source includes; `link`: a kind="runtime" library it calls. Raises `CompilerNotFound`
    when a build is needed and no compiler runs, `BuildError` when the compiler rejects the source.
    """
    if kind not in _KINDS:
        raise ValueError(f"build: unknown kind {kind!r}; expected one of {', '.join(_KINDS)}")
    if not isinstance(source, str) or not isinstance(cdef, str):
        raise TypeError("build: source and cdef must be str")
    if flags is None:
        flags = default_flags() if kind != "cuda" else default_nvcc_flags() + list(NVCC_FAT_BINARY)
    flags = [str(flag) for flag in flags]
    with _LOCK:
        return _build(source, cdef, flags, kind, _Inputs(dict(headers or {}), link))


@dataclass(frozen=True)
class _Inputs:
    """What a build reads besides its source: the headers it includes, the library it links."""
    headers: dict
    link: BuiltModule | None

    def key_parts(self) -> dict:
        return {"headers": self.headers, "link": self.link.module_name if self.link else None}

    def include_dir(self, directory: Path) -> Path | None:
        """The directory holding the headers (written there, by their hash, if missing or changed)."""
        if not self.headers:
            return None
        include = directory / "include" / sha256_json(self.headers)[:16]
        for name, text in self.headers.items():
            if _file_sha256(include / name) != hashlib.sha256(text.encode()).hexdigest():
                include.mkdir(parents=True, exist_ok=True)
                atomic_write(include / name, text.encode())
        return include


def _build(source: str, cdef: str, flags: list[str], kind: str, inputs: _Inputs) -> BuiltModule:
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    prekey = _prekey(source, cdef, flags, kind, inputs)
    try:
        key = _key(prekey, flags, kind)
    except CompilerNotFound:
        built = _load_without_compiler(directory, prekey, source, kind, cdef)
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
    so_path = _verified(paths, key, source)
    if so_path is None:
        with _file_lock(paths.lock):
            # Another process may have built it while we waited for the lock.
            so_path = _verified(paths, key, source)
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
        if path.name.startswith(("_symgrad_", ".tmp-")) or path.name in ("index", "locks", "sympy", "templates",
                                                                          "programs", "include"):
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    _LOADED.clear()
    return count


# ---------------------------------------------------------------------------------------------
# keys


def _prekey(source: str, cdef: str, flags: list[str], kind: str, inputs: _Inputs | None = None) -> str:
    """Hash of everything except the compiler: names the fallback when no compiler is present."""
    import symgrad

    inputs = inputs or _Inputs({}, None)
    return sha256_json({"format": FORMAT, "kind": kind, "source": source, "cdef": cdef, "flags": flags,
                         "cffi": _cffi_version(), "abi": sysconfig.get_config_var("EXT_SUFFIX"),
                         "symgrad": symgrad.__version__, **inputs.key_parts()})


def _key(prekey: str, flags: list[str], kind: str = "c") -> str:
    """The full cache key: the prekey plus compiler identity (`cc` or `nvcc --version`), build
    environment and, for -march=native, the host CPU."""
    parts = {"prekey": prekey, "compiler": nvcc_identity() if kind == "cuda" else compiler_identity(),
             "env": {name: os.environ.get(name) for name in _ENV_FLAG_VARS}}
    if any(flag.startswith(("-march=native", "-mcpu=native", "-mtune=native")) for flag in flags):
        parts["cpu"] = _host_cpu()
    return sha256_json(parts)


@functools.lru_cache(maxsize=None)
def _host_cpu() -> str:
    """CPU model and feature flags (what -march=native specialises for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + " " + platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")
    seen = {}
    for line in lines:
        field, _, value = line.partition(":")
        field = field.strip()
        if field in wanted and field not in seen:
            seen[field] = value.strip()
    return platform.machine() + json.dumps(seen, sort_keys=True)


def sha256_json(parts: dict) -> str:
    """The sha256 of `parts` as canonical JSON (sorted keys): a cache key, or an entry's checksum."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _cffi_version() -> str:
    import cffi

    return cffi.__version__


# ---------------------------------------------------------------------------------------------
# entries


class _Paths:
    """Where one entry's files live."""

    def __init__(self, directory: Path, name: str, kind: str = "c"):
        self.directory = directory
        self.name = name
        # A CUDA or runtime entry is a plain shared library, not a Python extension.
        self.library = directory / (name + (sysconfig.get_config_var("EXT_SUFFIX") if kind == "c" else ".so"))
        self.source = directory / (name + (".cu" if kind == "cuda" else ".c"))
        self.meta = directory / (name + ".json")
        self.log = directory / (name + ".log")  # only after a failed build
        self.lock = directory / "locks" / (name + ".lock")


def _on_disk(paths: _Paths) -> bool:
    """Whether the entry's metadata and binary are still in place (two stats; a loaded module's
    entry is only checked this far: its checksum held when it was loaded)."""
    return paths.meta.is_file() and paths.library.is_file()


def _verified(paths: _Paths, key: str, source: str) -> Path | None:
    """The entry's .so if its metadata and checksum hold, else None (missing or damaged)."""
    meta = read_json(paths.meta)
    if not meta or meta.get("format") != FORMAT or meta.get("key") != key:
        return None
    if meta.get("library") != paths.library.name or _file_sha256(paths.library) != meta.get("library_sha256"):
        return None
    if _file_sha256(paths.source) != hashlib.sha256(source.encode()).hexdigest():
        # The binary is fine; only the kept copy of the source was lost or edited: restore it.
        atomic_write(paths.source, source.encode())
    return paths.library


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
        if kind == "c":
            built = _compile(tmp, paths, source, cdef, flags, include=include, link=inputs.link)
        elif kind == "runtime":
            built = _compile_shared(tmp, paths, flags, include=include)
        else:
            built = _compile_nvcc(tmp, paths, source, cdef, flags)
        meta = {"format": FORMAT, "module_name": paths.name, "key": key, "prekey": prekey,
                "library": paths.library.name, "library_sha256": _file_sha256(built),
                "source_sha256": hashlib.sha256(source.encode()).hexdigest(), "flags": flags,
                "compiler": _COMPILER_IDS.get(shlex.join(nvcc_command() if kind == "cuda" else compiler_command()), ""),
                "cffi": _cffi_version(), "created": _now()}
        meta_tmp = tmp / "meta.json"
        meta_tmp.write_text(json.dumps(meta, indent=1, sort_keys=True))
        # Metadata last: an entry exists only once its checksum is in place.
        os.replace(built, paths.library)
        os.replace(meta_tmp, paths.meta)
        paths.log.unlink(missing_ok=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return paths.library


def _compile(tmp: Path, paths: _Paths, source: str, cdef: str, flags: list[str], include: Path | None = None,
             link: BuiltModule | None = None) -> Path:
    """Run cffi's out-of-line build in `tmp`, capturing the compiler's output; returns the .so.
    `include`: a directory on the include path; `link`: a runtime library linked by its soname,
    found at run time beside the extension ($ORIGIN: both sit in the cache directory)."""
    import cffi

    ffi = cffi.FFI()
    ffi.cdef(cdef)
    link_args = _openmp_link(flags)
    if link is not None:
        link_args += [str(link.library_path), "-Wl,-rpath,$ORIGIN"]
    # The #line makes the compiler's messages and the debug info point at the kept source file,
    # not at cffi's wrapper around it.
    ffi.set_source(paths.name, f"#line 1 {c_string_literal(os.fsencode(paths.source))}\n{source}",
                   extra_compile_args=list(flags), extra_link_args=link_args, libraries=["m"],
                   include_dirs=[str(include)] if include else [])
    log_path = tmp / "compiler.log"
    with _LOCK, _redirect_output(log_path):
        try:
            built = Path(ffi.compile(tmpdir=str(tmp), verbose=False))
            error = None
        except Exception as exc:  # cffi wraps setuptools' CompileError/LinkError in VerificationError
            error = exc
    if error is not None:
        log = log_path.read_text(errors="replace") if log_path.exists() else ""
        raise _build_failed(paths, log, error) from None
    if built.name != paths.library.name:
        raise BuildError(f"cffi produced {built.name}, expected {paths.library.name}")
    return built


def _compile_shared(tmp: Path, paths: _Paths, flags: list[str], include: Path | None = None) -> Path:
    """Compile the kept source into a plain shared library in `tmp` (kind "runtime"), its soname
    the library's file name; returns it."""
    out = tmp / paths.library.name
    command = [*compiler_command(), *flags, "-shared", "-fPIC", f"-Wl,-soname,{paths.library.name}",
               *(["-I", str(include)] if include else []), "-o", str(out), str(paths.source), "-lm",
               *_openmp_link(flags)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, cwd=tmp, timeout=600)
    except (OSError, subprocess.SubprocessError) as exc:
        raise _compiler_not_found(compiler_command(), f"could not be run ({exc})") from None
    if done.returncode != 0 or not out.is_file():
        raise _build_failed(paths, f"$ {shlex.join(command)}\n{done.stdout}\n{done.stderr}",
                            RuntimeError(f"the compiler exited with {done.returncode}"))
    return out


def _openmp_link(flags: list[str]) -> list[str]:
    """The link flags OpenMP code needs: -fopenmp when it was compiled with it."""
    return ["-fopenmp"] if any(flag.startswith("-fopenmp") for flag in flags) else []


def _compile_nvcc(tmp: Path, paths: _Paths, source: str, cdef: str, flags: list[str]) -> Path:
    """Run nvcc on the kept .cu (so its messages name that file) into `tmp`; returns the .so."""
    out = tmp / paths.library.name
    command = [*nvcc_command(), *flags, "-o", str(out), str(paths.source)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, cwd=tmp, timeout=600)
    except (OSError, subprocess.SubprocessError) as exc:
        raise CompilerNotFound(f"No working CUDA compiler: {shlex.join(nvcc_command())!r} could not be run "
                               f"({exc}).\nThe CUDA backend needs nvcc to build its libraries. Fix: install the "
                               f"CUDA toolkit, or point the NVCC environment variable at nvcc.") from None
    if done.returncode != 0 or not out.is_file():
        text = f"$ {shlex.join(command)}\n{done.stdout}\n{done.stderr}"
        atomic_write(paths.log, text.encode())
        raise BuildError(f"CUDA compilation of {paths.name} failed (nvcc exited with {done.returncode}).\n"
                         f"nvcc output (tail):\n{_tail(text)}\n"
                         f"Source kept at: {paths.source} (full log: {paths.log})",
                         log=text, source_path=paths.source)
    return out


def _build_failed(paths: _Paths, log: str, error: Exception) -> Exception:
    """`CompilerNotFound` if the compiler could not even start, else a `BuildError` with the
    compiler's output tail; the full log is kept beside the source."""
    text = f"{log}\n{error}"
    # The driver ran but could not start itself or its parts (cc1, as, ld): an install problem,
    # not a bug in the source.
    broken = ("cannot execute", "error trying to exec", "No such file or directory: '")
    if any(marker in text for marker in broken) or (
            "No such file or directory" in text and "command" in text and "failed" in text):
        return _compiler_not_found(compiler_command(), f"could not be run:\n{_tail(text, lines=8)}")
    atomic_write(paths.log, text.encode())
    return BuildError(f"C compilation of {paths.name} failed ({error.__class__.__name__}).\n"
                      f"Compiler output (tail):\n{_tail(text)}\n"
                      f"Source kept at: {paths.source} (full log: {paths.log})",
                      log=text, source_path=paths.source)


def _remove_entry(paths: _Paths) -> None:
    """Delete a damaged entry, metadata first so that concurrent readers see it as absent."""
    for path in (paths.meta, paths.library, paths.source):
        path.unlink(missing_ok=True)


class DlopenModule:
    """A kind="cuda" or "runtime" entry loaded with cffi's ABI mode: `.ffi` (with the cdef) and `.lib`
    (the functions)."""

    def __init__(self, name: str, so_path: Path, cdef: str):
        import cffi

        self.__name__ = name
        self.ffi = cffi.FFI()
        self.ffi.cdef(cdef)
        self.lib = self.ffi.dlopen(str(so_path))

    def __repr__(self) -> str:
        return f"<symgrad shared library {self.__name__}>"


def _open(name: str, so_path: Path, kind: str, cdef: str):
    """The loaded entry: an imported extension module (kind "c"), a dlopened library (kind "cuda",
    "runtime"; RTLD_LOCAL: a program linking a runtime finds it by its soname, and two runtimes
    built with other flags, which define the same names, never serve each other's programs)."""
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
                           cdef: str = "") -> BuiltModule | None:
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
    so_path = _verified(paths, key, source)
    if so_path is None or (read_json(paths.meta) or {}).get("prekey") != prekey:
        return None
    built = BuiltModule(_open(name, so_path, kind, cdef), name, paths.source, so_path, directory)
    _LOADED[memo] = built
    return built


# ---------------------------------------------------------------------------------------------
# small helpers


def _compiler_not_found(command: list[str], problem: str) -> CompilerNotFound:
    cc = shlex.join(command) if command else "(empty)"
    source = "$CC" if os.environ.get("CC") else "the compiler Python was built with (set $CC to change)"
    return CompilerNotFound(
        f"No working C compiler: {cc!r} ({source}) {problem}.\n"
        f"The C backend needs one to build its modules. Fix: install gcc (e.g. `apt install gcc` or "
        f"`conda install gcc`), or point the CC environment variable at a working C compiler.\n"
        f"backend=\"numpy\" works without a compiler.")


def _nvcc_not_found(command: list[str], problem: str) -> CompilerNotFound:
    nvcc = shlex.join(command) if command else "(empty)"
    return CompilerNotFound(
        f"No working CUDA compiler: {nvcc!r} {problem}.\n"
        f"The CUDA backend needs nvcc to build its libraries. Fix: install the CUDA toolkit, or point "
        f"the NVCC environment variable at nvcc.\nbackend=\"c\" and backend=\"numpy\" work without it.")


@contextlib.contextmanager
def _redirect_output(log_path: Path):
    """Send fds 1 and 2 (where setuptools' compiler subprocesses write) to `log_path`."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with open(log_path, "wb") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive fcntl lock on `path` (released when the process dies, too)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to a fresh file beside `path`, then rename it over `path`."""
    # Not mkstemp: its 0600 mode would make a shared cache unreadable to others; "x" honours umask.
    tmp = path.parent / f".tmp-{path.name}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with open(tmp, "xb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_json(path: Path) -> dict | None:
    """The JSON object in `path`, or None when it is missing, unreadable or not an object."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _file_sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def c_string_literal(data: bytes) -> str:
    """`data` as a C string literal that spells exactly these bytes, in printable ASCII.

    Printable ASCII stays as it is; every other byte (a control character such as ESC or a
    newline, the bytes of UTF-8 or of a file name that is not UTF-8) becomes a three-digit octal
    escape, which, unlike `\\x`, cannot run on into the characters after it. `\\`, `"` and `?` are
    escaped (the last so that no `??/` trigraph forms: -std=c11 turns trigraphs on). JSON's
    escapes are not C's: `\\u001b` is an invalid universal character name in C.
    """
    out = []
    for byte in data:
        char = chr(byte)
        if char in '\\"?':
            out.append("\\" + char)
        elif 32 <= byte < 127:
            out.append(char)
        else:
            out.append(f"\\{byte:03o}")
    return '"' + "".join(out) + '"'


def _tail(text: str, lines: int = 30, chars: int = 4000) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])[-chars:]


def _now() -> str:
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
