"""What a fresh process loads to compile: the cffi declarations come from the cache (no C parser),
and the derivatives of an MLP, or of a LayerNorm trained by AdamW (sqrt's), need no sympy.simplify
(whose first call imports sympy.physics.units).

Each check runs a child process with its own cache directory, since what a process has
imported cannot be undone in this one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from symgrad.backends import c
from symgrad.backends.build import ffi

REPO = Path(__file__).resolve().parents[2]

_CHILD = r"""
import json, sys
import numpy as np
import symgrad as sg
x = sg.input("x", (8, 5))
y = sg.input("y", (8,), dtype="int64")
W1, b1 = sg.param("W1", (5, 7), init="normal"), sg.param("b1", (7,), init="zeros")
W2, b2 = sg.param("W2", (7, 3), init="normal"), sg.param("b2", (3,), init="zeros")
hidden = sg.relu(x @ W1 + b1)
optimizer = sg.optim.SGD(lr=0.1)
if sys.argv[2:] == ["norm"]:  # a LayerNorm and AdamW: square roots
    hidden = sg.layer_norm(hidden, (7,))
    optimizer = sg.optim.AdamW(lr=0.01)
loss = sg.cross_entropy(hidden @ W2 + b2, y)
step = sg.train_step(loss, params=[W1, b1, W2, b2], optimizer=optimizer, backend=sys.argv[1])
value = step(x=np.ones((8, 5), np.float32), y=np.arange(8) % 3)
print(json.dumps({"loss": float(value), "modules": sorted(m for m in sys.modules
                  if m.startswith(("pycparser", "sympy.physics")))}))
"""


def _child(backend: str, cache: Path, *model: str) -> dict:
    # -O0: the child's empty cache builds the C runtime first, 2 s so, 13 s at the default -O3
    env = {**os.environ, "SYMGRAD_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1",
           "SYMGRAD_CFLAGS": "-O0 -fopenmp -std=c11 -fno-math-errno",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", _CHILD, backend, *model], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"the child failed ({done.returncode}):\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model", [(), ("norm",)], ids=["mlp", "layer_norm_adamw"])
def test_a_cold_compile_never_imports_sympy_physics(tmp_path, model):
    child = _child("numpy", tmp_path / "cache", *model)
    assert not [m for m in child["modules"] if m.startswith("sympy.physics")], child["modules"]


def test_a_second_process_loads_a_c_program_without_a_c_parser(tmp_path):
    first = _child("c", tmp_path / "cache")
    assert list((tmp_path / "cache" / ffi.DIRECTORY).glob("_symgrad_ffi_*.py")), "no declarations module written"
    second = _child("c", tmp_path / "cache")
    assert second["loss"] == first["loss"]
    assert not [m for m in second["modules"] if m.startswith("pycparser")], second["modules"]


def test_a_damaged_declarations_module_is_written_again(tmp_path, monkeypatch):
    monkeypatch.setenv("SYMGRAD_CACHE_DIR", str(tmp_path))
    ffi.declared.cache_clear()
    try:
        ffi.declared(c.CDEF)
        (module,) = (tmp_path / ffi.DIRECTORY).glob("_symgrad_ffi_*.py")
        module.write_text("this is not python (\n")
        ffi.declared.cache_clear()
        declared = ffi.declared(c.CDEF)
        assert declared.sizeof("sg_context") > 0
        compile(module.read_text(), str(module), "exec")  # whole again
    finally:
        ffi.declared.cache_clear()


def test_the_declarations_read_back_are_the_ones_parsed(tmp_path, monkeypatch):
    import cffi

    monkeypatch.setenv("SYMGRAD_CACHE_DIR", str(tmp_path))
    ffi.declared.cache_clear()
    try:
        ffi.declared(c.CDEF)          # parsed and written
        ffi.declared.cache_clear()
        read = ffi.declared(c.CDEF)   # read back from the module
        parsed = cffi.FFI()
        parsed.cdef(c.CDEF)
        assert not isinstance(read, cffi.FFI)  # the out-of-line module's FFI, not a parse
        assert read.sizeof("sg_context") == parsed.sizeof("sg_context")
        assert read.offsetof("sg_context", "failed") == parsed.offsetof("sg_context", "failed")
    finally:
        ffi.declared.cache_clear()
