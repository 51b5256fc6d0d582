"""A compiled program imports by name in a process without symgrad (symgrad/backends/build/importable.py).

`import _symgrad_<hash>` with the cache directory on sys.path gives `lib`, `ffi`, `source`, and
`run`, which calls the C program with NumPy arrays and computes what the step computes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import symgrad as sg
from symgrad.backends.build import cache, importable


def run_clean(code: str, cwd) -> str:
    """`code` in an isolated interpreter (-I: no PYTHONPATH, no user site, no script directory)
    with nothing of this process's environment but PATH; returns stdout."""
    done = subprocess.run([sys.executable, "-I", "-c", code], env={"PATH": os.environ.get("PATH", "")},
                          cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"subprocess failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


# The importing side: loads the arrays, imports the module by name, calls `run`, saves the results.
CALL = textwrap.dedent("""\
    import json, sys
    import numpy as np
    sys.path.insert(0, {cache!r})
    import {name} as m
    data = np.load("before.npz")
    count = lambda prefix: len([k for k in data.files if k.startswith(prefix)])
    inputs = [data[f"in{{k}}"] for k in range(count("in"))]
    variables = [data[f"var{{k}}"].copy() for k in range(count("var"))]
    outputs = [np.empty_like(data[f"out{{k}}"]) for k in range(count("out"))]
    m.run({dims!r}, inputs, variables, outputs)
    np.savez("after.npz", *outputs, *variables)
    print(json.dumps({{"symgrad": "symgrad" in sys.modules, "source": m.source == open({source!r}).read(),
                      "library": m.LIBRARY, "names": sorted(n for n in dir(m) if not n.startswith("_"))}}))
    """)


def _imported_run(compiled, dims: list, inputs: list, variables: list, outputs: list, tmp_path) -> tuple:
    """Run `compiled`'s module in a clean process on these arrays: (report, outputs, variables)."""
    np.savez(tmp_path / "before.npz", **{f"in{k}": a for k, a in enumerate(inputs)},
             **{f"var{k}": a for k, a in enumerate(variables)}, **{f"out{k}": a for k, a in enumerate(outputs)})
    code = CALL.format(cache=str(compiled.library_path.parent), name=compiled.module_name, dims=dims,
                       source=str(compiled.source_path))
    report = json.loads(run_clean(code, tmp_path).strip().splitlines()[-1])
    with np.load(tmp_path / "after.npz") as after:
        arrays = [after[f"arr_{k}"] for k in range(len(after.files))]
    return report, arrays[:len(outputs)], arrays[len(outputs):]


def _model(dtype: str = "float64"):
    """Inputs x, y, parameters W1, W2, the logits, and the parameters' values by name."""
    rng = np.random.default_rng(0)
    B = sg.Dim("B")
    x, y = sg.input("x", (B, 6), dtype=dtype), sg.input("y", (B,), dtype="int64")
    values = {"W1": rng.standard_normal((6, 8)).astype(dtype), "W2": rng.standard_normal((8, 3)).astype(dtype)}
    W1 = sg.param("W1", (6, 8), init=values["W1"], dtype=dtype)
    W2 = sg.param("W2", (8, 3), init=values["W2"], dtype=dtype)
    return x, y, [W1, W2], sg.relu(x @ W1) @ W2, values


def test_a_train_step_imports_by_name_and_computes_the_steps_numbers(tmp_path):
    x, y, params, logits, _ = _model()
    step = sg.train_step(sg.cross_entropy(logits, y), params=params,
                         optimizer=sg.optim.Adam(params, lr=0.01), backend="c")
    rng = np.random.default_rng(1)
    xb, yb = rng.standard_normal((5, 6)), rng.integers(0, 3, 5)
    names = [v.name for v in step.graph.variables]
    current = {**step.params, **step.state}
    before = [np.ascontiguousarray(current[n]) for n in names]
    loss = step(x=xb, y=yb)
    after = {**step.params, **step.state}

    report, outputs, variables = _imported_run(step, [5], [xb, yb], before, [np.zeros((), np.float64)], tmp_path)
    assert report["symgrad"] is False and report["source"] is True
    assert report["library"] == str(step.library_path)
    assert {"lib", "ffi", "source", "run", "workspace_sizes", "CDEF"} <= set(report["names"])
    np.testing.assert_allclose(outputs[0], loss, rtol=1e-12)
    for name, value in zip(names, variables):
        np.testing.assert_allclose(value, after[name], rtol=1e-12, atol=1e-15, err_msg=name)
    assert step.module_name == step.program.module_name and step.library_path.name == f"lib{step.module_name}.so"
    assert (step.library_path.parent / f"{step.module_name}.py").is_file()


def test_a_function_imports_by_name_too(tmp_path):
    x, y, params, logits, values = _model("float32")
    f = sg.function([x], [sg.softmax(logits, dim=1)], backend="c")
    xb = np.random.default_rng(2).standard_normal((4, 6)).astype(np.float32)
    (want,) = f(xb)
    variables = [values[v.name] for v in f.graph.variables]
    assert f.module_name.startswith("_symgrad_") and f.module_name == f.program.module_name
    report, (got,), _ = _imported_run(f, [4], [xb], variables, [np.zeros((4, 3), np.float32)], tmp_path)
    assert report["symgrad"] is False and report["source"] is True
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_the_module_text_opens_the_library_beside_it_not_one_named_as_the_module():
    """Python's importer takes `<name>.so` for an extension module before `<name>.py`: the library
    has another name."""
    text = importable.text("_symgrad_abc", "int f(void);", "_symgrad_abc.c")
    assert importable.library_file("_symgrad_abc") == "lib_symgrad_abc.so"
    assert "'lib_symgrad_abc.so'" in text and "import symgrad" not in text and "from symgrad" not in text
    compile(text + importable.c_helpers("symgrad_run", "symgrad_workspace_bytes", "symgrad_scratch_bytes", 64), "<module>", "exec")


@pytest.mark.nvcc
@pytest.mark.skipif(shutil.which(cache.nvcc_command()[0]) is None, reason="needs nvcc, the CUDA compiler")
def test_a_cuda_program_imports_by_name_with_lib_ffi_and_source(tmp_path):
    """A CUDA program's module (built only: no GPU needed) loads its library beside it and answers;
    it has no `run` (its entry takes a device state)."""
    x, y, params, logits, _ = _model("float32")
    step = sg.train_step(sg.cross_entropy(logits, y), params=params, optimizer=sg.optim.SGD(lr=0.1),
                         backend="cuda", build_only=True)
    code = textwrap.dedent(f"""\
        import json, sys
        sys.path.insert(0, {str(step.library_path.parent)!r})
        import {step.module_name} as m
        count, err = m.ffi.new("int*"), m.ffi.new("char[]", 256)
        status = m.lib.sg_cuda_device_count(count, err, 256)
        print(json.dumps({{"symgrad": "symgrad" in sys.modules, "status": status, "has_run": hasattr(m, "run"),
                          "source": m.source == open({str(step.source_path)!r}).read()}}))
        """)
    report = json.loads(run_clean(code, tmp_path).strip().splitlines()[-1])
    assert report == {"symgrad": False, "status": 0, "has_run": False, "source": True}
    assert step.library_path.name == f"lib{step.module_name}.so" and step.source_path.suffix == ".cu"


def test_the_cache_writes_the_module_with_the_library_and_restores_it(tmp_path, monkeypatch):
    """Any plain library the cache builds (kind "program") gets its module, with the `helpers` it is
    given; a module lost or edited is written again when the entry is next loaded."""
    monkeypatch.setenv("SYMGRAD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cache, "_LOADED", {})
    source, cdef = "int add(int a, int b) { return a + b; }\n", "int add(int a, int b);"
    built = cache.build(source, cdef, kind="program", helpers="\n\ndef twice(a):\n    return lib.add(a, a)\n")
    module = built.cache_dir / f"{built.module_name}.py"
    assert built.library_path == built.cache_dir / f"lib{built.module_name}.so" and module.is_file()
    written = module.read_text()
    module.write_text("raise ImportError('edited')\n")
    monkeypatch.setattr(cache, "_LOADED", {})
    assert cache.build(source, cdef, kind="program").module.lib.add(2, 3) == 5
    assert module.read_text() != written  # written again, as this build asks: without the helpers
    module.unlink()
    monkeypatch.setattr(cache, "_LOADED", {})
    cache.build(source, cdef, kind="program", helpers="\n\ndef twice(a):\n    return lib.add(a, a)\n")
    assert module.read_text() == written
    code = (f"import sys\nsys.path.insert(0, {str(built.cache_dir)!r})\nimport {built.module_name} as m\n"
            f"print(m.lib.add(40, 2), m.twice(21), m.source == {source!r}, 'symgrad' in sys.modules)")
    assert run_clean(code, tmp_path).split() == ["42", "42", "True", "False"]
