"""The compilers a build runs: which ones, their default flags, how each kind of cache entry is
compiled, and the errors a failed build raises.

    default_flags(), compiler_command()           the C compiler and its flags (kinds "c", "runtime")
    default_nvcc_flags(), nvcc_command()          nvcc (kind "cuda")
    compile_shared(tmp, paths, flags, ...)        a shared library: the runtime (kind "runtime"), or
                                                  cffi's extension module around a program (kind "c")
    compile_nvcc(tmp, paths, flags)               a CUDA library (kind "cuda")

A Python extension is compiled and linked by the compiler directly, without setuptools:
importing and running setuptools cost a cold compile about 0.3 s. `paths` is a cache entry's files: `.name`, `.source` (the kept source, compiled in
place so that messages name it), `.library`, `.log` (where the cache keeps a failed build's log).
"""

from __future__ import annotations

import os
import re
import select
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

# The C compiler's flags unless $SYMGRAD_CFLAGS says otherwise (see default_flags).
# -fno-trapping-math (clang's default) lets gcc compute both sides of a select and choose: no
# program enables floating-point traps, and every value stays IEEE's. Without it gcc 12 moves the
# work of sg_expf's and sg_tanhf's clamps under branches and then keeps every loop over them
# scalar (such work might trap), a GPT step's GELU and softmax loops included.
DEFAULT_FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c11", "-fno-math-errno", "-fno-trapping-math")

# kind="cuda": nvcc builds a plain shared library (no Python C-API) that cffi loads in ABI mode.
# No --use_fast_math: its approximate expf/logf/division would break parity with the reference.
DEFAULT_NVCC_FLAGS = ("-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC")
# With no device to ask for its architecture: a fat binary for Ampere and Hopper.
NVCC_FAT_BINARY = ("-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90")


_PARTS = re.compile(r"^#define SG_PARTS ([0-9]+)$", re.M)
POLL = 0.05   # seconds between looks at the compilers running side by side
# What this thread's builds run their compilers under: `.nice`, how much lower their priority is
# (set by `yield_to_other_work`; 0 where never set).
_THREAD = threading.local()


def yield_to_other_work(nice: int) -> None:
    """Run the compilers this thread starts from now on `nice` lower in priority (through `nice`,
    where the system has it): a build on a thread of its own (a train step's predict program) leaves
    the cores to the steps running meanwhile. Only the compilers: the thread itself keeps its
    priority, or, holding Python's lock at a lower one, it would keep the steps waiting for it."""
    _THREAD.nice = nice


@contextmanager
def while_compiling(work: Callable[[], None]):
    """Have this thread's next build call `work()` once its compilers have started (a program's
    cache entry, written while they run: see symgrad.backends.c.compile_in_background); a build
    that runs no compiler leaves it undone."""
    _THREAD.meanwhile = work
    try:
        yield
    finally:
        _THREAD.meanwhile = None


def _prioritized(command: list[str]) -> list[str]:
    """`command` run at this thread's compiler priority (`yield_to_other_work`)."""
    nice = getattr(_THREAD, "nice", 0)
    program = shutil.which("nice") if nice else None
    return [program, "-n", str(nice), *command] if program else command


class CompilerNotFound(RuntimeError):
    """No working C compiler: says which one was looked for and how to fix it."""


class BuildError(RuntimeError):
    """The compiler rejected the source: carries its output tail and the kept source path."""

    def __init__(self, message: str, *, log: str = "", source_path: Path | None = None):
        super().__init__(message)
        self.log = log
        self.source_path = source_path


def default_flags() -> list[str]:
    """Compiler flags: `$SYMGRAD_CFLAGS` (shell-split) if it names any, else `DEFAULT_FLAGS`.

    A variable set but empty (`SYMGRAD_CFLAGS=`) means the defaults: an empty flag list would
    build with no -O3 and no OpenMP, a step 20x slower with nothing said.
    No -ffast-math: it lets gcc assume there are no NaNs or infinities, which breaks
    the NumPy semantics (log(0) = -inf, nan propagation) the backends must match.
    Programs and the runtime add the machine's vector width to these (runtime.default_flags).
    """
    configured = shlex.split(os.environ.get("SYMGRAD_CFLAGS", ""))
    return configured or list(DEFAULT_FLAGS)


def compiler_command() -> list[str]:
    """The C compiler setuptools will run: `$CC`, else the one Python was built with."""
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    return shlex.split(cc)


def default_nvcc_flags() -> list[str]:
    """nvcc flags before the architecture: `$SYMGRAD_NVCCFLAGS` (shell-split) if it names any,
    else `DEFAULT_NVCC_FLAGS` (set but empty means the defaults, as for `default_flags`)."""
    configured = shlex.split(os.environ.get("SYMGRAD_NVCCFLAGS", ""))
    return configured or list(DEFAULT_NVCC_FLAGS)


def nvcc_command() -> list[str]:
    """The CUDA compiler: `$NVCC`, else `nvcc` on PATH, else /usr/local/cuda/bin/nvcc."""
    configured = os.environ.get("NVCC")
    if configured:
        return shlex.split(configured)
    return [shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"]


# (compiler command, flags) -> None where an empty library built, else the error: asked once a process.
_PROBED: dict[tuple, Exception | None] = {}


def probe() -> None:
    """Build an empty shared library with the C compiler and its flags, once per process and
    compiler: what the default backend asks before it chooses C (a compiler that answers
    --version may still lack OpenMP or a linker). Raises CompilerNotFound saying why it cannot.
    (cache.check_compiler keeps a success in the cache, for the processes after this one.)"""
    command, flags = compiler_command(), default_flags()
    key = (tuple(command), tuple(flags))
    if key not in _PROBED:
        _PROBED[key] = _probe(command, flags)
    if _PROBED[key] is not None:
        raise _PROBED[key]


def _probe(command: list[str], flags: list[str]) -> CompilerNotFound | None:
    with tempfile.TemporaryDirectory(prefix="symgrad-probe-") as tmp:
        source, library = Path(tmp) / "probe.c", Path(tmp) / "probe.so"
        source.write_text("int symgrad_probe(void) { return 0; }\n")
        run = [*command, *flags, "-fPIC", "-shared", str(source), "-o", str(library), *openmp_link(flags)]
        try:
            done = subprocess.run(run, capture_output=True, text=True, cwd=tmp, timeout=120)
        except (OSError, subprocess.SubprocessError) as exc:
            return compiler_not_found(command, f"could not be run ({exc})")
        if done.returncode != 0 or not library.is_file():
            first = tail(done.stderr or done.stdout, lines=1) or f"exit status {done.returncode}"
            return CompilerNotFound(f"No working C compiler: {shlex.join(command)!r} cannot build a shared "
                                    f"library with {shlex.join(flags)} ({first})")
    return None


def translation_units(source: str) -> int:
    """How many translation units a program's source is built as: its `#define SG_PARTS <n>`
    (symgrad.backends.render.program), else 1."""
    found = _PARTS.search(source)
    return int(found.group(1)) if found else 1


def jobs(units: int) -> int:
    """How many compilers run side by side for `units` translation units: one per core this
    process may use, at most one per unit."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(units, cores))


def compile_shared(tmp: Path, paths, flags: list[str], *, source: Path | None = None, include_dirs=(),
                   link_args=(), python: bool = False, units: int = 1, progress=None, meanwhile=None) -> Path:
    """Compile a C file (default: the kept source) in `tmp` with the C compiler and `flags`, and link
    it into the shared library `paths.library.name` there, its soname that name; returns the
    library. `python`: a Python extension module (cffi's wrapper around the kept source), compiled
    as setuptools would, with Python's headers and compile flags. `units` > 1: the file is
    compiled that many times side by side (`jobs(units)` at a time), with -DSG_PART=0, 1, ...,
    each keeping its own part (translation_units), and the objects linked together; `progress`
    (a BuildProgress) hears of each. `meanwhile`: work of this thread's done while the compilers run
    (see _run_all)."""
    out = tmp / paths.library.name
    cc = compiler_command()
    compile_flags = [*cc, *(_python_flags() if python else []), *flags, "-fPIC", *(f"-I{d}" for d in include_dirs)]
    if units == 1:
        objects = [tmp / (paths.name + ".o")]
        commands = [[*compile_flags, "-c", str(source or paths.source), "-o", str(objects[0])]]
    else:
        objects = [tmp / f"{paths.name}.{unit}.o" for unit in range(units)]
        commands = [[*compile_flags, f"-DSG_PART={unit}", "-c", str(source or paths.source), "-o", str(obj)]
                    for unit, obj in enumerate(objects)]
    _run_all(paths, commands, tmp, progress, meanwhile)
    _run(paths, [*cc, "-shared", *flags, *(shlex.split(os.environ.get("LDFLAGS", "")) if python else []),
                 f"-Wl,-soname,{out.name}", *map(str, objects), "-o", str(out), "-lm", *openmp_link(flags),
                 *link_args], tmp)
    if not out.is_file():
        raise build_failed(paths, "", RuntimeError(f"the compiler wrote no {out.name}"))
    return out


def _both(first: Callable[[], None], then: Callable[[], None]) -> Callable[[], None]:
    """`first()`, then `then()` even where `first` raised (what it raised raised after)."""
    def both():
        try:
            first()
        finally:
            then()
    return both


def _run_all(paths, commands: list[list[str]], cwd: Path, progress=None, meanwhile=None) -> None:
    """Run the compiler `commands`, `jobs(len(commands))` at a time, polled from this thread (no
    thread pool: each thread's malloc arena would stay reserved in the process). The first that
    fails raises `build_failed`'s error, the others stopped first: their objects would not be
    linked. `progress` (a BuildProgress) ticks while they run and hears of each that ends.
    `meanwhile()` is called once the first compilers have started: work that would otherwise wait
    for them (the cache parses the program's declarations there). It is work done ahead, so what
    it raises is dropped: the same work done again after the build raises it where it belongs."""
    also, _THREAD.meanwhile = getattr(_THREAD, "meanwhile", None), None   # while_compiling's, once
    if also is not None:  # first: it tells the caller that the compilers run (Building.started)
        meanwhile = also if meanwhile is None else _both(also, meanwhile)
    if len(commands) == 1 and progress is None and meanwhile is None:
        return _run(paths, commands[0], cwd)
    waiting, running = list(commands), []
    try:
        while waiting or running:
            while waiting and len(running) < jobs(len(commands)):
                command = waiting.pop(0)
                log = tempfile.TemporaryFile(mode="w+", dir=cwd)
                try:
                    running.append((subprocess.Popen(_prioritized(command), stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                                                     text=True), command, log))
                except OSError as exc:
                    log.close()
                    raise compiler_not_found(command[:1], f"could not be run ({exc})") from None
            if meanwhile is not None:
                try:
                    meanwhile()
                except Exception:  # noqa: BLE001 -- done again after the build, which raises it there
                    pass
                meanwhile = None
            _wait_any([process for process, _, _ in running], POLL)
            for entry in [e for e in running if e[0].poll() is not None]:
                process, command, log = entry
                running.remove(entry)
                if process.returncode != 0:
                    log.seek(0)
                    output = log.read()
                    log.close()
                    raise build_failed(paths, f"$ {shlex.join(command)}\n{output}",
                                       RuntimeError(f"the compiler exited with {process.returncode}"))
                log.close()
                if progress is not None:
                    progress.unit_done()
            if progress is not None:
                progress.tick()
    finally:
        for process, _, log in running:   # after a failure or an interrupt: stop the others
            process.kill()
            process.wait()
            log.close()
        if progress is not None:
            progress.end()


def _wait_any(processes: list[subprocess.Popen], timeout: float) -> None:
    """Return once one of `processes` has exited, or after `timeout` seconds. On Linux a poll of
    their pidfds, woken as one exits; elsewhere Popen.wait on the first, which looks at that one
    alone at intervals backing off to 50 ms (about 7 ms late on average)."""
    try:
        fds = [os.pidfd_open(process.pid) for process in processes]
    except (AttributeError, OSError):  # no pidfd_open (not Linux, or a kernel before 5.3)
        try:
            processes[0].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        return
    try:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        poller.poll(timeout * 1000)
    finally:
        for fd in fds:
            os.close(fd)


def _run(paths, command: list[str], cwd: Path) -> None:
    """Run one compiler command; a failure is `build_failed`'s error (its output in the log)."""
    try:
        done = subprocess.run(_prioritized(command), capture_output=True, text=True, cwd=cwd, timeout=600)
    except (OSError, subprocess.SubprocessError) as exc:
        raise compiler_not_found(command[:1], f"could not be run ({exc})") from None
    if done.returncode != 0:
        raise build_failed(paths, f"$ {shlex.join(command)}\n{done.stdout}\n{done.stderr}",
                           RuntimeError(f"the compiler exited with {done.returncode}"))


def _python_flags() -> list[str]:
    """What setuptools adds to an extension's compile: Python's CFLAGS and CCSHARED, its headers,
    then $CFLAGS and $CPPFLAGS ($LDFLAGS goes to the link)."""
    config = sysconfig.get_config_vars()
    paths = sysconfig.get_paths()
    flags = [*shlex.split(config.get("CFLAGS") or ""), *shlex.split(config.get("CCSHARED") or "")]
    flags += [f"-I{d}" for d in dict.fromkeys([paths["include"], paths["platinclude"]])]
    for name in ("CFLAGS", "CPPFLAGS"):
        flags += shlex.split(os.environ.get(name, ""))
    return flags


def openmp_link(flags: list[str]) -> list[str]:
    """The link flags OpenMP code needs: -fopenmp when it was compiled with it."""
    return ["-fopenmp"] if any(flag.startswith("-fopenmp") for flag in flags) else []


def compile_nvcc(tmp: Path, paths, flags: list[str]) -> Path:
    """Run nvcc on the kept .cu (so its messages name that file) into `tmp`; returns the .so."""
    out = tmp / paths.library.name
    command = [*nvcc_command(), *flags, "-o", str(out), str(paths.source)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, cwd=tmp, timeout=600)
    except (OSError, subprocess.SubprocessError) as exc:
        raise CompilerNotFound(f"No working CUDA compiler: {shlex.join(nvcc_command())!r} could not be run "
                               f"({exc}).\nThe CUDA backend needs nvcc to build its libraries. Fix: install the "
                               f"CUDA toolkit, or point the NVCC environment variable at nvcc.") from None
    if done.returncode != 0 or not out.is_file():
        text = f"$ {shlex.join(command)}\n{done.stdout}\n{done.stderr}"
        raise BuildError(f"CUDA compilation of {paths.name} failed (nvcc exited with {done.returncode}).\n"
                         f"nvcc output (tail):\n{tail(text)}\n"
                         f"Source kept at: {paths.source} (full log: {paths.log})",
                         log=text, source_path=paths.source)
    return out


def build_failed(paths, log: str, error: Exception) -> Exception:
    """`CompilerNotFound` if the compiler could not even start, else a `BuildError` with the
    compiler's output tail, its full log in `.log` (the cache keeps it beside the source)."""
    text = f"{log}\n{error}"
    # The driver ran but could not start itself or its parts (cc1, as, ld): an install problem,
    # not a bug in the source.
    broken = ("cannot execute", "error trying to exec", "No such file or directory: '")
    if any(marker in text for marker in broken) or (
            "No such file or directory" in text and "command" in text and "failed" in text):
        return compiler_not_found(compiler_command(), f"could not be run:\n{tail(text, lines=8)}")
    return BuildError(f"C compilation of {paths.name} failed ({error.__class__.__name__}).\n"
                      f"Compiler output (tail):\n{tail(text)}\n"
                      f"Source kept at: {paths.source} (full log: {paths.log})",
                      log=text, source_path=paths.source)


def compiler_not_found(command: list[str], problem: str) -> CompilerNotFound:
    """The error for a C compiler that is missing or does not run: what was tried, how to fix it."""
    cc = shlex.join(command) if command else "(empty)"
    source = "$CC" if os.environ.get("CC") else "the compiler Python was built with (set $CC to change)"
    return CompilerNotFound(
        f"No working C compiler: {cc!r} ({source}) {problem}.\n"
        f"The C backend needs one to build its modules. Fix: install gcc (e.g. `apt install gcc` or "
        f"`conda install gcc`), or point the CC environment variable at a working C compiler.\n"
        f"backend=\"numpy\" works without a compiler.")


def nvcc_not_found(command: list[str], problem: str) -> CompilerNotFound:
    """The error for an nvcc that is missing or does not run: what was tried, how to fix it."""
    nvcc = shlex.join(command) if command else "(empty)"
    return CompilerNotFound(
        f"No working CUDA compiler: {nvcc!r} {problem}.\n"
        f"The CUDA backend needs nvcc to build its libraries. Fix: install the CUDA toolkit, or point "
        f"the NVCC environment variable at nvcc.\nbackend=\"c\" and backend=\"numpy\" work without it.")


def c_string_literal(data: bytes) -> str:
    """`data` as a C string literal that spells exactly these bytes, in printable ASCII.

    Printable ASCII stays as it is; every other byte (a control character such as ESC or a
    newline, the bytes of UTF-8 or of a file name that is not UTF-8) becomes a three-digit octal
    escape, which, unlike `\\x`, cannot run on into the characters after it. `\\`, `"` and `?` are
    escaped (the last so that no `??/` trigraph forms: -std=c11 turns trigraphs on). JSON's
    escapes are not C's: `\\u001b` is an invalid universal character name in C.
    """
    out = []
    for byte in data:
        char = chr(byte)
        if char in '\\"?':
            out.append("\\" + char)
        elif 32 <= byte < 127:
            out.append(char)
        else:
            out.append(f"\\{byte:03o}")
    return '"' + "".join(out) + '"'


def tail(text: str, lines: int = 30, chars: int = 4000) -> str:
    """The last `lines` lines of a compiler's output, at most `chars` characters."""
    return "\n".join(text.strip().splitlines()[-lines:])[-chars:]
