"""Backends: numpy (the reference interpreter), c (OpenMP, a shared library called through cffi), cuda (nvcc).

A backend is a module with `compile(graph, **options) -> program`; a program
has `run(inputs, bindings, variables) -> outputs` (writing the graph's
updates into the `variables` arrays in place), and `source` / `module`.
"""

from __future__ import annotations

import importlib

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
