"""What a user gets without choosing (issue 35): `sg.function` and `sg.train_step` compile to C where
a C compiler is found, fall back to numpy with one warning per process where none is, and the
examples default to C with every flag's default in their --help."""

from __future__ import annotations

import argparse
import ast
import warnings
from pathlib import Path

import numpy as np
import pytest

import symgrad as sg
from symgrad import backends
from symgrad.backends.build.cache import compiler_identity
from symgrad.backends.build.toolchain import CompilerNotFound

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.py"))


def _have_cc() -> bool:
    try:
        compiler_identity()
        return True
    except CompilerNotFound:
        return False


needs_cc = pytest.mark.skipif(not _have_cc(), reason="no working C compiler")


def _tiny():
    x, y = sg.input("x", (sg.Dim("B"), 3)), sg.input("y", (sg.Dim("B"),), dtype="int64")
    W = sg.param("W", (3, 4), init=np.arange(12, dtype=np.float32).reshape(3, 4) / 10)
    logits = x @ W
    return x, y, W, logits


@pytest.fixture(scope="module")
def default_step():
    """One step built with no backend named, its predict program compiled too: shared by the tests."""
    x, y, W, logits = _tiny()
    step = sg.train_step(sg.cross_entropy(logits, y), [W], sg.optim.SGD(lr=0.1), predict=logits)
    step.program_for("predict")
    return step


@needs_cc
def test_the_default_backend_is_c_where_a_compiler_is_found(default_step):
    assert default_step.backend == "c"
    assert default_step.module is not None and "void" in default_step.source
    assert default_step.program_for("predict").backend == "c"  # the step's other programs follow it


@needs_cc
def test_a_function_defaults_to_c_and_agrees_with_numpy():
    x, _, _, logits = _tiny()
    f = sg.function([x], logits)
    assert f.backend == "c"
    xb = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_allclose(f(xb), sg.function([x], logits, backend="numpy")(xb), rtol=1e-6)


@pytest.fixture
def no_compiler(monkeypatch):
    """$CC names a program that does not exist; the once-per-process warning not yet given."""
    monkeypatch.setenv("CC", "/nonexistent/symgrad-test-cc")
    monkeypatch.setattr(backends, "_WARNED", False)


def test_without_a_compiler_the_default_falls_back_to_numpy_with_one_warning(no_compiler):
    x, y, W, logits = _tiny()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f = sg.function([x], logits)
        step = sg.train_step(sg.cross_entropy(logits, y), [W], sg.optim.SGD(lr=0.1))
    assert (f.backend, step.backend) == ("numpy", "numpy")
    fallbacks = [w for w in caught if issubclass(w.category, backends.BackendFallbackWarning)]
    assert len(fallbacks) == 1, [str(w.message) for w in caught]  # once per process, not per call
    message = str(fallbacks[0].message)
    assert "\n" not in message
    assert "/nonexistent/symgrad-test-cc" in message and "numpy" in message and "$CC" in message
    assert fallbacks[0].filename == __file__  # points at the user's call
    xb = np.ones((2, 3), np.float32)
    assert f(xb).shape == (2, 4) and np.isfinite(step(x=xb, y=np.zeros(2, np.int64)))


def test_a_compiler_that_cannot_build_a_library_is_no_compiler(monkeypatch, tmp_path):
    """A compiler that answers --version but cannot build (no OpenMP, no linker) falls back too."""
    fake = tmp_path / "fake-cc"
    fake.write_text('#!/bin/sh\nif [ "$1" = "--version" ]; then echo "fake-cc 1.0"; exit 0; fi\n'
                    'echo "fake-cc: cannot find -lgomp" >&2; exit 1\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setattr(backends, "_WARNED", False)
    with pytest.warns(backends.BackendFallbackWarning, match=r"cannot build a shared library .*cannot find -lgomp"):
        assert backends.resolve(None, stacklevel=2) == "numpy"


def test_a_named_backend_is_not_replaced(no_compiler):
    x, _, _, logits = _tiny()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning for a backend the user chose
        assert sg.function([x], logits, backend="numpy").backend == "numpy"
        fresh = sg.input("fresh", (5, 7))  # a graph no earlier test compiled (nothing cached to load)
        with pytest.raises(CompilerNotFound, match="symgrad-test-cc"):
            sg.function([fresh], fresh * 3.25, backend="c")


def test_resolve_keeps_a_given_name_and_asks_no_compiler(monkeypatch):
    monkeypatch.setattr("symgrad.backends.build.cache_keys.compiler_identity", lambda: pytest.fail("asked"))
    assert backends.resolve("numpy") == "numpy" and backends.resolve("cuda") == "cuda"


# ---- the examples: C by default, every flag's default in --help ----

def _parsers(path: Path) -> list[ast.Call]:
    tree = ast.parse(path.read_text())
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == "ArgumentParser"]


def _arguments(path: Path) -> list[ast.Call]:
    tree = ast.parse(path.read_text())
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == "add_argument"]


@pytest.mark.parametrize("path", [p for p in EXAMPLES if _parsers(p)], ids=lambda p: p.name)
def test_example_flags_have_help_with_their_defaults_and_c_is_the_default_backend(path):
    for parser in _parsers(path):
        keywords = {k.arg: ast.unparse(k.value) for k in parser.keywords}
        assert keywords.get("formatter_class") == "argparse.ArgumentDefaultsHelpFormatter", path.name
    for argument in _arguments(path):
        flag = ast.literal_eval(argument.args[0])
        keywords = {k.arg: k.value for k in argument.keywords}
        assert "help" in keywords, f"{path.name}: {flag} has no help text"
        if flag == "--backend":
            assert ast.literal_eval(keywords["default"]) == "c", path.name


def test_the_help_formatter_prints_each_default():
    """What the formatter the examples use does: --help names each flag's default."""
    parser = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--backend", default="c", choices=["numpy", "c"], help="the backend")
    assert "(default: c)" in parser.format_help()
