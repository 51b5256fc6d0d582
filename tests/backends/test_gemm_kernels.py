"""The C backend's matmul kernels against NumPy: every kernel variant, odd sizes, both dtypes.

Narrow outputs (N <= 16 columns, known at compile time) take a dot-product kernel when A's rows
are contiguous and a transposed-formulation kernel when A is a transposed operand; anything
else takes the register-tiled GEMM. One module per dtype holds every case.
"""

import numpy as np
import pytest

import symgrad as sg
from asm_loops import LEVELS

pytest.importorskip("symgrad.backends.c")

#: (M, K, N): ragged M and K (vector and row-pair tails), N on both sides of the block sizes.
SHAPES = [(1, 1, 1), (5, 3, 1), (7, 9, 5), (13, 17, 6), (64, 784, 10), (33, 19, 12), (9, 40, 13),
          (21, 8, 16), (6, 5, 17), (40, 70, 33),
          (150, 600, 40),   # the tiled GEMM over several row blocks and K chunks (600 = 3 x 200)
          (100, 300, 200),  # few row blocks, wide: with 2+ threads, each takes a slice of the columns
          # tall (K of 8+ chunks, a small C): K split over the threads, each with a partial product;
          # on one thread below the team's size, ragged rows and columns, a short last chunk
          (5, 2048, 20), (180, 3000, 40), (27, 4100, 64)]


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


def test_narrow_matmuls_after_a_team_gemm_run_on_the_team():
    """A narrow matmul too small to wake a sleeping OpenMP team runs on it once the call has run a
    GEMM on the team (its threads are then awake): an output layer's product and weight gradient,
    128 x 256 x 10, after the 128 x 784 x 256 GEMM that makes their input. They match NumPy."""
    x = sg.input("x", (128, 784))
    w = sg.input("w", (784, 256))
    v = sg.input("v", (256, 10))
    g = sg.input("g", (128, 10))
    h = sg.relu(x @ w)
    fn = sg.function([x, w, v, g], [h @ v, sg.transpose(h) @ g], backend="c")
    from symgrad.backends.build import runtime
    src, lib = fn.source, runtime.source()
    entry = src[src.rindex("int symgrad_run("):]
    # Each call starts warm only if the previous one ended moments ago (a training loop), and
    # records when it ends, in the program's context; a GEMM on the team makes it warm.
    assert entry.index("sg_team_begin_call(context);") < entry.index("k0_")
    assert entry.rindex("k1_") < entry.index("sg_team_end_call(context);")
    assert "context->team_warm = omp_get_wtime() - context->last_call_end < SG_TEAM_AWAKE_S;" in lib
    assert "context->last_call_end = omp_get_wtime();" in lib
    gemm = lib[lib.index("static int sg_gemm_any_f32("):].split("\n}\n")[0]
    assert "if (parallel) {" in gemm and "context->team_warm = 1;" in gemm
    for kind in ("dot5", "tn10"):
        body = lib[lib.index(f"int sg_gemm_{kind}_f32("):].split("\n}\n")[0]
        assert "if((double)M * N * K >= (context->team_warm ? 262144 : 4194304))" in body
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal(a.shape).astype(np.float32) for a in (x, w, v, g)]
    xa, wa, va, ga = (a.astype(np.float64) for a in arrays)
    ha = np.maximum(xa @ wa, 0)
    calls = [fn(*arrays) for _ in range(3)]  # back to back: the later ones find the team awake
    for got in calls:
        for out, ref in zip(got, [ha @ va, ha.T @ ga]):
            np.testing.assert_allclose(out, ref, rtol=2e-4, atol=2e-3)


STEAL_SCRIPT = """
import numpy as np, symgrad as sg
a, b = sg.input("a", (515, 300)), sg.input("b", (300, 200))
fn = sg.function([a, b], [sg.relu(a @ b), sg.transpose(a) @ a], backend="c")
rng = np.random.default_rng(9)
x, w = rng.standard_normal((515, 300)).astype(np.float32), rng.standard_normal((300, 200)).astype(np.float32)
for _ in range(20):
    y, g = fn(x, w)
    assert np.allclose(y, np.maximum(x.astype(np.float64) @ w, 0), rtol=2e-4, atol=2e-3)
    assert np.allclose(g, x.T.astype(np.float64) @ x, rtol=2e-4, atol=2e-3)
print("ok")
"""


@pytest.mark.parametrize("threads", [3, 5])
def test_threads_that_finish_early_take_the_others_row_blocks(threads):
    """More OpenMP threads than cores: some are descheduled mid-GEMM while the others finish
    their own row blocks and claim the rest (the work stealing that keeps a slowed core from
    holding the team at each K chunk's barrier). Uneven runs of rows; the results stay exact."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    done = subprocess.run([sys.executable, "-c", STEAL_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


# ---- register tiles stay in registers, on every x86-64 level (read from the assembly) ----------

#: gcc's x86-64 levels: SSE2 only (16 registers of 16 bytes), AVX2 + FMA (16 of 32 bytes), AVX-512 (32).
KERNELS = ("sg_micro", "sg_gemm")  # the micro-kernels, and the narrow kernels (inlined into sg_gemm_*)


def _assembly(source: str, march: str) -> str:
    from asm_loops import assembly
    return assembly(source, march)


def _kernel_loops(asm: str) -> list:
    from asm_loops import kernel_loops
    return [loop for prefix in KERNELS for loop in kernel_loops(asm, prefix)]


@pytest.fixture(scope="module")
def every_kernel_source() -> str:
    """C source holding every GEMM variant (tiled, dot and tn of every block width, in-place A), both
    dtypes: the runtime's, which every program calls."""
    from symgrad.backends.build import runtime
    return runtime.source()


@pytest.mark.parametrize("march", LEVELS)
def test_register_tiles_never_touch_the_stack_in_their_k_loop(every_kernel_source, march):
    """The k loop of every register-tiled kernel (the GEMM's micro-kernels, the narrow dot and tn
    kernels, both dtypes) neither loads from nor stores to the stack, for each x86-64 level: its
    accumulators fit the target's vector registers. A spilled tile runs several times slower."""
    loops = _kernel_loops(_assembly(every_kernel_source, march))
    functions = {loop.function.split(".")[0] for loop in loops}
    for name in ("sg_micro_f32", "sg_micro_rows_f32", "sg_micro_f64", "sg_micro_rows_f64"):
        assert name in functions, f"{march}: no k loop found in {name}"
    assert any(f.startswith("sg_gemm_dot") for f in functions) and any(f.startswith("sg_gemm_tn") for f in functions)
    spills = {loop.function: loop.stack_accesses for loop in loops if loop.stack_accesses}
    assert not spills, f"{march}: k loops that use the stack: " + "; ".join(
        f"{name}: {accesses[:4]}" for name, accesses in spills.items())


def test_a_tile_too_big_for_the_registers_is_caught():
    """The check above catches a spill: a 12-row tile (24 accumulators) on AVX2's 16 registers. (Its
    loop over a one-vector sliver, 12 accumulators, fits: only the two-vector loops spill.)"""
    from symgrad.backends.build.runtime import Target, source as runtime_source
    source = runtime_source(targets=(Target("too big", "", 32, 12, 1, 2, 4),))
    assert "enum { SG_F32_MR = 12, SG_F32_MC = 72 };" in source
    loops = [loop for loop in _kernel_loops(_assembly(source, "x86-64-v3")) if loop.function.startswith("sg_micro")]
    two_vector = [loop for loop in loops if loop.vector_multiplies >= 24]
    assert two_vector and all(loop.stack_accesses for loop in two_vector)
