"""The export's library: the files `step.export(dir)` writes, and each program's tables and expressions.

`write` takes what the step gathered (symgrad/step/exporting.py): its programs (`compiled`: the
source a C program was built from; `rendered`: a graph through the driver's stages, for C or CUDA,
no compiler run) and a reader of its variables' values; it renders templates/export/*.j2 around
them (the module doc of symgrad.backends.export lists the files).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sympy

from .. import c as c_backend
from ..build import runtime
from ..render.c_printer import printer
from ..render.templates import render
from ..status import MEANINGS, Status
from ...ir import dtypes as D
from ...ir.graph import Graph
from ...ir.ops import label_checks
from ...version import __version__
from .formats import C_NAME, DTYPE_CODES, MAGIC
from .variables import c_string, checkpoint_header, read_variables, shape_text, write_weights

# The CUDA program's host API, renamed per program (<name>_<kind>_...) so that two link together.
CUDA_RENAMES = (("sg_cuda_run", "run"), ("sg_cuda_create", "device_create"), ("sg_cuda_destroy", "device_destroy"),
                ("sg_cuda_write_variable", "write_variable"), ("sg_cuda_read_variable", "read_variable"),
                ("sg_cuda_device_count", "device_count"))
# The programs an export may hold: the training step, the step's loss without an update (train_main's
# validation loss), and predict (the predict= value(s); without predict=, the loss).
PROGRAMS = ("step", "loss", "predict")
# What each program computes, as its header comment says.
_DOCS = {"step": "One training step (forward, backward, the optimizer's update)",
         "loss": "The step's loss, forward only, nothing updated (dropout and batch statistics as in\n"
                 "   training): train_main's validation loss",
         "predict": "Predict: the step's predict= value(s), forward only",
         "predict-loss": "Predict: the step had no predict=, so its forward outputs (the loss), nothing updated"}
BATCH = sympy.Symbol("batch", integer=True, positive=True)
# The learning rates a step reads: the first parameter group's "lr", the others' "param_groups.<k>.lr".
_LEARNING_RATE = re.compile(r"(lr|param_groups\.\d+\.lr)\Z")
_RUNTIME_SYMBOL = re.compile(r"^[A-Za-z_][\w \t*]*?\b(sg_\w+)\s*\(", re.M)


@dataclass
class Program:
    """One exported program: its C (or CUDA) source as the backend compiles it, Dims, arena and graph."""
    kind: str
    source: str
    dims: list
    arena: object
    graph: Graph


def kinds(programs) -> list[str]:
    """The program kinds asked for (`programs=` of step.export: one, several, or None for all), in
    PROGRAMS order; refuses (ValueError) an unknown one or none."""
    if programs is None:
        return list(PROGRAMS)
    asked = [programs] if isinstance(programs, str) else list(programs)
    unknown = [k for k in asked if k not in PROGRAMS]
    if unknown or not asked:
        raise ValueError(f"export: programs must be some of {PROGRAMS}, got {programs!r}")
    return [k for k in PROGRAMS if k in asked]


def check_arguments(name, backend: str) -> None:
    """Refuses (ValueError) a library name that is no C identifier, and a backend but "c" or "cuda"."""
    if not isinstance(name, str) or not C_NAME.match(name):
        raise ValueError(f"export: name must be a C identifier, got {name!r}")
    if backend not in ("c", "cuda"):
        raise ValueError(f"export: backend must be 'c' or 'cuda', got {backend!r}")


def compiled(kind: str, program) -> Program:
    """A C program as it was built (`program` of a step on the C backend): the same source byte for
    byte, so the library computes what the step computes."""
    return Program(kind, program.source, list(program.dims), program.arena, program.graph)


def rendered(kind: str, graph: Graph, cuda: bool) -> Program:
    """`graph` rendered for C (with OpenMP) or CUDA through the driver's stages, without the build:
    no compiler, nvcc or GPU runs here."""
    from .. import driver
    if cuda:
        from ..render.languages import CUDA as language
    else:
        language = c_backend.C_OPENMP
    entry = driver.prepare(graph, language).entry
    return Program(kind, entry.source, list(entry.dims), entry.arena, graph)


def write(out_dir, name: str, programs: list[Program], value_of, *, cuda: bool, flags, has_predict: bool,
          checkpoint_format: str) -> dict:
    """Write `programs` as a C library (and, with a "step" program, train_main) into `out_dir`.

    name: the library's name and the prefix of every global symbol (check_arguments checked it).
    value_of(variable): the variable's value now, as the weights file holds it. cuda: the programs
    are CUDA (`.cu`, no runtime files). flags: the C compiler's (the step's: the same compiler and
    flags, the same numbers; runtime.default_flags() if None). has_predict: the step had predict= (else its
    predict program is the loss). checkpoint_format: symgrad.step.checkpoint's FORMAT, written
    in the weights file's metadata. Returns {file kind: path}. Refuses (ValueError) programs whose
    inputs are not batches: one Dim (or none) leading every input.
    """
    dim = _batch_dim(programs)
    held = read_variables([p.graph for p in programs], value_of)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    renamed = [] if cuda else [(s, f"{name}_{s}") for s in runtime_symbols()]
    contexts = [_program_context(k, p, name, dim, held, cuda) for k, p in enumerate(programs)]
    for c in contexts:
        c["doc"] = _DOCS[c["kind"] if c["kind"] != "predict" or has_predict else "predict-loss"]
    context = _library_context(name, contexts, held, checkpoint_header(held, checkpoint_format), dim, cuda,
                               list(flags or runtime.default_flags()), has_predict)
    files = {
        "header": (f"{name}.h", render("export/library.h.j2", **context)),
        "library": (f"{name}.c", render("export/library.c.j2", **context)),
        "makefile": ("Makefile", render("export/Makefile.j2", **context)),
    }
    if context["trains"]:
        files["train_main"] = ("train_main.c", render("export/train_main.c.j2", **context))
    if not cuda:
        files["runtime_header"] = (runtime.HEADER, runtime.header())
        files["runtime_source"] = ("symgrad_runtime.c", runtime.source())
        files["runtime"] = (f"{name}_runtime.c", f"/* {name}'s copy of symgrad's runtime: its symbols renamed "
                            f"{name}_sg_*, so that two exported libraries link into one program. */\n"
                            f"{_defines(renamed)}\n"
                            f'#include "symgrad_runtime.c"\n')
    for p, ctx in zip(programs, contexts):
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
    write_weights(written["weights"], held, context["checkpoint"])
    return written


def _library_context(name: str, contexts: list[dict], held: list[dict], checkpoint: dict, dim, cuda: bool,
                     flags: list[str], has_predict: bool) -> dict:
    """What the library's templates read: its name, statuses, variables, programs and build flags."""
    by_kind = {c["kind"]: c for c in contexts}
    return dict(lib=name, LIB=name.upper(), version=__version__, statuses=statuses(name), variables=held,
                programs=contexts, by_kind=by_kind, checkpoint=checkpoint,
                hyper=[v for v in held if v["role"] == "hyper"], trains="step" in by_kind,
                learning_rates=[v for v in held if v["role"] == "hyper" and _LEARNING_RATE.match(v["name"])],
                fixed_batch=None if dim is None or isinstance(dim, sympy.Symbol) else int(dim),
                dtype_codes=DTYPE_CODES, magic=MAGIC.decode(), runtime_header=runtime.HEADER,
                has_predict=has_predict, cuda=cuda, align=_cuda().ALIGN if cuda else c_backend.ALIGN,
                flags=" ".join(flags), nvcc_flags=" ".join(_nvcc_flags()) if cuda else "",
                weights=f"{name}.safetensors")


def runtime_symbols() -> list[str]:
    """The runtime's global functions (declared in symgrad_runtime.h), which the export renames."""
    return sorted(set(_RUNTIME_SYMBOL.findall(runtime.header())))


def _in_namespace(source: str, namespace: str) -> str:
    """A CUDA program's code after its #includes inside a C++ namespace: its kernels are global
    symbols with names of their own (k0_sum_t43), which another program of the same model, or of
    another model, may have too. Its extern "C" API keeps its (renamed) C names."""
    includes = list(re.finditer(r"^#include .*$", source, re.M))
    at = includes[-1].end() + 1 if includes else 0
    return render("export/namespace.cu.j2", head=source[:at], body=source[at:], namespace=namespace)


def _defines(renames) -> str:
    """#define lines renaming each (old, new) pair: how a program keeps its source and takes the library's names."""
    return "".join(f"#define {old} {new}\n" for old, new in renames)


def _cuda():
    from .. import cuda
    return cuda


def _nvcc_flags() -> list[str]:
    """nvcc's flags for object files: the CUDA backend's, without -shared (the Makefile links)."""
    from ..build.toolchain import default_nvcc_flags
    flags = [f for f in default_nvcc_flags() if f != "-shared"]
    return flags + _cuda().arch_flags()


def _batch_dim(programs: list[Program]):
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


def _program_context(number: int, p: Program, name: str, dim, variables: list[dict], cuda: bool) -> dict:
    """What the library template needs of one program: its renamed entry, argument tables, the
    workspace sizes printed as C expressions of `batch`, and the temporaries' lifetimes."""
    prefix = f"{name}_{p.kind}"
    size = _size_printer(dim)

    def batch_shape(shape) -> str:  # the batch Dim as the API's `batch`
        if dim is None or not isinstance(dim, sympy.Symbol):
            return shape_text(shape)
        return shape_text([sympy.sympify(d).xreplace({dim: BATCH}) for d in shape])
    index = {v["name"]: v["index"] for v in variables}
    inputs = [dict(name=v.name, c_name=c_string(v.name), ctype=D.C_TYPES[v.dtype], dtype=v.dtype,
                   code=DTYPE_CODES.get(v.dtype, 0), per_row=int(np.prod(v.shape[1:], dtype=np.int64)),
                   shape=batch_shape(v.shape), sizes=[size(d) for d in v.shape], ident=_ident(v.name, k, name))
              for k, v in enumerate(p.graph.inputs)]
    names = _output_names(p, [i["ident"] for i in inputs])
    outputs = [dict(name=n, c_name=c_string(n), ident=n, ctype=D.C_TYPES[v.dtype], dtype=v.dtype,
                    code=DTYPE_CODES.get(v.dtype, 0), numel=size(sympy.Mul(*v.shape)), shape=batch_shape(v.shape),
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


def _output_names(p: Program, taken: list[str]) -> list[str]:
    """C names of a program's outputs: the loss of the step and of the loss program is `loss`; a
    predict output its value's name where that is a safe identifier, else `output` (`output<k>`
    when there are several); made unique against the inputs' parameter names."""
    outputs = p.graph.outputs
    names = []
    for k, v in enumerate(outputs):
        if p.kind != "predict" and k == 0:
            base = "loss"
        elif v.name and C_NAME.match(v.name) and v.name not in _RESERVED and not v.name.startswith(("sg", "out")):
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
    safe = C_NAME.match(name) and name not in _RESERVED and not name.lower().startswith(prefixes)
    return name if safe else f"input{k}"


def statuses(name: str) -> list[dict]:
    """The library's status codes (<NAME>_OK ...): symgrad's one Status enum, so that a status the
    entry returns reads the same through the library."""
    return [dict(name=f"{name.upper()}_{s.name}", value=int(s), text=MEANINGS[s]) for s in Status]

