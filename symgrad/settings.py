"""Where symgrad keeps what it builds: settings read from the environment, in one place.

A leaf module: it imports nothing from symgrad, so every layer (the IR's sympy
memo, the build caches) can ask it.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The cache directory: `$SYMGRAD_CACHE_DIR`, else `~/.cache/symgrad`."""
    configured = os.environ.get("SYMGRAD_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "symgrad"


def quiet(given: bool | None = None) -> bool:
    """Whether builds say nothing on stderr, however long they take: `given` where a caller passed
    it (quiet=True), else `$SYMGRAD_QUIET` set to anything but "" or "0"."""
    if given is not None:
        return bool(given)
    return os.environ.get("SYMGRAD_QUIET", "").strip() not in ("", "0")
