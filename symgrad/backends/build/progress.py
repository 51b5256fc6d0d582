"""The wait made visible: a build that takes longer than a second says so on stderr.

    progress = BuildProgress("a C program: 450 kernels in 97 functions", units=4, jobs=2)
    ... progress.tick() while the compilers run, progress.unit_done() as each exits ...
    progress.end()

Nothing is printed for a build that ends within DELAY seconds (most builds, and every cache
hit). After that, one line: what is compiling and on how many jobs; on a terminal that line is
redrawn as a progress bar over the translation units until the build ends. `SYMGRAD_QUIET=1`,
or `quiet=True` where a compile takes it (sg.function, sg.train_step), silences it
(symgrad.settings.quiet).
"""

from __future__ import annotations

import sys
import time

DELAY = 1.0     # seconds a build runs before it is announced
TICK = 0.25     # seconds between redraws of the bar on a terminal
BAR = 24        # characters of the bar


class BuildProgress:
    """Announces a build of `units` translation units on `jobs` jobs once it has run DELAY
    seconds (`what`: what is compiling). The builder, which polls its compilers, calls `tick()`
    while it waits and `unit_done()` as each unit's compiler exits; `end()` when the build is
    over. No thread of its own: a thread's malloc arena would stay reserved in the process."""

    def __init__(self, what: str, units: int = 1, jobs: int = 1, stream=None, delay: float | None = None):
        self.what, self.units, self.jobs = what, units, jobs
        self.stream = stream if stream is not None else sys.stderr
        self.delay = DELAY if delay is None else delay
        self.done = 0
        self.announced = False
        self._started = time.perf_counter()
        self._drawn = 0.0

    def tick(self) -> None:
        """The build is still running: announce it once it has run `delay` seconds, and redraw
        the bar on a terminal every TICK seconds."""
        now = time.perf_counter()
        if not self.announced:
            if now - self._started < self.delay:
                return
            self.announced = True
            if not self._terminal():
                self._write(self.line() + "...\n")
        if self._terminal() and now - self._drawn >= TICK:
            self._draw()

    def unit_done(self) -> None:
        """One translation unit compiled."""
        self.done += 1
        if self.announced and self._terminal():
            self._draw()

    def end(self) -> None:
        """The build is over: a bar that was drawn ends its line."""
        if self.announced and self._terminal():
            self._draw(final=True)

    def line(self) -> str:
        """The announcement: what is compiling, in how many units on how many jobs."""
        units = f"{self.units} translation units on {self.jobs} jobs" if self.units > 1 else "1 translation unit"
        return f"symgrad: compiling {self.what} ({units})"

    def _draw(self, final: bool = False) -> None:
        self._drawn = time.perf_counter()
        filled = BAR * self.done // max(self.units, 1)
        elapsed = self._drawn - self._started
        end = f" done in {elapsed:.1f} s\n" if final else f" {elapsed:.1f} s"
        self._write(f"\r{self.line()} [{'#' * filled}{'.' * (BAR - filled)}] {self.done}/{self.units}{end}")

    def _terminal(self) -> bool:
        try:
            return self.stream.isatty()
        except (AttributeError, ValueError):
            return False

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):   # a closed or broken stderr: the build goes on regardless
            pass
