"""The package's layout (DESIGN.md, issue 33): folders that show the data flow, modules a reader can
hold in mind, and a wheel that carries every one of them.

- Every module opens with a docstring whose first line says what it holds.
- No module over MAX_MODULE_LINES lines, no function over MAX_FUNCTION_LINES (a nested function
  counts towards its own length, and towards its parent's).
- The top level of symgrad/ holds only the public API's root, autodiff, the leaves (settings,
  version, the narrow limit) and the folders; pyproject.toml lists every package, so a wheel built from it (not
  only an editable install) imports.
"""

from __future__ import annotations

import ast

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "symgrad"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
TOP_LEVEL_MODULES = {"__init__.py", "autodiff.py", "settings.py", "version.py", "narrow_limit.py"}


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def test_every_module_opens_with_a_docstring_saying_what_it_holds():
    missing = []
    for path in _modules():
        doc = ast.get_docstring(ast.parse(path.read_text()))
        if not doc or not doc.splitlines()[0].strip():
            missing.append(str(path.relative_to(ROOT)))
    assert missing == []


def test_no_module_over_the_limit():
    long = {str(p.relative_to(ROOT)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def function_lengths(source: str) -> dict[str, int]:
    """qualified name -> lines, of every function and method in `source`."""
    out = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    out[name] = child.end_lineno - child.lineno + 1
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return out


def test_no_function_over_the_limit():
    long = {f"{p.relative_to(ROOT)}:{name}": n for p in _modules()
            for name, n in function_lengths(p.read_text()).items() if n > MAX_FUNCTION_LINES}
    assert long == {}


def test_the_length_check_sees_methods_and_nested_functions():
    source = "class A:\n    def m(self):\n        def inner():\n            pass\n        return 1\n"
    assert function_lengths(source) == {"A.m": 4, "A.m.inner": 2}


def test_the_top_level_holds_the_root_the_leaves_and_the_folders():
    files = {p.name for p in PACKAGE.glob("*.py")}
    assert files == TOP_LEVEL_MODULES


def test_pyproject_lists_every_package():
    """setuptools is given the packages by hand (templates/ is mapped into the wheel from outside
    symgrad/), so a new folder must be added there or a wheel install lacks it."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"]) - {"symgrad.templates"}
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in PACKAGE.rglob("__init__.py")}
    assert listed == found
