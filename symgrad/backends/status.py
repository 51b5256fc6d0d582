"""The status codes a compiled program, the runtime and an exported library return, defined once.

The C entry point, the runtime's functions (symgrad_runtime.h's SG_* macros), the Python
wrappers that read a status and the exported library's header (<NAME>_* codes,
templates/export/library.h.j2) all take them from here: one table, so two meanings can never
share a code again (the export once had its own list, whose BAD_SIZE=3 was the runtime's
COLLECTIVE_FAILED).
"""

from __future__ import annotations

from enum import IntEnum, unique


@unique
class Status(IntEnum):
    """What a call of a program, of the runtime or of an exported library returns."""

    OK = 0                  # done
    OUT_OF_MEMORY = 1       # a buffer could not be allocated; nothing more was computed
    BAD_LABEL = 2           # the entry's own refusal of a class label outside [0, classes)
    COLLECTIVE_FAILED = 3   # the caller's collective hook failed (its exception is the caller's)
    # The exported library's own refusals (templates/export): after the program's, never among them.
    BAD_SIZE = 4
    BAD_ARGUMENT = 5
    IO_ERROR = 6
    BAD_CHECKPOINT = 7
    NO_SUCH_VARIABLE = 8
    DEVICE_ERROR = 9


# What each code means, as the exported library's <name>_status_text says it.
MEANINGS = {
    Status.OK: "success",
    Status.OUT_OF_MEMORY: "out of memory",
    Status.BAD_LABEL: "a class label outside [0, classes)",
    Status.COLLECTIVE_FAILED: "the collective hook failed",
    Status.BAD_SIZE: "a bad batch size",
    Status.BAD_ARGUMENT: "a NULL or bad argument",
    Status.IO_ERROR: "a file could not be read or written",
    Status.BAD_CHECKPOINT: "a checkpoint that does not match the model",
    Status.NO_SUCH_VARIABLE: "no variable (or hyperparameter) of that name",
    Status.DEVICE_ERROR: "a CUDA call failed",
}
