"""The Python module that makes a plain shared library importable by name: `_symgrad_<hash>.py`.

A C or CUDA program is a plain shared library (no Python C-API) loaded with cffi's ABI mode.
Beside it in the cache directory the build cache (symgrad.backends.build.cache) writes a small
pure-Python module of the entry's name, so that with the cache directory on `sys.path`

    import _symgrad_<hash> as m      # in any process: needs cffi (and NumPy for `run`), not symgrad

gives `m.lib` (the library's functions), `m.ffi` (cffi's FFI with the declarations),
`m.CDEF` (those declarations), `m.source` (the C or CUDA text, byte for byte what was
compiled) and `m.LIBRARY` (the library's path). A backend adds the functions that call its
entry point with NumPy arrays (`c_helpers`: the C program's `run` and `workspace_sizes`).

The library is named `lib_symgrad_<hash>.so`, not `_symgrad_<hash>.so`: Python's importer tries
extension modules before source files, and would take a `.so` of the module's own name for a
C extension (which it is not) before ever reading the `.py`.

This module imports nothing of symgrad: the text it writes must run where symgrad is absent.
"""

from __future__ import annotations


def library_file(name: str) -> str:
    """The file name of the shared library that module `name` loads."""
    return f"lib{name}.so"


def text(name: str, cdef: str, source_file: str, helpers: str = "") -> str:
    """The Python text of module `name`: it declares `cdef`, opens `library_file(name)` from its own
    directory and reads `source_file` from there; `helpers`: Python text appended (functions using
    `ffi` and `lib`)."""
    declared = f'"""\\\n{cdef}"""' if '"""' not in cdef and "\\" not in cdef else repr(cdef)
    return f'''"""{name}: a program compiled by symgrad, importable without symgrad (needs cffi).

Written by symgrad beside its library {library_file(name)}
and its source {source_file}. Do not edit it: symgrad writes it again.
`lib`: the library's functions (cffi ABI mode), `ffi`: the FFI declaring them (`CDEF`),
`source`: the text that was compiled, byte for byte, `LIBRARY`: the library's path.
"""

import os as _os

import cffi as _cffi

_HERE = _os.path.dirname(_os.path.abspath(__file__))
CDEF = {declared}
LIBRARY = _os.path.join(_HERE, {library_file(name)!r})
SOURCE_PATH = _os.path.join(_HERE, {source_file!r})

ffi = _cffi.FFI()
ffi.cdef(CDEF)
lib = ffi.dlopen(LIBRARY)
with open(SOURCE_PATH, encoding="utf-8", newline="") as _file:
    source = _file.read()
{helpers}'''


def c_helpers(entry: str, workspace_sizes: str, scratch_bytes: str, align: int) -> str:
    """Python text of the C program's NumPy call: `run(dims, inputs, variables, outputs)` and
    `workspace_sizes(dims)`, for the entry point `entry`, its sizes function `workspace_sizes` and
    its runtime scratch function `scratch_bytes` (symgrad.backends.render.languages' C_ENTRY,
    C_WORKSPACE_SIZES and C_SCRATCH_BYTES); `align`: where each temporary starts, in bytes."""
    return f'''

ALIGN = {align}  # bytes: where each workspace temporary starts


def workspace_sizes(dims):
    """The bytes of each temporary the program needs for these Dim values ({workspace_sizes})."""
    count = lib.{workspace_sizes}(ffi.NULL, ffi.NULL)
    sizes = ffi.new("int64_t[]", max(count, 1))
    lib.{workspace_sizes}(ffi.new("int64_t[]", [int(d) for d in dims] or [0]), sizes)
    return list(sizes)[:count]


def run(dims, inputs, variables=(), outputs=()):
    """Call the program's entry point on NumPy arrays; returns `outputs`.

        int {entry}(const int64_t* dims, void** inputs, void** variables, void** outputs,
                    char* workspace, const int64_t* offsets, sg_context* context)

    The orders are those of the comment at the top of `source`:
    `graph(<inputs>) vars(<variables>) {{ ... return (<outputs>) }}`.
    dims: the value of each Dim (symbolic size), in the order symgrad's program lists them
    (`step.program.dims`; the Dims of the inputs' shapes, first seen first).
    inputs: C-contiguous arrays of the inputs' dtypes and shapes, read only.
    variables: writeable C-contiguous arrays (parameters, optimizer state, hyperparameters such as
    `lr`), updated in place as symgrad's step updates them.
    outputs: writeable C-contiguous arrays of the outputs' dtypes and shapes, written.

    Nothing is checked but contiguity and writeability: an array of another shape or dtype is
    read or written out of bounds (symgrad's calls check all of that first). Each temporary gets
    bytes of its own here (symgrad's memory plan shares them). Raises RuntimeError on a nonzero
    status (2: a class label outside [0, classes), nothing changed).
    """
    import numpy as np

    dims = [int(d) for d in dims]
    offsets, total = [], 0
    for size in workspace_sizes(dims):
        offsets.append(total)
        total += -(-size // ALIGN) * ALIGN
    # the runtime's scratch (GEMM panels, Winograd blocks) for the calling thread's OpenMP team, last
    scratch = int(lib.{scratch_bytes}(ffi.new("int64_t[]", dims or [0])))
    raw = np.zeros(total + scratch + 2 * ALIGN, dtype=np.uint8)
    shift = (-raw.ctypes.data) % ALIGN
    workspace = raw[shift:shift + total + scratch + ALIGN]
    keep = []

    def pointers(arrays, what, writeable):
        table = ffi.new("void*[]", max(len(arrays), 1))
        for k, array in enumerate(arrays):
            if not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
                raise TypeError(f"{{what}} {{k}}: a C-contiguous numpy.ndarray is needed, got {{type(array).__name__}}")
            keep.append(ffi.from_buffer(array, require_writable=writeable))
            table[k] = keep[-1]
        return table

    context = ffi.new("sg_context*")
    context.scratch, context.scratch_bytes = ffi.from_buffer(workspace) + total, scratch
    status = lib.{entry}(ffi.new("int64_t[]", dims or [0]), pointers(inputs, "input", False),
                         pointers(variables, "variable", True), pointers(outputs, "output", True),
                         ffi.from_buffer(workspace), ffi.new("int64_t[]", offsets or [0]), context)
    if status != 0:
        failed = ffi.string(context.failed).decode() if context.failed != ffi.NULL else ""
        raise RuntimeError(f"{entry} returned status {{status}}" + (f" in kernel {{failed}}" if failed else ""))
    return outputs
'''
