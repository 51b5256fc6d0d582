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


def read_kept(path: Path, key: dict) -> dict | None:
    """The record `keep` wrote to `path` for `key`, or None: missing, unreadable, or kept for
    another key (the file's name is a prefix of the key's hash; the key itself is compared)."""
    record = read_json(path)
    return record if record is not None and record.get("key") == key else None


def keep(path: Path, key: dict, **values) -> None:
    """Write {"key": key, **values} to `path` atomically; a cache that cannot be written (read-only,
    removed meanwhile) only means that the answer is asked for again next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps({"key": key, **values}, indent=1).encode())
    except OSError:
        pass


def file_sha256(path: Path) -> str | None:
    """The sha256 of the file at `path`, or None when it cannot be read."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def tree_digest(root: Path, suffix: str, memo_dir: Path | None = None) -> str:
    """The sha256 of the files under `root` whose names end in `suffix`: each one's relative path,
    size and bytes, in sorted order.

    Reading and hashing every file took a third of a warm compile (a few hundred files). With
    `memo_dir` the digest is kept there under the files' paths, sizes and modification times (what
    Python trusts for its .pyc), so a later process only lists and stats them; a memo that cannot be
    read or written only means hashing again."""
    files = sorted(_files_under(str(root), "", suffix))
    memo = None
    if memo_dir is not None:
        stats = hashlib.sha256()
        for relative, entry in files:
            info = entry.stat()
            stats.update(f"{relative} {info.st_size} {info.st_mtime_ns}\n".encode())
        memo = memo_dir / f"{stats.hexdigest()[:32]}.txt"
        try:
            kept = memo.read_text()
            if len(kept) == 64 and all(c in "0123456789abcdef" for c in kept):
                return kept
        except OSError:
            pass
    digest = hashlib.sha256()
    for relative, entry in files:
        data = Path(entry.path).read_bytes()
        digest.update(f"{relative} {len(data)}\n".encode())
        digest.update(data)
    if memo is not None:
        try:
            memo_dir.mkdir(parents=True, exist_ok=True)
            atomic_write(memo, digest.hexdigest().encode())
        except OSError:
            pass
    return digest.hexdigest()


def _files_under(folder: str, relative: str, suffix: str):
    """(path relative to the walk's root, os.DirEntry) of each file under `folder` whose name ends
    in `suffix`, Python's __pycache__ folders left out. os.scandir's entries carry what stat asks,
    and the relative path is built as the walk goes: os.walk and os.path.relpath took 2 of the 3.5
    ms a warm compile spent on the code's fingerprint."""
    with os.scandir(folder) as entries:
        for entry in entries:
            name = f"{relative}{entry.name}"
            if entry.is_dir(follow_symlinks=False):   # as os.walk: a link to a folder is not followed
                if entry.name != "__pycache__":
                    yield from _files_under(entry.path, f"{name}/", suffix)
            elif entry.name.endswith(suffix):
                yield name, entry


def now_utc() -> str:
    """The time now, in UTC, as ISO 8601 text to the second."""
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
