"""The innermost loops of gcc's x86-64 assembly (AT&T syntax), and what they touch on the stack.

A register-tiled kernel is fast only while its accumulators stay in registers: once the compiler
spills them, every iteration of the k loop stores and reloads them through the stack, and the
kernel runs several times slower. That is decided by the register count of the target (16 vector
registers on SSE2 and AVX2, 32 with AVX-512), not by the CPU the tests run on, so it is checked
here in the assembly gcc writes for each `-march` level, without running anything.

Each function is cut into basic blocks; a loop is a back edge (a jump to a block that dominates
the jumping one) with the blocks that reach it without passing its header, as a compiler finds
natural loops (a backward jump in the text is not enough: gcc places cold blocks after the loop
they return to). An innermost loop contains no other. The k loop of a kernel is an innermost loop
that multiplies vectors (FMAs, or SSE2's mulps/mulpd); a spill is an operand addressed through
%rsp, or through %rbp in a function that made %rbp its frame pointer.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

import pytest

# The builds whose assembly the register-tile checks read: each x86-64 level, and AVX-512 with
# the kernels in 64-byte vectors (what `-DSG_VECTOR_BYTES=64` selects on a CPU whose 512-bit FMAs
# are twice as fast: symgrad.backends.build.vector_width). "<march>/<vector bytes>".
WIDE = "x86-64-v4/64"
LEVELS = ["x86-64", "x86-64-v3", "x86-64-v4", WIDE]

_LABEL = re.compile(r"^(\.?[A-Za-z_][\w.$]*):")
_JUMP = re.compile(r"^\s+(j[a-z]+)\s+(\.L\w+)\s*$")
_ENDS_FLOW = re.compile(r"^\s+(jmp|ret|ud2)\b")
_FRAME_POINTER = re.compile(r"^\s+movq\s+%rsp,\s*%rbp\s*$")
_VECTOR_MULTIPLY = re.compile(r"^\s+(vfn?m(add|sub)\w*p[sd]|v?mulp[sd])\s")


@dataclass(frozen=True)
class Loop:
    """One innermost loop: the function it is in, its lines (block by block) and whether that
    function uses %rbp as its frame pointer."""
    function: str
    lines: tuple[str, ...]
    frame_pointer: bool

    @property
    def vector_multiplies(self) -> int:
        """Vector multiply (or multiply-add) instructions in the loop body."""
        return sum(1 for line in self.lines if _VECTOR_MULTIPLY.match(line))

    @property
    def stack_accesses(self) -> list[str]:
        """The instructions that load from or store to the stack frame."""
        base = r"\((%rsp|%rbp)\b" if self.frame_pointer else r"\(%rsp\b"
        return [line.strip() for line in self.lines
                if not line.lstrip().startswith(".") and re.search(base, line)]


def functions(asm: str) -> dict[str, list[str]]:
    """Each function's lines (its body, from its label to its `.size`), by name."""
    declared = set(re.findall(r"^\s+\.type\s+([\w.$]+),\s*@function", asm, re.M))
    bodies: dict[str, list[str]] = {}
    current = None
    for line in asm.splitlines():
        match = _LABEL.match(line)
        if match and match.group(1) in declared:
            current = match.group(1)
            bodies[current] = []
        elif current is not None:
            if re.match(rf"^\s+\.size\s+{re.escape(current)},", line):
                current = None
            else:
                bodies[current].append(line)
    return bodies


def _blocks(lines: list[str]) -> tuple[list[list[str]], list[set[int]]]:
    """Basic blocks (lists of lines) and each one's successors (block indices)."""
    blocks: list[list[str]] = [[]]
    for line in lines:
        if _LABEL.match(line) and blocks[-1]:
            blocks.append([])
        blocks[-1].append(line)
        if _JUMP.match(line) or _ENDS_FLOW.match(line):
            blocks.append([])
    blocks = [b for b in blocks if b]
    label_block = {}
    for i, block in enumerate(blocks):
        for line in block:
            match = _LABEL.match(line)
            if match:
                label_block[match.group(1)] = i
    successors = []
    for i, block in enumerate(blocks):
        out = set()
        last = next((line for line in reversed(block) if line.strip() and not line.lstrip().startswith(".")
                     and not _LABEL.match(line)), "")
        jump = _JUMP.match(last)
        if jump and jump.group(2) in label_block:
            out.add(label_block[jump.group(2)])
        if not _ENDS_FLOW.match(last) and i + 1 < len(blocks):
            out.add(i + 1)  # falls through (a conditional jump, or no jump)
        successors.append(out)
    return blocks, successors


def _dominators(successors: list[set[int]]) -> list[set[int]]:
    """dom[b]: the blocks on every path from the entry (block 0) to b (iterative data flow)."""
    n = len(successors)
    predecessors: list[set[int]] = [set() for _ in range(n)]
    for b, out in enumerate(successors):
        for s in out:
            predecessors[s].add(b)
    everything = set(range(n))
    dom = [everything.copy() for _ in range(n)]
    dom[0] = {0}
    changed = True
    while changed:
        changed = False
        for b in range(1, n):
            reached = [dom[p] for p in predecessors[b]]
            new = (set.intersection(*reached) if reached else set()) | {b}
            if new != dom[b]:
                dom[b], changed = new, True
    return dom


def innermost_loops(asm: str) -> list[Loop]:
    """Every innermost natural loop of every function in `asm`."""
    loops = []
    for name, lines in functions(asm).items():
        blocks, successors = _blocks(lines)
        if not blocks:
            continue
        dom = _dominators(successors)
        predecessors: list[set[int]] = [set() for _ in blocks]
        for b, out in enumerate(successors):
            for s in out:
                predecessors[s].add(b)
        bodies: dict[int, set[int]] = {}  # header -> blocks of its loop (back edges to it merged)
        for tail, out in enumerate(successors):
            for header in out:
                if header in dom[tail]:
                    body, stack = bodies.setdefault(header, {header}), [tail]
                    while stack:
                        b = stack.pop()
                        if b not in body:
                            body.add(b)
                            stack.extend(predecessors[b])
        frame_pointer = any(_FRAME_POINTER.match(line) for line in lines)
        for header, body in bodies.items():
            if not any(other != header and inner < body for other, inner in bodies.items()):
                loops.append(Loop(name, tuple(line for b in sorted(body) for line in blocks[b]), frame_pointer))
    return loops


def kernel_loops(asm: str, prefix: str) -> list[Loop]:
    """The innermost loops that multiply vectors, in functions whose name starts with `prefix`
    (an OpenMP region's outlined body, `sg_gemm_dot5_f32._omp_fn.0`, keeps its function's name)."""
    return [loop for loop in innermost_loops(asm)
            if loop.function.startswith(prefix) and loop.vector_multiplies > 0]


def assembly(source: str, march: str) -> str:
    """gcc's assembly of a C source (a runtime or a program: the runtime's header beside it) with
    symgrad's default flags, for `march` (a level of LEVELS: "<march>/64" adds -DSG_VECTOR_BYTES=64);
    skips the test without gcc."""
    from symgrad.backends.build import runtime
    from symgrad.backends.build.cache import DEFAULT_FLAGS
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("needs gcc: the check reads gcc's assembly")
    march, _, vector_bytes = march.partition("/")
    flags = [f for f in DEFAULT_FLAGS if not f.startswith("-march")]
    flags += [f"-DSG_VECTOR_BYTES={vector_bytes}"] if vector_bytes else []
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/kernels.c"
        with open(path, "w") as f:
            f.write(source)
        with open(f"{tmp}/{runtime.HEADER}", "w") as f:
            f.write(runtime.header())
        subprocess.run([gcc, *flags, f"-march={march}", "-S", "-o", f"{tmp}/kernels.s", path], check=True,
                       capture_output=True, text=True, timeout=120)
        with open(f"{tmp}/kernels.s") as f:
            return f.read()
