"""The export for applications: `step.export(dir)` as a function, and train_main's Python side.

The export itself is a back end (symgrad/backends/export/: it renders the step's programs for C or
CUDA and writes the library around them); TrainStep.export runs it. What an application needs
beside it is here: `name_of` (the library's name from a file's, as `symgrad export FILE` names
it) and, from symgrad.tools.export_training, what train_main does beside the library, so Python can
write its dataset (`write_dataset`) and reproduce its run (`shuffle_order`, `learning_rate`).
"""

from __future__ import annotations

from ..backends.export.formats import DTYPE_CODES, MAGIC, name_of
from .export_training import learning_rate, shuffle_order, write_dataset


def export(step, out_dir, name: str | None = None, backend: str = "c", programs=None) -> dict:
    """`step.export(out_dir, ...)` (TrainStep.export says what it writes), as a function."""
    return step.export(out_dir, name=name, backend=backend, programs=programs)


__all__ = ["DTYPE_CODES", "MAGIC", "export", "learning_rate", "name_of", "shuffle_order", "write_dataset"]
