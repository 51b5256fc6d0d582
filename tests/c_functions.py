"""The function definitions of a C source and their lengths in lines, as a reader sees them.

Issue 33 holds symgrad's emitted C to the limit its Python has (tests/test_package_layout.py):
`over_the_limit` names the functions of a source longer than MAX_FUNCTION_LINES.

A function runs from the line of its name to the line of its closing brace, both counted (the
comment above it is not; lines of an #if's other branches inside it are). The source is read once
for each target the runtime is tiled for (TARGETS: the macros its compiler defines), its #if chains
resolved as that target's preprocessor would, with comments and string literals blanked: a
definition is then a `{` at file level after a parameter list's `)`. A function defined once per
target, in the branches of an #if, is measured in each.
"""

from __future__ import annotations

import re

MAX_FUNCTION_LINES = 80
# A program's entry point and its two size queries (symgrad.backends.render.languages: C_ENTRY,
# C_WORKSPACE_SIZES, C_SCRATCH_BYTES): a list with a line (or a few) per kernel or temporary of the
# graph, as long as the graph is; read as that list, not as a function's logic.
PROGRAM_LISTS = {"symgrad_run", "symgrad_workspace_bytes", "symgrad_scratch_bytes"}

#: The macros gcc defines for each -march level of the runtime's TARGETS (symgrad.backends.build.runtime),
#: and one with AVX-512's bf16 (its own GEMM); every one compiles with GCC and OpenMP.
TARGETS = ({"__AVX512VL__", "__AVX512F__", "__AVX512BF16__", "__AVX2__", "__AVX__"}, {"__AVX2__", "__AVX__"}, set())
COMMON = {"__GNUC__", "_OPENMP"}

_COMMENT_OR_STRING = re.compile(r'/\*.*?\*/|//[^\n]*|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)
_NAME_BEFORE_PARAMETERS = re.compile(r"([A-Za-z_]\w*)\s*$")


def _blank(match: re.Match) -> str:
    """A comment or string with every character but its newlines turned into a space."""
    return re.sub(r"[^\n]", " ", match.group(0))


def _holds(condition: str, defined: set[str]) -> bool:
    """An #if condition under `defined` (`defined(X)`, !, &&, ||; SG_IN_PART(n): every part is in
    the source read; any other name is 0, as in C's preprocessor)."""
    expression = re.sub(r"defined\s*\(?\s*(\w+)\s*\)?", lambda m: str(int(m.group(1) in defined)), condition)
    expression = re.sub(r"SG_IN_PART\(\s*\d+\s*\)", "1", expression)
    expression = re.sub(r"[A-Za-z_]\w*", "0", expression)
    expression = expression.replace("&&", " and ").replace("||", " or ").replace("!", " not ")
    return bool(eval(expression, {}))


def _code_lines(source: str, defined: set[str]) -> list[str]:
    """The source's lines as the preprocessor keeps them under `defined`, comments and strings
    blanked; directives and the lines it drops are empty (a #define adds nothing to `defined`:
    only the macros that choose symgrad's branches matter, and those come from the compiler)."""
    lines = _COMMENT_OR_STRING.sub(_blank, source).split("\n")
    out, chains, continued = [], [], False  # chains: per open #if, [this branch kept, one was kept]
    for line in lines:
        if continued or line.lstrip().startswith("#"):
            if not continued:
                word, rest = re.match(r"#\s*(\w*)(.*)", line.strip()).groups()
                if word in ("if", "ifdef", "ifndef", "elif"):
                    holds = (_holds(rest, defined) if word in ("if", "elif")
                             else (rest.strip() in defined) == (word == "ifdef"))
                    if word == "elif":
                        chains[-1] = [holds and not chains[-1][1], chains[-1][1] or holds]
                    else:
                        chains.append([holds, holds])
                elif word == "else":
                    chains[-1] = [not chains[-1][1], True]
                elif word == "endif":
                    chains.pop()
            continued = line.rstrip().endswith("\\")
            out.append("")
        else:
            out.append(line if all(kept for kept, _ in chains) else "")
    return out


def function_lengths(source: str) -> dict[str, int]:
    """name -> lines of every function defined in `source`, the longest over the targets."""
    out: dict[str, int] = {}
    for target in TARGETS:
        for name, n in _lengths(_code_lines(source, target | COMMON)).items():
            out[name] = max(out.get(name, 0), n)
    return out


def _lengths(lines: list[str]) -> dict[str, int]:
    """name -> lines of every function defined in the preprocessed `lines`."""
    text = "\n".join(lines)
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line) + 1)

    def line_of(offset: int) -> int:
        lo, hi = 0, len(starts) - 1
        while lo < hi:  # the last line start at or before offset
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if starts[mid] <= offset else (lo, mid - 1)
        return lo

    out: dict[str, int] = {}
    depth, opened = 0, None
    for match in re.finditer(r"[{}]", text):
        if match.group(0) == "{":
            if depth == 0:
                opened = _definition(text, match.start())
            depth += 1
        else:
            depth -= 1
            if depth == 0 and opened is not None:
                name, offset = opened
                out[name] = max(out.get(name, 0), line_of(match.start()) - line_of(offset) + 1)
                opened = None
    assert depth == 0, "unbalanced braces: the reader of the source lost its way"
    return out


def _definition(text: str, brace: int) -> tuple[str, int] | None:
    """(name, offset of the name) when the `{` at `brace` opens a function's body, else None (a
    struct, an enum, an initialiser). Read backwards from the brace: a parameter list's `)`,
    its `(`, the name before it."""
    k = brace - 1
    while k >= 0 and text[k].isspace():
        k -= 1
    if k < 0 or text[k] != ")":
        return None
    depth = 0
    while k >= 0:  # back to the `(` that opens the parameter list
        depth += {")": 1, "(": -1}.get(text[k], 0)
        if depth == 0:
            break
        k -= 1
    name = _NAME_BEFORE_PARAMETERS.search(text, max(0, k - 200), max(0, k))
    if name is None or name.group(1) in ("if", "for", "while", "switch", "sizeof", "return"):
        return None
    return name.group(1), name.start(1)


def over_the_limit(source: str) -> dict[str, int]:
    """name -> lines of the functions of `source` over MAX_FUNCTION_LINES (but PROGRAM_LISTS)."""
    return {name: n for name, n in function_lengths(source).items()
            if n > MAX_FUNCTION_LINES and name not in PROGRAM_LISTS}
