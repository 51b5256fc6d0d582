"""The C backend's own float32 exp and tanh (sg_expf, sg_tanhf, templates/program/expf.h.j2) against
the exact values.

libm's expf and tanhf keep a loop scalar; sg_expf and sg_tanhf are arithmetic the compiler
vectorizes. sg_expf must stay within 1 ulp of the exact value over the whole float range,
subnormal results included, and give inf, 0 and NaN exactly where e^x does; sg_tanhf within
2 ulp, with +-0, +-1 and NaN exactly where tanh gives them.
"""

import numpy as np
import pytest

import symgrad as sg
from asm_loops import LEVELS

pytest.importorskip("symgrad.backends.c")

SPECIAL = np.array([0.0, -0.0, 1e-8, -1e-8, 1.0, -1.0, 88.72283, 88.7229, 89.0, 1000.0, np.inf,
                    -87.33, -103.28, -103.97, -104.0, -1000.0, -np.inf, np.nan], dtype=np.float32)


def _compiled(fn, dtype="float32", n=sg.Dim("n")):
    x = sg.input("x", (n,), dtype)
    return sg.function([x], fn(x), backend="c")


@pytest.fixture(scope="module")
def exp_c():
    return _compiled(sg.exp)


@pytest.fixture(scope="module")
def tanh_c():
    return _compiled(sg.tanh)


@pytest.mark.parametrize("fn, name", [(sg.exp, "sg_expf"), (sg.tanh, "sg_tanhf")])
def test_the_vectorizable_one_in_float32_only(fn, name):
    assert f"{name}(" in _compiled(fn).source and f"static inline float {name}" in _compiled(fn).source
    assert name not in _compiled(fn, "float64", 4).source


def test_within_one_ulp_of_exact_over_the_float_range(exp_c):
    rng = np.random.default_rng(0)
    x = np.concatenate([np.linspace(-106, 90, 400_001, dtype=np.float32),
                        rng.uniform(-20, 20, 100_000).astype(np.float32), SPECIAL])
    got = exp_c(x)
    with np.errstate(over="ignore"):
        exact = np.exp(x.astype(np.float64))
        rounded = exact.astype(np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(x))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(rounded))
    np.testing.assert_array_equal(got == 0, rounded == 0)
    finite = np.isfinite(rounded) & (rounded > 0)
    ulp = np.abs(got[finite] - exact[finite]) / np.spacing(rounded[finite]).astype(np.float64)
    assert ulp.max() <= 1.0, f"{ulp.max():.3f} ulp at x = {x[finite][ulp.argmax()]!r}"


TANH_SPECIAL = np.array([0.0, -0.0, 1e-45, -1e-45, 1e-30, -1e-30, 1e-8, 0.5499999, 0.55, 0.5500001, -0.55,
                         9.0, 20.0, -20.0, np.inf, -np.inf, np.nan], dtype=np.float32)


def test_tanh_within_two_ulp_of_exact_with_its_special_values(tanh_c):
    rng = np.random.default_rng(1)
    x = np.concatenate([np.linspace(-12, 12, 1_200_001, dtype=np.float32),
                        (rng.standard_normal(100_000) * 0.3).astype(np.float32), TANH_SPECIAL])
    got = tanh_c(x)
    exact = np.tanh(x.astype(np.float64))
    rounded = exact.astype(np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(x))
    same = ~np.isnan(x) & ((rounded == 0) | (np.abs(rounded) == 1))   # exactly 0 or +-1
    np.testing.assert_array_equal(got[same], rounded[same])
    np.testing.assert_array_equal(np.signbit(got), np.signbit(rounded))  # -0 stays -0
    inside = np.isfinite(x) & ~same
    ulp = np.abs(got[inside] - exact[inside]) / np.spacing(np.abs(rounded[inside])).astype(np.float64)
    assert ulp.max() <= 2.0, f"{ulp.max():.3f} ulp at x = {x[inside][ulp.argmax()]!r}"


@pytest.mark.parametrize("march", LEVELS)
def test_loops_over_exp_and_tanh_compile_to_vector_code(exp_c, tanh_c, march):
    """Without timing: each kernel's innermost loop multiplies whole vectors (mulps, vfmadd...ps) on
    every x86-64 level, in gcc's assembly of the program with the default flags."""
    from asm_loops import assembly, kernel_loops
    for fn in (exp_c, tanh_c):
        kernel = fn.program.plan.kernels[0].name
        loops = kernel_loops(assembly(fn.source, march), kernel)
        assert loops, f"{march}: no loop of {kernel} multiplies vectors (it runs one element at a time)"
