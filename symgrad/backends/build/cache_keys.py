"""The build cache's keys: everything a binary depends on (source, flags, compiler, environment), hashed.

The key is the sha256 of the source, the cdef, the flags, the compiler's identity (its resolved
path and `--version` output; `CC` is honoured), the
CFLAGS/CPPFLAGS/LDFLAGS/LDSHARED environment setuptools uses, the cffi version, the extension ABI
suffix and the symgrad version; with `-march=native` also the CPU model and feature flags, since
such a binary is only valid on CPUs like the one that built it. The prekey leaves the compiler out:
it names what the same inputs built last, for a machine with no compiler (symgrad.backends.build.cache).

A compiler's `--version` is asked once per process, and its answer kept in the cache
(`compilers/<hash>.json`) under the compiler binary's path, size, modification time and inode:
starting gcc to ask took 4-8 ms of every warm compile, a tenth of model B's. A compiler installed
over the old one is a new file and is asked again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sysconfig
from pathlib import Path

from ... import version
from ...settings import cache_dir
from . import toolchain
from .cache_files import keep, read_kept
from .toolchain import compiler_command, nvcc_command

# Bumped whenever the layout or the metadata changes, so old entries are never misread.
# 2: a program's library is lib_symgrad_<hash>.so, beside its importable _symgrad_<hash>.py.
FORMAT = 2
_ENV_FLAG_VARS = ("CFLAGS", "CPPFLAGS", "LDFLAGS", "LDSHARED")
# compiler command -> identity string; asking `cc --version` once per process is enough.
_COMPILER_IDS: dict[str, str] = {}


def compiler_identity() -> str:
    """Resolved path and `--version` output of the C compiler; raises `CompilerNotFound`."""
    return _identity(compiler_command(), toolchain.compiler_not_found)


def nvcc_identity() -> str:
    """Resolved path and `--version` output of nvcc (kind="cuda"); raises `CompilerNotFound`."""
    return _identity(nvcc_command(), toolchain.nvcc_not_found)


def asked_identity(kind: str) -> str:
    """The identity of `kind`'s compiler as this process asked it (an entry's metadata), else ""."""
    return _COMPILER_IDS.get(shlex.join(nvcc_command() if kind == "cuda" else compiler_command()), "")


def _identity(command: list[str], not_found) -> str:
    """`command`'s resolved path and `--version` output, asked once per process; `not_found` builds
    the error when it cannot be run."""
    cache_key = shlex.join(command)
    if cache_key in _COMPILER_IDS:
        return _COMPILER_IDS[cache_key]
    resolved = shutil.which(command[0]) if command else None
    if resolved is None:
        raise not_found(command, "was not found")
    try:
        binary = binary_key(resolved, command)
    except OSError as exc:  # removed since `which` found it
        raise not_found(command, f"could not be run ({exc})") from None
    kept_at = cache_dir() / "compilers" / f"{sha256_json(binary)[:32]}.json"
    kept = read_kept(kept_at, binary)
    if kept is not None and isinstance(kept.get("identity"), str):
        _COMPILER_IDS[cache_key] = kept["identity"]
        return kept["identity"]
    try:
        done = subprocess.run([resolved, *command[1:], "--version"], capture_output=True, text=True,
                              timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise not_found(command, f"could not be run ({exc})") from None
    if done.returncode != 0:
        raise not_found(command, f"failed to run: `--version` exited with {done.returncode}:\n"
                                 f"{toolchain.tail(done.stderr or done.stdout)}")
    identity = f"{resolved}\n{done.stdout.strip()}"
    keep(kept_at, binary, identity=identity)
    _COMPILER_IDS[cache_key] = identity
    return identity


def binary_key(resolved: str, command: list[str]) -> dict:
    """What names a compiler's binary file: the command, its resolved path, the file it leads to
    (symbolic links followed: /usr/bin/gcc -> gcc-12) and that file's size, modification time and
    inode. A compiler upgraded or installed over the old one changes one of them."""
    real = os.path.realpath(resolved)
    info = os.stat(real)
    return {"command": list(command), "resolved": resolved, "real": real, "size": info.st_size,
            "modified_ns": info.st_mtime_ns, "inode": info.st_ino, "device": info.st_dev}


def _prekey(source: str, cdef: str, flags: list[str], kind: str, inputs=None) -> str:
    """Hash of everything except the compiler: names the fallback when no compiler is present
    (`inputs`: the build's headers and linked library, symgrad.backends.build.cache._Inputs)."""
    # The source by its digest: written into the JSON whole, a runtime's 350 KB would cost 1.4 ms.
    return sha256_json({"format": FORMAT, "kind": kind, "source": hashlib.sha256(source.encode()).hexdigest(),
                        "cdef": cdef, "flags": flags,
                         "cffi": _cffi_version(), "abi": sysconfig.get_config_var("EXT_SUFFIX"),
                         "symgrad": version.__version__, **(inputs.key_parts() if inputs is not None else {"headers": {}, "link": None})})


def _key(prekey: str, flags: list[str], kind: str = "c") -> str:
    """The full cache key: the prekey plus compiler identity (`cc` or `nvcc --version`), build
    environment and, for -march=native, the host CPU."""
    parts = {"prekey": prekey, "compiler": nvcc_identity() if kind == "cuda" else compiler_identity(),
             "env": {name: os.environ.get(name) for name in _ENV_FLAG_VARS}}
    if any(flag.startswith(("-march=native", "-mcpu=native", "-mtune=native")) for flag in flags):
        parts["cpu"] = _host_cpu()
    return sha256_json(parts)


@functools.lru_cache(maxsize=None)
def _host_cpu() -> str:
    """CPU model and feature flags (what -march=native specialises for)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + " " + platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")
    seen = {}
    for line in lines:
        field, _, value = line.partition(":")
        field = field.strip()
        if field in wanted and field not in seen:
            seen[field] = value.strip()
    return platform.machine() + json.dumps(seen, sort_keys=True)


def sha256_json(parts: dict) -> str:
    """The sha256 of `parts` as canonical JSON (sorted keys): a cache key, or an entry's checksum."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _cffi_version() -> str:
    """cffi's version, from its C backend: `import cffi` (its parser's front end, 2-3 ms) is needed
    only where declarations are parsed, which a warm process does not do (symgrad.backends.build.ffi);
    cffi refuses to import with a backend of another version."""
    import _cffi_backend

    return _cffi_backend.__version__
