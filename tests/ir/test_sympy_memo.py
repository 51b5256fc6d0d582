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
    monkeypatch.setattr(sympy_memo, "_FILES", {})   # a fresh process: read from the file
    got = sympy_memo.lookup("test", __file__, "key")
    assert got is not None and sympy.srepr(got) == sympy.srepr(expr)
    assert {type(f) for f in got.atoms(sympy.Function)} == {trunc, floor_divide, bitwise_and, sympy.Piecewise}
    assert got.atoms(is_nan) == {is_nan(y)}
