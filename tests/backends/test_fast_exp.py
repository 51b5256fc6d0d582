"""The C backend's own float32 exp (sg_expf, templates/c/expf.h.j2) against exact e^x.

libm's expf keeps a loop scalar; sg_expf is arithmetic the compiler vectorizes. It must stay
within 1 ulp of the exact value over the whole float range, subnormal results included, and
give inf, 0 and NaN exactly where e^x does.
"""

import numpy as np
import pytest

import symgrad as sg

pytest.importorskip("symgrad.backends.c")

SPECIAL = np.array([0.0, -0.0, 1e-8, -1e-8, 1.0, -1.0, 88.72283, 88.7229, 89.0, 1000.0, np.inf,
                    -87.33, -103.28, -103.97, -104.0, -1000.0, -np.inf, np.nan], dtype=np.float32)


@pytest.fixture(scope="module")
def exp_c():
    x = sg.input("x", (sg.Dim("n"),))
    return sg.function([x], sg.exp(x), backend="c")


def test_exp_is_the_vectorizable_one_in_float32_only(exp_c):
    assert "sg_expf(" in exp_c.source and "static inline float sg_expf" in exp_c.source
    x = sg.input("x", (4,), "float64")
    assert "sg_expf" not in sg.function([x], sg.exp(x), backend="c").source


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
