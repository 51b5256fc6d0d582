"""The documentation, checked: every public name has a docstring and an entry in docs/api.md, and
every link in README.md and docs/*.md leads to a file (and heading) inside the repository.

Public names are those in `symgrad.__all__`, and in the `__all__` of every module listed there
that has one (`symgrad.nn`, `symgrad.optim`, `symgrad.nn.functional`, `symgrad.tools.distributed`, and
whatever joins them, such as `symgrad.nn.init` or `symgrad.optim.lr_scheduler`).

docs/api.md has one section per module, headed by the module's name in backticks
(## `symgrad.nn`), and one list item per name, starting with the name in backticks:

    - `Linear` — y = x @ weight.T + bias, weight [out_features, in_features] as in torch.nn.Linear.

To print the entries docs/api.md lacks (the description is the docstring's first sentence), run

    python tests/test_docs.py

and paste each into its module's section (a new module gets a new section).
"""

from __future__ import annotations

import inspect
import re
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api.md"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


# --- public names --------------------------------------------------------------------------------

def public_modules() -> list[tuple[str, types.ModuleType]]:
    """(qualified name, module) for symgrad and every module reachable through `__all__` lists
    that has an `__all__` of its own, in the order they are found."""
    import symgrad

    found, queue = [], [("symgrad", symgrad)]
    while queue:
        name, module = queue.pop(0)
        if any(m is module for _, m in found):
            continue
        found.append((name, module))
        for attr in getattr(module, "__all__", ()):
            value = getattr(module, attr, None)
            if isinstance(value, types.ModuleType) and hasattr(value, "__all__"):
                queue.append((f"{name}.{attr}", value))
    return found


def public_names() -> list[tuple[str, str, object]]:
    """(module name, public name, object) for every name in a public module's `__all__`."""
    return [(module_name, attr, getattr(module, attr))
            for module_name, module in public_modules() for attr in module.__all__]


def own_docstring(obj) -> str | None:
    """The object's own docstring: a class's is not inherited (inspect.getdoc would find a base's)."""
    if isinstance(obj, type):
        doc = vars(obj).get("__doc__")
    else:
        doc = getattr(obj, "__doc__", None)
    return doc if isinstance(doc, str) and doc.strip() else None


def needs_docstring(obj) -> bool:
    """Modules, classes and callables carry a docstring; a plain value (`__version__`) cannot."""
    return isinstance(obj, (types.ModuleType, type)) or callable(obj)


def summary(obj) -> str:
    """The docstring's first sentence, on one line (its first paragraph when no sentence ends)."""
    doc = inspect.cleandoc(own_docstring(obj) or "")
    paragraph = " ".join(doc.split("\n\n")[0].split())
    match = re.match(r"(.+?[.!?])(\s|$)", paragraph)
    return match.group(1) if match else paragraph


# --- docs/api.md ---------------------------------------------------------------------------------

SECTION = re.compile(r"^## `(symgrad(?:\.\w+)*)`\s*$")
ENTRY = re.compile(r"^- `([A-Za-z_]\w*)`")


def api_entries(text: str) -> dict[str, list[str]]:
    """module name -> the names its section lists, in order."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("## "):
            match = SECTION.match(line)
            current = match.group(1) if match else None
            if current is not None:
                sections.setdefault(current, [])
        elif current is not None and (entry := ENTRY.match(line)):
            sections[current].append(entry.group(1))
    return sections


def missing_entries() -> list[tuple[str, str, object]]:
    sections = api_entries(API.read_text(encoding="utf-8"))
    return [(m, n, obj) for m, n, obj in public_names() if n not in sections.get(m, ())]


def entry_line(name: str, obj) -> str:
    text = summary(obj) if needs_docstring(obj) else f"{obj!r}."
    return f"- `{name}` — {text}"


def test_every_public_name_has_a_docstring():
    undocumented = [f"{m}.{n}" for m, n, obj in public_names() if needs_docstring(obj) and not own_docstring(obj)]
    assert not undocumented, f"public names without a docstring: {', '.join(undocumented)}"


def test_every_public_name_has_an_entry_in_docs_api():
    missing = missing_entries()
    assert not missing, (
        "public names without an entry in docs/api.md (`python tests/test_docs.py` prints them):\n"
        + "\n".join(f"  ## `{m}`: {entry_line(n, obj)}" for m, n, obj in missing))


def test_docs_api_lists_no_name_that_is_not_public():
    """A renamed or removed name leaves no stale entry behind, and each module's section lists a
    name once."""
    modules = dict(public_modules())
    sections = api_entries(API.read_text(encoding="utf-8"))
    assert set(sections) <= set(modules), f"sections for modules that are not public: {set(sections) - set(modules)}"
    for module_name, names in sections.items():
        public = set(modules[module_name].__all__)
        assert not set(names) - public, f"{module_name}: entries for names not in __all__: {sorted(set(names) - public)}"
        repeated = sorted({n for n in names if names.count(n) > 1})
        assert not repeated, f"{module_name}: listed more than once: {repeated}"


def test_summary_takes_the_first_sentence():
    def f():
        """One sentence, continued
        on a second line. A second sentence.

        Details."""
    assert summary(f) == "One sentence, continued on a second line."


# --- links ---------------------------------------------------------------------------------------

FENCE = re.compile(r"^(```|~~~)")
INLINE_CODE = re.compile(r"`+[^`]*`+")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")


def prose_lines(text: str, blank_code: bool = True):
    """(line number, line) outside fenced code blocks, inline code spans blanked unless not
    `blank_code`."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            yield number, INLINE_CODE.sub("``", line) if blank_code else line


def links(path: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        found += [(number, m.group(1)) for m in LINK.finditer(line)]
        if (m := REFERENCE.match(line)):
            found.append((number, m.group(1)))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped, spaces as
    hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    for _, line in prose_lines(path.read_text(encoding="utf-8"), blank_code=False):
        if (m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)):
            base = slug(m.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
    result = set()
    for base, count in seen.items():
        result.add(base)
        result.update(f"{base}-{k}" for k in range(1, count))
    return result


def link_problem(source: Path, target: str) -> str | None:
    """Why `target`, a link in `source`, is wrong; None when it leads to a file (and heading) of
    the repository."""
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", target) or target.startswith("//"):
        return "points outside the repository (the docs link only to the repository's files)"
    if target.startswith("/"):
        return "is an absolute path (write it relative to the file)"
    path_part, _, fragment = target.partition("#")
    resolved = (source.parent / path_part).resolve() if path_part else source
    if resolved != ROOT and ROOT not in resolved.parents:
        return "points outside the repository"
    if not resolved.exists():
        return "points to a file that does not exist"
    if fragment and resolved.suffix == ".md" and resolved.is_file() and fragment not in anchors(resolved):
        return f"names a heading #{fragment} that {resolved.relative_to(ROOT)} does not have"
    return None


def test_docs_exist():
    for name in ("guide.md", "api.md", "performance.md", "architecture.md"):
        assert (ROOT / "docs" / name).is_file(), f"docs/{name} is missing"


def test_every_link_leads_inside_the_repository():
    problems = []
    for path in DOCS:
        for number, target in links(path):
            if (why := link_problem(path, target)) is not None:
                problems.append(f"{path.relative_to(ROOT)}:{number}: {target} {why}")
    assert not problems, "\n".join(problems)


def test_the_docs_name_no_path_outside_the_repository():
    """The design notes beside the repository are not part of it: no link, no path to them."""
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for needle in ("../shared", "/work/shared", "shared/DESIGN"):
            assert needle not in text, f"{path.relative_to(ROOT)} mentions {needle}"


def test_link_checker_catches_what_it_should(tmp_path):
    page = ROOT / "docs" / "api.md"
    assert link_problem(page, "../README.md") is None
    assert link_problem(page, "guide.md#no-such-heading") is not None
    assert link_problem(page, "missing.md") is not None
    assert link_problem(page, "../../outside.md") is not None
    assert link_problem(page, "https://example.com") is not None
    assert link_problem(page, "/etc/passwd") is not None
    assert slug("`sg.nn`: modules & layers") == "sgnn-modules--layers"
    assert slug("`symgrad.optim.lr_scheduler`") == "symgradoptimlr_scheduler"


# --- the README ----------------------------------------------------------------------------------

TEST_COMMAND = "pip install -e '.[test]' && python -m pytest -q"


def test_readme_keeps_the_test_command_ci_runs():
    """.ci/run runs the README's test command verbatim: the two must not drift apart."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert TEST_COMMAND in readme.splitlines()
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert "pip install -e '.[demo]' && symgrad demo" in readme.splitlines()


def test_readme_python_runs(capsys):
    """The README's Python blocks, run in order as one program (on the reference backend, a few
    steps), do what they say: a step trains, predicts, and prints its graph."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```python\n(.*?)^```", readme, re.S | re.M)
    assert blocks, "README.md has no Python block"
    code = "\n".join(blocks).replace('backend="c"', 'backend="numpy"').replace("range(100)", "range(3)")
    namespace: dict = {}
    exec(compile(code, str(ROOT / "README.md"), "exec"), namespace)
    assert capsys.readouterr().out
    assert isinstance(namespace["loss_value"], float) and namespace["loss_value"] > 0
    assert namespace["predictions"].shape == (64,)


if __name__ == "__main__":
    current = None
    for module_name, name, obj in missing_entries():
        if module_name != current:
            print(f"\n## `{module_name}`\n")
            current = module_name
        print(entry_line(name, obj))
