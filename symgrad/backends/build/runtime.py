"""The C runtime: the GEMM kernels, their vector helpers and the OpenMP team's clock, rendered
once into `symgrad_runtime.h` (declarations) and a C source, compiled once per compiler and flags
into the build cache, and linked by every C program.

    header() -> str              templates/runtime/runtime.h.j2: what a program may call
    source(targets) -> str       templates/runtime/runtime.c.j2: every GEMM variant a program may call
    build(flags) -> BuiltModule  the shared library, cached (symgrad.backends.build.cache, kind "runtime")
    default_flags() -> list      what programs and the runtime are built with unless told otherwise
    scratch_bytes(function, m, n, k, threads)           the scratch one call of it takes (asked of C)

Which of them computes one matmul is decide's choice (symgrad.backends.decide.gemm_table).

A program's source includes the header and calls the runtime by name; the cache builds the
program with the header's directory on its include path and links it to the library (see
symgrad.backends.build.cache). The GEMM is a few thousand lines of C once its register tiles are
unrolled: compiling it once, not once per model, is most of a cold compile saved.

Everything the runtime knows about a call lives in the caller's `sg_context` (the team's
clock) and its arguments: the library keeps no state of its own, and allocates nothing. A
function that needs buffers while it runs (packed panels, transformed tiles) takes them from a
`scratch` region of its caller's, and says how many bytes that must be beside its code:
`<function>_scratch_bytes(M, N, K, threads)`. A program sizes its region with them
(symgrad_scratch_bytes), Python asks them through `scratch_bytes`: one count of those bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import jinja2

from ...ir import dtypes as D
from . import cache
from .vector_width import vector_flags
from ..decide import winograd
from ...narrow_limit import NARROW_N  # matmuls with at most this many output columns use a narrow-N kernel
from ..status import Status
from ..render.templates import render, template_dir
# The GEMM table is decide's (which function computes a product); the runtime renders what it names.
from ..decide.gemm_table import GEMM, narrow_columns

HEADER = "symgrad_runtime.h"    # the name programs include it by
_PACKAGE = Path(__file__).resolve().parents[2]  # symgrad/ (this is symgrad/backends/build/runtime.py)
GEMM_PARALLEL_MIN = 1 << 18     # multiply-adds: below this a matmul runs on one thread
CONV_ROWS = 6                   # output channels in the direct convolution's register tile (conv_rows.c.j2)
NARROW_PARALLEL_MIN = 1 << 22   # multiply-adds: below this a narrow-N matmul runs on one thread: the
                                # team costs ~1 us awake, but 40 us to milliseconds when the last region
                                # was long enough ago that it fell asleep (measured on 2-vCPU VMs)
NARROW_PARALLEL_MIN_WARM = 1 << 18  # ...and below this while the team is awake (context->team_warm: a
                                    # GEMM ran on it in this call, or the previous call ended < 0.5 ms
                                    # ago, as in a training loop): A b64's step 20% faster, A b256's 30%
# A tall product (K at least TALL_CHUNKS chunks of KC, C at most TALL_MN elements and TALL_N
# columns: a convolution's weight gradient) splits K over the threads, each with a private
# partial product and chunk of B (KC x TALL_N at most: 1 MB of floats).
TALL_CHUNKS, TALL_MN, TALL_N = 8, 65536, 1024


def scratch_bytes(function: str, m: int, n: int, k: int, threads: int | None = None,
                  flags: list[str] | None = None) -> int:
    """The bytes of scratch the runtime function `function` (as `gemm_function` names it, or
    "sg_conv_winograd[_grad]_f32", ...) takes for an m x n x k product on a team of `threads`
    (default `team_size()`): asked of the runtime library built with `flags` (its
    `<function>_scratch_bytes`, beside the code that uses the memory), not counted again here."""
    import ctypes
    count = getattr(_library(tuple(flags) if flags is not None else None), f"{function}_scratch_bytes")
    count.argtypes, count.restype = [ctypes.c_int64] * 4, ctypes.c_int64
    return int(count(m, n, k, threads or team_size()))


@lru_cache(maxsize=None)
def _library(flags: tuple | None):
    """The runtime library built with `flags` (None: the programs' default), opened with ctypes."""
    import ctypes
    return ctypes.CDLL(str(build(list(flags) if flags is not None else None).library_path))


def team_size() -> int:
    """The threads an OpenMP region gets by default: $OMP_NUM_THREADS (its first level), else the
    machine's cores."""
    first = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else (os.cpu_count() or 1)


@dataclass(frozen=True)
class Target:
    """One SIMD level the kernels are tiled for, chosen in the C source by the preprocessor.

    The register tiles are sized for the registers the level has: a tile that does not fit is
    spilled by the compiler, and its k loop then stores and reloads every accumulator through the
    stack (a 5x slowdown on AVX2: issue #13). `condition` is the `#if` test that selects it ("" for
    the portable rest); `vector_bytes` its vector width; `gemm_rows` the rows of the GEMM's register
    tile (MR; it is 2 vectors wide); `tn_vectors` the vectors of rows the narrow transposed kernel
    keeps per column; `conv_vectors` the vectors (forward) or patch rows (weight gradient) beside
    CONV_ROWS channels in the direct convolution's tile; `attention_rows` the rows of fused
    attention's register tile (2 vectors wide; a divisor of its 32-row tiles and 64-key blocks);
    `f32_block_rows` the float32 GEMM's MC, the most rows of A one cache block packs (a multiple of
    every target's MR; float64 keeps GEMM's MC on every target).
    """
    name: str
    condition: str
    vector_bytes: int
    gemm_rows: int
    tn_vectors: int
    conv_vectors: int
    attention_rows: int
    f32_block_rows: int = GEMM["float32"]["MC"]


#: Tested in this order; the first whose condition holds is compiled. 16 vector registers (SSE2,
#: AVX2) hold a 6-row tile: 12 accumulators, 2 B vectors and a broadcast (SSE2: plus the product,
#: having no FMA); AVX-512VL's 32 hold 8 rows (model B's step 6% faster on Zen 4) and two vectors of
#: rows in the tn kernel (24 accumulators). AVX-512 keeps 32-byte vectors unless the machine's
#: 64-byte FMAs run at least 1.5x the 32-byte rate (Zen 4 splits 64-byte ones; Intel's server cores
#: have two 512-bit units: 1.84x measured on one): then the build defines SG_VECTOR_BYTES=64
#: (symgrad.backends.build.vector_width), the same tiles in 64-byte vectors. Fused attention's tile
#: has 8 rows (16 accumulators) on AVX-512 and 4 (8) on 16 registers. The full-width target's float32
#: GEMM packs 4x the rows per block of A (288 x KC floats, 288 KiB: those cores have 1-2 MiB of L2):
#: a block's rows stream the packed panel of B (K x NC) from L3 once, so the panel is streamed M / MC
#: times. A GPT's products (`python -m benchmarks.gemm --gpt --threads 2`, Sapphire Rapids) ran at
#: 0.70-0.90 of torch.mm with 72 rows, 0.83-0.93 with 288 (and sg_gemm_plan's column groups for a
#: panel past L2). AVX2's 6 x 16 tile packs 144 rows, what BLIS's configuration for Zen 3 (512 KiB of
#: L2) gives the same tile: its build's weight-gradient products 7-17% faster here, the others as
#: they were. AVX-512VL's (Zen 4, 1 MiB of L2; BLIS packs 512 rows there for its own tile) packs 144
#: too: in 32-byte vectors on this machine (SYMGRAD_VECTOR_BYTES=32) every product as fast or faster,
#: the weight gradients 7-21%. (Not measured on a Zen 4.)
TARGETS = (
    Target("AVX-512 at full width: 32 registers of 64 bytes", "SG_VECTOR_BYTES == 64", 64, 8, 2, 4, 8,
           f32_block_rows=288),
    Target("AVX-512VL: 32 vector registers", "defined(__AVX512VL__)", 32, 8, 2, 4, 8, f32_block_rows=144),
    Target("AVX, AVX2: 16 vector registers of 32 bytes", "defined(__AVX__)", 32, 6, 1, 2, 4, f32_block_rows=144),
    Target("SSE2, NEON and the rest: 16-byte vectors", "", 16, 6, 1, 2, 4),
)


def target_branches(targets, value) -> list[dict]:
    """The `#if` / `#elif` / `#else` chain that picks `value(target)` for the target compiled: one
    branch per run of consecutive targets with equal values, each a dict of the directive that
    opens it, the targets' names and the value. The last target is the fallback (`#else`, or `#if 1`
    alone); the chain ends with `#endif`."""
    groups: list[tuple[list, object]] = []
    for t in targets:
        if groups and groups[-1][1] == value(t):
            groups[-1][0].append(t)
        else:
            groups.append(([t], value(t)))
    branches = []
    for k, (group, v) in enumerate(groups):
        if k == len(groups) - 1:
            directive = "#else" if k else "#if 1"
        else:
            directive = ("#elif " if k else "#if ") + " || ".join(t.condition for t in group)
        branches.append(dict(directive=directive, names="; ".join(t.name for t in group), value=v))
    return branches


def _narrow_variants(dtype: str, targets: tuple) -> list[dict]:
    """Every narrow kernel `gemm_function` can pick for `dtype`, as template contexts."""
    g = GEMM[dtype]
    variants = []
    for kind in ("dot", "tn"):
        for nb in sorted({narrow_columns(kind, n) for n in range(1, NARROW_N + 1)}):
            variants.append(dict(name=f"sg_gemm_{kind}{nb}_{g['suffix']}", kind=kind, NB=nb,
                                 ctype=D.C_TYPES[dtype], suffix=g["suffix"], SUFFIX=g["suffix"].upper(),
                                 parallel_min=NARROW_PARALLEL_MIN, parallel_min_warm=NARROW_PARALLEL_MIN_WARM,
                                 tiles=target_branches(targets, lambda t: t.tn_vectors)))
    return variants


def _context(targets: tuple) -> dict:
    """What both templates are rendered from: the GEMMs, their narrow variants and vector types."""
    from ...version import __version__
    gemms = [dict(GEMM[d], ctype=D.C_TYPES[d], SUFFIX=GEMM[d]["suffix"].upper(), parallel_min=GEMM_PARALLEL_MIN,
                  tall_chunks=TALL_CHUNKS, tall_mn=TALL_MN, tall_n=TALL_N,
                  tiles=target_branches(targets, lambda t: (t.gemm_rows, t.f32_block_rows if d == "float32"
                                                            else GEMM[d]["MC"]))) for d in GEMM]
    vectors = [dict(GEMM[d], ctype=D.C_TYPES[d], SUFFIX=GEMM[d]["suffix"].upper(),
                    widths=[dict(b, lanes=b["value"] // D.to_numpy(d).itemsize)
                            for b in target_branches(targets, lambda t: t.vector_bytes)]) for d in GEMM]
    return dict(version=__version__, header=HEADER, ok=int(Status.OK), out_of_memory=int(Status.OUT_OF_MEMORY),
                attention_rows=target_branches(targets, lambda t: t.attention_rows),
                collective_failed=int(Status.COLLECTIVE_FAILED), gemms=gemms,
                vectors=vectors, narrow=[v for d in GEMM for v in _narrow_variants(d, targets)],
                convs=[dict(ctype=D.C_TYPES[d], suffix=GEMM[d]["suffix"], SUFFIX=GEMM[d]["suffix"].upper(),
                            rows=CONV_ROWS, parallel_min=GEMM_PARALLEL_MIN,
                            tiles=target_branches(targets, lambda t: t.conv_vectors)) for d in GEMM],
                winograds=[dict(ctype=D.C_TYPES[d], suffix=GEMM[d]["suffix"], SUFFIX=GEMM[d]["suffix"].upper(),
                                parallel_min=GEMM_PARALLEL_MIN, **winograd.transforms(D.C_TYPES[d])) for d in GEMM])


def header() -> str:
    """`symgrad_runtime.h`: the status codes, the epilogue and context types, and a declaration
    of every function a program may call."""
    return _rendered(TARGETS)["header"]


def source(targets: tuple = TARGETS) -> str:
    """The runtime's C source (it includes `symgrad_runtime.h`), its kernels tiled for `targets`."""
    return _rendered(targets)["source"]


@lru_cache(maxsize=None)
def code_digest() -> str:
    """The sha256 of symgrad's Python sources and its templates: what the runtime's text and every
    program are rendered by (cache.code_digest of each tree, kept under the files' sizes and times)."""
    trees = [cache.code_digest(_PACKAGE, ".py"), cache.code_digest(Path(template_dir()), ".j2")]
    return hashlib.sha256("\n".join(trees).encode()).hexdigest()


@lru_cache(maxsize=None)
def _rendered(targets: tuple) -> dict:
    """The header and the source, rendered, or read back from the build cache.

    Rendering them takes 10-20 ms, a third of a warm compile, which needs only their text (the
    key of the library built from it): the texts are kept in the cache (`runtime/<hash>.h` and
    `.c`, with their checksum in `runtime/<hash>.json`) under a hash of what they are rendered
    from: symgrad's code and templates (`code_digest`, which the program cache's keys hold too),
    jinja2's version and the targets. A text that does not match its checksum is
    rendered again. (Keyed by the rendering context itself, a warm compile computed that context,
    digested the templates and decoded 350 KB of JSON: 5 ms.)
    """
    inputs = dict(code=code_digest(), jinja2=jinja2.__version__, targets=repr(targets))
    stem = cache.cache_dir() / "runtime" / cache.sha256_json(inputs)[:32]
    paths = {"header": stem.with_suffix(".h"), "source": stem.with_suffix(".c")}
    try:
        texts = {name: path.read_text() for name, path in paths.items()}
        if (cache.read_json(stem.with_suffix(".json")) or {}).get("sha256") == _checksum(texts):
            return texts
    except (OSError, ValueError):
        pass
    context = _context(targets)
    texts = {"header": render("runtime/runtime.h.j2", **context), "source": render("runtime/runtime.c.j2", **context)}
    try:  # a cache that cannot be written (read-only, removed meanwhile) only means rendering again
        stem.parent.mkdir(parents=True, exist_ok=True)
        for name, path in paths.items():
            cache.atomic_write(path, texts[name].encode())
        cache.atomic_write(stem.with_suffix(".json"), json.dumps({"sha256": _checksum(texts)}).encode())
    except OSError:
        pass
    return texts


def _checksum(texts: dict) -> str:
    return hashlib.sha256("\0".join([texts["header"], texts["source"]]).encode()).hexdigest()


def default_flags() -> list[str]:
    """The flags programs and the runtime are built with by default: the compiler's
    (`cache.default_flags()`: $SYMGRAD_CFLAGS, else DEFAULT_FLAGS) and this machine's vector width
    (`-DSG_VECTOR_BYTES=64` where its 64-byte multiply-adds run at least 1.5x the 32-byte rate:
    vector_width)."""
    flags = cache.default_flags()
    return flags + vector_flags(flags)


def build(flags: list[str] | None = None) -> cache.BuiltModule:
    """The runtime library built with `flags` (default: `default_flags()`, as programs), from
    the cache when it was built before with the same compiler: once per compiler and flags."""
    flags = default_flags() if flags is None else flags
    return cache.build(source(), "", flags=flags, kind="runtime", headers={HEADER: header()})

