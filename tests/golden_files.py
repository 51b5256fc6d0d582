"""Golden files: compare a text with its stored copy in tests/golden/, or rewrite the copy on request.

A change to emitted code or to a printed decision shows in review as a diff of the stored file. When
the change is intended, regenerate the files: SYMGRAD_UPDATE_GOLDEN=1 python -m pytest <the test file>
"""

from __future__ import annotations

import os
from pathlib import Path

GOLDEN = Path(__file__).resolve().parent / "golden"


def check_golden(name: str, text: str) -> None:
    """Assert that `text` is tests/golden/<name> byte for byte (with SYMGRAD_UPDATE_GOLDEN=1, write it first)."""
    path = GOLDEN / name
    if os.environ.get("SYMGRAD_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"{path} is missing; create it with SYMGRAD_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{name} changed; if intended, rerun with SYMGRAD_UPDATE_GOLDEN=1 and review the diff"
