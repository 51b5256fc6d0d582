"""How a build runs its compilers side by side (symgrad.backends.build.toolchain._run_all): every
command runs, the work given as `meanwhile` is done while they do, a failing one raises after the
others have stopped, and the wait for them wakes as one exits, not at its next look.

The commands here are shell lines standing in for compilers: what is tested is the running of
processes, not what a compiler makes of a source."""

import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from symgrad.backends.build import toolchain
from symgrad.backends.build.toolchain import BuildError

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="the commands are POSIX shell lines")


def _paths(tmp_path: Path) -> SimpleNamespace:
    """The entry's files a failed build names in its error."""
    return SimpleNamespace(name="_symgrad_test", source=tmp_path / "unit.c", log=tmp_path / "unit.log")


def _shell(line: str) -> list[str]:
    return ["sh", "-c", line]


def test_every_command_runs_and_the_work_meanwhile_is_done_while_they_run(tmp_path):
    # The slow command writes its file only at its end: `meanwhile` must find it not yet there.
    commands = [_shell("sleep 0.5; echo slow > slow.txt"), _shell("echo quick > quick.txt")]
    seen = []
    toolchain._run_all(_paths(tmp_path), commands, tmp_path,
                       meanwhile=lambda: seen.append((tmp_path / "slow.txt").exists()))
    assert seen == [False]   # called once, while the slow command was still running
    assert (tmp_path / "slow.txt").read_text() == "slow\n"
    assert (tmp_path / "quick.txt").read_text() == "quick\n"


def test_one_command_with_work_meanwhile_runs_it_too(tmp_path):
    seen = []
    toolchain._run_all(_paths(tmp_path), [_shell("sleep 0.3; echo one > one.txt")], tmp_path,
                       meanwhile=lambda: seen.append((tmp_path / "one.txt").exists()))
    assert seen == [False]
    assert (tmp_path / "one.txt").read_text() == "one\n"


def test_what_the_work_meanwhile_raises_does_not_stop_the_build(tmp_path):
    def fails():
        raise RuntimeError("done again after the build, where it is raised")

    toolchain._run_all(_paths(tmp_path), [_shell("echo a > a.txt"), _shell("echo b > b.txt")], tmp_path,
                       meanwhile=fails)
    assert (tmp_path / "a.txt").exists() and (tmp_path / "b.txt").exists()


def test_work_given_for_the_threads_next_build_is_done_once_while_its_compilers_run(tmp_path):
    """toolchain.while_compiling: the program cache's entry is written so, after the compilers
    have started (symgrad.backends.c.compile_in_background); before the build's own work, since
    it also tells a caller waiting for the compilers that they run (Building.started)."""
    seen, own = [], []
    with toolchain.while_compiling(lambda: seen.append((tmp_path / "slow.txt").exists())):
        toolchain._run_all(_paths(tmp_path), [_shell("sleep 0.5; echo slow > slow.txt")], tmp_path,
                           meanwhile=lambda: own.append(len(seen)))
        toolchain._run_all(_paths(tmp_path), [_shell("echo again > again.txt")], tmp_path)
    assert seen == [False] and own == [1]   # once, while the compiler ran, before the build's own work
    toolchain._run_all(_paths(tmp_path), [_shell("echo later > later.txt")], tmp_path)
    assert seen == [False]


def test_a_failing_command_raises_with_its_output_once_the_others_have_stopped(tmp_path):
    commands = [_shell("echo 'unit.c:3: error: expected ;' >&2; exit 1"), _shell("sleep 30; echo late > late.txt")]
    started = time.monotonic()
    with pytest.raises(BuildError, match="expected ;"):
        toolchain._run_all(_paths(tmp_path), commands, tmp_path)
    # The sleeping command was killed, not waited for (30 s), and never wrote its file.
    assert time.monotonic() - started < 20
    assert not (tmp_path / "late.txt").exists()


def test_the_wait_wakes_as_soon_as_one_process_exits():
    slow = subprocess.Popen(["sleep", "30"])
    quick = subprocess.Popen(["true"])
    try:
        started = time.monotonic()
        toolchain._wait_any([slow, quick], timeout=20)
        assert time.monotonic() - started < 10   # woken by `quick`'s exit, not by the timeout
        assert quick.wait(timeout=5) == 0
        assert slow.poll() is None
        started = time.monotonic()
        toolchain._wait_any([slow], timeout=0.2)   # nothing exits: back after the timeout
        assert 0.15 < time.monotonic() - started < 10
    finally:
        slow.kill()
        slow.wait()
