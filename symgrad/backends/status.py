"""The status codes a compiled program and the runtime return, defined once.

The C entry point, the runtime's functions (symgrad_runtime.h's SG_* macros) and the Python
wrappers that read a status all take them from here.
"""

from __future__ import annotations

from enum import IntEnum, unique


@unique
class Status(IntEnum):
    """What a call of a program or of the runtime returns."""

    OK = 0                  # done
    OUT_OF_MEMORY = 1       # a buffer could not be allocated; nothing more was computed
    BAD_LABEL = 2           # the entry's own refusal of a class label outside [0, classes)
    COLLECTIVE_FAILED = 3   # the caller's collective hook failed (its exception is the caller's)
