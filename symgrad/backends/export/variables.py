"""The exported library's variables: their values and C literals, the checkpoint header, the weights file.

The values are the step's when it exports (the step hands a reader of them to `variables`); a
scalar that configures the step rather than holds what it learnt stays in the C source too
(LITERAL_ROLES), so a state created without a checkpoint still has it. The header and the weights
file are laid out as symgrad.step.checkpoint's save writes a safetensors checkpoint, so that the
library loads Python's checkpoints and Python loads the library's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ...ir import dtypes as D
from .formats import DTYPE_CODES

SAFETENSORS_DTYPES = {"float32": "F32", "float64": "F64", "int32": "I32", "int64": "I64", "bool": "BOOL"}
# Variables whose exported value stays in the C source: scalars that configure a step rather than
# hold what it learnt (the learning rate, the generator's seed), so that a state created without a
# checkpoint, or loaded from a torch model's file (no optimizer state), still has them.
LITERAL_ROLES = ("hyper", "rng", "optimizer")
WORDS_PER_LINE = 8


def read_variables(graphs, value_of) -> list[dict]:
    """Every variable the programs' `graphs` use (the first program's first), with its value
    `value_of(variable)`: as C words too for a scalar of LITERAL_ROLES (the rest is in the weights
    file only)."""
    seen, out = set(), []
    for graph in graphs:
        for v in graph.variables:
            if v.name in seen:
                continue
            seen.add(v.name)
            value = np.ascontiguousarray(value_of(v), dtype=D.to_numpy(v.dtype))
            if v.dtype not in SAFETENSORS_DTYPES:
                raise ValueError(f"export: variable {v.name!r} is {v.dtype}; a checkpoint holds "
                                 f"{sorted(SAFETENSORS_DTYPES)}")
            out.append(dict(index=len(out), name=v.name, c_name=c_string(v.name), dtype=v.dtype,
                            code=DTYPE_CODES[v.dtype], ctype=D.C_TYPES[v.dtype], role=v.attrs["role"],
                            shape=[int(s) for s in v.shape], numel=int(value.size), nbytes=int(value.nbytes),
                            itemsize=value.itemsize, value=value, shape_text=shape_text(v.shape),
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


def checkpoint_header(variables: list[dict], checkpoint_format: str) -> dict:
    """The safetensors header of a checkpoint of these variables (static: their shapes are), as
    symgrad.step.checkpoint's save writes it: metadata with the format and the roles, then each
    tensor in order."""
    roles = {v["name"]: v["role"] for v in variables}
    header, offset = {"__metadata__": {"format": checkpoint_format, "roles": json.dumps(roles)}}, 0
    for v in variables:
        header[v["name"]] = {"dtype": SAFETENSORS_DTYPES[v["dtype"]], "shape": v["shape"],
                             "data_offsets": [offset, offset + v["nbytes"]]}
        v["offset"] = offset
        offset += v["nbytes"]
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return dict(text=c_bytes(text), raw=text, length=len(text), data_bytes=offset,
                dtypes=[dict(code=c, name=SAFETENSORS_DTYPES[d]) for d, c in DTYPE_CODES.items()])


def write_weights(path: Path, variables: list[dict], checkpoint: dict) -> None:
    """The variables' values as the library's save writes them: the header's length, the header,
    each variable's bytes in order (little-endian)."""
    with open(path, "wb") as f:
        f.write(np.uint64(checkpoint["length"]).astype("<u8").tobytes())
        f.write(checkpoint["raw"])
        for v in variables:
            value = v["value"]
            f.write(value.astype(value.dtype.newbyteorder("<"), copy=False).tobytes())


# ---- C text -------------------------------------------------------------------------------

def c_bytes(data: bytes) -> str:
    """A C string literal holding exactly `data`: printable ASCII kept, the rest octal escapes, and
    so are `*` and `/`, so that the literal is safe inside a comment too."""
    out = []
    for byte in data:
        ch = chr(byte)
        out.append(ch if 32 <= byte < 127 and ch not in '"\\?*/' else f"\\{byte:03o}")
    return '"' + "".join(out) + '"'


def c_string(text: str) -> str:
    """A user's name as a C string literal (UTF-8): no name enters C unescaped."""
    return c_bytes(text.encode())


def shape_text(shape) -> str:
    """A shape as the library's tables and comments print it: [B, 784]."""
    return "[" + ", ".join(str(s) for s in shape) + "]"
