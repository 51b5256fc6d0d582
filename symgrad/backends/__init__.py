"""Backends: numpy (the reference interpreter), c (OpenMP, a shared library called through cffi), cuda (nvcc).

A backend is a module with `compile(graph, **options) -> program`; a program
has `run(inputs, bindings, variables) -> outputs` (writing the graph's
updates into the `variables` arrays in place), and `source` / `module`.

`sg.function` and `sg.train_step` name no backend by default (`resolve(None)`):
"c" where a working C compiler is found, the reason to use symgrad; else "numpy",
with one warning per process that says why.
"""

from __future__ import annotations

import importlib
import warnings

BACKENDS = {"numpy": "numpy_backend", "c": "c", "cuda": "cuda"}


def get(name: str):
    """The backend module called `name`."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; expected one of {', '.join(BACKENDS)}")
    try:
        return importlib.import_module(f"{__name__}.{BACKENDS[name]}")
    except ModuleNotFoundError as exc:
        if exc.name == f"{__name__}.{BACKENDS[name]}":
            raise NotImplementedError(f"backend {name!r} is not built yet") from None
        raise


class BackendFallbackWarning(UserWarning):
    """No C compiler was found for a call that named no backend: it runs on numpy instead."""


_WARNED = False  # whether this process was told, once, that the default fell back to numpy


def resolve(name: str | None, stacklevel: int = 3) -> str:
    """The backend to compile with: `name`, or by default "c" where a working C compiler is found
    (its `--version` runs and it builds an empty library with its flags, OpenMP included: asked
    once per process, and kept in the cache once it builds, build.cache.check_compiler), else
    "numpy" with a one-line BackendFallbackWarning, once per process. `stacklevel` points the
    warning at the user's call."""
    if name is not None:
        return name
    from .build.toolchain import CompilerNotFound
    try:
        from .build.cache import check_compiler
        check_compiler()
        return "c"
    except CompilerNotFound as exc:
        global _WARNED
        if not _WARNED:
            _WARNED = True
            reason = str(exc).splitlines()[0].rstrip(".")
            warnings.warn(f"{reason}; symgrad runs on the numpy backend (the reference, much slower). "
                          f"Install gcc or set $CC for the C backend; pass backend=\"numpy\" to choose "
                          f"numpy and silence this", BackendFallbackWarning, stacklevel=stacklevel)
        return "numpy"
