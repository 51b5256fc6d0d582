"""`step.export(dir)`: what the step hands the export back end: its programs, its variables' values, its flags.

The back end (symgrad/backends/export/) renders and writes the library; this module knows the
step: which graph each program is, whether the step already built it on C (then its very source is
exported), where each variable's current value is, and whose file the library is named after.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..api.cells import current_value
from ..backends.export import library
from ..backends.export.formats import name_of
from ..ir.graph import Graph
from .checkpoint import FORMAT


def export(step, out_dir, name: str | None = None, backend: str = "c", programs=None) -> dict:
    """Write `step` (a TrainStep) as a C library and training program into `out_dir`: TrainStep.export
    says what, symgrad.backends.export how. Refuses (ValueError) a name that is no C identifier, an
    unknown backend or program, and a step whose inputs are not batches."""
    if name is None:
        name = _default_name()
    library.check_arguments(name, backend)
    kinds = library.kinds(programs)
    cuda = backend == "cuda"
    exported = [_program(step, kind, cuda) for kind in kinds]

    def value_of(v):  # the step's storage holds what it trained; a variable it never ran, its cell
        return step._read_variable(v.name) if v.name in step._storage else current_value(v)
    # The flags the step's C programs were built with: the same compiler and flags, the same numbers.
    flags = step._options.get("flags") if step.backend == "c" else None
    return library.write(out_dir, name, exported, value_of, cuda=cuda, flags=flags,
                         has_predict=step._predict is not None, checkpoint_format=FORMAT)


def _program(step, kind: str, cuda: bool) -> library.Program:
    """The program `kind` of the step: the one the step built, when it runs on C and the export is
    for C (the same source byte for byte, so the library computes what the step computes); else
    its graph rendered now for the export's language."""
    built = step if kind == "step" else step._programs.get(kind)
    if not cuda and built is not None and built.backend == "c":
        return library.compiled(kind, built.program)
    return library.rendered(kind, _graph_of(step, kind), cuda)


def _graph_of(step, kind: str) -> Graph:
    """The graph of one program: the step's; its loss without updates; the predict= value's (the
    loss where there is none)."""
    if kind == "step":
        return step.graph
    if kind == "predict" and step._predict is not None:
        return step._build("predict")
    return Graph(step.graph.inputs, step.graph.outputs)


def _default_name() -> str:
    """The stem of the first Python file outside symgrad on the call stack (the user's script,
    the model's module), else "model" (an interactive session)."""
    package = Path(__file__).resolve().parents[1]  # symgrad/ (this is symgrad/step/exporting.py)
    frame = sys._getframe(1)
    while frame is not None:
        file = frame.f_code.co_filename
        if file and not file.startswith("<"):
            path = Path(file).resolve()
            if package not in path.parents and path.suffix == ".py":
                return name_of(path)
        frame = frame.f_back
    return "model"
