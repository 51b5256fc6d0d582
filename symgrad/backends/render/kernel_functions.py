"""Which kernels share one function, and which translation unit each function is compiled in.

    sharing_key(context) -> str | None            a kernel's context as its function reads it
    shared(texts, names, params) -> list[int]     per kernel: the kernel whose function it calls
    partition(sizes, parts) -> list[int]          per function: its translation unit
    calls(source, names) -> dict[str, list[str]]  a program's functions and the kernels calling each

Depth should cost calls, not code. The kernels of every transformer layer, every residual block
and every same-shaped parameter's optimizer update differ only in the buffers they read and
write and in the names of the graph nodes they compute; rendered, each is the same C but for
those names. Such kernels become one function, called once per use with that use's buffers, so
a 12-layer model compiles about as much C as a 4-layer one.

Two kernels share a function when their sources are equal once each is read with its own names
replaced by their roles: its function name (and the names derived from it: a matmul's epilogue
and its argument struct), its parameters by position (the call passes each use's buffers in
that order), and the locals named after graph nodes (t<n>) by first appearance. Comments, which
name each use's nodes and buffers, are left out of the comparison; every other identifier (a
constant table, a helper) must be the same for the sources to match. Kernels whose template
contexts are equal when read so (`sharing_key`) render to equal sources: only the first of each
key is rendered (symgrad.backends.render.program). Pure functions over text and plain data.
"""

from __future__ import annotations

import heapq
import re

from .expressions import Comment

_COMMENT = re.compile(r"/\*.*?\*/", re.S)
_IDENTIFIER = re.compile(r"([A-Za-z_][A-Za-z_0-9]*)")  # a group: re.split keeps the words


def canonical(text: str, name: str, params: list[str]) -> str:
    """`text` (a kernel's source) without comments, its own names replaced by their roles:
    `name` and the names it prefixes by @f, the parameters by @p<position>, the node locals by
    @t<first appearance>. Two kernels with equal canonical forms compute the same function.

    The text is split at its identifiers in one pass of the regex engine and the words are looked
    up in a loop (a 12-layer GPT's kernels hold 94,000 of them: a callback per match cost twice
    as much)."""
    return _roles(_COMMENT.sub("", text), name, params)


def _roles(text: str, name: str, params: list[str]) -> str:
    """`canonical` of a text without comments."""
    roles = {param: f"@p{position}" for position, param in enumerate(params)}
    parts = _IDENTIFIER.split(text)   # the identifiers at the odd positions
    for k in range(1, len(parts), 2):
        word = parts[k]
        found = roles.get(word)
        if found is None:
            if word.startswith(name):   # the function itself, its epilogue, its epilogue's struct
                found = "@f" + word[len(name):]
            elif word[0] == "t" and word[1:].isdigit():   # a node local (t[0-9]+: the words are ASCII)
                found = roles[word] = f"@t{len(roles)}"
            else:
                continue
        parts[k] = found
    return "".join(parts)


# A context's entries its function does not print: the call's arguments, and what the entry point
# does after the call (`final`: the gradients it reports). Only C programs share functions (a CUDA
# kernel's host side launches it with its own `args`).
_CALL_ONLY = frozenset({"args", "final", "call"})
# The key sets of the contexts' dicts and the dataclasses in them, each a number in a sharing key,
# where every mark of structure (and of a value not a string) starts with \x1e, which C code and
# the names in it never hold: a key reads back one way only.
_LAYOUTS: dict = {}


class _Unkeyed(Exception):
    """A context holds a value whose text might not say all it holds."""


def sharing_key(context: dict) -> str | None:
    """A kernel's template context as text, without its comments (`Comment` strings) and without
    what only its call prints (_CALL_ONLY), its own names replaced by their roles as `canonical`
    replaces them in a source. Kernels with equal keys render to sources with equal canonical
    forms (a template prints the names it is given, and nothing else differs between them), so
    only the first kernel of each key is rendered: a 12-layer GPT's 1,235 kernels are 82 renders.
    A key costs a third of a render and its canonical form. A context holding a value of a type
    not listed here (none does, today) has no key (None): its kernel is rendered."""
    words: list[str] = []
    add = words.append

    def walk(value, skipped=frozenset()) -> None:
        kind = type(value)
        if kind is str:
            add(value)
        elif kind is Comment:
            add("\x1e#")
        elif kind is int or kind is float or kind is bool or value is None:
            add(f"\x1e{value!r}")
        elif kind is dict:
            keys = tuple(value)
            add(f"\x1e<{_LAYOUTS.setdefault(keys, len(_LAYOUTS))}")
            for key in keys:
                if key not in skipped:
                    walk(value[key])
            add("\x1e>")
        elif kind is list or kind is tuple:
            add("\x1e[")
            for item in value:
                walk(item)
            add("\x1e]")
        elif hasattr(kind, "__dataclass_fields__"):  # the statements: Let, Store, Fold, Accumulator
            add(f"\x1e({_LAYOUTS.setdefault(kind, len(_LAYOUTS))}")
            for name in kind.__dataclass_fields__:
                walk(getattr(value, name))
            add("\x1e)")
        else:
            raise _Unkeyed

    try:
        walk(context, _CALL_ONLY)   # the context's own entries only: a statement's are all code
    except _Unkeyed:
        return None
    return _roles("\x1f".join(words), context["name"], [p["name"] for p in context["params"]])


def shared(texts: list[str], names: list[str], params: list[list[str]]) -> list[int]:
    """For each kernel (its source, function name and parameter names), the position of the first
    kernel with the same canonical form: the kernel whose function it calls (itself if first)."""
    first: dict[str, int] = {}
    return [first.setdefault(canonical(text, name, ps), position)
            for position, (text, name, ps) in enumerate(zip(texts, names, params))]


def partition(sizes: list[int], parts: int, fixed: int = 0) -> list[int]:
    """Each function's translation unit (0 .. parts - 1), from its size (its lines: what the
    compiler's time follows): the largest first, each to the unit with the least so far, so the
    units take about equally long to compile side by side. `fixed`: lines unit 0 holds besides
    (the entry point)."""
    load = [(fixed if unit == 0 else 0, unit) for unit in range(parts)]
    heapq.heapify(load)
    unit_of = [0] * len(sizes)
    for position in sorted(range(len(sizes)), key=lambda p: -sizes[p]):
        lines, unit = heapq.heappop(load)
        unit_of[position] = unit
        heapq.heappush(load, (lines + sizes[position], unit))
    return unit_of


# An entry point's call of another kernel's function: `    k4_add_t7(d0, var3);  /* k9_add_t12 */`,
# and a loop's, naming its first round's kernel (templates/program/program.c.j2; entry_loops).
_CALL_OF_ANOTHER = re.compile(r"^    (k[0-9]+_\w+)\(.*\);  /\* (k[0-9]+_\w+) \*/$", re.M)
_LOOP = re.compile(r"^    for \(int64_t l = 0; l < ([0-9]+); \+\+l\) \{  /\* ([0-9]+) rounds of ([0-9]+) calls? \*/$\n"
                   r"((?:        .*\n)+)    \}$", re.M)
_LOOP_CALL = re.compile(r"^        (k[0-9]+_\w+)\(.*\);  /\* (k[0-9]+_\w+) \*/$", re.M)


def calls(source: str, names: list[str]) -> dict[str, list[str]]:
    """The kernels of a program (`names`, in run order) grouped by the function each calls, read
    from the entry point of its `source`: function name -> the kernels calling it, the function's
    own kernel first. A loop's call names its first round's kernel; round l's is the kernel a
    period (the loop's calls) l later. A source with no shared functions (CUDA's) gives each
    kernel its own."""
    function_of = {kernel: function for function, kernel in _CALL_OF_ANOTHER.findall(source)}
    position = {name: p for p, name in enumerate(names)}
    for loop in _LOOP.finditer(source):
        rounds, period = int(loop.group(1)), int(loop.group(3))
        for function, kernel in _LOOP_CALL.findall(loop.group(4)):
            for r in range(rounds):
                function_of[names[position[kernel] + period * r]] = function
    grouped: dict[str, list[str]] = {}
    for name in names:
        grouped.setdefault(function_of.get(name, name), []).append(name)
    return grouped
