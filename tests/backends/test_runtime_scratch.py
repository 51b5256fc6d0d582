"""The runtime's scratch (issue #33): each runtime function that needs buffers while it runs takes
them from a region of its caller's and says how many bytes that must be (`<function>_scratch_bytes`,
beside the code that uses them); nothing else counts them.

Checked against the code that uses the memory: every function is run over a grid of sizes (each
path of the GEMM: blocked, column groups, tall, several panels; the narrow kernels; Winograd's
forward and weight gradient) and teams, on a region of exactly the bytes it reports followed by a
guard of known bytes, which must come back untouched, with the product right. Then whole programs
(benchmarks.gpt's small GPT; benchmarks.cnn's residual network, its 3x3 convolutions Winograd's):
no allocator called in a step's source or imported by the libraries, the region the report counts
is the one the program is given, and resident memory does not grow over 20 steps.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import symgrad as sg
from helpers import omp_threads, set_omp_threads
from symgrad.backends import host_memory
from symgrad.backends.build import runtime
from symgrad.backends.decide.gemm_table import gemm_function
from symgrad.backends.kinds.matmul import MatmulKernel
from symgrad.backends.status import Status
from symgrad.backends.report import format_bytes
from symgrad.ir import shapes as S

pytest.importorskip("symgrad.backends.c")

GUARD = 4096          # bytes after the region, which no function may touch
FILL = 0xA5
TEAMS = (1, 2, 3)     # omp_set_num_threads before each call (3: a team that does not divide the work)
I64, PTR = ctypes.c_int64, ctypes.c_void_p
ALLOCATORS = ("malloc", "calloc", "realloc", "free", "aligned_alloc", "posix_memalign", "memalign", "valloc")


class Context(ctypes.Structure):
    """sg_context, as symgrad_runtime.h lays it out (symgrad.backends.c.CDEF_CONTEXT_FIELDS)."""
    _fields_ = [("team_warm", ctypes.c_int), ("last_call_end", ctypes.c_double), ("status", ctypes.c_int),
                ("failed", ctypes.c_char_p), ("gradient_final", PTR), ("gradient_final_data", PTR),
                ("collective", PTR), ("collective_data", PTR), ("scratch", PTR), ("scratch_bytes", I64)]


class Winograd(ctypes.Structure):
    """sg_winograd_f32 / _f64: a 3x3 stride-1 convolution's patch matrix."""
    _fields_ = [("src", PTR), ("R", I64), ("Q", I64), ("Ho", I64), ("Wo", I64), ("Wp", I64), ("origin", I64),
                ("tap", I64 * 9)]


@pytest.fixture(scope="module")
def lib():
    return ctypes.CDLL(str(runtime.build().library_path))


def _function(lib, name: str, arguments: list):
    function = getattr(lib, name)
    function.argtypes, function.restype = arguments, ctypes.c_int
    return function


def _guarded(nbytes: int):
    """A region of `nbytes` bytes on a 64-byte boundary, then GUARD bytes of FILL: (array, address)."""
    raw = np.full(nbytes + GUARD + 64, FILL, np.uint8)
    start = (-raw.ctypes.data) % 64
    return raw[start:start + nbytes + GUARD], raw.ctypes.data + start


def _run(lib, function: str, m: int, n: int, k: int, call) -> None:
    """`call(scratch address)` on each team of TEAMS with a region of exactly the bytes
    `function`_scratch_bytes reports for it; the guard after the region must be untouched."""
    own = omp_threads()
    try:
        for team in TEAMS:
            set_omp_threads(team)
            nbytes = runtime.scratch_bytes(function, m, n, k, threads=omp_threads())
            region, address = _guarded(nbytes)
            call(address)
            assert (region[nbytes:] == FILL).all(), (function, m, n, k, team, nbytes)
    finally:
        set_omp_threads(own)


GEMMS = [  # (M, N, K, A transposed, B transposed): what each exercises
    (20, 30, 40, False, False),      # below the team's threshold: one thread, one block
    (300, 200, 300, False, False),   # rows shared out (2 threads), column groups (3: too few row blocks)
    (64, 4096, 512, False, True),    # column groups, B transposed (packed from its columns)
    (64, 100, 4096, True, False),    # tall: K split over the threads, A transposed
    (50, 2100, 30, False, False),    # two panels of B (N past NC)
    (700, 300, 200, False, False),   # rows in blocks of MC (288 on the full-width AVX-512 target), one partial
    (384, 1536, 1024, True, False),  # a GPT's weight gradient: column groups where the panel of B passes L2
    (5, 7, 0, False, False),         # K = 0: C zeroed, no scratch
    (7, 9, 1, True, True),           # one row of K, both transposed
]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("m, n, k, ta, tb", GEMMS)
def test_the_gemm_stays_within_the_scratch_it_reports(lib, dtype, m, n, k, ta, tb):
    rng = np.random.default_rng(m + n + k)
    a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
    a_stored, b_stored = (np.ascontiguousarray(a.T) if ta else a), (np.ascontiguousarray(b.T) if tb else b)
    sam, sak = (1, m) if ta else (k, 1)
    sbk, sbn = (1, k) if tb else (n, 1)
    name = f"sg_gemm_{runtime.GEMM[dtype]['suffix']}"
    gemm = _function(lib, name, [I64, I64, I64, PTR, I64, I64, PTR, I64, I64, PTR, PTR, PTR, PTR])
    context, want = Context(), a.astype(np.float64) @ b

    def call(scratch):
        c = np.full((m, n), np.nan, dtype)
        assert gemm(m, n, k, a_stored.ctypes.data, sam, sak, b_stored.ctypes.data, sbk, sbn, c.ctypes.data,
                    ctypes.byref(context), None, scratch) == Status.OK
        np.testing.assert_allclose(c, want, rtol=1e-4, atol=1e-3 * max(k, 1) ** 0.5)
    _run(lib, name, m, n, k, call)


NARROW = [(64, 10, 784), (7, 3, 5), (1000, 16, 300), (33, 1, 17), (2, 5, 1 << 12)]


@pytest.mark.parametrize("kind", ["dot", "tn"])
@pytest.mark.parametrize("m, n, k", NARROW)
def test_the_narrow_kernels_stay_within_the_scratch_they_report(lib, kind, m, n, k):
    rng = np.random.default_rng(n)
    a, b = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    stored, stride = (a, k) if kind == "dot" else (np.ascontiguousarray(a.T), m)
    name, chosen = gemm_function("float32", n, k if kind == "dot" else 1, 1 if kind == "dot" else m)
    assert chosen == kind
    gemm = _function(lib, name, [I64, I64, I64, PTR, I64, PTR, I64, I64, PTR, PTR, PTR, PTR])
    context, want = Context(), a.astype(np.float64) @ b

    def call(scratch):
        c = np.full((m, n), np.nan, np.float32)
        assert gemm(m, n, k, stored.ctypes.data, stride, b.ctypes.data, n, 1, c.ctypes.data,
                    ctypes.byref(context), None, scratch) == Status.OK
        np.testing.assert_allclose(c, want, rtol=1e-4, atol=1e-3 * k ** 0.5)
    _run(lib, name, m, n, k, call)


def test_the_bfloat16_gemm_stays_within_the_scratch_it_reports(lib):
    """(On a CPU without AVX512_BF16 it is the float32 GEMM, and reports that one's bytes.) Its
    operands are bfloat16 values held in floats, as a step passes them: the AVX512_BF16 path
    keeps each float's upper half, so a float that is not a bfloat16 would lose its low bits."""
    import ml_dtypes
    m, n, k = 70, 45, 300
    rng = np.random.default_rng(3)
    a, b = (rng.standard_normal(s).astype(ml_dtypes.bfloat16).astype(np.float32) for s in ((m, k), (k, n)))
    gemm = _function(lib, "sg_gemm_bf16", [I64, I64, I64, PTR, I64, I64, PTR, I64, I64, PTR, PTR, PTR, PTR])
    context = Context()

    def call(scratch):
        c = np.full((m, n), np.nan, np.float32)
        assert gemm(m, n, k, a.ctypes.data, k, 1, b.ctypes.data, n, 1, c.ctypes.data, ctypes.byref(context),
                    None, scratch) == Status.OK
        np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-2, atol=1e-2)
    _run(lib, "sg_gemm_bf16", m, n, k, call)


@pytest.mark.parametrize("function", ["sg_gemm_f32", "sg_gemm_bf16"])
def test_the_bytes_for_a_team_cover_every_smaller_team(function):
    """A program sizes its region for its team; a later call on fewer threads (set_threads) must
    fit in it: the bytes reported never shrink as the team grows. (The bfloat16 GEMM's blocks get
    fewer tiles on a bigger team: its per-thread rows are sized for the most any team takes.)"""
    for m, n, k in ((8, 32, 64), (40, 70, 128), (136, 32, 128), (300, 64, 96), (1024, 384, 384)):
        sizes = [runtime.scratch_bytes(function, m, n, k, threads=t) for t in range(1, 9)]
        assert all(a <= b for a, b in zip(sizes, sizes[1:])), (function, m, n, k, sizes)


def _patches(images: np.ndarray, Ho: int, Wo: int) -> np.ndarray:
    """The patch matrix of a 3x3 stride-1 convolution of padded `images` (P, Ho + 2, Wo + 2, Q):
    rows (image, y, x), columns (ky, kx, channel)."""
    P, _, _, Q = images.shape
    return np.stack([images[:, ky:ky + Ho, kx:kx + Wo, :] for ky in range(3) for kx in range(3)],
                    axis=3).reshape(P * Ho * Wo, 9 * Q)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("P, Q, Ho, Wo, N", [(2, 16, 8, 8, 16), (3, 20, 7, 9, 19), (2, 24, 18, 18, 40)])
@pytest.mark.parametrize("gradient", [False, True], ids=["forward", "weight gradient"])
def test_winograd_stays_within_the_scratch_it_reports(lib, dtype, P, Q, Ho, Wo, N, gradient):
    rng = np.random.default_rng(Q + N)
    images = rng.standard_normal((P, Ho + 2, Wo + 2, Q)).astype(dtype)
    x = _patches(images, Ho, Wo)
    spec = Winograd(images.ctypes.data, (Ho + 2) * (Wo + 2), Q, Ho, Wo, Wo + 2, 0, (I64 * 9)(*range(9)))
    suffix = runtime.GEMM[dtype]["suffix"]
    name = f"sg_conv_winograd_{'grad_' if gradient else ''}{suffix}"
    conv = _function(lib, name, [I64, I64, I64, PTR, PTR, I64, I64, PTR, PTR, PTR])
    m, k = (9 * Q, x.shape[0]) if gradient else (x.shape[0], 9 * Q)
    b = rng.standard_normal((k, N)).astype(dtype)
    want = (x.T if gradient else x).astype(np.float64) @ b
    context = Context()

    def call(scratch):
        c = np.full((m, N), np.nan, dtype)
        assert conv(m, N, k, ctypes.byref(spec), b.ctypes.data, N, 1, c.ctypes.data, ctypes.byref(context),
                    scratch) == Status.OK
        np.testing.assert_allclose(c, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())
    _run(lib, name, m, N, k, call)


# ---- whole programs ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt():
    """A train step of benchmarks.gpt's small config (AdamW; attention, narrow and batched products)."""
    from benchmarks import gpt
    bench = gpt.CONFIGS["small"]
    _, state, x, y = gpt.setup(bench)
    return gpt.symgrad_step(bench, state, "c"), dict(idx=x, targets=y)


@pytest.fixture
def cnn():
    """benchmarks.cnn's residual network (16 channels, 4 images of 12x12: its 3x3 convolutions and
    their gradients are Winograd's) as a train step, with its NumPy twin and a batch; made afresh
    for each test (the build and the program caches keep the compile)."""
    from benchmarks.cnn_models import resnet
    steps = []
    for backend in ("c", "numpy"):
        sg.manual_seed(0)
        model = resnet(sg.nn, channels=16)
        x, y = sg.input("x", (4, 3, 12, 12)), sg.input("y", (4,), dtype="int64")
        steps.append(sg.train_step(sg.cross_entropy(model(x), y), model.parameters(),
                                   sg.optim.SGD(lr=0.02, momentum=0.9), backend=backend))
    rng = np.random.default_rng(5)
    return (*steps, dict(x=rng.standard_normal((4, 3, 12, 12)).astype(np.float32), y=rng.integers(0, 10, 4)))


CALL = re.compile(r"\b(%s)\s*\(" % "|".join(ALLOCATORS))


def test_no_allocation_in_the_runtime_source():
    assert not CALL.findall(runtime.source())


def _imports(library: Path) -> set[str]:
    """The undefined (imported) dynamic symbols of a shared library, by name."""
    listing = subprocess.run(["nm", "-D", "--undefined-only", str(library)], capture_output=True, text=True,
                             check=True).stdout
    return {line.split()[-1].split("@")[0] for line in listing.splitlines() if line.strip()}


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm")
def test_the_runtime_library_imports_no_allocator():
    assert not _imports(runtime.build().library_path) & set(ALLOCATORS)


def _expected_scratch(program) -> int:
    """The most one runtime call of `program` takes, asked of the runtime function by function (the
    program's unbatched matmuls; its batched ones are none here, or counted below this)."""
    bindings = program.memory_plan.bindings
    most = 0
    for k in program.plan.kernels:
        if not isinstance(k, MatmulKernel) or k.impl == "direct rows" or k.batch:
            continue
        name = k.function   # the runtime function decide chose (Decisions.matmuls)
        sizes = [int(S.evaluate(n, bindings)) for n in (k.M, k.N, k.K)]
        most = max(most, runtime.scratch_bytes(name, *sizes, threads=omp_threads()))
    return most


def _resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


@pytest.mark.parametrize("model", ["gpt", "cnn"])
def test_a_step_allocates_nothing_and_its_memory_is_the_reported(request, model):
    """The step's source calls no allocator and its library imports none; the report's runtime
    scratch is the region the program is given (an array of its own beside the arena's), no less
    than each matmul's runtime function asks for; and over 20 steps after the first the process's
    resident memory stays where it was."""
    built = request.getfixturevalue(model)
    step, inputs = (built[0], built[2]) if model == "cnn" else built  # (the CNN's NumPy twin unused)
    program = step.program
    assert not CALL.findall(step.source)
    if shutil.which("nm"):
        assert not _imports(Path(program.library_path)) & set(ALLOCATORS)
    step(**inputs)
    planned = program.memory_plan
    parts = step.report().memory
    assert f"runtime scratch {format_bytes(planned.scratch_bytes)}" in str(parts)
    assert planned.scratch_bytes >= _expected_scratch(program) > 0
    if not any(isinstance(k, MatmulKernel) and k.batch for k in program.plan.kernels):
        assert planned.scratch_bytes == _expected_scratch(program)
    layout = next(iter(program._layouts.values()))
    workspace, (scratch, scratch_bytes) = layout[3], layout[-1]
    assert scratch_bytes == planned.scratch_bytes
    assert workspace.nbytes == planned.arena_bytes + 64
    assert len(program._ffi.buffer(scratch)) == planned.scratch_bytes + 64
    host_memory.populated()   # (the workspace's pages faulted in on a thread: all of them resident now)
    before = _resident_bytes()
    for _ in range(20):
        step(**inputs)
    assert _resident_bytes() - before <= 256 * 1024


def test_the_cnn_step_is_its_numpy_twins(cnn):
    """Three steps of the Winograd CNN on C against the same network on the NumPy reference."""
    c_step, numpy_step, inputs = cnn
    assert c_step.source.count("= sg_conv_winograd_") >= 2
    for _ in range(3):
        np.testing.assert_allclose(c_step(**inputs), numpy_step(**inputs), rtol=1e-4)


def test_a_larger_team_than_the_region_was_sized_for_gets_a_larger_region():
    """The entry checks the region against its team before it computes anything: a thread whose team
    grew since the region was sized has its call refused, the region sized again, and the call made."""
    # (Rows enough that every team takes the blocked GEMM: its scratch grows with the team, whatever
    # the target's MC. With fewer rows a team of 3 splits the columns and may need less than 1.)
    x, w = sg.input("x", (600, 200)), sg.input("w", (200, 200))
    fn = sg.function([x, w], [x @ w], backend="c")
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((600, 200)).astype(np.float32), rng.standard_normal((200, 200)).astype(np.float32)
    own = omp_threads()
    try:
        set_omp_threads(1)
        np.testing.assert_allclose(fn(a, b)[0], a @ b, rtol=1e-4, atol=1e-3)
        alone = fn.program.memory_plan.scratch_bytes
        set_omp_threads(3)
        np.testing.assert_allclose(fn(a, b)[0], a @ b, rtol=1e-4, atol=1e-3)
        assert fn.program.memory_plan.scratch_bytes == runtime.scratch_bytes("sg_gemm_f32", 600, 200, 200, 3) > alone
    finally:
        set_omp_threads(own)


@pytest.mark.parametrize("batch, m, n, k, share", [(64, 16, 40, 16, True), (2, 600, 200, 300, False)],
                         ids=["shared out", "one at a time"])
def test_a_batched_product_gives_each_thread_its_slice(batch, m, n, k, share):
    """A batched product whose GEMMs are shared out over the team (each too small for it) gives
    each thread a slice of the region, one product's scratch in whole lines: the region is the
    team's slices; one whose GEMMs each run on the team takes one GEMM's. Right on teams 1 to 3."""
    a, b = sg.input("a", (batch, m, k)), sg.input("b", (batch, k, n))
    fn = sg.function([a, b], [a @ b], backend="c")
    (kernel,) = [kn for kn in fn.program.plan.kernels if isinstance(kn, MatmulKernel)]
    assert kernel.batch and ("share" in fn.source)
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal(a.shape).astype(np.float32), rng.standard_normal(b.shape).astype(np.float32)
    own = omp_threads()
    try:
        for team in TEAMS:
            set_omp_threads(team)
            np.testing.assert_allclose(fn(x, y)[0], x @ y, rtol=1e-4, atol=1e-4 * k)
            one = runtime.scratch_bytes("sg_gemm_f32", m, n, k, threads=1)
            want = team * (-(-one // 64) * 64) if share else runtime.scratch_bytes("sg_gemm_f32", m, n, k, threads=team)
            assert fn.program._scratch_bytes(()) == fn.program.memory_plan.scratch_bytes == want, team
    finally:
        set_omp_threads(own)


# Products through each of sg_gemm_f32's paths: the blocked one with B transposed (a weight), the
# columns shared out over the team (few rows) with B row-major, the blocked one with two column
# slivers (where it reads an A it need not round in place), and a tall one (K split over the team).
_ROUNDED_PRODUCTS = [(70, 45, 300, True), (70, 200, 300, False), (70, 20, 300, False), (30, 40, 2100, True)]


@pytest.mark.parametrize("level", ["", "avx2"])
@pytest.mark.parametrize("m, n, k, b_transposed", _ROUNDED_PRODUCTS)
def test_the_rounding_bfloat16_gemm_stays_within_the_scratch_it_reports(level, m, n, k, b_transposed):
    """sg_gemm_bf16_round_ab, the product a folded cast leaves (backends/decide/half.py), on float32
    operands that are not bfloat16 values: on this machine's runtime (which rounds as it packs where
    it has AVX512_BF16) and on the AVX2 one (sg_gemm_f32_rounded: sg_gemm_f32 rounding each block
    as it packs it, in sg_gemm_f32's scratch). On a region of exactly the bytes reported, then a
    guard; the product is that of the rounded operands, exactly: integers moved by less than a
    quarter of bfloat16's ulp round back to them."""
    from helpers import c_build_options
    flags = c_build_options(level).get("flags")
    lib = ctypes.CDLL(str(runtime.build(flags).library_path))
    gemm = _function(lib, "sg_gemm_bf16_round_ab", [I64, I64, I64, PTR, I64, I64, PTR, I64, I64, PTR, PTR, PTR, PTR])
    rng = np.random.default_rng(4)
    whole = [rng.choice([-3.0, -2.0, -1.0, 1.0, 2.0, 3.0], size=s) for s in ((m, k), (k, n))]
    a, b = ((w + rng.uniform(-1, 1, w.shape) * 2.0 ** -9).astype(np.float32) for w in whole)
    if b_transposed:  # B read transposed (strides 1, k), as a weight is
        b_buffer, sbk, sbn = np.ascontiguousarray(b.T), 1, k
    else:
        b_buffer, sbk, sbn = np.ascontiguousarray(b), n, 1
    want = whole[0] @ whole[1]
    context = Context()
    own = omp_threads()
    try:
        for team in TEAMS:
            set_omp_threads(team)
            nbytes = runtime.scratch_bytes("sg_gemm_bf16_round_ab", m, n, k, threads=team, flags=flags)
            if level == "avx2":
                assert nbytes == runtime.scratch_bytes("sg_gemm_f32", m, n, k, threads=team, flags=flags)
            region, address = _guarded(nbytes)
            c = np.full((m, n), np.nan, np.float32)
            assert gemm(m, n, k, a.ctypes.data, k, 1, b_buffer.ctypes.data, sbk, sbn, c.ctypes.data,
                        ctypes.byref(context), None, address) == Status.OK
            np.testing.assert_array_equal(c, want.astype(np.float32))
            assert (region[nbytes:] == FILL).all(), (level, team, nbytes)
    finally:
        set_omp_threads(own)
