"""The CUDA backend (symgrad/backends/cuda.py, the .cu.j2 templates).

Three layers, each running wherever it can:

- nvcc, no GPU (CI): the .cu of every graph of the op/gradient suite (all cases
  of tests/helpers.py, float64 and float32), of the representative graphs of
  test_passes.py, of training steps (SGD, momentum, Adam, BatchNorm, dropout,
  accumulate/apply/predict) and of the benchmarks' GPT, LeNet and
  residual-network steps renders and compiles. nvcc is slow, so all
  graphs go through two nvcc processes running side by side: each graph's .cu
  is #included, unchanged, into one of two translation units inside its own
  namespace, with its extern "C" names renamed by macros. One more build goes
  the real way (the cache, the default flags, a shared library that cffi loads).
- no nvcc, no GPU: rendering, the printer's refusals, the no-device error, and
  the program's host side (residency, shared variables, close, CUDA errors
  surfaced as CudaError, the workspace layout from the static memory plan)
  against a simulated device that runs the NumPy reference.
- a GPU: the seed softmax regression training, awkward kernel sizes and device
  errors here (batched products, convolutions, attention and the benchmarks'
  steps: test_cuda_kernels.py, which runs them on a CPU stand-in too); the op/gradient suite runs on backend="cuda" through the
  `backend` fixture (tests/conftest.py adds "cuda" when a GPU is present).
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import symgrad as sg
from symgrad.api.cells import current_value
from symgrad import nn
from symgrad.backends.build import cache
from symgrad.backends import cuda
from symgrad.backends.render.c_printer import CPrintError
from symgrad.backends.render.cuda_printer import printer as cuda_printer
from symgrad.backends.lower.lowering import lower
from symgrad.backends.lower.memory import liveness, memory_plan
from symgrad.ir import dtypes as D
from symgrad.ir import shapes as S
from symgrad.ir.graph import Graph

NVCC = shutil.which(cache.nvcc_command()[0])
HAS_GPU = cuda.probe_device_count()[0] > 0  # in a child process: CUDA stays uninitialised here
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="needs nvcc, the CUDA compiler (on PATH or in $NVCC)")
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU")
no_gpu_only = pytest.mark.skipif(HAS_GPU, reason="checks the behaviour without a GPU")

B = sg.Dim("B")


# ---- the graphs -----------------------------------------------------------------------------

def op_suite(dtype: str) -> Graph:
    """Every case of the op/gradient table (value, gradient, Hessian-vector product) as one graph."""
    from helpers import CASES, build_case
    inputs, outputs = [], []
    for k, case in enumerate(CASES):
        built = build_case(case, dtype, f"c{k}")
        inputs += built.inputs
        outputs += built.outputs
    return Graph(inputs, outputs)


def unary_derivatives() -> Graph:
    """First to third derivatives of every unary op (test_gradients_torch's grad-of-grad graph)."""
    from test_gradients_torch import UNARY_DOMAINS, _grad_of_grad_graph
    inputs, outputs = [], []
    for name in UNARY_DOMAINS:
        x, outs = _grad_of_grad_graph(name)
        inputs.append(x)
        outputs += outs
    return Graph(inputs, outputs)


def integer_and_index_ops() -> Graph:
    """What the differentiable table lacks: argmax, integer arithmetic and reductions, bool values."""
    x = sg.input("x", (B, 5))
    k = sg.input("k", (B, 5), dtype="int64")
    outs = [sg.argmax(x, axis=1), sg.argmax(x), sg.argmax(x, axis=0, keepdims=True),
            sg.max(k, axis=0), sg.sum(k), k ** 2, k * 3 - 1, sg.where(x > 0, k, -k),
            sg.sum(sg.cast(x > 0, "float32"), axis=1), sg.one_hot(sg.argmax(x, axis=1), 5),
            sg.cast(k, "float64") / 2, sg.max(sg.cast(x, "float64"))]
    return Graph([x, k], outs)


def training_programs() -> dict:
    """A model with BatchNorm, dropout and Adam: its step, accumulate, apply and predict graphs."""
    sg.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.25), nn.Linear(8, 3))
    x, y = sg.input("x", (B, 6)), sg.input("y", (B,), dtype="int64")
    loss = sg.cross_entropy(model(x), y)
    model.eval()
    logits = model(x)
    model.train()
    step = sg.train_step(loss, model.parameters(), sg.optim.Adam(lr=1e-3), backend="numpy", predict=logits)
    graphs = {"adam_bn_dropout_step": step.graph}
    for kind in ("accumulate", "apply", "predict"):
        graphs[f"adam_bn_dropout_{kind}"] = step.program_for(kind).graph
    return graphs


def gather_ops() -> sg.Graph:
    """take, its gradient scatter_add, and embed (the gradient of a strided slice)."""
    table = sg.input("table", (7, 3), dtype="float32")
    ids = sg.input("ids", (B, 2), dtype="int64")
    x = sg.input("x", (B, 6), dtype="float32")
    rows = sg.embedding(table, ids)
    loss = (rows * rows).sum() + (x[:, 1::2] ** 2).sum()
    return sg.Graph([table, ids, x], [rows, *sg.grad(loss, [table, x])])


def attention_ops() -> sg.Graph:
    """Fused attention and its gradient, causal and not, in float32 and float64 (T a Dim, heads
    read through the transpose a transformer hands over); and a gradient whose forward is not in
    the plan (its output handed in: the softmax found by a sweep)."""
    from symgrad.ir.ops_attention import attention_grad
    outs, inputs = [], []
    for dtype in ("float32", "float64"):
        x = sg.input(f"x_{dtype}", (2, B, 3, 8), dtype=dtype)  # (batch, T, heads, head dim)
        heads = sg.swapaxes(x, 1, 2)
        for causal in (False, True):
            y = sg.nn.functional.scaled_dot_product_attention(heads, heads * 2, heads * heads, is_causal=causal)
            outs += [y, *sg.grad((y * y).sum(), [x])]
        inputs.append(x)
    q, out, g = (sg.input(name, (3, B, 8)) for name in ("q", "out", "g"))
    outs.append(attention_grad(q, q * 2, q * q, out, g, True, 0.3))
    return sg.Graph(inputs + [q, out, g], outs)


def batched_matmul_ops() -> sg.Graph:
    """Batched products (a Dim and a broadcast batch axis) and convolutions (plain, grouped, and of
    one input channel as LeNet's first), with their gradients: each product one launch of the CUDA
    GEMM walking its batch."""
    a = sg.input("a", (B, 3, 5, 7))
    b = sg.input("b", (3, 7, 4))
    img = sg.input("img", (B, 2, 9, 9))
    w = sg.input("w", (3, 2, 3, 3))
    wg = sg.input("wg", (4, 1, 3, 3))   # groups=2: each output channel sees one input channel
    w1 = sg.input("w1", (3, 1, 5, 5))   # one input channel
    y = sg.matmul(a, b)
    z = sg.nn.functional.conv2d(img, w, padding=1)
    zg = sg.nn.functional.conv2d(img, wg, padding=1, groups=2)
    z1 = sg.nn.functional.conv2d(img[:, :1], w1, padding=2)
    loss = (y * y).sum() + (z * z).sum() + (zg * zg).sum() + (z1 * z1).sum()
    return sg.Graph([a, b, img, w, wg, w1], [y, z, zg, z1, *sg.grad(loss, [a, b, img, w, wg, w1])])


def benchmark_steps() -> dict:
    """The benchmarks' train steps: benchmarks.gpt's small config cut to one block (the same layers
    at the same sizes: attention, batched and narrow products, AdamW), benchmarks.cnn's LeNet (its
    first convolution of one input channel) and residual network (BatchNorm2d), at batch 2."""
    from dataclasses import replace
    from benchmarks import cnn, gpt
    bench = replace(gpt.CONFIGS["small"], layers=1)
    _, state, _, _ = gpt.setup(bench)
    steps = {"gpt_step": gpt.symgrad_step(bench, state, "numpy").graph}
    for name in ("lenet", "resnet"):
        bench = replace(cnn.CONFIGS[name], batch=2)
        _, state, _, x, y = cnn.setup(bench)
        steps[f"{name}_step"] = cnn.symgrad_step(bench, state, x, y, "numpy").graph
    return steps


def all_graphs() -> dict:
    """Every graph whose CUDA source must compile, by name."""
    import sys
    passes_tests = str(Path(__file__).resolve().parents[1] / "passes")
    if passes_tests not in sys.path:  # pytest puts it there only when it collects tests/passes too
        sys.path.append(passes_tests)
    from test_passes import GRAPHS
    from test_rowwise import ROW_GRAPHS
    graphs = {"ops_float64": op_suite("float64"), "ops_float32": op_suite("float32"),
              "unary_derivatives": unary_derivatives(), "integer_and_index_ops": integer_and_index_ops(),
              "gather_ops": gather_ops(), "attention_ops": attention_ops(),
              "batched_matmul_ops": batched_matmul_ops()}
    graphs.update({f"passes_{name}": build() for name, build in GRAPHS.items()})
    graphs.update({name: build() for name, build in ROW_GRAPHS.items()})
    graphs.update(training_programs())
    graphs.update(benchmark_steps())
    from test_integer_ops import cuda_graph as integer_ops_graph  # rounded division, bits, shifts, asin..atan2
    graphs["integer_and_trig_ops"] = integer_ops_graph()
    return graphs


@functools.lru_cache(maxsize=None)
def rendered() -> dict:
    """name -> .cu text of every graph (rendered once per session)."""
    return {name: sg.cuda_source(graph) for name, graph in all_graphs().items()}


# ---- compiling many graphs in few nvcc runs -------------------------------------------------

API = ("sg_cuda_device_count", "sg_cuda_create", "sg_cuda_destroy", "sg_cuda_write_variable",
       "sg_cuda_read_variable", "sg_cuda_run")
# Validity, not speed: device and host optimisation off (-O3 triples nvcc's time and checks nothing more).
CHECK_FLAGS = ["-std=c++17", "-arch=sm_80", "-Xcompiler", "-O0", "-Xptxas", "-O0", "-Xcicc", "-O0",
               "-Werror", "all-warnings"]


def translation_unit(names: list[str]) -> str:
    """A .cu that #includes each graph's file in a namespace of its own, its API names renamed."""
    lines = ["#include <cuda_runtime.h>", "#include <stdint.h>", "#include <stdio.h>", "#include <stdlib.h>",
             "#include <string.h>", "#include <math.h>"]
    for k, name in enumerate(names):
        lines.append(f"namespace sg_g{k} {{")
        lines += [f"#define {api} sg_g{k}_{api}" for api in API]
        lines.append(f'#include "{name}.cu"')
        lines += [f"#undef {api}" for api in API]
        lines.append(f"}}  /* {name} */")
    return "\n".join(lines) + "\n"


def compile_in_groups(sources: dict, directory: Path, groups: int = 2) -> list[tuple]:
    """nvcc -c on `groups` translation units at once; returns (names, returncode, output) per unit."""
    for name, text in sources.items():
        (directory / f"{name}.cu").write_text(text)
    # Balance by size: the op suites are most of the work.
    units = [[] for _ in range(groups)]
    sizes = [0] * groups
    for name in sorted(sources, key=lambda n: -len(sources[n])):
        k = sizes.index(min(sizes))
        units[k].append(name)
        sizes[k] += len(sources[name])

    def run(k: int) -> tuple:
        tu = directory / f"unit{k}.cu"
        tu.write_text(translation_unit(units[k]))
        done = subprocess.run([NVCC, *CHECK_FLAGS, "-c", str(tu), "-o", str(directory / f"unit{k}.o")],
                              capture_output=True, text=True, cwd=directory, timeout=900)
        return units[k], done.returncode, done.stdout + done.stderr

    with ThreadPoolExecutor(groups) as pool:
        return list(pool.map(run, range(groups)))


@pytest.mark.nvcc
@needs_nvcc
def test_every_graph_compiles_with_nvcc(tmp_path):
    sources = rendered()
    assert len(sources) >= 15
    for name, text in sources.items():
        assert "__global__" in text and 'extern "C"' in text, name
    for names, returncode, output in compile_in_groups(sources, tmp_path):
        assert returncode == 0, f"nvcc failed on the unit holding {names}:\n{output[-6000:]}"
        assert "warning" not in output, f"nvcc warned on {names}:\n{output[-6000:]}"


# ---- the real build path: cache, default flags, cffi ----------------------------------------

def softmax_regression(dtype="float32", seed=0):
    """The seed model: 784 -> 10 softmax regression, SGD(lr=0.1); nonzero weights so steps differ."""
    rng = np.random.default_rng(seed)
    x = sg.input("x", (B, 784), dtype=dtype)
    y = sg.input("y", (B,), dtype="int64")
    W = sg.param("W", (784, 10), init=(rng.standard_normal((784, 10)) * 0.01).astype(dtype))
    b = sg.param("b", (10,), init="zeros", dtype=dtype)
    return sg.cross_entropy(x @ W + b, y), [W, b]


def batches(n, size=64, dtype="float32", seed=1):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((size, 784)).astype(dtype), rng.integers(0, 10, size)) for _ in range(n)]


@pytest.mark.nvcc
@needs_nvcc
def test_build_only_builds_through_the_cache_and_loads(monkeypatch):
    loss, params = softmax_regression()
    initial = current_value(params[0])
    step = sg.train_step(loss, params, sg.optim.SGD(lr=0.1), backend="cuda", build_only=True)
    source_path, library_path = Path(step.source_path), Path(step.library_path)
    assert source_path.suffix == ".cu" and library_path.suffix == ".so"
    assert source_path.read_text() == step.source          # byte for byte what nvcc compiled
    meta = (source_path.parent / (step.module_name + ".json")).read_text()
    assert "nvcc" in meta.lower() and "-shared" in meta and "-O3" in meta
    if not HAS_GPU:
        assert "arch=compute_80,code=sm_80" in meta and "arch=compute_90,code=sm_90" in meta  # the fat binary
    # The library loads (ABI mode) and its API answers without a device.
    ffi, lib = step.module.ffi, step.module.lib
    count, err = ffi.new("int*"), ffi.new("char[]", 256)
    assert lib.sg_cuda_device_count(count, err, 256) == 0
    assert count[0] == (cuda.device_count()[0])
    # A build-only program never runs, but its variables stay readable on the host.
    np.testing.assert_array_equal(step.params["W"], initial)
    xb, yb = batches(1)[0]
    with pytest.raises(RuntimeError, match="build_only"):
        step(x=xb, y=yb)
    # Built once: the same graph again loads the cached library, even with nvcc gone.
    monkeypatch.setenv("NVCC", "/nonexistent/nvcc")
    started = time.perf_counter()
    again = cuda.compile(step.graph, build_only=True)
    assert time.perf_counter() - started < 5
    assert again.library_path == library_path and again.source == step.source


@pytest.mark.nvcc
@needs_nvcc
def test_nvcc_errors_name_the_kept_source(tmp_path, monkeypatch):
    monkeypatch.setenv("SYMGRAD_CACHE_DIR", str(tmp_path))
    with pytest.raises(cache.BuildError, match="CUDA compilation") as info:
        cache.build("this is not CUDA;\n", cuda.CDEF, kind="cuda", flags=["-arch=sm_80", "-shared", "-Xcompiler", "-fPIC"])
    assert info.value.source_path.suffix == ".cu" and info.value.source_path.is_file()
    assert "this is not CUDA" in info.value.source_path.read_text() and "error" in info.value.log


def test_missing_nvcc_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SYMGRAD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("NVCC", str(tmp_path / "no-such-nvcc"))
    with pytest.raises(cache.CompilerNotFound, match="CUDA toolkit"):
        cache.build("// never compiled\n", cuda.CDEF, kind="cuda")


@no_gpu_only
def test_without_a_device_compile_raises_before_building(monkeypatch):
    monkeypatch.setattr(cuda.CudaProgram, "_build", lambda *a: pytest.fail("must not build without a device"))
    loss, params = softmax_regression()
    with pytest.raises(RuntimeError, match="backend='cuda': no CUDA device is present.*build_only=True"):
        sg.train_step(loss, params, sg.optim.SGD(lr=0.1), backend="cuda")


def test_device_probe_asks_a_child_process(monkeypatch):
    """What the conftest's backend list relies on: the child's answer is device_count()'s."""
    want = cuda.device_count()
    monkeypatch.setattr(cuda, "_load_driver", lambda: (object(), ""))  # as if a driver were installed
    assert cuda.probe_device_count.__wrapped__() == want


def test_cuda_takes_only_its_options():
    x = sg.input("x", (3,))
    with pytest.raises(TypeError, match="build_only"):
        cuda.compile(Graph([x], [x * 2]), fast=True)
    with pytest.raises(ValueError, match="sm_80"):
        cuda.arch_flags("ampere")


# ---- the source itself (no nvcc needed) ------------------------------------------------------

def test_source_structure():
    x = sg.input("x */ #include <evil>", (B, 5))
    W = sg.param("W", (5, 3), init="normal")
    y = sg.input("y", (B,), dtype="int64")
    loss = sg.cross_entropy(sg.tanh(x @ W), y)
    (gW,) = sg.grad(loss, [W])
    text = sg.cuda_source(Graph([x, y], [loss, gW, sg.argmax(x @ W, axis=1)]))
    assert text == sg.cuda_source(Graph([x, y], [loss, gW, sg.argmax(x @ W, axis=1)]))  # deterministic
    assert 'extern "C"' in text and "int sg_cuda_run(void* handle, const int64_t* dims" in text
    assert "sg_gemm<float><<<" in text                   # matmuls go to the tiled kernel
    assert "__shared__" in text and "atomicAdd" not in text  # block reductions, no atomics
    assert re.search(r"\btanhf\(", text) and re.search(r"\bexpf\(", text) and "__expf" not in text
    assert "cudaGetLastError(), \"launching k" in text   # every launch is checked
    # User names appear only inside comments, their "*/" escaped.
    assert "*/ #include" not in text
    for line in text.splitlines():
        if "<evil>" in line:
            assert line.startswith(" *") or -1 < line.find("/*") < line.find("<evil>"), line
    for fn in re.findall(r"__global__ void __launch_bounds__\(SG_THREADS\) (\w+)\(", text):
        assert f"{fn}<<<" in text                        # every kernel is launched
    with pytest.raises(TypeError, match="Graph"):
        sg.cuda_source(x)


def test_printer_uses_precise_device_functions():
    import sympy
    from symgrad.backends.render.cuda_printer import device_function_ok
    v = sympy.Symbol("v0", real=True)
    assert cuda_printer("float32").doprint(sympy.exp(v) + sympy.log(v)) == "expf(v0) + logf(v0)"
    # Comparisons, not fmax (which drops a NaN), as the C printer: NaN propagates as in torch.
    assert cuda_printer("float64").doprint(sympy.Max(v, 0)) == "(((v0) > (0.0) || (v0) != (v0)) ? (v0) : (0.0))"
    assert device_function_ok("tanhf") and device_function_ok("erf") and device_function_ok("sg_random_bits")
    assert not device_function_ok("__expf") and not device_function_ok("__fdividef")
    assert not device_function_ok("qsort")
    with pytest.raises(CPrintError):
        cuda_printer("float32").doprint(sympy.besselj(0, v))


# ---- the host side against a simulated device --------------------------------------------------

class SimulatedDevice:
    """Stands in for a built library: the extern "C" API over host arrays, the kernels replaced by
    the NumPy reference. Counts uploads, runs and destroys; records the workspace layout each run
    was given (offsets, arena bytes); can fail like CUDA does."""

    def __init__(self, program):
        from symgrad.backends import numpy_backend
        self.evaluate = numpy_backend.evaluate
        # Not the program itself: the test keeps the device, and the program must stay collectable.
        self.graph, self.dims, self.ffi = program.graph, program.plan.dims, program._ffi
        self.memory: dict[int, dict] = {}
        self.handles = []
        self.uploads = self.runs = self.destroyed = 0
        self.n_workspace = len(program.plan.workspace)
        self.layouts: list[tuple[list[int], int]] = []
        self.fail = None

    def _error(self, err, errlen, text, code):
        self.ffi.memmove(err, text.encode()[:errlen - 1] + b"\0", min(len(text) + 1, errlen))
        return code

    def sg_cuda_device_count(self, count, err, errlen):
        count[0] = 1
        return 0

    def sg_cuda_create(self, handle, err, errlen):
        token = self.ffi.new("char[]", 1)
        self.handles.append(token)
        address = int(self.ffi.cast("uintptr_t", token))
        self.memory[address] = {v.name: np.zeros(tuple(v.shape), D.to_numpy(v.dtype))
                                for v in self.graph.variables}
        handle[0] = self.ffi.cast("void*", token)
        return 0

    def _vars(self, handle):
        return self.memory[int(self.ffi.cast("uintptr_t", handle))]

    def sg_cuda_destroy(self, handle, err, errlen):
        del self.memory[int(self.ffi.cast("uintptr_t", handle))]
        self.destroyed += 1
        return 0

    def sg_cuda_write_variable(self, handle, index, host, nbytes, err, errlen):
        array = self._vars(handle)[self.graph.variables[index].name]
        if nbytes != array.nbytes:
            return self._error(err, errlen, "variable size does not match", -1)
        array.reshape(-1).view(np.uint8)[...] = np.frombuffer(self.ffi.buffer(self.ffi.cast("char*", host), nbytes),
                                                              np.uint8)
        self.uploads += 1
        return 0

    def sg_cuda_read_variable(self, handle, index, host, nbytes, err, errlen):
        array = self._vars(handle)[self.graph.variables[index].name]
        self.ffi.memmove(host, array.tobytes(), nbytes)
        return 0

    def sg_cuda_run(self, handle, dims, inputs, outputs, offsets, arena_bytes, err, errlen):
        self.layouts.append(([int(offsets[k]) for k in range(self.n_workspace)], int(arena_bytes)))
        if self.fail:
            return self._error(err, errlen, self.fail, 700)
        graph = self.graph
        bindings = {d: int(dims[k]) for k, d in enumerate(self.dims)}
        arrays = []
        for k, v in enumerate(graph.inputs):
            shape = tuple(int(s) for s in sg.ir.shapes.evaluate_shape(v.shape, bindings))
            dtype = np.dtype("bool" if v.dtype == "bool" else v.dtype)
            nbytes = int(np.prod(shape)) * dtype.itemsize
            arrays.append(np.frombuffer(self.ffi.buffer(self.ffi.cast("char*", inputs[k]), nbytes),
                                        dtype).reshape(shape).copy())
        variables = self._vars(handle)
        outs, news = self.evaluate(graph, arrays, variables, bindings)
        for k, out in enumerate(outs):
            self.ffi.memmove(outputs[k], np.ascontiguousarray(out).tobytes(), out.nbytes)
        for (target, _), new in zip(graph.updates, news):
            variables[target.name][...] = new
        self.runs += 1
        return 0


@pytest.fixture
def simulated(monkeypatch):
    """backend="cuda" on the simulated device: returns the list of devices, one per program built."""
    import cffi
    devices = []

    def build(program, flags, arch):
        ffi = cffi.FFI()
        ffi.cdef(cuda.CDEF)
        module = type("Module", (), {})()
        module.ffi = ffi
        program._ffi = ffi  # SimulatedDevice reads it before the program's own assignment
        module.lib = SimulatedDevice(program)
        devices.append(module.lib)
        return cache.BuiltModule(module, "simulated", Path("simulated.cu"), Path("simulated.so"), Path("."))

    monkeypatch.setattr(cuda, "device_count", lambda: (1, ""))
    monkeypatch.setattr(cuda.CudaProgram, "_build", build)
    return devices


def test_parameters_stay_on_the_device_between_steps(simulated):
    data = batches(3)
    steps = {}
    for backend in ("numpy", "cuda"):
        loss, params = softmax_regression()
        steps[backend] = sg.train_step(loss, params, sg.optim.SGD(lr=0.1), backend=backend)
    step, device = steps["cuda"], simulated[0]
    initial = step._storage["W"].copy()
    losses = []
    for k, (xb, yb) in enumerate(data):
        losses.append((steps["numpy"](x=xb, y=yb), step(x=xb, y=yb)))
        if k == 0:
            uploads = device.uploads
    assert device.uploads == uploads                      # after the first step: only the batch moves
    assert device.runs == 3
    np.testing.assert_array_equal(step._storage["W"], initial)  # the host copy is not written per step
    for want, got in losses:
        assert got == pytest.approx(want, rel=1e-6)
    for name in ("W", "b"):
        np.testing.assert_allclose(step.params[name], steps["numpy"].params[name], rtol=1e-6, atol=1e-7)
    # The learning rate is a device variable too: changed without recompiling.
    step.lr = steps["numpy"].lr = 0.05
    xb, yb = data[0]
    assert step(x=xb, y=yb) == pytest.approx(steps["numpy"](x=xb, y=yb), rel=1e-6)
    assert step.lr == 0.05
    np.testing.assert_allclose(step.params["W"], steps["numpy"].params["W"], rtol=1e-6, atol=1e-7)


def test_accumulate_apply_and_predict_share_the_variables(simulated):
    from test_accumulate import compile_step, data, make_models
    results = {}
    for backend in ("numpy", "cuda"):
        _, model = make_models()
        step = compile_step(model, backend)
        for xb, yb in data(rounds=2):
            for k in range(0, 64, 16):
                step.accumulate(x=xb[k:k + 16], y=yb[k:k + 16])
            step.apply()
            step(x=xb, y=yb)                              # the fused step on the same variables
        results[backend] = ({n: step.params[n] for n in step.params}, {n: step.state[n] for n in step.state},
                            step.predict(x=data()[0][0]))
    (pn, sn, yn), (pc, sc, yc) = results["numpy"], results["cuda"]
    assert pn.keys() == pc.keys() and sn.keys() == sc.keys()
    for name in pn:
        np.testing.assert_allclose(pc[name], pn[name], rtol=1e-12, err_msg=name)
    for name in sn:
        np.testing.assert_allclose(sc[name], sn[name], rtol=1e-12, err_msg=name)
    np.testing.assert_allclose(yc, yn, rtol=1e-12)
    assert len(simulated) == 4                            # step, accumulate, apply, predict


def test_close_frees_device_memory_and_keeps_the_values(simulated):
    loss, params = softmax_regression()
    xb, yb = batches(1)[0]
    with sg.train_step(loss, params, sg.optim.SGD(lr=0.1), backend="cuda") as step:
        step(x=xb, y=yb)
        trained = step.params["W"]
    device = simulated[0]
    assert device.destroyed == 1 and not device.memory
    np.testing.assert_array_equal(step.params["W"], trained)   # copied back before the memory was freed
    with pytest.raises(RuntimeError, match="closed"):
        step(x=xb, y=yb)
    step.close()                                                 # closing twice is harmless
    # A program that is only dropped frees its memory when collected.
    import gc
    other = sg.train_step(loss, params, sg.optim.SGD(lr=0.1), backend="cuda")
    del other
    gc.collect()
    assert simulated[1].destroyed == 1


def test_a_step_collected_in_a_cycle_leaves_its_trained_values(simulated):
    """A step dropped inside a reference cycle is finalised by the garbage collector, which clears
    the weak references to it first: its device values must still reach the host storage that
    `state_dict()` reads once the step is gone (tests/nn/test_nn.py failed so on an H100)."""
    import gc
    loss, params = softmax_regression()
    initial = current_value(params[0])
    xb, yb = batches(1)[0]
    step = sg.train_step(loss, params, sg.optim.SGD(lr=0.1), backend="cuda")
    step(x=xb, y=yb)
    trained = step.params["W"]
    assert not np.array_equal(trained, initial)
    step.cycle = step
    del step
    gc.collect()
    assert simulated[0].destroyed == 1
    np.testing.assert_array_equal(params[0].attrs["cell"].read(), trained)


def test_cuda_failures_become_python_exceptions(simulated):
    loss, params = softmax_regression()
    step = sg.train_step(loss, params, sg.optim.SGD(lr=0.1), backend="cuda")
    xb, yb = batches(1)[0]
    simulated[0].fail = "running the kernels: an illegal memory access was encountered (cudaErrorIllegalAddress)"
    with pytest.raises(cuda.CudaError, match="illegal memory access") as info:
        step(x=xb, y=yb)
    assert info.value.code == 700
    simulated[0].fail = None
    # Bad input is refused in Python: the device never sees it.
    with pytest.raises(TypeError, match="float32"):
        step(x=xb.astype(np.float64), y=yb)
    with pytest.raises(ValueError, match="784"):
        step(x=xb[:, :10].copy(), y=yb)
    assert simulated[0].runs == 0


# ---- the workspace: one arena from the static memory plan ----------------------------------------

def mlp_loss():
    """Issue 4's MLP 784-256-256-10 with a symbolic batch: (loss, parameters)."""
    sg.manual_seed(0)
    x, y = sg.input("x", (B, 784)), sg.input("y", (B,), dtype="int64")
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    return sg.cross_entropy(model(x), y), model.parameters()


def assert_disjoint_while_live(plan, offsets: list, arena_bytes: int, bindings: dict) -> None:
    """Temporaries live during a same kernel occupy disjoint bytes, all inside the arena, each
    offset a multiple of the CUDA alignment."""
    sizes = [int(S.evaluate(b.numel, bindings)) * D.to_numpy(b.dtype).itemsize for b in plan.workspace]
    live = liveness(plan)
    assert all(o % cuda.ALIGN == 0 and o + n <= arena_bytes for o, n in zip(offsets, sizes))
    for i in range(len(sizes)):
        for j in range(i):
            if live[i][0] <= live[j][1] and live[j][0] <= live[i][1]:
                assert offsets[i] + sizes[i] <= offsets[j] or offsets[j] + sizes[j] <= offsets[i], \
                    (plan.workspace[i], plan.workspace[j])


def test_source_takes_the_workspace_layout_from_the_caller():
    x, y = sg.input("x", (B, 784)), sg.input("y", (B,), dtype="int64")
    W = sg.param("W", (784, 10), init="zeros")
    loss = sg.cross_entropy(sg.tanh(x @ W), y)
    plan = lower(sg.passes.optimize(Graph([x, y], [loss, *sg.grad(loss, [W])])), language=cuda.CUDA)
    text = cuda.render_source(plan)
    assert plan.workspace and cuda.SIGNATURE in text and "#define SG_ALIGN 256" in text
    # Every temporary is the arena's base plus the offset the caller passed for it: no layout of its own.
    pointers = re.findall(r"\* (ws\d+) = \(\w+\*\)\(\(char\*\)st->workspace \+ offsets\[(\d+)\]\);", text)
    assert pointers and all(name == f"ws{k}" for name, k in pointers)
    assert {name for name, _ in pointers} == {b.name for b in plan.workspace}
    assert "sg_reserve(&st->workspace, &st->workspace_capacity, (size_t)arena_bytes)" in text
    assert "offsets[k] % SG_ALIGN != 0 || bytes[k] > arena_bytes - offsets[k]" in text  # a bad layout is refused


def test_each_run_gets_the_memory_plan_of_its_dim_binding(simulated):
    loss, params = mlp_loss()
    step = sg.train_step(loss, params, sg.optim.SGD(lr=0.1), backend="cuda")
    program, device = step.program, simulated[0]
    assert program.memory_plan.assumed and "assumed: not called yet" in step.report()
    rng = np.random.default_rng(0)
    for size in (128, 32, 128):
        step(x=rng.standard_normal((size, 784)).astype(np.float32), y=rng.integers(0, 10, size))
        offsets, arena_bytes = device.layouts[-1]
        want = memory_plan(program.plan, {B: size}, align=cuda.ALIGN)
        assert (offsets, arena_bytes) == (want.offsets, want.arena_bytes)
        assert_disjoint_while_live(program.plan, offsets, arena_bytes, {B: size})
        assert arena_bytes < want.naive_bytes            # buffers do share bytes
    # One plan per binding, made at its first call; the report shows the newest.
    assert sorted(program.memory_plans) == [(32,), (128,)]
    mp = program.memory_plan
    assert not mp.assumed and mp.bindings == {B: 32}
    assert f"arena {mp.arena_bytes} B, naive {mp.naive_bytes} B" in step.report() and "B=32" in step.report()


def test_mlp_arena_equals_the_c_backends_plan(simulated):
    # One model per backend (equal: mlp_loss seeds): two steps of one model would train the same parameters.
    steps = {backend: sg.train_step(*mlp_loss(), sg.optim.SGD(lr=0.1), backend=backend) for backend in ("c", "cuda")}
    rng = np.random.default_rng(1)
    xb, yb = rng.standard_normal((128, 784)).astype(np.float32), rng.integers(0, 10, 128)
    losses = {backend: step(x=xb, y=yb) for backend, step in steps.items()}
    assert losses["cuda"] == pytest.approx(losses["c"], rel=1e-5)
    cuda_plan = steps["cuda"].program.memory_plan
    # C fuses matmul epilogues and CUDA does not (yet): the same optimized graph lowered without
    # them, planned by the C backend's planner, is the arena CUDA must use.
    c_program = steps["c"].program
    c_plan = memory_plan(lower(c_program.optimized, variables=c_program.graph.variables), {B: 128},
                         align=cuda.ALIGN)
    assert cuda_plan.bindings == c_plan.bindings == {B: 128}
    assert (cuda_plan.sizes, cuda_plan.live) == (c_plan.sizes, c_plan.live)     # the same temporaries
    assert (cuda_plan.offsets, cuda_plan.arena_bytes) == (c_plan.offsets, c_plan.arena_bytes)
    assert simulated[0].layouts[-1] == (cuda_plan.offsets, cuda_plan.arena_bytes)
    assert cuda_plan.arena_bytes <= 1.25 * cuda_plan.lower_bound_bytes
    assert cuda_plan.arena_bytes < 0.5 * cuda_plan.naive_bytes


# ---- on a GPU ---------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("size", [64, 1024])
def test_softmax_regression_training_matches_numpy_on_gpu(size):
    # Two batches in turn: on 20 fresh batches of noise the loss need not fall (it rose at size 64 on
    # an H100, as it does on NumPy), on two seen ten times it must.
    data = batches(2, size=size) * 10
    runs = {}
    for backend in ("numpy", "cuda"):
        loss, params = softmax_regression()
        with sg.train_step(loss, params, sg.optim.SGD(lr=0.1), backend=backend) as step:
            losses = [step(x=xb, y=yb) for xb, yb in data]
            runs[backend] = (losses, step.params["W"], step.params["b"])
    (ln, Wn, bn), (lc, Wc, bc) = runs["numpy"], runs["cuda"]
    np.testing.assert_allclose(lc, ln, rtol=1e-4)
    np.testing.assert_allclose(Wc, Wn, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(bc, bn, rtol=1e-4, atol=1e-6)
    assert lc[-2] < lc[0] - 0.3 and lc[-1] < lc[1] - 0.3


@pytest.mark.gpu
@needs_gpu
def test_kernels_at_awkward_sizes_on_gpu():
    """Tiles that do not divide the sizes, transposed operands, reductions wider than a block, argmax ties
    and NaN, max with NaN."""
    rng = np.random.default_rng(0)
    a = sg.input("a", (67, 130))
    b = sg.input("b", (33, 130))
    big = sg.input("big", (3, 70000))
    outs = [a @ b.T, (a.T).T @ (b.T * 2), sg.sum(big, axis=1), sg.max(big), sg.argmax(big, axis=1),
            sg.sum(big * big), sg.max(big, axis=0)]
    f = {bk: sg.function([a, b, big], outs, backend=bk) for bk in ("numpy", "cuda")}
    arrays = [rng.standard_normal((67, 130)).astype(np.float32), rng.standard_normal((33, 130)).astype(np.float32),
              rng.standard_normal((3, 70000)).astype(np.float32)]
    arrays[2][1, 5] = arrays[2][1, 9] = 50.0                  # a tie: the first index wins
    arrays[2][2, 11] = np.nan                                 # NaN wins argmax and propagates through max
    for got, want in zip(f["cuda"](*arrays), f["numpy"](*arrays)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, equal_nan=True)


@pytest.mark.gpu
@needs_gpu
def test_out_of_device_memory_is_a_cuda_error_and_the_next_call_works():
    x = sg.input("x", (B, 1))
    f = sg.function([x], sg.sum(x @ x.T, axis=1), backend="cuda")  # a B x B temporary in the arena
    big = 1 << 18                                                   # 256 GiB of it
    assert f.program.memory_plan.assumed
    with pytest.raises(cuda.CudaError, match="out of memory"):
        f(np.ones((big, 1), np.float32))
    assert f.program.memory_plans[(big,)].arena_bytes >= big * big * 4
    # The failed allocation is not reported again by a later, good call's launch checks.
    xs = np.arange(4, dtype=np.float32)[:, None]
    np.testing.assert_allclose(f(xs), (xs @ xs.T).sum(axis=1), rtol=1e-6)


def test_cuda_statements_keep_nan_tests():
    """x != x is true for NaN: the CUDA printer must not fold it to false (the C renderer's statement is shared)."""
    x = sg.input("x", (4,))
    source = sg.cuda_source(sg.Graph([x], [sg.not_equal(x, x)]))
    (statement,) = [line for line in source.splitlines() if "= not_equal(x, x)" in line and "const" in line]
    assert "v0 != v0" in statement.replace("(", " ").replace(")", " ")
