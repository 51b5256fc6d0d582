"""What an exported library shares with Python: its dtype codes, the dataset file's magic, its name rule.

This module imports nothing of symgrad (a leaf of tests/test_layering.py): the back end's export
renders these numbers into the C it writes, and the applications (symgrad.tools.export_training,
which writes the dataset file train_main reads; `symgrad export FILE`, which names the library
after the file) read the same ones.
"""

from __future__ import annotations

import re
from pathlib import Path

#: The dataset file's first 8 bytes (train_main checks them).
MAGIC = b"SGDATA01"
#: The dtype codes of the dataset file and of the exported library's API (its variables, inputs, outputs).
DTYPE_CODES = {"float32": 1, "float64": 2, "int32": 3, "int64": 4, "bool": 5}
#: A C identifier: what a library's name (the prefix of its every global symbol) must be.
C_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def name_of(path: Path) -> str:
    """A C identifier from a file's name: its stem, non-identifier characters as `_`."""
    name = re.sub(r"\W", "_", Path(path).stem, flags=re.ASCII)
    return name if C_NAME.match(name) else f"model_{name}"
