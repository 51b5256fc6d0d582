"""The runtime's bfloat16 GEMM (templates/matmul/gemm_bf16.c.j2), checked where its speed is decided:
the k loop gcc writes for an AVX512_BF16 target is vdpbf16ps on a register tile that never touches
the stack, with AMX it is four tile products, and a target without either keeps the float32 path.
Read in the assembly, not run: this machine need not have AVX512_BF16 or AMX. Both paths' packing,
tiles and edges are run on any machine with the intrinsics replaced by scalar C that follows
Intel's definitions of vdpbf16ps and tdpbf16ps; one large product runs on the runtime built here."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import ml_dtypes
import numpy as np
import pytest

from asm_loops import assembly, innermost_loops


@pytest.fixture(scope="module")
def runtime_source() -> str:
    """The runtime's preamble and its bfloat16 GEMM alone (gcc on the whole runtime takes 15 s)."""
    from symgrad.backends.build import runtime
    source = runtime.source()
    preamble = source.split("void sg_team_begin_call", 1)[0]
    start = source.index("/*\n * sg_gemm_bf16:")
    end = source.index("#endif", source.index("return sg_gemm_f32(M, N, K, A, sam, sak, B, sbk, sbn, C, context, ep, scratch);"))
    return preamble + source[start:end + len("#endif")] + "\n"


def test_bf16_k_loop_is_vdpbf16ps_in_registers(runtime_source):
    """sapphirerapids (AVX512_BF16): the micro-kernel's k loop holds 16 vdpbf16ps (8 rows x 2
    vectors of 16 float32 sums: 32 multiply-adds each), 2 loads of B and 8 broadcasts of A's pairs,
    and no load or store through the stack (16 accumulators within the 32 registers)."""
    asm = assembly(runtime_source, "sapphirerapids")
    loops = [loop for loop in innermost_loops(asm) if loop.function.startswith("sg_micro_bf16")
             and any("vdpbf16ps" in line for line in loop.lines)]
    assert len(loops) == 1, [loop.function for loop in loops]
    (loop,) = loops
    instructions = [line.split()[0] for line in loop.lines if line.startswith("\t") and not line.lstrip().startswith(".")]
    assert instructions.count("vdpbf16ps") == 16
    assert instructions.count("vpbroadcastd") == 8
    assert not loop.stack_accesses, loop.stack_accesses
    assert not any(i.startswith("vfmadd") for i in instructions)


def test_with_amx_the_k_loop_is_four_tile_products(runtime_source):
    """sapphirerapids (AMX): each of the AMX path's k loops (a claim's whole blocks, chunk by
    chunk; the blocks at C's edges) loads two tiles of A's rows and two of B's columns and
    multiplies them into the 2 x 2 tiles of sums (4 tdpbf16ps, 8192 multiply-adds each), nothing
    else loaded or stored; cooperlake (AVX512_BF16, no AMX) has no tile instruction at all."""
    asm = assembly(runtime_source, "sapphirerapids")
    loops = [loop for loop in innermost_loops(asm) if any("tdpbf16ps" in line for line in loop.lines)]
    assert loops and all(loop.function.startswith("sg_amx_rows") for loop in loops), [loop.function for loop in loops]
    for loop in loops:
        instructions = [line.split()[0] for line in loop.lines if line.startswith("\t")]
        assert instructions.count("tdpbf16ps") == 4 and instructions.count("tileloadd") == 4, instructions
        assert "tilestored" not in instructions, instructions
    assert "tdpbf16ps" not in assembly(runtime_source, "cooperlake")


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64-v4"])
def test_without_avx512_bf16_the_float32_gemm_computes_it(runtime_source, march):
    """Without AVX512_BF16 (SSE2, AVX2, AVX-512 of Skylake) no vdpbf16ps is emitted and
    sg_gemm_bf16 calls sg_gemm_f32, whose products of bfloat16 values are exact."""
    asm = assembly(runtime_source, march)
    assert "vdpbf16ps" not in asm
    body = asm.split("sg_gemm_bf16:", 1)[1].split(".size\tsg_gemm_bf16", 1)[0]
    assert "sg_gemm_f32" in body


# The intrinsics the AVX512_BF16 path calls, as GCC vectors and scalar loops: an immintrin.h found
# first on the include path. vdpbf16ps per lane, as Intel's pseudo-code: the odd pair's product
# added to the sum, then the even pair's, each in float32.
_EMULATED_INTRINSICS = r"""
#include <stdint.h>
#include <string.h>
typedef float __m512 __attribute__((vector_size(64)));
typedef short __m512bh __attribute__((vector_size(64)));
typedef long long __m512i __attribute__((vector_size(64)));
static inline __m512 _mm512_setzero_ps(void) { __m512 z = {0}; return z; }
static inline __m512i _mm512_loadu_si512(const void* p) { __m512i v; memcpy(&v, p, 64); return v; }
static inline __m512i _mm512_set1_epi32(int x)
{ int32_t l[16]; for (int i = 0; i < 16; i++) l[i] = x; __m512i v; memcpy(&v, l, 64); return v; }
static inline void _mm512_storeu_ps(void* p, __m512 v) { memcpy(p, &v, 64); }
static inline __m512 _mm512_loadu_ps(const void* p) { __m512 v; memcpy(&v, p, 64); return v; }
static inline __m512 _mm512_add_ps(__m512 a, __m512 b) { return a + b; }
static inline float emulated_bf16(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline __m512 _mm512_dpbf16_ps(__m512 acc, __m512bh a, __m512bh b)
{
    uint16_t x[32], y[32]; float s[16];
    memcpy(x, &a, 64); memcpy(y, &b, 64); memcpy(s, &acc, 64);
    for (int i = 0; i < 16; i++) {
        s[i] += emulated_bf16(x[2 * i + 1]) * emulated_bf16(y[2 * i + 1]);
        s[i] += emulated_bf16(x[2 * i]) * emulated_bf16(y[2 * i]);
    }
    __m512 out; memcpy(&out, s, 64); return out;
}
"""

# AMX's tile intrinsics, as scalar C over 8 tiles of 16 rows x 64 bytes (the one configuration the
# runtime loads), and the permission Linux grants (here: always). tdpbf16ps per element, as Intel's
# pseudo-code: the even pair's product added to the sum, then the odd pair's, each in float32.
_EMULATED_AMX = r"""
#include <stdint.h>
#include <string.h>
long sg_emulated_syscall(long number, ...) { (void)number; return 0; }
#define syscall sg_emulated_syscall
static __thread unsigned char sg_emulated_tiles[8][16][64];
long sg_emulated_tile_products;  /* how many tdpbf16ps ran: the test sees the AMX path taken */
#define _tile_loadconfig(config) ((void)(config))
#define _tile_release() ((void)0)
#define _tile_zero(t) memset(sg_emulated_tiles[t], 0, sizeof sg_emulated_tiles[t])
#define _tile_loadd(t, base, stride) \
    for (int r_ = 0; r_ < 16; r_++) memcpy(sg_emulated_tiles[t][r_], (const char*)(base) + r_ * (stride), 64)
#define _tile_stored(t, base, stride) \
    for (int r_ = 0; r_ < 16; r_++) memcpy((char*)(base) + r_ * (stride), sg_emulated_tiles[t][r_], 64)
static inline float emulated_amx_bf16(const unsigned char* p)
{ uint16_t h; memcpy(&h, p, 2); uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline void sg_emulated_dpbf16(int c, int a, int b)
{
    __atomic_fetch_add(&sg_emulated_tile_products, 1, __ATOMIC_RELAXED);
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 16; n++) {
            float s;
            memcpy(&s, &sg_emulated_tiles[c][m][4 * n], 4);
            for (int k = 0; k < 16; k++) {
                s += emulated_amx_bf16(&sg_emulated_tiles[a][m][4 * k]) * emulated_amx_bf16(&sg_emulated_tiles[b][k][4 * n]);
                s += emulated_amx_bf16(&sg_emulated_tiles[a][m][4 * k + 2]) * emulated_amx_bf16(&sg_emulated_tiles[b][k][4 * n + 2]);
            }
            memcpy(&sg_emulated_tiles[c][m][4 * n], &s, 4);
        }
}
#define _tile_dpbf16ps(c, a, b) sg_emulated_dpbf16(c, a, b)
"""


def _bf16_functions(library):
    """sg_gemm_bf16 and sg_gemm_bf16_scratch_bytes of a loaded library, with their C signatures."""
    gemm, scratch_bytes = library.sg_gemm_bf16, library.sg_gemm_bf16_scratch_bytes
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    gemm.argtypes, gemm.restype = [i64, i64, i64, ptr, i64, i64, ptr, i64, i64, ptr, ptr, ptr, ptr], ctypes.c_int
    scratch_bytes.argtypes, scratch_bytes.restype = [i64] * 4, i64
    return gemm, scratch_bytes


@pytest.mark.parametrize("path", ["vdpbf16ps", "amx"])
def test_bf16_path_computes_the_product_with_emulated_intrinsics(runtime_source, tmp_path, path):
    """The AVX512_BF16 path, and the AMX one, built with scalar stand-ins for their intrinsics and
    run: edges of the 8 x 32 register tile and of AMX's 32 x 32 block in M and N, an odd K (its
    last pair padded), K = 0, A and B each read as stored and transposed (the packing's vector
    paths and their remainders), K in more than one chunk (SG_BF16_KC pairs, SG_AMX_KC) and past a
    tile's 16 pairs, M in more than one block, and claims of several of AMX's 32-row blocks whose
    last one is at M's edge. Each result is within float32's rounding of the exact sum of
    the bfloat16 products; floats that are not bfloat16 values are rounded as a cast rounds them."""
    from symgrad.backends.build import runtime
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("needs gcc")
    amx = path == "amx"
    (tmp_path / "immintrin.h").write_text(_EMULATED_INTRINSICS + (_EMULATED_AMX if amx else ""))
    (tmp_path / runtime.HEADER).write_text(runtime.header())
    # AMX: B's panels past 64 KB (not 2 MB) take the chunked path, the two last products here
    defines = "#define __AVX512F__ 1\n#define __AVX512BF16__ 1\n" + (
        "#define __AMX_BF16__ 1\n#define __AMX_TILE__ 1\n#define SG_AMX_CACHED_B 65536\n" if amx else "")
    (tmp_path / "bf16.c").write_text(defines + runtime_source)
    subprocess.run([gcc, "-O1", "-fopenmp", "-fPIC", "-shared", "-Wno-psabi", f"-I{tmp_path}", "-o",
                    str(tmp_path / "bf16.so"), str(tmp_path / "bf16.c")], check=True, capture_output=True, timeout=120)
    library = ctypes.CDLL(str(tmp_path / "bf16.so"))
    gemm, scratch_bytes = _bf16_functions(library)
    rng = np.random.default_rng(39)
    for m, n, k, transposed, b_transposed in ((13, 45, 37, False, False), (8, 32, 2, False, True), (1, 1, 1, False, False),
                                              (17, 70, 64, True, False), (5, 3, 0, False, False),
                                              (150, 40, 301, False, True), (70, 33, 520, True, True),
                                              (300, 70, 600, False, False)):
        a, b = (rng.standard_normal(s).astype(ml_dtypes.bfloat16).astype(np.float32) for s in ((m, k), (k, n)))
        stored = np.ascontiguousarray(a.T) if transposed else a
        sam, sak = (1, m) if transposed else (k, 1)
        b_stored = np.ascontiguousarray(b.T) if b_transposed else b
        sbk, sbn = (1, k) if b_transposed else (n, 1)
        c = np.full((m, n), np.nan, np.float32)
        threads = runtime.team_size()  # the team's: $OMP_NUM_THREADS, else at least the CPUs it may use
        scratch = np.zeros(scratch_bytes(m, n, k, threads) + 64, np.uint8)
        at = scratch.ctypes.data + (-scratch.ctypes.data) % 64
        assert gemm(m, n, k, stored.ctypes.data, sam, sak, b_stored.ctypes.data, sbk, sbn, c.ctypes.data, None, None, at) == 0
        exact = a.astype(np.float64) @ b.astype(np.float64)
        bound = k * 2.0 ** -23 * (np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)) + 1e-30
        assert np.all(np.abs(c - exact) <= bound), (m, n, k, transposed, b_transposed)
    # Floats that are not bfloat16 values are rounded to nearest even as they are packed, as a cast
    # rounds them (not cut to their high half); a NaN whose payload is all in the low half stays NaN.
    m, n, k = 37, 40, 70
    a, b = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    a[3, 5] = np.array([0x7F800001], np.uint32).view(np.float32)[0]
    c = np.full((m, n), np.nan, np.float32)
    scratch = np.zeros(scratch_bytes(m, n, k, runtime.team_size()) + 64, np.uint8)
    at = scratch.ctypes.data + (-scratch.ctypes.data) % 64
    assert gemm(m, n, k, a.ctypes.data, k, 1, b.ctypes.data, n, 1, c.ctypes.data, None, None, at) == 0
    with np.errstate(invalid="ignore"):  # the NaN's cast
        rounded = [x.astype(ml_dtypes.bfloat16).astype(np.float64) for x in (a, b)]
    exact = rounded[0] @ rounded[1]
    bound = k * 2.0 ** -23 * (np.abs(rounded[0]) @ np.abs(rounded[1])) + 1e-30
    assert np.isnan(c[3]).all() and np.isnan(exact[3]).all()
    finite = np.arange(m) != 3
    assert np.all(np.abs(c[finite] - exact[finite]) <= bound[finite])
    if amx:
        assert ctypes.c_long.in_dll(library, "sg_emulated_tile_products").value > 0, "the AMX path never ran"


def test_the_runtime_built_here_computes_a_product_whose_b_passes_l2():
    """The runtime as built for this machine (AMX, vdpbf16ps or the float32 GEMM, whichever it has)
    on a product whose packed B (2.6 MB) passes SG_AMX_CACHED_B: on AMX, claims of several 32-row
    blocks with k in chunks, and edges in M and N. Small integers are bfloat16 values and their sums
    are exact in float32, so the product must equal NumPy's exactly."""
    from test_runtime_scratch import Context

    from symgrad.backends.build import runtime
    gemm, scratch_bytes = _bf16_functions(ctypes.CDLL(str(runtime.build().library_path)))
    rng = np.random.default_rng(7)
    m, k, n = 300, 2100, 600
    a = rng.integers(-3, 4, (m, k)).astype(np.float32)
    b = rng.integers(-3, 4, (k, n)).astype(np.float32)
    c = np.full((m, n), np.nan, np.float32)
    scratch = np.zeros(scratch_bytes(m, n, k, runtime.team_size()) + 64, np.uint8)
    at = scratch.ctypes.data + (-scratch.ctypes.data) % 64
    context = Context()
    assert gemm(m, n, k, a.ctypes.data, k, 1, b.ctypes.data, n, 1, c.ctypes.data, ctypes.byref(context), None, at) == 0
    np.testing.assert_array_equal(c, a @ b)
