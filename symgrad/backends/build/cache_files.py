"""Files of the caches (symgrad.backends.build.cache, program_cache, runtime): written atomically,
read leniently, locked across processes."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
from pathlib import Path


@contextlib.contextmanager
def file_lock(path: Path):
    """An exclusive fcntl lock on `path` (released when the process dies, too)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to a fresh file beside `path`, then rename it over `path`."""
    # Not mkstemp: its 0600 mode would make a shared cache unreadable to others; "x" honours umask.
    tmp = path.parent / f".tmp-{path.name}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with open(tmp, "xb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_json(path: Path) -> dict | None:
    """The JSON object in `path`, or None when it is missing, unreadable or not an object."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def file_sha256(path: Path) -> str | None:
    """The sha256 of the file at `path`, or None when it cannot be read."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def now_utc() -> str:
    """The time now, in UTC, as ISO 8601 text to the second."""
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
