"""`step.export(dir)`: a train step as a standalone C training library and program.

The export writes, into one directory:

    <name>.h            the C API: create / free a state, load / save a safetensors checkpoint,
                        set hyperparameters, the programs (one training step, the loss without an
                        update, predict), and the names, dtypes and shapes of the variables and of
                        each program's inputs and outputs, as tables and as query functions
    <name>.c            that API: it owns the variables (parameters, optimizer state, generator
                        state, step counters), sizes and plans the workspace from the batch size,
                        reads and writes safetensors in plain C. Code only: the values are in
    <name>.safetensors  the step's variables when exported (the library's own checkpoint layout;
                        <name>_load reads it, train_main loads it by default)
    <name>_step.c       the programs, the very source the C backend compiles (entry points renamed
    <name>_loss.c       with #defines), each of the kinds asked for by `programs=`
    <name>_predict.c
    <name>_runtime.c    the runtime the programs call (symgrad_runtime.h/.c, its GEMMs), its symbols
                        renamed <name>_sg_*: every global symbol of the library starts with <name>_,
                        so two exported models link into one program
    train_main.c        a training program (with a "step" program): a dataset file in, epochs of
                        shuffled batches, a warmup + cosine learning-rate schedule, the train and
                        validation loss printed, checkpoints written
    Makefile            `make` builds lib<name>.a (and train_main) with the flags the step used

`programs=("predict",)` exports an inference-only library: no optimizer state, no train_main; it
loads a training checkpoint, ignoring the entries it does not hold.

With backend="cuda" the programs are the CUDA backend's `.cu` files (nvcc; no runtime files), each
keeping its variables on the GPU; `<name>.c` moves a variable between the host and a program's
device copy only when another copy is newer (to save, to read, after a load).

Nothing needs Python, cffi or symgrad to build or run. What train_main does beside the library (its
dataset file, its shuffle, its learning-rate schedule) symgrad.tools.export_training does in Python, so
Python can write its data and reproduce its run. Templates: templates/export/*.j2; this module computes
names, tables and expressions.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sympy

from ..backends import c as c_backend
from ..backends.build import runtime
from ..backends.render.c_printer import printer
from ..backends.status import MEANINGS, Status
from ..backends.render.templates import render
from ..backends.build.toolchain import default_flags
from ..api.cells import current_value
from ..step.checkpoint import FORMAT
from .export_training import DTYPE_CODES, MAGIC, learning_rate, shuffle_order, write_dataset  # noqa: F401
from ..ir import dtypes as D
from ..ir.graph import Graph
from ..ir.ops import label_checks

SAFETENSORS_DTYPES = {"float32": "F32", "float64": "F64", "int32": "I32", "int64": "I64", "bool": "BOOL"}
# The CUDA program's host API, renamed per program (<name>_<kind>_...) so that two link together.
CUDA_RENAMES = (("sg_cuda_run", "run"), ("sg_cuda_create", "device_create"), ("sg_cuda_destroy", "device_destroy"),
                ("sg_cuda_write_variable", "write_variable"), ("sg_cuda_read_variable", "read_variable"),
                ("sg_cuda_device_count", "device_count"))
# The programs an export may hold: the training step, the step's loss without an update (train_main's
# validation loss), and predict (the predict= value(s); without predict=, the loss).
PROGRAMS = ("step", "loss", "predict")
# Variables whose exported value stays in the C source: scalars that configure a step rather than
# hold what it learnt (the learning rate, the generator's seed), so that a state created without a
# checkpoint, or loaded from a torch model's file (no optimizer state), still has them.
LITERAL_ROLES = ("hyper", "rng", "optimizer")
# What each program computes, as its header comment says.
_DOCS = {"step": "One training step (forward, backward, the optimizer's update)",
         "loss": "The step's loss, forward only, nothing updated (dropout and batch statistics as in\n"
                 "   training): train_main's validation loss",
         "predict": "Predict: the step's predict= value(s), forward only",
         "predict-loss": "Predict: the step had no predict=, so its forward outputs (the loss), nothing updated"}
BATCH = sympy.Symbol("batch", integer=True, positive=True)
WORDS_PER_LINE = 8
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# The learning rates a step reads: the first parameter group's "lr", the others' "param_groups.<k>.lr".
_LEARNING_RATE = re.compile(r"(lr|param_groups\.\d+\.lr)\Z")
_RUNTIME_SYMBOL = re.compile(r"^[A-Za-z_][\w \t*]*?\b(sg_\w+)\s*\(", re.M)


@dataclass
class _Program:
    """One exported program: its C source (as the backend compiles it), Dims, arena and graph."""
    kind: str
    source: str
    dims: list
    arena: object
    graph: Graph


def export(step, out_dir, name: str | None = None, backend: str = "c", programs=None) -> dict:
    """Write `step` as a C library and training program into `out_dir` (see the module doc).

    name: the library's name and the prefix of every global symbol (a C identifier); default:
    the stem of the Python file that calls export (else "model"). backend: "c" (the programs as
    C with OpenMP), or "cuda": the same API, the programs as `.cu` files (the CUDA backend's
    source, built by nvcc; variables live on the GPU and move to the host only to be saved or
    read). programs: which of "step", "loss", "predict" the library holds (default all three);
    ("predict",) is an inference-only library. The exported state (`<name>.safetensors`) is the
    step's current values (its parameters, optimizer state, generator, learning rate). Returns
    {file kind: path}. Refuses (ValueError) a name that is no C identifier, an unknown program,
    and a step whose inputs are not batches: one Dim (or none) leading every input.
    """
    if name is None:
        name = _default_name()
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"export: name must be a C identifier, got {name!r}")
    if backend not in ("c", "cuda"):
        raise ValueError(f"export: backend must be 'c' or 'cuda', got {backend!r}")
    kinds = _kinds(programs)
    cuda = backend == "cuda"
    exported = _programs(step, cuda, kinds)
    dim = _batch_dim(exported)
    variables = _variables(step, exported)
    # The flags the step's C programs were built with: the same compiler and flags, the same numbers.
    flags = list((step._options.get("flags") if step.backend == "c" else None) or default_flags())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    renamed = [] if cuda else [(s, f"{name}_{s}") for s in runtime_symbols()]
    contexts = [_program_context(k, p, name, dim, variables, cuda) for k, p in enumerate(exported)]
    by_kind = {c["kind"]: c for c in contexts}
    for c in contexts:
        c["doc"] = _DOCS[c["kind"] if c["kind"] != "predict" or step._predict is not None else "predict-loss"]
    checkpoint = _checkpoint_header(variables)
    context = dict(lib=name, LIB=name.upper(), version=_version(), statuses=_statuses(name), variables=variables,
                   programs=contexts, by_kind=by_kind, checkpoint=checkpoint,
                   hyper=[v for v in variables if v["role"] == "hyper"], trains="step" in by_kind,
                   learning_rates=[v for v in variables if v["role"] == "hyper" and _LEARNING_RATE.match(v["name"])],
                   fixed_batch=None if dim is None or isinstance(dim, sympy.Symbol) else int(dim),
                   dtype_codes=DTYPE_CODES, magic=MAGIC.decode(), runtime_header=runtime.HEADER,
                   has_predict=step._predict is not None, cuda=cuda, align=_cuda().ALIGN if cuda else c_backend.ALIGN,
                   flags=" ".join(flags), nvcc_flags=" ".join(_nvcc_flags()) if cuda else "",
                   weights=f"{name}.safetensors")
    files = {
        "header": (f"{name}.h", render("export/library.h.j2", **context)),
        "library": (f"{name}.c", render("export/library.c.j2", **context)),
        "makefile": ("Makefile", render("export/Makefile.j2", **context)),
    }
    if "step" in by_kind:
        files["train_main"] = ("train_main.c", render("export/train_main.c.j2", **context))
    if not cuda:
        files["runtime_header"] = (runtime.HEADER, runtime.header())
        files["runtime_source"] = ("symgrad_runtime.c", runtime.source())
        files["runtime"] = (f"{name}_runtime.c", f"/* {name}'s copy of symgrad's runtime: its symbols renamed "
                            f"{name}_sg_*, so that two exported libraries link into one program. */\n"
                            f"{_defines(renamed)}\n"
                            f'#include "symgrad_runtime.c"\n')
    for p, ctx in zip(exported, contexts):
        language = "CUDA" if cuda else "C"
        source = _in_namespace(p.source, f"{ctx['prefix']}_program") if cuda else p.source
        files[p.kind] = (f"{ctx['prefix']}.{'cu' if cuda else 'c'}", f"/* {name}'s {p.kind} program: symgrad's "
                         f"generated {language}, its entry points (and the runtime's) renamed. */\n"
                         f"{_defines(ctx['renames'] + renamed)}\n{source}")
    written = {}
    for kind, (filename, text) in files.items():
        path = out / filename
        path.write_text(text)
        written[kind] = path
    written["weights"] = out / context["weights"]
    _write_weights(written["weights"], variables, checkpoint)
    return written


def runtime_symbols() -> list[str]:
    """The runtime's global functions (declared in symgrad_runtime.h), which the export renames."""
    return sorted(set(_RUNTIME_SYMBOL.findall(runtime.header())))


def name_of(path: Path) -> str:
    """A C identifier from a file's name: its stem, non-identifier characters as `_`."""
    name = re.sub(r"\W", "_", path.stem, flags=re.ASCII)
    return name if _NAME.match(name) else f"model_{name}"


def _default_name() -> str:
    """The stem of the first Python file outside symgrad on the call stack (the user's script,
    the model's module), else "model" (an interactive session)."""
    package = Path(__file__).resolve().parents[1]  # symgrad/ (this is symgrad/tools/export.py)
    frame = sys._getframe(1)
    while frame is not None:
        file = frame.f_code.co_filename
        if file and not file.startswith("<"):
            path = Path(file).resolve()
            if package not in path.parents and path.suffix == ".py":
                return name_of(path)
        frame = frame.f_back
    return "model"


def _kinds(programs) -> list[str]:
    """The program kinds asked for, in PROGRAMS order; refuses an unknown one or none."""
    if programs is None:
        return list(PROGRAMS)
    asked = [programs] if isinstance(programs, str) else list(programs)
    unknown = [k for k in asked if k not in PROGRAMS]
    if unknown or not asked:
        raise ValueError(f"export: programs must be some of {PROGRAMS}, got {programs!r}")
    return [k for k in PROGRAMS if k in asked]


def _in_namespace(source: str, namespace: str) -> str:
    """A CUDA program's code after its #includes inside a C++ namespace: its kernels are global
    symbols with names of their own (k0_sum_t43), which another program of the same model, or of
    another model, may have too. Its extern "C" API keeps its (renamed) C names."""
    includes = list(re.finditer(r"^#include .*$", source, re.M))
    at = includes[-1].end() + 1 if includes else 0
    return f"{source[:at]}namespace {namespace} {{\n{source[at:]}\n}}  // namespace {namespace}\n"


def _defines(renames) -> str:
    return "".join(f"#define {old} {new}\n" for old, new in renames)


# ---- the programs -------------------------------------------------------------------------

def _graph_of(step, kind: str) -> Graph:
    """The graph of one program: the step's; its loss without updates; the predict= value's (the
    loss where there is none)."""
    if kind == "step":
        return step.graph
    if kind == "predict" and step._predict is not None:
        return step._build("predict")
    return Graph(step.graph.inputs, step.graph.outputs)


def _c_program(step, kind: str) -> _Program:
    """The program as the C backend compiles it: the step's own when it runs on C (the same source
    byte for byte, so the library computes what the step computes), else rendered for C now (the
    backend's stages without its build: no compiler runs here)."""
    from ..backends import driver
    compiled = step if kind == "step" else step._programs.get(kind)
    if compiled is not None and compiled.backend == "c":
        program = compiled.program
        return _Program(kind, program.source, list(program.dims), program.arena, program.graph)
    graph = _graph_of(step, kind)
    entry = driver.prepare(graph, c_backend.C_OPENMP).entry
    return _Program(kind, entry.source, list(entry.dims), entry.arena, graph)


def _programs(step, cuda: bool, kinds) -> list[_Program]:
    """The programs of `kinds`, in that order."""
    if cuda:
        return [_cuda_program(_graph_of(step, kind), kind) for kind in kinds]
    return [_c_program(step, kind) for kind in kinds]


def _cuda():
    from ..backends import cuda
    return cuda


def _nvcc_flags() -> list[str]:
    """nvcc's flags for object files: the CUDA backend's, without -shared (the Makefile links)."""
    from ..backends.build.toolchain import default_nvcc_flags
    flags = [f for f in default_nvcc_flags() if f != "-shared"]
    return flags + _cuda().arch_flags()


def _cuda_program(graph: Graph, kind: str) -> _Program:
    """The program as the CUDA backend renders it, through the same driver (no GPU or nvcc needed
    to render)."""
    from ..backends import driver
    from ..backends.render.languages import CUDA
    entry = driver.prepare(graph, CUDA).entry
    return _Program(kind, entry.source, list(entry.dims), entry.arena, graph)


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

    def shape_text(shape) -> str:  # the batch Dim as the API's `batch`
        if dim is None or not isinstance(dim, sympy.Symbol):
            return _shape_text(shape)
        return _shape_text([sympy.sympify(d).xreplace({dim: BATCH}) for d in shape])
    index = {v["name"]: v["index"] for v in variables}
    inputs = [dict(name=v.name, c_name=_c_string(v.name), ctype=D.C_TYPES[v.dtype], dtype=v.dtype,
                   code=DTYPE_CODES.get(v.dtype, 0), per_row=int(np.prod(v.shape[1:], dtype=np.int64)),
                   shape=shape_text(v.shape), sizes=[size(d) for d in v.shape], ident=_ident(v.name, k, name))
              for k, v in enumerate(p.graph.inputs)]
    names = _output_names(p, [i["ident"] for i in inputs])
    outputs = [dict(name=n, c_name=_c_string(n), ident=n, ctype=D.C_TYPES[v.dtype], dtype=v.dtype,
                    code=DTYPE_CODES.get(v.dtype, 0), numel=size(sympy.Mul(*v.shape)), shape=shape_text(v.shape),
                    sizes=[size(d) for d in v.shape], scalar=v.shape == ())
               for n, v in zip(names, p.graph.outputs)]
    labels = [dict(position=at, c_name=inputs[at]["c_name"], ctype=inputs[at]["ctype"],
                   numel=size(sympy.Mul(*p.graph.inputs[at].shape)), classes=size(node.attrs["num_classes"]),
                   ignore=node.attrs.get("ignore_index"))
              for at, node in label_checks(p.graph)]
    slots = [index[v.name] for v in p.graph.variables]
    renames = ([(old, f"{prefix}_{new}") for old, new in CUDA_RENAMES] if cuda else
               [(c_backend.ENTRY, f"{prefix}_run"), (c_backend.WORKSPACE_SIZES, f"{prefix}_temporaries"),
                (c_backend.SCRATCH_BYTES, f"{prefix}_scratch"), (c_backend.SET_THREADS, f"{prefix}_set_num_threads")])
    return dict(index=number, kind=p.kind, prefix=prefix, renames=renames,
                slot_of=[slots.index(v["index"]) if v["index"] in slots else -1 for v in variables],
                updated=sorted({index[t.name] for t, _ in p.graph.updates}), entry=f"{prefix}_run",
                dims=len(p.dims), inputs=inputs, outputs=outputs, slots=slots, labels=labels,
                sizes=[size(n) for n in p.arena.nbytes], live=[list(r) for r in p.arena.live])


def _output_names(p: _Program, taken: list[str]) -> list[str]:
    """C names of a program's outputs: the loss of the step and of the loss program is `loss`; a
    predict output its value's name where that is a safe identifier, else `output` (`output<k>`
    when there are several); made unique against the inputs' parameter names."""
    outputs = p.graph.outputs
    names = []
    for k, v in enumerate(outputs):
        if p.kind != "predict" and k == 0:
            base = "loss"
        elif v.name and _NAME.match(v.name) and v.name not in _RESERVED and not v.name.startswith(("sg", "out")):
            base = v.name
        else:
            base = "output" if len(outputs) == 1 else f"output{k}"
        name = base
        while name in taken or name in names:
            name += "_out"
        names.append(name)
    return names


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
status k i labels classes raw bytes main shape index""".split())


def _ident(name: str, k: int, lib: str) -> str:
    """A C parameter name for input `name`: the name itself when it is a safe identifier, else input<k>."""
    prefixes = ("sg", lib.lower(), "out", "input")
    safe = _NAME.match(name) and name not in _RESERVED and not name.lower().startswith(prefixes)
    return name if safe else f"input{k}"


# ---- the variables and the checkpoint -----------------------------------------------------

def _variables(step, programs: list[_Program]) -> list[dict]:
    """Every variable the programs use (the step's first) with its current value: as C words too
    for a scalar of LITERAL_ROLES (the rest is in the weights file only)."""
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
                            itemsize=value.itemsize, value=value, shape_text=_shape_text(v.shape),
                            init=_words(value) if v.attrs["role"] in LITERAL_ROLES and value.size == 1 else None))
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
    return dict(text=_c_bytes(text), raw=text, length=len(text), data_bytes=offset,
                dtypes=[dict(code=c, name=SAFETENSORS_DTYPES[d]) for d, c in DTYPE_CODES.items()])


def _write_weights(path: Path, variables: list[dict], checkpoint: dict) -> None:
    """The variables' values as the library's save writes them: the header's length, the header,
    each variable's bytes in order (little-endian)."""
    with open(path, "wb") as f:
        f.write(np.uint64(checkpoint["length"]).astype("<u8").tobytes())
        f.write(checkpoint["raw"])
        for v in variables:
            value = v["value"]
            f.write(value.astype(value.dtype.newbyteorder("<"), copy=False).tobytes())


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
    """The library's status codes (<NAME>_OK ...): symgrad's one Status enum, so that a status the
    entry returns reads the same through the library."""
    return [dict(name=f"{name.upper()}_{s.name}", value=int(s), text=MEANINGS[s]) for s in Status]


def _version() -> str:
    from ..version import __version__
    return __version__
