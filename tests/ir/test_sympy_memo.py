"""The sympy memo reads back what it stored, symgrad's own sympy Functions included."""

import sympy

import symgrad  # noqa: F401 - defines symgrad's sympy Functions (trunc, floor_divide, ...)
from symgrad.ir import sympy_memo
from symgrad.ir.elementwise import is_nan
from symgrad.ir.integer import bitwise_and, floor_divide
from symgrad.ir.rounding import trunc


def test_symgrad_functions_round_trip(tmp_path, monkeypatch):
    """An entry naming trunc (sympy has a polynomial `trunc` of its own), floor_divide or is_nan rebuilds
    to symgrad's Function, not to nothing (derived again in every process) or to sympy's."""
    monkeypatch.setenv("SYMGRAD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(sympy_memo, "_FILES", {})
    x, y = sympy.symbols("x y")
    expr = trunc(x) * floor_divide(x, y) + bitwise_and(x, y) + sympy.Piecewise((1, is_nan(y)), (0, True))
    sympy_memo.store("test", __file__, "key", expr)
    sympy_memo.flush()
    monkeypatch.setattr(sympy_memo, "_FILES", {})   # a fresh process: read from the file
    got = sympy_memo.lookup("test", __file__, "key")
    assert got is not None and sympy.srepr(got) == sympy.srepr(expr)
    assert {type(f) for f in got.atoms(sympy.Function)} == {trunc, floor_divide, bitwise_and, sympy.Piecewise}
    assert got.atoms(is_nan) == {is_nan(y)}


def test_a_result_is_written_once_flushed(tmp_path, monkeypatch):
    """store keeps a result in the process (lookup gives it back at once) and writes nothing;
    flush writes every kind stored since the last one: a compile's results in one write per kind,
    not the whole file again per result."""
    monkeypatch.setenv("SYMGRAD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(sympy_memo, "_FILES", {})
    x = sympy.Symbol("x")
    sympy_memo.store("first", __file__, "a", x + 1)
    sympy_memo.store("second", __file__, "b", sympy.tanh(x))
    assert sympy_memo.lookup("first", __file__, "a") == x + 1
    assert not (tmp_path / "sympy").exists()
    sympy_memo.flush()
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "sympy").glob("*.json")) == ["first", "second"]
    printed = []
    real_srepr = sympy.srepr
    monkeypatch.setattr(sympy, "srepr", lambda e: printed.append(e) or real_srepr(e))
    sympy_memo.store("first", __file__, "c", x + 2)
    sympy_memo.flush()
    assert printed == [x + 2]        # each result printed once, not every flush again
    monkeypatch.setattr(sympy_memo, "_FILES", {})   # a fresh process
    assert sympy_memo.lookup("second", __file__, "b") == sympy.tanh(x)
    for key, expr in (("a", x + 1), ("c", x + 2)):   # (read back as printed: compared as printed)
        assert sympy.srepr(sympy_memo.lookup("first", __file__, key)) == sympy.srepr(expr)


def test_an_undefined_function_in_the_process_leaves_the_memo_readable(tmp_path, monkeypatch):
    """sympy.Function("f") makes a class whose module is None; collecting symgrad's Functions raised
    AttributeError on it inside lookup, which took it for a corrupt entry: every lookup of the
    process missed (the CI clone met it once some test had made one)."""
    monkeypatch.setenv("SYMGRAD_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(sympy_memo, "_FILES", {})
    monkeypatch.setattr(sympy_memo, "_names_found", None)
    undefined = sympy.Function("an_undefined_function")
    x = sympy.Symbol("x")
    sympy_memo.store("undefined", __file__, "k", trunc(x) + undefined(x))
    sympy_memo.flush()
    monkeypatch.setattr(sympy_memo, "_FILES", {})
    got = sympy_memo.lookup("undefined", __file__, "k")
    assert got is not None and got.atoms(trunc) == {trunc(x)}
