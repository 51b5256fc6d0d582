"""The cffi declarations a native program is loaded with, parsed once per machine, not per process.

A C or CUDA program is a plain shared library loaded in cffi's ABI mode, which needs its
declarations (the backend's fixed cdef). `cffi.FFI().cdef(...)` imports pycparser and parses
them: about 35 ms, half of a warm compile. cffi's out-of-line ABI mode does that once: it
writes the parsed declarations as a small Python module (`_symgrad_ffi_<hash>.py`, in the
cache's ffi/ directory, keyed by the cdef and cffi's version), and importing that module
builds the same FFI from its tables, with no C parser.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
from functools import lru_cache

from ...settings import cache_dir
from .cache_files import atomic_write

DIRECTORY = "ffi"   # under the cache directory


@lru_cache(maxsize=None)
def declared(cdef: str):
    """An FFI that knows `cdef` (one per cdef in a process; `ffi.dlopen` opens any number of
    libraries with it), from the cache's module of its parsed tables, written first if missing."""
    import _cffi_backend  # what the module imports; cffi itself (2-3 ms) only to write one

    name = "_symgrad_ffi_" + hashlib.sha256(f"{_cffi_backend.__version__}\n{cdef}".encode()).hexdigest()[:20]
    path = cache_dir() / DIRECTORY / f"{name}.py"
    try:
        return _imported(name, path).ffi
    except Exception:  # missing, or not a module cffi wrote for this cdef (a damaged file): write it again
        pass
    import cffi
    from cffi.recompiler import make_py_source

    builder = cffi.FFI()
    builder.cdef(cdef)
    text = io.StringIO()
    make_py_source(builder, name, text)  # what cffi's out-of-line ABI mode writes (set_source(name, None))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, text.getvalue().encode())  # whole or not at all, for processes sharing the cache
    except OSError:  # a read-only cache: this process keeps the FFI it parsed
        return builder
    return _imported(name, path).ffi


def _imported(name: str, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # FileNotFoundError when missing
    return module
