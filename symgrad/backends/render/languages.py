"""What differs between the C-style languages symgrad emits, as data: one row per language.

The renderer (symgrad.backends.render.renderer) is the same for every language; it reads
a `Language` for the rest. As in tinygrad's C-style renderer, a new C-like target
is a new row here (and its templates), not a new renderer class.

- `extension`: the file extension of the language's kernel and program templates, which sit
  in a folder per kind beside the other language's (templates/loop/loop.c.j2,
  templates/loop/loop.cu.j2, ...); the statements inside kernels come from the shared
  templates/statements.j2.
- `memory`: who owns the buffers. "host": the program is a library called with
  host pointers and a workspace (C); "device": the program holds device memory in
  a state and copies inputs in and outputs out (CUDA).
- `printer`: dtype -> sympy expression printer for the fused nodes.
- `restrict`: the no-alias qualifier of kernel pointer parameters.
- `index`: how a kernel's loop nest maps to threads. "nested": one C loop per
  axis, the outer one split over an OpenMP team; "flat": one grid-stride index
  over the whole nest, split into the axes' indices (only those a view reads).
- `combine`: how the partial accumulators of a reduction combine. "simd": one
  thread owns a whole reduction and OpenMP `simd reduction(...)` clauses combine
  the vector lanes; "block": the threads of a block each fold a strided part,
  then a shared-memory tree combines them in a fixed order (deterministic).
- `reduced_at`: where a reduce kernel's accumulator and argmax's best index are
  read once the threads' parts are combined (C: the thread's own locals; CUDA:
  slot 0 of the block's shared arrays).
- `row_combine`: the expression that combines a row reduction's per-thread part
  `{value}` (of reduction `{op}` in C type `{ctype}`) across the threads: C's one
  thread per row has nothing to combine; CUDA calls the block-wide tree of
  templates/row/row.cu.j2.
- `max_fold`: how a reduce kernel's max folds an element. "flag": a plain `>`
  select (vectorizes) beside a "saw a NaN" flag applied at the end; "select": one
  select that lets a NaN in (what a block tree then compares pairwise). A row
  kernel folds with the flag in every language: each thread applies it to its
  part before the block combines.
- `column_sums`: a sum over leading axes into a contiguous axis gets a tiled
  kernel of its own (rows added into a tile of accumulators: vectorizes on a CPU).
- What it can build, consulted by decide (symgrad.backends.decide.decisions), which
  refuses a graph naming the op and the language rather than planning what
  render could not emit: `matmuls`, the products' implementations
  (symgrad.backends.kinds.matmul: the precompiled runtime's GEMMs and
  convolutions, or the tiled kernel of templates/matmul/gemm.cu.j2);
  `matmul_dtypes`; `matmul_batch_axes` (the most batch axes of one product, None: any; CUDA's
  GEMM walks its products' axes from a fixed-size record); `epilogues` (elementwise work fused
  into a product, run inside the runtime's GEMM); `reductions`; `collectives` (all_reduce through the
  caller's hook); `sized_variables` (every variable's size known when the program
  is made: the device program allocates them up front).
- `attention`: how a fused attention kernel walks its rows, which fixes the scratch the plan
  gives it (symgrad.backends.kinds.attention). "key blocks": a thread takes tiles of query rows
  against blocks of keys, k (and v) transposed per head in scratch, and the gradient's threads
  take whole heads (C). "rows": a row (a warp, or a thread) per query row for the forward and dq,
  then per key row summing its dk and dv over the query rows in a fixed order, reading each row's
  softmax (m, 1 / l) and D = g . out from a scratch of per-row statistics: no atomics, the same
  sums every run (CUDA).
- `declare_used_only`: the entry point declares typed pointers only for the
  buffers some launch passes (nvcc warns about unused locals).
- `helper_qualifiers`: the storage class of the helpers kernels call (sg_random_bits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import c_printer, cuda_printer
from ..status import Status


class Refusal(NotImplementedError):
    """A graph holding an op the language cannot build, refused by decide, before any planning."""


# templates/ holds a folder per kernel kind (each kind's C and CUDA side by side); the kinds
# whose template sits in another kind's folder:
TEMPLATE_FOLDER = {"reduce_columns": "reduce"}


@dataclass(frozen=True)
class Language:
    """One C-style target: everything the renderer does not decide the same way for all."""

    name: str
    extension: str
    memory: str                # "host" | "device"
    printer: Callable
    restrict: str
    index: str                 # "nested" | "flat"
    combine: str               # "simd" | "block"
    reduced_at: tuple          # (accumulator, argmax index) after the combine
    row_combine: str           # format of the combined row reduction: {op}, {ctype}, {value}
    max_fold: str              # "flag" | "select"
    column_sums: bool
    matmuls: tuple             # the matmul implementations it builds (kinds.matmul.IMPLEMENTATIONS)
    matmul_dtypes: tuple
    matmul_batch_axes: int | None  # the most batch axes of one product (None: any)
    epilogues: bool            # matmuls compute fused elementwise epilogues
    reductions: tuple
    collectives: bool
    sized_variables: bool      # variables must have sizes known at compile time
    attention: str             # "key blocks" | "rows": the fused attention's walk (and its scratch)
    declare_used_only: bool
    helper_qualifiers: str

    def refusal(self, node, why: str) -> "Refusal":
        """The error decide raises for a node this language cannot build: it names the op, the node
        and the language."""
        return Refusal(f"{node.op.name} {node.type_str}: {why} (language {self.name})")

    @property
    def program(self) -> str:
        """The program template: prelude, kernels, entry point."""
        return self.kernel_template("program")

    def kernel_template(self, kind: str) -> str:
        """The template of a kernel kind ("loop", "reduce", "reduce_columns", "row", "matmul", "program")
        in this language: templates/<kind's folder>/<kind>.<extension>.j2, beside the other languages'."""
        return f"{TEMPLATE_FOLDER.get(kind, kind)}/{kind}.{self.extension}.j2"


C_OPENMP = Language(
    name="C", extension="c", memory="host",
    printer=c_printer.printer, restrict="restrict",
    index="nested", combine="simd", reduced_at=("acc", "best"), row_combine="{value}",
    max_fold="flag", column_sums=True,
    matmuls=("gemm", "narrow", "bf16 gemm", "patch gemm", "winograd", "direct rows"),
    matmul_dtypes=("float32", "float64"), matmul_batch_axes=None, epilogues=True,
    reductions=("sum", "max", "argmax"), collectives=True, sized_variables=False, attention="key blocks",
    declare_used_only=False, helper_qualifiers="static inline",
)

CUDA = Language(
    name="CUDA", extension="cu", memory="device",
    printer=cuda_printer.printer, restrict="__restrict__",
    index="flat", combine="block", reduced_at=("s_acc[0]", "s_best[0]"),
    row_combine="sg_block_{op}<{ctype}>({value}, s_{ctype})", max_fold="select", column_sums=False,
    matmuls=("template gemm",), matmul_dtypes=("float32", "float64"), matmul_batch_axes=4, epilogues=False,
    reductions=("sum", "max", "argmax"), collectives=False, sized_variables=True, attention="rows",
    declare_used_only=True, helper_qualifiers="static __host__ __device__ __forceinline__",
)

# The C program's entry points, shared by its template and the cffi declarations that load it.
C_ENTRY = "symgrad_run"
# What the workspace must hold: the number of temporaries, and (given nbytes) the bytes each needs
# for these dims: the kernels' own sizes, against which a caller checks its arena.
C_WORKSPACE_SIZES = "symgrad_workspace_bytes"
# The bytes of the runtime's scratch region (sg_context.scratch) for these dims on the calling
# thread's team: what the runtime's own <function>_scratch_bytes say of each call it makes.
C_SCRATCH_BYTES = "symgrad_scratch_bytes"
# Caps the OpenMP team of the calling thread's later parallel regions.
C_SET_THREADS = "symgrad_set_num_threads"
C_SIGNATURE = (f"int {C_ENTRY}(const int64_t* dims, void** inputs, void** variables, void** outputs, "
               f"char* workspace, const int64_t* offsets, sg_context* context)")
# The profiling build's (render(..., profile=True)): lend the array its calls record each kernel's
# (kernel, start, end) into, and count the records made since.
C_PROFILE_EVENTS = "symgrad_profile_events"
C_PROFILE_COUNT = "symgrad_profile_count"
C_BAD_LABEL = Status.BAD_LABEL  # the entry's status when a class-label input holds a label outside [0, classes)
PARALLEL_MIN = 1 << 15   # elements: below this a C loop runs on one thread
COLUMN_TILE = 256        # accumulators per column tile of a column sum (a few KB on the stack)

CUDA_ENTRY = "sg_cuda_run"
CUDA_SIGNATURE = (f"int {CUDA_ENTRY}(void* handle, const int64_t* dims, void** inputs, void** outputs, "
                  f"const int64_t* offsets, int64_t arena_bytes, char* err, size_t errlen)")
CUDA_ALIGN = 256         # bytes: each workspace temporary starts where cudaMalloc would put a buffer
