"""step.export / `symgrad export` (symgrad/export.py): the exported C library and train_main, built
with make, against the Python C-backend step bit for bit; its checkpoints against Python and torch."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch

import symgrad as sg
from symgrad import export, nn
from symgrad.backends.memory import memory_plan
from symgrad.backends.toolchain import default_flags

pytestmark = pytest.mark.skipif(shutil.which("make") is None or shutil.which("cc") is None,
                                reason="needs make and a C compiler")

ROWS, BATCH, EPOCHS = 70, 16, 2  # 5 batches an epoch, the last one partial
RNG = np.random.default_rng(11)
X = RNG.standard_normal((ROWS, 5)).astype(np.float32)
Y = RNG.integers(0, 3, ROWS)


class Exported:
    """A step, its export built by make, and the checkpoint of its state when exported."""

    def __init__(self, step, directory: Path, name: str, torch_model):
        self.step, self.dir, self.name, self.torch_model = step, directory, name, torch_model
        step.export(directory, name=name)
        self.init = directory / "init.safetensors"
        step.save(self.init)
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

    def harness(self, code: str) -> Path:
        """A C program linked with the exported library."""
        source = self.dir / "harness.c"
        source.write_text(code)
        binary = self.dir / "harness"
        subprocess.run(["cc", *default_flags(), "-fPIC", "-o", str(binary), str(source),
                        str(self.dir / f"lib{self.name}.a"), "-lm"], check=True, cwd=self.dir)
        return binary


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


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    made = {}

    def get(kind: str) -> Exported:
        if kind not in made:
            made[kind] = {"softmax": _softmax, "mlp": _mlp}[kind](tmp_path_factory.mktemp(kind))
        return made[kind]
    return get


@pytest.mark.parametrize("kind", ["softmax", "mlp"])
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
        assert step_bytes == memory_plan(e.step.program.arena, {dim: batch}).arena_bytes
        assert predict_bytes == memory_plan(predict.arena, {dim: batch}).arena_bytes
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
    assert got["size"].startswith("size 3 ") and "batch size 0" in got["size"]
    assert got["null"].startswith("null 4 ") and "input x is NULL" in got["null"]
    assert got["lr"].startswith("lr 4 ") and "finite non-negative" in got["lr"]
    assert got["hyper"].startswith("hyper 7 ")
    assert got["other"].startswith("other 6 ") and "nothing loaded" in got["other"] and "'W'" in got["other"]
    assert got["missing"].startswith("missing 5 ")
    assert got["garbage"].startswith("garbage 6 ")
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
    from symgrad.cli import main

    example = Path(__file__).resolve().parent.parent / "examples" / "inspect_softmax.py"
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
