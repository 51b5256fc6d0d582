"""`step.export(dir)`: a train step as a standalone C training library and program.

The export writes, into one directory:

    <name>.h            the C API: create / free a training state, load / save a safetensors
                        checkpoint, set hyperparameters, one training step, predict
    <name>.c            that API: it owns the variables (parameters, optimizer state, generator
                        state, step counters), sizes and plans the workspace from the batch size,
                        reads and writes safetensors in plain C
    <name>_step.c       the step's program, the very source the C backend compiles (entry points
    <name>_predict.c    renamed with #defines), and the predict program's
    symgrad_runtime.h/.c  the runtime the programs call (GEMMs), compiled into the library
    train_main.c        a training program: a dataset file in, epochs of shuffled batches, the
                        loss printed, checkpoints written
    Makefile            `make` builds lib<name>.a and train_main with the flags the step used

With backend="cuda" the programs are the CUDA backend's `.cu` files (nvcc; no runtime files), each
keeping its variables on the GPU; `<name>.c` moves a variable between the host and a program's
device copy only when another copy is newer (to save, to read, after a load).

Nothing needs Python, cffi or symgrad to build or run. The dataset layout that train_main reads
(`write_dataset` writes it) is, all integers int64 little-endian:

    "SGDATA01"                          8 bytes of magic
    rows, arrays                        the row count, the number of arrays (the step's inputs)
    arrays x (dtype code, per_row)      DTYPE_CODES[dtype], elements per row
    the arrays, in input order          each rows x per_row elements, C order, little-endian

`shuffle_order(rows, seed, epoch)` is train_main's per-epoch shuffle, so Python can reproduce its
batches. Templates: templates/export/*.j2; this module computes names, tables and expressions.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sympy

from .backends import c as c_backend
from .backends import runtime
from .backends.c_printer import printer
from .backends.templates import render
from .backends.toolchain import default_flags
from .cells import current_value
from .checkpoint import FORMAT
from .ir import dtypes as D
from .ir.graph import Graph
from .ir.ops import label_checks

MAGIC = b"SGDATA01"
# The dtype codes of the dataset file (also the exported library's, for its variables).
DTYPE_CODES = {"float32": 1, "float64": 2, "int32": 3, "int64": 4, "bool": 5}
SAFETENSORS_DTYPES = {"float32": "F32", "float64": "F64", "int32": "I32", "int64": "I64", "bool": "BOOL"}
# The library's status codes: the runtime's and the program's first, as the entry returns them.
STATUSES = (("OK", "success"), ("OUT_OF_MEMORY", "out of memory"),
            ("BAD_LABEL", "a class label outside [0, classes)"), ("BAD_SIZE", "a bad batch size"),
            ("BAD_ARGUMENT", "a NULL or bad argument"), ("IO_ERROR", "a file could not be read or written"),
            ("BAD_CHECKPOINT", "a checkpoint that does not match the model"),
            ("NO_SUCH_VARIABLE", "no variable (or hyperparameter) of that name"),
            ("DEVICE_ERROR", "a CUDA call failed"))
# The CUDA program's host API, renamed per program (<name>_<kind>_...) so that two link together.
CUDA_RENAMES = (("sg_cuda_run", "run"), ("sg_cuda_create", "device_create"), ("sg_cuda_destroy", "device_destroy"),
                ("sg_cuda_write_variable", "write_variable"), ("sg_cuda_read_variable", "read_variable"),
                ("sg_cuda_device_count", "device_count"))
BATCH = sympy.Symbol("batch", integer=True, positive=True)
WORDS_PER_LINE = 8
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_MIX = 0x9E3779B97F4A7C15  # splitmix64's increment: the shuffle's generator (train_main.c's too)
_MASK = (1 << 64) - 1


@dataclass
class _Program:
    """One exported program: its C source (as the backend compiles it), Dims, arena and graph."""
    kind: str
    source: str
    dims: list
    arena: object
    graph: Graph


def export(step, out_dir, name: str = "model", backend: str = "c") -> dict:
    """Write `step` as a C library and training program into `out_dir` (see the module doc).

    backend: "c" (the programs as C with OpenMP), or "cuda": the same API, the programs as
    `.cu` files (the CUDA backend's source, built by nvcc; variables live on the GPU and move to
    the host only to be saved or read). The exported state starts from the step's current values
    (its parameters, optimizer state, generator, learning rate). Returns {file kind: path}.
    Refuses (ValueError) a name that is no C identifier and a step whose inputs are not batches:
    one Dim (or none) leading every input.
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"export: name must be a C identifier, got {name!r}")
    if backend not in ("c", "cuda"):
        raise ValueError(f"export: backend must be 'c' or 'cuda', got {backend!r}")
    cuda = backend == "cuda"
    programs = _programs(step, cuda)
    dim = _batch_dim(programs)
    variables = _variables(step, programs)
    # The flags the step's C programs were built with: the same compiler and flags, the same numbers.
    flags = list((step._options.get("flags") if step.backend == "c" else None) or default_flags())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    contexts = [_program_context(k, p, name, dim, variables, cuda) for k, p in enumerate(programs)]
    context = dict(lib=name, LIB=name.upper(), version=_version(), statuses=_statuses(name), variables=variables,
                   programs=contexts, checkpoint=_checkpoint_header(variables),
                   hyper=[v for v in variables if v["role"] == "hyper"],
                   fixed_batch=None if dim is None or isinstance(dim, sympy.Symbol) else int(dim),
                   dtype_codes=DTYPE_CODES, magic=MAGIC.decode(), runtime_header=runtime.HEADER,
                   has_predict=step._predict is not None, cuda=cuda, align=_cuda().ALIGN if cuda else c_backend.ALIGN, flags=" ".join(flags),
                   nvcc_flags=" ".join(_nvcc_flags()) if cuda else "")
    files = {
        "header": (f"{name}.h", render("export/library.h.j2", **context)),
        "library": (f"{name}.c", render("export/library.c.j2", **context)),
        "train_main": ("train_main.c", render("export/train_main.c.j2", **context)),
        "makefile": ("Makefile", render("export/Makefile.j2", **context)),
    }
    if not cuda:
        files["runtime_header"] = (runtime.HEADER, runtime.header())
        files["runtime"] = ("symgrad_runtime.c", runtime.source())
    for p, ctx in zip(programs, contexts):
        renames = "".join(f"#define {old} {new}\n" for old, new in ctx["renames"])
        language = "CUDA" if cuda else "C"
        files[p.kind] = (f"{ctx['prefix']}.{'cu' if cuda else 'c'}", f"/* {name}'s {p.kind} program: symgrad's "
                         f"generated {language}, its entry points renamed. */\n{renames}\n{p.source}")
    written = {}
    for kind, (filename, text) in files.items():
        path = out / filename
        path.write_text(text)
        written[kind] = path
    return written


def export_file(path, out_dir, name: str | None = None, backend: str = "c") -> dict:
    """`symgrad export FILE`: compile the step of FILE's build() (as `symgrad inspect` reads it;
    a dict may add "predict") on the C backend and export it for `backend`; `name` defaults to
    the file's."""
    from .inspect_cmd import load_build
    from .training import train_step

    path = Path(path)
    loss, params, optimizer, predict = load_build(path, with_predict=True)
    if name is None:
        name = re.sub(r"\W", "_", path.stem, flags=re.ASCII)
        name = name if _NAME.match(name) else f"model_{name}"
    step = train_step(loss, params, optimizer, backend="c", predict=predict)
    return export(step, out_dir, name=name, backend=backend)


# ---- the programs -------------------------------------------------------------------------

def _c_program(compiled, graph: Graph, kind: str) -> _Program:
    """The program as the C backend compiles it: the step's own when it runs on C (the same source
    byte for byte, so the library computes what the step computes), else compiled for C now."""
    program = compiled.program if compiled is not None and compiled.backend == "c" else c_backend.compile(graph)
    return _Program(kind, program.source, list(program.dims), program.arena, program.graph)


def _programs(step, cuda: bool) -> list[_Program]:
    """The step's program and the predict program: the predict= value's, else the step's forward
    outputs (the loss) without updates."""
    predict = step._build("predict") if step._predict is not None else Graph(step.graph.inputs, step.graph.outputs)
    if cuda:
        return [_cuda_program(step.graph, "step"), _cuda_program(predict, "predict")]
    compiled_predict = step.program_for("predict") if step._predict is not None and step.backend == "c" else None
    return [_c_program(step, step.graph, "step"), _c_program(compiled_predict, predict, "predict")]


def _cuda():
    from .backends import cuda
    return cuda


def _nvcc_flags() -> list[str]:
    """nvcc's flags for object files: the CUDA backend's, without -shared (the Makefile links)."""
    from .backends.toolchain import default_nvcc_flags
    flags = [f for f in default_nvcc_flags() if f != "-shared"]
    return flags + _cuda().arch_flags()


def _cuda_program(graph: Graph, kind: str) -> _Program:
    """The program as the CUDA backend renders it (no GPU or nvcc needed to render)."""
    from . import passes
    from .backends.lowering import lower
    from .backends.memory import ArenaSpec
    plan = lower(passes.optimize(graph), variables=graph.variables)
    return _Program(kind, _cuda().render_source(plan), list(plan.dims), ArenaSpec.of(plan), graph)


def _batch_dim(programs: list[_Program]):
    """The batch size every input leads with: the one Dim, or the fixed leading size if none."""
    dims = {d for p in programs for d in p.dims}
    if len(dims) > 1:
        raise ValueError(f"export: the step has Dims {sorted(map(str, dims))}; the C API binds one, the batch size")
    leading = set()
    for p in programs:
        for v in p.graph.inputs:
            rest = v.shape[1:]
            if not v.shape or not all(isinstance(s, (int, np.integer)) for s in rest):
                raise ValueError(f"export: input {v.name!r} has shape {list(v.shape)}; the C API takes batches "
                                 f"(the batch size first, fixed sizes after)")
            leading.add(v.shape[0])
    if dims:
        (dim,) = dims
        wrong = [v.name for p in programs for v in p.graph.inputs if v.shape[0] != dim]
        if wrong:
            raise ValueError(f"export: inputs {wrong} do not lead with the batch Dim {dim}")
        return dim
    if len(leading) > 1:
        raise ValueError(f"export: the inputs lead with different sizes {sorted(leading)}; expected one batch size")
    return int(leading.pop()) if leading else None


def _program_context(number: int, p: _Program, name: str, dim, variables: list[dict], cuda: bool) -> dict:
    """What the library template needs of one program: its renamed entry, argument tables, the
    workspace sizes printed as C expressions of `batch`, and the temporaries' lifetimes."""
    prefix = f"{name}_{p.kind}"
    size = _size_printer(dim)
    index = {v["name"]: v["index"] for v in variables}
    inputs = [dict(name=v.name, c_name=_c_string(v.name), ctype=D.C_TYPES[v.dtype], dtype=v.dtype,
                   per_row=int(np.prod(v.shape[1:], dtype=np.int64)), shape=_shape_text(v.shape),
                   ident=_ident(v.name, k, name)) for k, v in enumerate(p.graph.inputs)]
    outputs = [dict(ctype=D.C_TYPES[v.dtype], numel=size(sympy.Mul(*v.shape)), shape=_shape_text(v.shape),
                    scalar=v.shape == ()) for v in p.graph.outputs]
    labels = [dict(position=at, c_name=inputs[at]["c_name"], ctype=inputs[at]["ctype"],
                   numel=size(sympy.Mul(*p.graph.inputs[at].shape)), classes=size(node.attrs["num_classes"]),
                   ignore=node.attrs.get("ignore_index"))
              for at, node in label_checks(p.graph)]
    slots = [index[v.name] for v in p.graph.variables]
    renames = ([(old, f"{prefix}_{new}") for old, new in CUDA_RENAMES] if cuda else
               [(c_backend.ENTRY, f"{prefix}_run"), (c_backend.WORKSPACE_SIZES, f"{prefix}_temporaries"),
                (c_backend.SET_THREADS, f"{prefix}_set_num_threads")])
    return dict(index=number, kind=p.kind, prefix=prefix, renames=renames,
                slot_of=[slots.index(v["index"]) if v["index"] in slots else -1 for v in variables],
                updated=sorted({index[t.name] for t, _ in p.graph.updates}), entry=f"{prefix}_run",
                dims=len(p.dims), inputs=inputs, outputs=outputs, slots=slots, labels=labels,
                sizes=[size(n) for n in p.arena.nbytes], live=[list(r) for r in p.arena.live])


def _size_printer(dim):
    """int64 C text of a size: Dims become `batch` (the API's argument)."""
    ints = printer("int64")

    def size(value) -> str:
        expr = sympy.sympify(value)
        if dim is not None and isinstance(dim, sympy.Symbol):
            expr = expr.xreplace({dim: BATCH})
        return str(int(expr)) if expr.is_Integer else f"((int64_t)({ints.doprint(expr)}))"
    return size


# What an input's C parameter may not be called: C's keywords, the API functions' other parameters
# and locals, and the runtime's and the library's prefixes.
_RESERVED = set("""auto break case char const continue default do double else enum extern float for goto if
inline int long register restrict return short signed sizeof static struct switch typedef union unsigned void
volatile while _Bool _Complex _Imaginary bool true false NULL s w state batch dims inputs outputs variables
status k i labels classes raw bytes main""".split())


def _ident(name: str, k: int, lib: str) -> str:
    """A C parameter name for input `name`: the name itself when it is a safe identifier, else input<k>."""
    prefixes = ("sg", lib.lower(), "out", "input")
    safe = _NAME.match(name) and name not in _RESERVED and not name.lower().startswith(prefixes)
    return name if safe else f"input{k}"


# ---- the variables and the checkpoint -----------------------------------------------------

def _variables(step, programs: list[_Program]) -> list[dict]:
    """Every variable the programs use (the step's first), with its current value as C words."""
    seen, out = {}, []
    for p in programs:
        for v in p.graph.variables:
            if v.name in seen:
                continue
            seen[v.name] = len(out)
            value = np.ascontiguousarray(step._read_variable(v.name) if v.name in step._storage else current_value(v),
                                         dtype=D.to_numpy(v.dtype))
            if v.dtype not in SAFETENSORS_DTYPES:
                raise ValueError(f"export: variable {v.name!r} is {v.dtype}; a checkpoint holds "
                                 f"{sorted(SAFETENSORS_DTYPES)}")
            out.append(dict(index=len(out), name=v.name, c_name=_c_string(v.name), dtype=v.dtype,
                            code=DTYPE_CODES[v.dtype], ctype=D.C_TYPES[v.dtype], role=v.attrs["role"],
                            shape=[int(s) for s in v.shape], numel=int(value.size), nbytes=int(value.nbytes),
                            itemsize=value.itemsize, init=_words(value), shape_text=_shape_text(v.shape)))
    return out


def _words(value: np.ndarray) -> dict | None:
    """The value's bytes as unsigned words of its item size (exact, whatever the dtype); None if zero."""
    if not value.any():
        return None
    word = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[value.itemsize]
    words = value.reshape(-1).view(word)
    suffix = "ULL" if value.itemsize == 8 else "U"
    items = [f"0x{int(w):x}{suffix}" for w in words]
    rows = [", ".join(items[i:i + WORDS_PER_LINE]) for i in range(0, len(items), WORDS_PER_LINE)]
    return dict(ctype=f"uint{8 * value.itemsize}_t", rows=rows)


def _checkpoint_header(variables: list[dict]) -> dict:
    """The safetensors header of a checkpoint of these variables (static: their shapes are), as
    checkpoint.save writes it: metadata with the format and the roles, then each tensor in order."""
    roles = {v["name"]: v["role"] for v in variables}
    header, offset = {"__metadata__": {"format": FORMAT, "roles": json.dumps(roles)}}, 0
    for v in variables:
        header[v["name"]] = {"dtype": SAFETENSORS_DTYPES[v["dtype"]], "shape": v["shape"],
                             "data_offsets": [offset, offset + v["nbytes"]]}
        v["offset"] = offset
        offset += v["nbytes"]
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return dict(text=_c_bytes(text), length=len(text), data_bytes=offset,
                dtypes=[dict(code=c, name=SAFETENSORS_DTYPES[d]) for d, c in DTYPE_CODES.items()])


# ---- C text -------------------------------------------------------------------------------

def _c_bytes(data: bytes) -> str:
    """A C string literal holding exactly `data`: printable ASCII kept, the rest octal escapes, and
    so are `*` and `/`, so that the literal is safe inside a comment too."""
    out = []
    for byte in data:
        ch = chr(byte)
        out.append(ch if 32 <= byte < 127 and ch not in '"\\?*/' else f"\\{byte:03o}")
    return '"' + "".join(out) + '"'


def _c_string(text: str) -> str:
    """A user's name as a C string literal (UTF-8): no name enters C unescaped."""
    return _c_bytes(text.encode())


def _shape_text(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _statuses(name: str) -> list[dict]:
    return [dict(name=f"{name.upper()}_{s}", value=k, text=t) for k, (s, t) in enumerate(STATUSES)]


def _version() -> str:
    from . import __version__
    return __version__


# ---- datasets ------------------------------------------------------------------------------

def write_dataset(path, arrays) -> None:
    """Write arrays (the step's inputs, in input order; one row per example) as train_main reads them."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    if not arrays or any(a.ndim == 0 for a in arrays):
        raise ValueError("write_dataset: give one or more arrays of at least one axis (rows first)")
    rows = arrays[0].shape[0]
    header = [rows, len(arrays)]
    for k, a in enumerate(arrays):
        dtype = a.dtype.name
        if a.shape[0] != rows or dtype not in DTYPE_CODES:
            raise ValueError(f"write_dataset: array {k} is {dtype}{list(a.shape)}; expected {rows} rows of "
                             f"one of {sorted(DTYPE_CODES)}")
        header += [DTYPE_CODES[dtype], int(np.prod(a.shape[1:], dtype=np.int64))]
    with open(path, "wb") as f:
        f.write(MAGIC + np.asarray(header, dtype="<i8").tobytes())
        for a in arrays:
            f.write(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes())


def shuffle_order(rows: int, seed: int, epoch: int) -> np.ndarray:
    """The row order of epoch `epoch` as train_main shuffles it: Fisher-Yates driven by splitmix64
    seeded with seed + (epoch + 1) * 0x9E3779B97F4A7C15 (mod 2**64)."""
    state = (seed + (epoch + 1) * _MIX) & _MASK
    order = list(range(rows))
    for i in range(rows - 1, 0, -1):
        state = (state + _MIX) & _MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        z ^= z >> 31
        j = z % (i + 1)
        order[i], order[j] = order[j], order[i]
    return np.asarray(order, dtype=np.int64)

