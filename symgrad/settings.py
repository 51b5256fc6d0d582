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
