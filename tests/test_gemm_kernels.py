"""The C backend's matmul kernels against NumPy: every kernel variant, odd sizes, both dtypes.

Narrow outputs (N <= 16 columns, known at compile time) take a dot-product kernel when A's rows
are contiguous and a transposed-formulation kernel when A is a transposed operand; anything
else takes the register-tiled GEMM. One module per dtype holds every case.
"""

import numpy as np
import pytest

import symgrad as sg

pytest.importorskip("symgrad.backends.c")

#: (M, K, N): ragged M and K (vector and row-pair tails), N on both sides of the block sizes.
SHAPES = [(1, 1, 1), (5, 3, 1), (7, 9, 5), (13, 17, 6), (64, 784, 10), (33, 19, 12), (9, 40, 13),
          (21, 8, 16), (6, 5, 17), (40, 70, 33),
          (150, 600, 40),   # the tiled GEMM over several row blocks and K chunks (600 = 3 x 200)
          (100, 300, 200)]  # few row blocks, wide: with 2+ threads, each takes a slice of the columns


#: A build for a CPU without AVX (gcc's generic x86-64 target splits the 32-byte vectors): the
#: portable fallback of the same kernels.
PORTABLE_FLAGS = ["-O2", "-fopenmp", "-std=c11", "-fno-math-errno"]


def _build(dtype, flags=None):
    cases = {}
    for M, K, N in SHAPES:
        a = sg.input(f"a_{M}_{K}_{N}", (M, K), dtype=dtype)       # rows contiguous: the dot kernel
        at = sg.input(f"at_{M}_{K}_{N}", (K, M), dtype=dtype)     # A = at.T: the transposed kernel
        b = sg.input(f"b_{M}_{K}_{N}", (K, N), dtype=dtype)
        bt = sg.input(f"bt_{M}_{K}_{N}", (N, K), dtype=dtype)     # a transposed B (strided columns)
        cases[(M, K, N)] = (a, at, b, bt)
    inputs = [v for group in cases.values() for v in group]
    outs = []
    for a, at, b, bt in cases.values():
        outs += [sg.matmul(a, b), sg.matmul(sg.transpose(at), b), sg.matmul(a, sg.transpose(bt)),
                 sg.matmul(sg.transpose(at), sg.transpose(bt))]
    options = {} if flags is None else {"flags": flags}
    return sg.function(inputs, outs, backend="c", **options), inputs


@pytest.fixture(scope="module", params=["float32", "float64", "float32-portable"])
def compiled(request):
    dtype = request.param.split("-")[0]
    fn, inputs = _build(dtype, PORTABLE_FLAGS if request.param.endswith("portable") else None)
    return dtype, fn, inputs


def test_every_matmul_layout_matches_numpy(compiled):
    dtype, fn, inputs = compiled
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal(v.shape).astype(dtype) for v in inputs]
    got = fn(*arrays)
    tol = dict(rtol=2e-4, atol=2e-4) if dtype == "float32" else dict(rtol=1e-11, atol=1e-11)
    for k, (M, K, N) in enumerate(SHAPES):
        a, at, b, bt = (x.astype(np.float64) for x in arrays[4 * k:4 * k + 4])
        refs = [a @ b, at.T @ b, a @ bt.T, at.T @ bt.T]
        for j, ref in enumerate(refs):
            np.testing.assert_allclose(got[4 * k + j], ref, **tol, err_msg=f"{(M, K, N)} layout {j}")


def test_narrow_outputs_use_the_narrow_kernels(compiled):
    _, fn, _ = compiled
    src = fn.source
    assert "sg_gemm_dot5_" in src      # N = 10, A rows contiguous: two blocks of 5 columns
    assert "sg_gemm_tn10_" in src      # N = 10, A transposed: one block of 10 columns
    assert "sg_gemm_dot6_" in src and "sg_gemm_tn8_" in src   # N = 16: 3 x 6 (rounded up) and 2 x 8
    # N = 17 and 33 are not narrow: the register-tiled kernel serves them.
    assert "sg_gemm_f32(6, 17" in src or "sg_gemm_f64(6, 17" in src
