"""step.export / `symgrad export` (the back end symgrad/backends/export/; train_main's Python side in
symgrad/tools/export.py): the exported C library and train_main, built with make, against the Python
C-backend step bit for bit; its checkpoints against Python and torch; its weights file, symbol
prefix, query API, inference-only export, learning-rate schedule and validation loss; and a build
with AddressSanitizer and UndefinedBehaviorSanitizer on bad files.

The exports are module-scoped (one make each); a build that needs another export of the same model
name reuses the runtime's object file (the longest compile), which is the same for the same name
and flags."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch

import symgrad as sg
from symgrad.tools import export
from symgrad import nn
from symgrad.backends.lower.memory import memory_plan
from symgrad.backends.status import Status
from symgrad.backends.build.runtime import default_flags

pytestmark = pytest.mark.skipif(shutil.which("make") is None or shutil.which("cc") is None,
                                reason="needs make and a C compiler")

ROWS, BATCH, EPOCHS = 70, 16, 2  # 5 batches an epoch, the last one partial
RNG = np.random.default_rng(11)
X = RNG.standard_normal((ROWS, 5)).astype(np.float32)
Y = RNG.integers(0, 3, ROWS)


class Exported:
    """A step, its export built by make, and the checkpoint of its state when exported."""

    def __init__(self, step, directory: Path, name: str, torch_model, programs=None, runtime_from: Path | None = None):
        self.step, self.dir, self.name, self.torch_model = step, directory, name, torch_model
        self.written = step.export(directory, name=name, programs=programs)
        self.init = directory / "init.safetensors"
        step.save(self.init)
        if runtime_from is not None:
            _reuse_runtime(runtime_from, directory, name)
        subprocess.run(["make", "-s", "-C", str(directory)], check=True, capture_output=True)
        export.write_dataset(directory / "data.bin", [X, Y])

    def train_main(self, *args, data=None):
        return subprocess.run([str(self.dir / "train_main"), str(data or self.dir / "data.bin"), *map(str, args)],
                              capture_output=True, text=True, timeout=120)

    def python_losses(self, epochs: int, batch: int) -> list[float]:
        """The Python step's losses on train_main's batches, from the exported state."""
        self.step.load(self.init)
        losses = []
        for epoch in range(epochs):
            order = export.shuffle_order(ROWS, 0, epoch)
            for start in range(0, ROWS, batch):
                rows = order[start:start + batch]
                losses.append(self.step(x=X[rows], y=Y[rows]))
        return losses

    def harness(self, code: str, name: str = "harness", others=()) -> Path:
        """A C program linked with the exported library (and the `others`' libraries)."""
        source = self.dir / f"{name}.c"
        source.write_text(code)
        binary = self.dir / name
        includes = [f"-I{o.dir}" for o in others]
        libraries = [str(e.dir / f"lib{e.name}.a") for e in (self, *others)]
        subprocess.run(["cc", *default_flags(), "-fPIC", *includes, "-o", str(binary), str(source), *libraries, "-lm"],
                       check=True, cwd=self.dir)
        return binary


def _reuse_runtime(source: Path, directory: Path, name: str) -> None:
    """Give `directory` the runtime object built in `source` when it is built from the same files
    with the same flags (the same library name): make then leaves it."""
    obj = source / f"{name}_runtime.o"
    inputs = (f"{name}_runtime.c", "symgrad_runtime.c", "symgrad_runtime.h")
    flags = [line for line in (source / "Makefile").read_text().splitlines() if line.startswith("CFLAGS")]
    same = all((source / f).read_bytes() == (directory / f).read_bytes() for f in inputs) and flags == [
        line for line in (directory / "Makefile").read_text().splitlines() if line.startswith("CFLAGS")]
    if obj.exists() and same:
        shutil.copyfile(obj, directory / obj.name)
        newest = max((directory / f).stat().st_mtime for f in inputs)
        os.utime(directory / obj.name, (newest + 1, newest + 1))


def _softmax(directory: Path) -> Exported:
    """The seeds' softmax regression (zero init, cross-entropy, SGD lr 0.1), predicting logits."""
    x, y = sg.input("x", (sg.Dim("B"), 5)), sg.input("y", (sg.Dim("B"),), dtype="int64")
    W, b = sg.param("W", (5, 3), init="zeros"), sg.param("b", (3,), init="zeros")
    logits = x @ W + b
    step = sg.train_step(sg.cross_entropy(logits, y), [W, b], sg.optim.SGD(lr=0.1), backend="c", predict=logits)
    module = torch.nn.Module()
    module.W, module.b = torch.nn.Parameter(torch.zeros(5, 3)), torch.nn.Parameter(torch.zeros(3))
    return Exported(step, directory, "softmax", module)


def _mlp(directory: Path) -> Exported:
    """An MLP with BatchNorm and Dropout trained by Adam; predict is the model in eval mode."""
    sg.manual_seed(3)
    model = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Dropout(0.3), nn.Linear(6, 3))
    x, y = sg.input("x", (sg.Dim("B"), 5)), sg.input("y", (sg.Dim("B"),), dtype="int64")
    loss = sg.cross_entropy(model(x), y)
    model.eval()
    logits = model(x)
    model.train()
    step = sg.train_step(loss, model.parameters(), sg.optim.Adam(lr=1e-2), backend="c", predict=logits)
    torch_model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU(),
                                      torch.nn.Dropout(0.3), torch.nn.Linear(6, 3))
    return Exported(step, directory, "mlp", torch_model)


def _imported(directory: Path, runtime_from: Path) -> Exported:
    """A torch MLP with BatchNorm brought in by sg.from_torch and trained by its torch Adam: the
    exported library trains it with no Python, and its checkpoint loads back into the torch model.
    Exported under the name "mlp", so it reuses that export's runtime object (the longest compile)."""
    torch.manual_seed(5)
    torch_model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU(),
                                      torch.nn.Linear(6, 3))
    optimizer = torch.optim.Adam(torch_model.parameters(), lr=1e-2)
    imported = sg.from_torch(torch_model, (torch.randn(BATCH, 5),), dynamic_shapes=({0: torch.export.Dim("B")},))
    x, y = sg.input("x", (sg.Dim("B"), 5)), sg.input("y", (sg.Dim("B"),), dtype="int64")
    loss = sg.cross_entropy(imported(x), y)
    imported.eval()
    logits = imported(x)
    imported.train()
    step = sg.train_step(loss, optimizer=sg.optim.from_torch(optimizer), backend="c", predict=logits)
    return Exported(step, directory, "mlp", torch_model, runtime_from=runtime_from)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    made = {}

    def get(kind: str) -> Exported:
        if kind not in made:
            build = {"softmax": _softmax, "mlp": _mlp, "imported": lambda d: _imported(d, get("mlp").dir)}[kind]
            made[kind] = build(tmp_path_factory.mktemp(kind))
        return made[kind]
    return get


@pytest.mark.parametrize("kind", ["softmax", "mlp", "imported"])
def test_train_main_equals_the_python_step_bit_for_bit(exported, kind):
    e = exported(kind)
    checkpoint = e.dir / "trained.safetensors"
    done = e.train_main("--epochs", EPOCHS, "--batch-size", BATCH, "--log-steps", "--save", checkpoint)
    assert done.returncode == 0, done.stderr
    c_losses = [float(line.split()[-1]) for line in done.stdout.splitlines() if line.startswith("step ")]
    assert len(c_losses) == EPOCHS * -(-ROWS // BATCH)
    assert c_losses == e.python_losses(EPOCHS, BATCH)  # exact: the same source, compiler and flags
    assert f"epoch {EPOCHS}/{EPOCHS} loss" in done.stdout

    # The C checkpoint holds what the Python step holds now, and loads into a step and into torch.
    tensors = safetensors.numpy.load_file(str(checkpoint))
    assert set(tensors) == set(e.step._storage)
    for name, value in tensors.items():
        np.testing.assert_array_equal(value, e.step._read_variable(name), err_msg=name)
        assert value.dtype == e.step._read_variable(name).dtype
    e.step.load(e.init)
    e.step.load(checkpoint)
    for name, value in tensors.items():
        np.testing.assert_array_equal(e.step._read_variable(name), value, err_msg=name)
    result = e.torch_model.load_state_dict(safetensors.torch.load_file(str(checkpoint)), strict=False)
    assert result.missing_keys == []
    for name, value in e.torch_model.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), tensors[name], err_msg=name)


HARNESS = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "mlp.h"

static void report(const char* what, int status, mlp_state* s)
{
    printf("%s %d %s\n", what, status, mlp_error(s));
}

int main(int argc, char** argv)
{
    mlp_state* s;
    if (mlp_create(&s) != MLP_OK) return 3;
    if (mlp_load(s, "mlp.safetensors") != MLP_OK) return 7;  /* the values when exported */
    if (strcmp(argv[1], "workspace") == 0) {
        const long long batches[] = {1, 7, 16, 64, 1000};
        for (int k = 0; k < 5; ++k)
            printf("%lld %lld %lld\n", batches[k], (long long)mlp_step_workspace_bytes(batches[k]),
                   (long long)mlp_predict_workspace_bytes(batches[k]));
        printf("bad %lld\n", (long long)mlp_step_workspace_bytes(0));
    } else if (strcmp(argv[1], "predict") == 0) {  /* predict CKPT ROWS: x from x.bin to out.bin */
        long long rows = atoll(argv[3]);
        float* x = malloc(sizeof(float) * 5 * rows);
        float* out = malloc(sizeof(float) * 3 * rows);
        FILE* f = fopen("x.bin", "rb");
        if (fread(x, sizeof(float), 5 * rows, f) != (size_t)(5 * rows)) return 4;
        fclose(f);
        int status = mlp_load(s, argv[2]);
        if (status != MLP_OK) { report("load", status, s); return 5; }
        status = mlp_predict(s, x, rows, out);
        if (status != MLP_OK) { report("predict", status, s); return 6; }
        f = fopen("out.bin", "wb");
        fwrite(out, sizeof(float), 3 * rows, f);
        fclose(f);
    } else if (strcmp(argv[1], "errors") == 0) {  /* errors OTHER_CKPT */
        float x[10] = {0}, loss = -1;
        int64_t y[2] = {1, 3};
        for (int k = 0; k < 10; ++k) x[k] = (float)k / 7 - 0.5f;
        void* weight;
        int64_t numel;
        mlp_variable(s, "0.weight", &weight, &numel);
        float before[30];
        memcpy(before, weight, sizeof before);
        report("label", mlp_step(s, x, y, 2, &loss), s);
        y[1] = -1;
        report("negative", mlp_step(s, x, y, 2, &loss), s);
        printf("unchanged %d loss %g\n", memcmp(before, weight, sizeof before) == 0, loss);
        y[1] = 2;
        report("size", mlp_step(s, x, y, 0, &loss), s);
        report("null", mlp_step(s, NULL, y, 2, &loss), s);
        report("lr", mlp_set_learning_rate(s, -1.0), s);
        report("hyper", mlp_set_hyperparameter(s, "0.weight", 1.0), s);
        report("other", mlp_load(s, argv[2]), s);
        report("missing", mlp_load(s, "no-such-file.safetensors"), s);
        report("garbage", mlp_load(s, "x.bin"), s);
        printf("unchanged %d\n", memcmp(before, weight, sizeof before) == 0);
        report("good", mlp_step(s, x, y, 2, &loss), s);
        printf("changed %d\n", memcmp(before, weight, sizeof before) != 0);
    }
    mlp_free(s);
    return 0;
}
"""


def test_predict_from_a_python_checkpoint_equals_python(exported):
    e = exported("mlp")
    e.step.load(e.init)
    for start in range(0, 48, BATCH):  # trained a little in Python, saved by step.save
        e.step(x=X[start:start + BATCH], y=Y[start:start + BATCH])
    e.step.save(e.dir / "python.safetensors")
    X[:20].tofile(e.dir / "x.bin")
    harness = e.harness(HARNESS)
    done = subprocess.run([str(harness), "predict", "python.safetensors", "20"], cwd=e.dir, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    c_out = np.fromfile(e.dir / "out.bin", dtype=np.float32).reshape(20, 3)
    np.testing.assert_array_equal(c_out, e.step.predict(x=X[:20]))


def test_a_torch_models_safetensors_loads_into_the_c_library(exported):
    """A file with the model's entries only (torch's state_dict; its own order and layout) loads the
    parameters and buffers and keeps the rest, as step.load does."""
    e = exported("mlp")
    trained = {name: torch.from_numpy(value + 0.25) for name, value in e.step.state_dict().items()
               if value.dtype == np.float32}
    trained["1.num_batches_tracked"] = torch.tensor(5)
    safetensors.torch.save_file(trained, str(e.dir / "torch.safetensors"))
    X[:20].tofile(e.dir / "x.bin")
    done = subprocess.run([str(e.harness(HARNESS)), "predict", "torch.safetensors", "20"], cwd=e.dir,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    e.step.load(e.init)
    e.step.load(e.dir / "torch.safetensors")
    c_out = np.fromfile(e.dir / "out.bin", dtype=np.float32).reshape(20, 3)
    np.testing.assert_array_equal(c_out, e.step.predict(x=X[:20]))


def test_a_fixed_batch_step_drops_the_last_partial_batch(tmp_path):
    x, y = sg.input("x", (16, 5)), sg.input("y", (16,), dtype="int64")
    W, b = sg.param("W", (5, 3), init="normal"), sg.param("b", (3,), init="zeros")
    step = sg.train_step(sg.cross_entropy(x @ W + b, y), [W, b], sg.optim.SGD(lr=0.1, momentum=0.9), backend="c")
    fixed = Exported(step, tmp_path, "fixed", None)
    done = fixed.train_main("--epochs", EPOCHS, "--log-steps")
    assert done.returncode == 0, done.stderr
    c_losses = [float(line.split()[-1]) for line in done.stdout.splitlines() if line.startswith("step ")]
    assert len(c_losses) == EPOCHS * (ROWS // 16)
    assert c_losses == _full_batches(fixed, EPOCHS, 16)
    done = fixed.train_main("--batch-size", 5)
    assert done.returncode == 2 and "exactly 16 rows" in done.stderr


def _full_batches(e: Exported, epochs: int, batch: int) -> list[float]:
    """The Python step's losses on train_main's batches, the last partial batch of each epoch dropped."""
    e.step.load(e.init)
    losses = []
    for epoch in range(epochs):
        order = export.shuffle_order(ROWS, 0, epoch)
        for start in range(0, ROWS - batch + 1, batch):
            rows = order[start:start + batch]
            losses.append(e.step(x=X[rows], y=Y[rows]))
    return losses


def test_workspace_is_planned_as_python_plans_it(exported):
    e = exported("mlp")
    done = subprocess.run([str(e.harness(HARNESS)), "workspace"], cwd=e.dir, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split("\n")
    predict = e.step.program_for("predict").program
    for line in lines[:5]:
        batch, step_bytes, predict_bytes = map(int, line.split())
        (dim,) = e.step.program.dims
        # the temporaries, then the runtime's scratch region (as the program counts it for its team)
        for program, nbytes in ((e.step.program, step_bytes), (predict, predict_bytes)):
            arena = memory_plan(program.arena, {dim: batch}).arena_bytes
            assert nbytes == -(-arena // 64) * 64 + program._scratch_bytes((batch,))
    assert lines[5] == "bad -1"


def test_bad_input_gives_a_status_and_a_message_not_a_crash(exported):
    e, other = exported("mlp"), exported("softmax")
    (other.dir / "softmax.safetensors").write_bytes(other.init.read_bytes())
    X[:2].tofile(e.dir / "x.bin")
    done = subprocess.run([str(e.harness(HARNESS)), "errors", str(other.dir / "softmax.safetensors")], cwd=e.dir,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    got = {line.split(" ", 1)[0]: line for line in done.stdout.splitlines()}
    assert got["label"] == "label 2 step: input y holds label 3 at index 1, outside [0, 3)"
    assert got["negative"].startswith("negative 2 ") and "label -1 at index 1" in got["negative"]
    assert "unchanged 1 loss -1" in done.stdout  # a refused step writes nothing
    assert got["size"].startswith(f"size {Status.BAD_SIZE:d} ") and "batch size 0" in got["size"]
    assert got["null"].startswith(f"null {Status.BAD_ARGUMENT:d} ") and "input x is NULL" in got["null"]
    assert got["lr"].startswith(f"lr {Status.BAD_ARGUMENT:d} ") and "finite non-negative" in got["lr"]
    assert got["hyper"].startswith(f"hyper {Status.NO_SUCH_VARIABLE:d} ")
    assert got["other"].startswith(f"other {Status.BAD_CHECKPOINT:d} ") and "nothing loaded" in got["other"]
    assert "'W'" in got["other"]
    assert got["missing"].startswith(f"missing {Status.IO_ERROR:d} ")
    assert got["garbage"].startswith(f"garbage {Status.BAD_CHECKPOINT:d} ")
    assert done.stdout.splitlines()[-2:] == ["good 0 ", "changed 1"]
    bad = e.dir / "bad.bin"
    export.write_dataset(bad, [X[:4], np.array([0, 1, 7, 2])])
    done = e.train_main("--batch-size", 4, "--no-shuffle", data=bad)
    assert done.returncode == 1 and "label 7 at index 2" in done.stderr and "outside [0, 3)" in done.stderr
    wrong = e.dir / "wrong.bin"
    export.write_dataset(wrong, [X[:4].astype(np.float64), Y[:4]])
    done = e.train_main(data=wrong)
    assert done.returncode == 1 and "input x" in done.stderr


def test_symgrad_export_command(tmp_path):
    from symgrad.tools.cli import main

    example = Path(__file__).resolve().parents[2] / "examples" / "inspect_softmax.py"
    assert main(["export", str(example), "--out", str(tmp_path)]) == 0
    header = (tmp_path / "inspect_softmax.h").read_text()
    for api in ("inspect_softmax_create(", "inspect_softmax_load(", "inspect_softmax_save(", "inspect_softmax_step(",
                "inspect_softmax_predict(", "inspect_softmax_set_learning_rate(", "inspect_softmax_free("):
        assert api in header
    assert {p.name for p in tmp_path.iterdir()} >= {"inspect_softmax.c", "train_main.c", "Makefile",
                                                    "inspect_softmax_step.c", "symgrad_runtime.c"}
    assert main(["export", str(tmp_path / "missing.py"), "--out", str(tmp_path)]) == 1


def test_export_refuses_what_the_c_api_cannot_take(tmp_path):
    x = sg.input("x", (sg.Dim("B"), sg.Dim("T")))
    w = sg.param("w", (), init="ones")
    step = sg.train_step(sg.sum(x * w), [w], sg.optim.SGD(lr=0.1), backend="numpy")
    with pytest.raises(ValueError, match="Dims"):
        step.export(tmp_path)
    with pytest.raises(ValueError, match="C identifier"):
        step.export(tmp_path, name="my model")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_cuda_export_builds_with_nvcc(tmp_path):
    """backend="cuda": the same API over the CUDA programs, built by nvcc (no GPU needed to build);
    train_main trains where a GPU is, and says there is none (a status, not a crash) where not."""
    from symgrad.backends import cuda

    sg.manual_seed(3)
    model = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Dropout(0.3), nn.Linear(6, 3))
    x, y = sg.input("x", (sg.Dim("B"), 5)), sg.input("y", (sg.Dim("B"),), dtype="int64")
    logits = model(x)
    step = sg.train_step(sg.cross_entropy(logits, y), model.parameters(), sg.optim.Adam(lr=1e-2), predict=logits,
                         backend="numpy")
    written = step.export(tmp_path, name="mlp", backend="cuda")
    assert written["step"].suffix == ".cu" and "mlp_step_run" in written["step"].read_text()
    arch = "-arch=sm_80" if cuda.probe_device_count()[0] == 0 else ""  # one architecture: half the build
    flags = f"NVCCFLAGS=-O3 -std=c++17 -Xcompiler -fPIC {arch or ' '.join(cuda.arch_flags())}"
    subprocess.run(["make", "-s", "-C", str(tmp_path), flags], check=True, capture_output=True, timeout=600)
    export.write_dataset(tmp_path / "data.bin", [X, Y])
    done = subprocess.run([str(tmp_path / "train_main"), str(tmp_path / "data.bin"), "--batch-size", "16",
                           "--save", str(tmp_path / "ckpt.safetensors")], capture_output=True, text=True, timeout=120)
    if arch:  # no GPU here
        assert done.returncode == 1 and "no CUDA device" in done.stderr
    else:
        assert done.returncode == 0, done.stderr
        assert set(safetensors.numpy.load_file(str(tmp_path / "ckpt.safetensors"))) == set(step._storage)


def test_odd_names_stay_inside_c_strings(tmp_path):
    """Names with quotes, comment ends and non-ASCII build, and come back from a C checkpoint as given."""
    odd_x, odd_w = 'x */ "é', 'W*/\\"ü?'
    x, y = sg.input(odd_x, (sg.Dim("B"), 5)), sg.input("y", (sg.Dim("B"),), dtype="int64")
    W = sg.param(odd_w, (5, 3), init="normal")
    step = sg.train_step(sg.cross_entropy(x @ W, y), [W], sg.optim.SGD(lr=0.1), backend="c")
    odd = Exported(step, tmp_path, "odd", None)
    done = odd.train_main("--epochs", 1, "--save", tmp_path / "odd.safetensors")
    assert done.returncode == 0, done.stderr
    assert set(safetensors.numpy.load_file(str(tmp_path / "odd.safetensors"))) == {odd_w, "lr"}
    step.load(tmp_path / "odd.safetensors")
    assert "input0" in (tmp_path / "odd.h").read_text()  # not a C identifier: a parameter name of its own


# ---- the weights file, the symbol prefix, the query API -----------------------------------------

def test_the_library_source_holds_code_and_the_weights_file_the_values(exported):
    """<name>.c holds no parameter's bytes; <name>.safetensors holds every variable as exported, in
    the layout the library's own save writes (a Python checkpoint of the same state loads into it)."""
    e = exported("mlp")
    source = (e.dir / "mlp.c").read_text()
    weight = np.ascontiguousarray(e.step._read_variable("0.weight"), dtype=np.float32)
    words = [f"0x{int(w):x}U" for w in weight.reshape(-1).view(np.uint32)]
    assert not any(w in source for w in words)
    weights = safetensors.numpy.load_file(str(e.written["weights"]))
    initial = safetensors.numpy.load_file(str(e.init))
    assert set(weights) == set(initial)
    for name, value in initial.items():
        np.testing.assert_array_equal(weights[name], value, err_msg=name)
        assert weights[name].dtype == value.dtype
    e.step.load(e.written["weights"])  # Python reads it too


def _globals(library: Path) -> list[str]:
    """The global symbols an archive defines."""
    nm = subprocess.run(["nm", "-g", "--defined-only", str(library)], check=True, capture_output=True, text=True)
    return [line.split()[2] for line in nm.stdout.splitlines() if len(line.split()) == 3]


TWO_MODELS = r"""
#include <stdio.h>
#include "mlp.h"
#include "softmax.h"

int main(void)
{
    mlp_state* m;
    softmax_state* s;
    if (mlp_create(&m) != MLP_OK || softmax_create(&s) != SOFTMAX_OK) return 3;
    if (mlp_load(m, "mlp.safetensors") != MLP_OK) { printf("%s\n", mlp_error(m)); return 4; }
    if (softmax_load(s, "SOFTMAX_WEIGHTS") != SOFTMAX_OK) { printf("%s\n", softmax_error(s)); return 5; }
    float x[10], a[6], b[6];
    for (int k = 0; k < 10; ++k) x[k] = (float)k / 5 - 1;
    if (mlp_predict(m, x, 2, a) != MLP_OK || softmax_predict(s, x, 2, b) != SOFTMAX_OK) return 6;
    for (int k = 0; k < 6; ++k) printf("%.9g %.9g\n", a[k], b[k]);
    mlp_free(m);
    softmax_free(s);
    return 0;
}
"""


def test_no_exported_c_function_is_over_the_limit(exported):
    """The export's C (train_main, the library, its programs and runtime; with and without a loss
    program and a learning rate's schedule) holds no function over the limit symgrad's other C has
    (tests/backends/test_c_function_length.py)."""
    from c_functions import function_lengths, over_the_limit
    for kind in ("softmax", "mlp"):
        written = [Path(p) for p in exported(kind).written.values()]
        sources = {p.name: p.read_text() for p in written if p.suffix in (".c", ".h")}
        assert "main" in function_lengths(sources["train_main.c"]) and f"{kind}_load" in function_lengths(
            sources[f"{kind}.c"]), sorted(sources)
        long = {f"{name}: {f}": n for name, text in sources.items() for f, n in over_the_limit(text).items()}
        assert long == {}, kind


def test_two_exported_models_link_into_one_program(exported):
    """Every global symbol of lib<name>.a starts with <name>_ (the runtime's are renamed too), so a
    program links two exported models and runs both."""
    e, other = exported("mlp"), exported("softmax")
    for lib in (e, other):
        symbols = _globals(lib.dir / f"lib{lib.name}.a")
        assert f"{lib.name}_create" in symbols and f"{lib.name}_sg_gemm_f32" in symbols
        assert [s for s in symbols if not s.startswith(lib.name + "_")] == []
    code = TWO_MODELS.replace("SOFTMAX_WEIGHTS", str(other.dir / "softmax.safetensors"))
    done = subprocess.run([str(e.harness(code, "two", others=[other]))], cwd=e.dir, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    got = np.array([line.split() for line in done.stdout.splitlines()], dtype=np.float32)
    x = (np.arange(10, dtype=np.float32) / 5 - 1).reshape(2, 5)
    for model, column in ((e, 0), (other, 1)):
        model.step.load(model.written["weights"])
        np.testing.assert_array_equal(got[:, column], model.step.predict(x=x).reshape(-1))


QUERY = r"""
#include <stdio.h>
#include <string.h>
#include "mlp.h"

static void shape(const char* what, int rank, const int64_t* sizes)
{
    printf("%s %d", what, rank);
    for (int d = 0; d < rank; ++d) printf(" %lld", (long long)sizes[d]);
    printf("\n");
}

int main(void)
{
    mlp_state* s;
    if (mlp_create(&s) != MLP_OK || mlp_load(s, "mlp.safetensors") != MLP_OK) return 3;
    int count = mlp_variable_count();
    printf("count %d\n", count);
    for (int k = 0; k < count; ++k) {
        void* by_name;
        int64_t numel;
        mlp_variable(s, mlp_variable_name(k), &by_name, &numel);
        printf("variable %s %s %s %lld %d %d\n", mlp_variable_name(k), mlp_variable_role(k),
               mlp_dtype_name(mlp_variable_dtype(k)), (long long)mlp_variable_numel(k),
               mlp_variable_data(s, k) == by_name, mlp_variable_index(mlp_variable_name(k)) == k);
        shape("shape", mlp_variable_rank(k), mlp_variable_shape(k));
    }
    printf("bad %d %d %d\n", mlp_variable_data(s, count) == NULL, mlp_variable_name(-1) == NULL,
           mlp_variable_index("no such") == -1);
    printf("message %s\n", mlp_error(s));
    int64_t sizes[8];
    for (int k = 0; k < mlp_step_input_count(); ++k) {
        printf("step input %s %s\n", mlp_step_input_name(k), mlp_dtype_name(mlp_step_input_dtype(k)));
        shape("shape", mlp_step_input_shape(k, 7, sizes), sizes);
    }
    for (int k = 0; k < mlp_step_output_count(); ++k) {
        printf("step output %s %s\n", mlp_step_output_name(k), mlp_dtype_name(mlp_step_output_dtype(k)));
        shape("shape", mlp_step_output_shape(k, 7, sizes), sizes);
    }
    for (int k = 0; k < mlp_predict_output_count(); ++k) {
        printf("predict output %s %s\n", mlp_predict_output_name(k), mlp_dtype_name(mlp_predict_output_dtype(k)));
        shape("shape", mlp_predict_output_shape(k, 7, sizes), sizes);
    }
    printf("refused %d %d\n", mlp_predict_output_shape(1, 7, sizes), mlp_predict_output_shape(0, 0, sizes));
    mlp_free(s);
    return 0;
}
"""


def test_the_header_codes_are_symgrads_one_status_enum(exported):
    """The library's <NAME>_* codes are Status's, one code per meaning: the entry's statuses pass
    through the library unchanged (BAD_SIZE once shared 3 with the runtime's COLLECTIVE_FAILED)."""
    header = (exported("mlp").dir / "mlp.h").read_text()
    codes = {name: int(value) for name, value in re.findall(r"^ +MLP_([A-Z_]+) = (\d+),  /\*", header, re.M)}
    assert codes == {s.name: int(s) for s in Status}
    assert len(set(codes.values())) == len(codes)


def test_the_header_and_the_query_api_give_names_dtypes_and_shapes(exported):
    e = exported("mlp")
    header = (e.dir / "mlp.h").read_text()
    assert "out0" not in header
    assert "int mlp_step(mlp_state* state, const float* x, const int64_t* y, int64_t batch, float* loss);" in header
    assert "loss: float32[], written" in header and "output: float32[batch, 3], written" in header
    assert '"0.weight" float32[6, 5] (param)' in header
    done = subprocess.run([str(e.harness(QUERY, "query"))], cwd=e.dir, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    names = list(safetensors.numpy.load_file(str(e.written["weights"])))
    assert lines[0] == f"count {len(names)}"
    for k, name in enumerate(names):
        value = e.step._read_variable(name)
        role = e.step._variables[name].attrs["role"]
        assert lines[1 + 2 * k] == f"variable {name} {role} {value.dtype} {value.size} 1 1"
        assert lines[2 + 2 * k].split() == ["shape", str(value.ndim), *map(str, value.shape)]
    rest = lines[1 + 2 * len(names):]
    assert rest[0] == "bad 1 1 1" and rest[1].startswith("message variable_data: no variable")
    assert rest[2:] == ["step input x float32", "shape 2 7 5", "step input y int64", "shape 1 7",
                        "step output loss float32", "shape 0", "predict output output float32", "shape 2 7 3",
                        "refused -1 -1"]


# ---- an inference-only library ---------------------------------------------------------------------

PREDICT_ONLY = r"""
#include <stdio.h>
#include <stdlib.h>
#include "mlp.h"

int main(int argc, char** argv)  /* CKPT ROWS: x from x.bin to out.bin */
{
    mlp_state* s;
    if (mlp_create(&s) != MLP_OK) return 3;
    int status = mlp_load(s, argv[1]);
    if (status != MLP_OK) { printf("load %d %s\n", status, mlp_error(s)); mlp_free(s); return 5; }
    long long rows = atoll(argv[2]);
    float* x = malloc(sizeof(float) * 5 * rows);
    float* out = malloc(sizeof(float) * 3 * rows);
    FILE* f = fopen("x.bin", "rb");
    if (fread(x, sizeof(float), 5 * rows, f) != (size_t)(5 * rows)) return 4;
    fclose(f);
    if (mlp_predict(s, x, rows, out) != MLP_OK) return 6;
    f = fopen("out.bin", "wb");
    fwrite(out, sizeof(float), 3 * rows, f);
    fclose(f);
    free(x);
    free(out);
    mlp_free(s);
    return 0;
}
"""


def test_an_inference_only_export_predicts_from_a_training_checkpoint(exported, tmp_path):
    """programs=("predict",): no step, no optimizer state, no train_main; a step.save checkpoint (its
    optimizer entries ignored) or the export's own weights file loads, and predicts as Python does."""
    e = exported("mlp")
    only = Exported(e.step, tmp_path, "mlp", None, programs=("predict",), runtime_from=e.dir)
    assert "train_main" not in only.written and not (tmp_path / "train_main.c").exists()
    header = (tmp_path / "mlp.h").read_text()
    assert "mlp_predict(" in header and "mlp_step(" not in header and "mlp_loss(" not in header
    assert "exp_avg" not in header and "an inference library" in header
    held = set(safetensors.numpy.load_file(str(only.written["weights"])))
    assert set(e.step.params) <= held <= set(e.step.state_dict())  # what predict reads: no optimizer state
    with pytest.raises(ValueError, match="programs"):
        e.step.export(tmp_path / "no", programs=("train",))
    X[:20].tofile(tmp_path / "x.bin")
    e.step.load(e.init)
    e.step(x=X[:16], y=Y[:16])
    e.step.save(tmp_path / "trained.safetensors")
    for checkpoint in ("trained.safetensors", "mlp.safetensors"):
        if checkpoint == "mlp.safetensors":
            e.step.load(e.init)
        done = subprocess.run([str(only.harness(PREDICT_ONLY, "predict_only")), checkpoint, "20"], cwd=tmp_path,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
        c_out = np.fromfile(tmp_path / "out.bin", dtype=np.float32).reshape(20, 3)
        np.testing.assert_array_equal(c_out, e.step.predict(x=X[:20]), err_msg=checkpoint)


def test_the_default_name_is_the_calling_files(tmp_path):
    x, y = sg.input("x", (sg.Dim("B"), 5)), sg.input("y", (sg.Dim("B"),), dtype="int64")
    W = sg.param("W", (5, 3), init="zeros")
    step = sg.train_step(sg.cross_entropy(x @ W, y), [W], sg.optim.SGD(lr=0.1), backend="c")
    written = step.export(tmp_path, programs=("predict",))
    assert written["header"].name == "test_export.h"
    assert "test_export_predict(" in written["header"].read_text()


# ---- train_main: the learning-rate schedule and the validation loss ---------------------------

def test_train_main_schedule_and_validation_loss_as_python(exported):
    """--schedule cosine --warmup: the losses equal the Python step's with step.lr set from
    export.learning_rate each step (bit for bit); --val prints the train and validation loss (the
    loss program over VAL's rows) at --eval-every steps and the last."""
    e = exported("softmax")
    val = e.dir / "val.bin"
    export.write_dataset(val, [X[:30], Y[:30]])
    done = e.train_main("--epochs", EPOCHS, "--batch-size", BATCH, "--log-steps", "--schedule", "cosine",
                        "--warmup", 3, "--lr", 0.2, "--val", val, "--eval-every", 4)
    assert done.returncode == 0, done.stderr
    c_losses = [float(line.split()[-1]) for line in done.stdout.splitlines() if re.match(r"step \d+ loss", line)]
    total = EPOCHS * -(-ROWS // BATCH)
    rates = [export.learning_rate(k, 0.2, 3, total, "cosine") for k in range(total)]
    assert rates[2] == pytest.approx(0.2) and export.learning_rate(total, 0.2, 3, total) == pytest.approx(0.02)
    e.step.load(e.init)
    python, k = [], 0
    evaluations = {}
    for epoch in range(EPOCHS):
        order = export.shuffle_order(ROWS, 0, epoch)
        for start in range(0, ROWS, BATCH):
            e.step.lr = rates[k]
            rows = order[start:start + BATCH]
            python.append(e.step(x=X[rows], y=Y[rows]))
            if k % 4 == 0 or k == total - 1:
                logits = X[:30].astype(np.float64) @ e.step.params["W"] + e.step.params["b"]
                log_p = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) \
                    - logits.max(1, keepdims=True)
                evaluations[k] = (python[-1], -log_p[np.arange(30), Y[:30]].mean(), rates[k])
            k += 1
    assert c_losses == python
    printed = [line for line in done.stdout.splitlines() if "val loss" in line]
    assert [int(line.split()[1]) for line in printed] == sorted(evaluations)
    for line in printed:
        fields = line.split()
        train, val_loss, rate = evaluations[int(fields[1])]
        assert float(fields[4]) == pytest.approx(train, abs=1e-4)
        assert float(fields[7]) == pytest.approx(val_loss, abs=2e-4)
        assert float(fields[9]) == pytest.approx(rate, rel=1e-2)
    e.step.load(e.init)
    done = e.train_main("--steps", 3, "--schedule", "linear")
    assert done.returncode == 2 and "constant or cosine" in done.stderr


# ---- bad files under AddressSanitizer and UndefinedBehaviorSanitizer -----------------------------

SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-g"]
REPORTS = ("AddressSanitizer", "LeakSanitizer", "runtime error:", "UndefinedBehaviorSanitizer")


def _sanitizers_work(directory: Path) -> bool:
    """Whether cc builds and runs a program with -fsanitize=address,undefined here."""
    source = directory / "probe.c"
    source.write_text("#include <stdlib.h>\nint main(void) { free(malloc(8)); return 0; }\n")
    built = subprocess.run(["cc", *SANITIZE, "-o", str(directory / "probe"), str(source)], capture_output=True)
    return built.returncode == 0 and subprocess.run([str(directory / "probe")], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def sanitized(exported, tmp_path_factory):
    """The MLP's export built again with `make SANITIZE=1`: the library, train_main and the programs
    with AddressSanitizer and UndefinedBehaviorSanitizer (leaks found by LeakSanitizer). The runtime's
    GEMMs, symgrad's own and tested with the backend, keep their optimized object (no instrumentation
    there; a quarter of the build's time saved)."""
    directory = tmp_path_factory.mktemp("sanitized")
    if not _sanitizers_work(directory):
        pytest.skip("the C compiler here cannot build with -fsanitize=address,undefined")
    e = exported("mlp")
    for path in e.dir.iterdir():
        if path.suffix in (".c", ".h", ".safetensors", ".bin") or path.name == "Makefile":
            shutil.copyfile(path, directory / path.name)
    _reuse_runtime(e.dir, directory, "mlp")
    subprocess.run(["make", "-s", "-C", str(directory), "SANITIZE=1"], check=True, capture_output=True, timeout=600)
    return directory


def _run_sanitized(directory: Path, *args):
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=1:halt_on_error=1", UBSAN_OPTIONS="print_stacktrace=1")
    return subprocess.run([str(directory / "train_main"), *map(str, args)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=directory)


def test_train_main_under_sanitizers_refuses_bad_files_cleanly(sanitized):
    """Truncated and corrupt datasets and checkpoints, a checkpoint of the wrong shape: a message
    that says what is wrong, exit status 1, and no sanitizer report (no memory error, no leak)."""
    d = sanitized
    good = (d / "data.bin").read_bytes()
    weights = (d / "mlp.safetensors").read_bytes()
    header_length = int.from_bytes(weights[:8], "little")
    header = weights[8:8 + header_length]
    huge_rows = bytearray(good)
    huge_rows[8:16] = (1 << 61).to_bytes(8, "little")
    wrong = {k: v for k, v in safetensors.numpy.load_file(str(d / "mlp.safetensors")).items()}
    wrong["0.weight"] = np.zeros((6, 4), np.float32)
    safetensors.numpy.save_file(wrong, str(d / "wrong.safetensors"))
    files = {"truncated.bin": good[:-13], "rows.bin": bytes(huge_rows), "empty.bin": b"",
             "magic.bin": b"NOTDATA!" + good[8:],
             "truncated.safetensors": weights[:-10], "short.safetensors": weights[:8 + header_length // 2],
             "length.safetensors": (1 << 62).to_bytes(8, "little") + weights[8:],
             "json.safetensors": weights[:8] + header.replace(b'"shape"', b'"shape"\x00', 1)[:header_length]
             + weights[8 + header_length:],
             "rank.safetensors": weights[:8] + header.replace(b"[6,5]", b"[-6,5]", 1) + weights[8 + header_length:]}
    for name, data in files.items():
        (d / name).write_bytes(data)
    cases = {"truncated.bin": ["truncated.bin"], "rows.bin": ["rows.bin"], "empty.bin": ["empty.bin"],
             "magic.bin": ["magic.bin"], "val.bin": ["data.bin", "--val", "truncated.bin"]}
    for checkpoint in ("truncated", "short", "length", "json", "rank", "wrong"):
        cases[checkpoint] = ["data.bin", "--init", f"{checkpoint}.safetensors"]
    expected = {"truncated.bin": "truncated or corrupt", "rows.bin": "truncated or corrupt",
                "empty.bin": "not a dataset", "magic.bin": "not a dataset", "val.bin": "truncated or corrupt",
                "truncated": "data_offsets", "short": "truncated, or not a safetensors", "length": "not a safetensors",
                "json": "malformed", "rank": "malformed",
                "wrong": "'0.weight' is F32 [6, 4] there, the model's is F32 [6, 5]"}
    for case, args in cases.items():
        done = _run_sanitized(d, *args)
        assert done.returncode == 1, (case, done.stdout, done.stderr)
        assert expected[case] in done.stderr, (case, done.stderr)
        assert not any(r in done.stderr for r in REPORTS), (case, done.stderr)
    # A good run, every feature on, is clean too: the state and the datasets are freed at the end.
    done = _run_sanitized(d, "data.bin", "--val", "data.bin", "--epochs", 2, "--batch-size", 16, "--schedule",
                          "cosine", "--warmup", 2, "--eval-every", 3, "--save", d / "trained.safetensors")
    assert done.returncode == 0 and not any(r in done.stderr for r in REPORTS), done.stderr
    assert "val loss" in done.stdout
    done = _run_sanitized(d, "data.bin", "--epochs", "x")
    assert done.returncode == 2 and "--epochs takes an integer" in done.stderr


def test_each_parameter_groups_learning_rate_follows_the_schedule(exported, tmp_path):
    """Two parameter groups with their own learning rates: train_main schedules each from its own
    peak, as setting each group's lr in Python does (bit for bit); set_learning_rate sets both."""
    x, y = sg.input("x", (sg.Dim("B"), 5)), sg.input("y", (sg.Dim("B"),), dtype="int64")
    W, b = sg.param("W", (5, 3), init="normal"), sg.param("b", (3,), init="zeros")
    optimizer = sg.optim.SGD([{"params": [W]}, {"params": [b], "lr": 0.05}], lr=0.1, momentum=0.9)
    step = sg.train_step(sg.cross_entropy(x @ W + b, y), optimizer=optimizer, backend="c")
    groups = Exported(step, tmp_path, "softmax", None, programs=("step",), runtime_from=exported("softmax").dir)
    assert '"param_groups.1.lr"' in (tmp_path / "softmax.c").read_text()
    done = groups.train_main("--epochs", 1, "--batch-size", BATCH, "--log-steps", "--schedule", "cosine",
                             "--warmup", 2)
    assert done.returncode == 0, done.stderr
    c_losses = [float(line.split()[-1]) for line in done.stdout.splitlines() if line.startswith("step ")]
    step.load(groups.init)
    order, total, python = export.shuffle_order(ROWS, 0, 0), -(-ROWS // BATCH), []
    for k, start in enumerate(range(0, ROWS, BATCH)):
        for group, peak in zip(step.param_groups, (0.1, 0.05)):
            group["lr"] = export.learning_rate(k, peak, 2, total, "cosine")
        python.append(step(x=X[order[start:start + BATCH]], y=Y[order[start:start + BATCH]]))
    assert c_losses == python
