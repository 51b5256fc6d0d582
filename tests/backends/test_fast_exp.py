"""The C backend's own float32 exp, tanh, erf, erfc, log and log1p (sg_expf, sg_tanhf,
templates/program/expf.h.j2; sg_erff, sg_erfcf, erff.h.j2; sg_logf, sg_log1pf, logf.h.j2) against the
exact values.

libm's expf, tanhf, erff and erfcf keep a loop scalar; the program's own are arithmetic the compiler
vectorizes. sg_expf must stay within 1 ulp of the exact value over the whole float range,
subnormal results included, and give inf, 0 and NaN exactly where e^x does; sg_tanhf and sg_erff
within 2 ulp, with +-0, +-1 and NaN exactly where tanh and erf give them; sg_erfcf (read by the
exact GELU's gradient) within 8 ulp, with 0, 1, 2 and NaN exactly where erfc gives them; sg_logf
within 2 ulp and sg_log1pf within 3 (softplus reads it), with +-0, +-inf and NaN exactly where log
and log1p give them.
"""

import numpy as np
import pytest
import sympy
from scipy.special import erf as exact_erf, erfc as exact_erfc

import symgrad as sg
from asm_loops import LEVELS, assembly, kernel_loops
from symgrad.ir.elementwise import ARGS, apply_expression

pytest.importorskip("symgrad.backends.c")

SPECIAL = np.array([0.0, -0.0, 1e-8, -1e-8, 1.0, -1.0, 88.72283, 88.7229, 89.0, 1000.0, np.inf,
                    -87.33, -103.28, -103.97, -104.0, -1000.0, -np.inf, np.nan], dtype=np.float32)


def _compiled(fn, dtype="float32", n=sg.Dim("n")):
    x = sg.input("x", (n,), dtype)
    return sg.function([x], fn(x), backend="c")


def _erfc(x):
    """erfc as an elementwise op (the exact GELU's gradient is where graphs meet it)."""
    return apply_expression(sympy.erfc(ARGS[0]), {ARGS[0]: x}, name="erfc")


# Each function's float32 program (one sg.function over a vector), compiled once for the module.
FUNCTIONS = {"exp": sg.exp, "tanh": sg.tanh, "erf": sg.erf, "erfc": _erfc, "log": sg.log, "log1p": sg.log1p}


@pytest.fixture(scope="module")
def compiled():
    return {name: _compiled(fn) for name, fn in FUNCTIONS.items()}


@pytest.mark.parametrize("fn, name", [(sg.exp, "sg_expf"), (sg.tanh, "sg_tanhf"), (sg.erf, "sg_erff"),
                                      (_erfc, "sg_erfcf"), (sg.log, "sg_logf"), (sg.log1p, "sg_log1pf")])
def test_the_vectorizable_one_in_float32_only(fn, name):
    assert f"{name}(" in _compiled(fn).source and f"static inline float {name}" in _compiled(fn).source
    assert name not in _compiled(fn, "float64", 4).source


def test_within_one_ulp_of_exact_over_the_float_range(compiled):
    rng = np.random.default_rng(0)
    x = np.concatenate([np.linspace(-106, 90, 400_001, dtype=np.float32),
                        rng.uniform(-20, 20, 100_000).astype(np.float32), SPECIAL])
    got = compiled["exp"](x)
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


def test_tanh_within_two_ulp_of_exact_with_its_special_values(compiled):
    rng = np.random.default_rng(1)
    x = np.concatenate([np.linspace(-12, 12, 1_200_001, dtype=np.float32),
                        (rng.standard_normal(100_000) * 0.3).astype(np.float32), TANH_SPECIAL])
    got = compiled["tanh"](x)
    exact = np.tanh(x.astype(np.float64))
    rounded = exact.astype(np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(x))
    same = ~np.isnan(x) & ((rounded == 0) | (np.abs(rounded) == 1))   # exactly 0 or +-1
    np.testing.assert_array_equal(got[same], rounded[same])
    np.testing.assert_array_equal(np.signbit(got), np.signbit(rounded))  # -0 stays -0
    inside = np.isfinite(x) & ~same
    ulp = np.abs(got[inside] - exact[inside]) / np.spacing(np.abs(rounded[inside])).astype(np.float64)
    assert ulp.max() <= 2.0, f"{ulp.max():.3f} ulp at x = {x[inside][ulp.argmax()]!r}"


ERF_SPECIAL = np.array([0.0, -0.0, 1e-45, -1e-45, 1e-40, 1e-30, -1e-30, 1e-8, 0.99999994, 1.0, 1.0000001, -1.0,
                        3.83, 3.9, 3.9999998, 4.0, 4.0000005, -4.0000005, 9.9, 10.0, 10.05, 10.06, 10.1, 10.2,
                        1e30, np.inf, -np.inf, np.nan], dtype=np.float32)


def _ulp_against(got, x, exact_fn, exact_values):
    """The largest distance of `got` from exact_fn(x), in ulps of the rounded value (subnormal
    spacing where it rounds to 0), after checking NaN (where exact_fn gives it), the sign bit and
    `exact_values` exactly."""
    exact = exact_fn(x.astype(np.float64))
    rounded = exact.astype(np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(rounded))
    known = ~np.isnan(rounded)   # (a NaN's sign bit says nothing)
    np.testing.assert_array_equal(np.signbit(got[known]), np.signbit(rounded[known]))  # -0 stays -0
    same = known & np.isin(rounded, exact_values)
    np.testing.assert_array_equal(got[same], rounded[same])
    inside = known & ~same
    ulp = np.abs(got[inside] - exact[inside]) / np.spacing(np.abs(rounded[inside])).astype(np.float64)
    return ulp.max(), x[inside][ulp.argmax()]


def _erf_arguments(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.concatenate([np.linspace(-12, 12, 1_200_001, dtype=np.float32),
                           (rng.standard_normal(100_000) * 1e-3).astype(np.float32),
                           (rng.standard_normal(100_000) * 3).astype(np.float32), ERF_SPECIAL])


def test_erf_within_two_ulp_of_exact_with_its_special_values(compiled):
    """+-0 keep their sign, erf rounds to exactly +-1 from |x| = 3.83 on (the clamp at 4 included),
    +-inf give +-1 and NaN NaN; everywhere else within 2 ulp."""
    x = _erf_arguments(2)
    worst, where = _ulp_against(compiled["erf"](x), x, exact_erf, [0.0, 1.0, -1.0])
    assert worst <= 2.0, f"{worst:.3f} ulp at x = {where!r}"


def test_erfc_within_eight_ulp_of_exact_with_its_special_values(compiled):
    """erfc's relative accuracy holds into its subnormal tail (the clamp at 10.1 gives 0); 2 at
    -inf and below -3.9, 1 at +-0, NaN at NaN."""
    x = _erf_arguments(3)
    worst, where = _ulp_against(compiled["erfc"](x), x, exact_erfc, [1.0, 2.0])
    assert worst <= 8.0, f"{worst:.3f} ulp at x = {where!r}"


LOG_SPECIAL = np.array([0.0, -0.0, 1e-45, 3e-45, 1e-40, 1.1754942e-38, 1.1754944e-38, 0.99999994, 1.0, 1.0000001,
                        3.4028235e38, np.inf, -np.inf, -1e-30, -1.0, np.nan], dtype=np.float32)


def test_log_within_two_ulp_of_exact_over_the_positive_floats(compiled):
    """Every binade of the floats, subnormals included (scaled before their bits are read), and
    dense around 1; -inf at +-0, inf at inf, NaN below 0 and at NaN, 0 exactly at 1."""
    rng = np.random.default_rng(4)
    x = np.concatenate([np.exp(rng.uniform(-103, 88.7, 1_000_000)).astype(np.float32),
                        np.linspace(0.5, 2.0, 600_001, dtype=np.float32), LOG_SPECIAL])
    with np.errstate(divide="ignore", invalid="ignore"):
        worst, where = _ulp_against(compiled["log"](x), x, np.log, [0.0, np.inf, -np.inf])
    assert worst <= 2.0, f"{worst:.3f} ulp at x = {where!r}"


def test_log1p_within_three_ulp_of_exact_and_exact_for_tiny_x(compiled):
    """Tiny x (where 1 + x rounds to 1) gives x itself, -0 keeps its sign; -inf at -1, inf at inf,
    NaN below -1 and at NaN."""
    rng = np.random.default_rng(5)
    x = np.concatenate([(rng.standard_normal(300_000) * 1e-3).astype(np.float32),
                        np.linspace(-0.999, 10, 600_001, dtype=np.float32),
                        np.exp(rng.uniform(-100, 88, 300_000)).astype(np.float32),
                        np.array([1e-45, -1e-45, 1e-30, -1e-8, 3e38, 0.0, -0.0, -1.0, -1.5, np.inf, -np.inf, np.nan],
                                 dtype=np.float32)])
    with np.errstate(divide="ignore", invalid="ignore"):
        worst, where = _ulp_against(compiled["log1p"](x), x, np.log1p, [0.0, np.inf, -np.inf])
    assert worst <= 3.0, f"{worst:.3f} ulp at x = {where!r}"
    tiny = np.array([1e-30, -1e-30, 1e-9], dtype=np.float32)
    np.testing.assert_array_equal(compiled["log1p"](tiny), tiny)


def test_the_exact_gelu_and_its_gradient_agree_with_float64():
    """torch's default nn.GELU, x * Phi(x), and its derivative Phi(x) + x phi(x) in float32 C against
    float64 on the same arguments, into the tails where Phi is 1e-38 and 1 - 1e-8. The forward is
    torch's formula, x / 2 * (1 + erf(x / sqrt 2)), exact to an ulp of 1 in Phi (torch's too is 0
    below x = -5.9); the derivative reads Phi(-|x|) as erfc(|x| / sqrt 2) / 2, relatively exact."""
    x = sg.input("x", (sg.Dim("n"),))
    y = sg.nn.functional.gelu(x)
    step = sg.function([x], [y, sg.grad(y.sum(), [x])[0]], backend="c")
    xs = np.concatenate([np.linspace(-13, 13, 260_001), [0.0, -0.0, -1e-30, 1e-30]]).astype(np.float32)
    got_y, got_dy = step(x=xs)
    v = xs.astype(np.float64)
    phi = 0.5 * exact_erfc(-v / np.sqrt(2))
    np.testing.assert_allclose(got_y, v * phi, rtol=4e-6, atol=np.abs(v).max() * 2 ** -23)
    # The derivative's two terms cancel near x = -0.75 (each ~0.2, their sum 0): an error of a few ulps
    # of the terms, not of the sum; in the tails the terms are as small as the sum, and x * x rounded
    # in float32 moves e^(-x^2/2) by up to 4e-6 at |x| = 11.6 (as in torch's float32 formula).
    slope = v * np.exp(-v * v / 2) / np.sqrt(2 * np.pi)
    error = np.abs(got_dy - (phi + slope)) / (np.abs(phi) + np.abs(slope) + 1e-300)
    assert error.max() <= 2 ** -17, f"{error.max():.3g} at x = {xs[error.argmax()]!r}"


@pytest.mark.parametrize("march", LEVELS)
def test_loops_over_the_functions_compile_to_vector_code(compiled, march):
    """Without timing: each kernel's innermost loop multiplies whole vectors (mulps, vfmadd...ps) on
    every x86-64 level, in gcc's assembly of the program with the default flags; softplus's too
    (log1p of exp in one arm of a select: libm's log1pf had kept it scalar, 17x torch's time)."""
    for fn in (*compiled.values(), _compiled(sg.softplus)):
        kernel = fn.program.plan.kernels[0].name
        loops = kernel_loops(assembly(fn.source, march), kernel)
        assert loops, f"{march}: no loop of {kernel} multiplies vectors (it runs one element at a time)"


def test_math_loops_take_64_byte_vectors_where_they_run_at_full_rate(compiled):
    """SG_MATH_LOOP: on a CPU whose compiler prefers 32-byte vectors (Sapphire Rapids' tuning), a loop
    over erf is in 64-byte vectors (%zmm) when SG_VECTOR_BYTES is 64 and in 32-byte ones otherwise;
    an elementwise loop without such calls keeps 32-byte ones (it is bound by memory)."""
    plain = _compiled(lambda x: x * 3.0 + 1.0)

    def widths(fn, march):
        loops = kernel_loops(assembly(fn.source, march), fn.program.plan.kernels[0].name)
        assert loops
        return {width for loop in loops for width in ("zmm", "ymm") if any(f"%{width}" in line for line in loop.lines)}

    erf_c = compiled["erf"]
    assert "SG_MATH_LOOP void" in erf_c.source and "SG_MATH_LOOP void" not in plain.source
    assert widths(erf_c, "sapphirerapids/64") == {"zmm"}
    assert widths(erf_c, "sapphirerapids") == {"ymm"}
    assert widths(plain, "sapphirerapids/64") == {"ymm"}
