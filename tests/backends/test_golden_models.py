"""Golden files of a GPT block's and a small CNN's training steps: C source, printed decisions, CUDA source.

A change to what decide chooses or to the code emitted for attention, LayerNorm, GELU, the embedding,
AdamW's parameter groups, or the convolution kinds (direct rows, patch GEMM, Winograd, narrow) shows in
review as a diff of tests/golden/gpt_block_step.c, gpt_block_decisions.txt, gpt_block_step.cu,
cnn_step.c and cnn_decisions.txt. When intended, regenerate them:
SYMGRAD_UPDATE_GOLDEN=1 python -m pytest tests/backends/test_golden_models.py

The texts are rendered through the driver's stages (passes, decide, lower, render: what
`sg.train_step(..., backend="c")` compiles, byte for byte) without building anything: no compiler,
no GPU, no nvcc. They do not depend on the machine, so CI's AMD Zen 3 (AVX2) and Zen 4 (AVX-512)
runners, with any number of cores, must produce the same bytes: the vector width is chosen by the C
preprocessor inside the compiled code (SG_F32_VL from the runtime header's #if chain), the thread
count is read when the program runs (omp_get_max_threads), the translation units follow the source's
length, not the cores, and no path, hash or time enters the text. Nothing needs normalising;
`test_the_texts_are_the_same_for_both_machine_kinds` renders again with each kind's settings
(-march, OpenMP threads, cores) to hold that.
"""

from __future__ import annotations

import os

import pytest

import symgrad as sg
from benchmarks.gpt_models import load_example
from symgrad import nn
from symgrad.backends.driver import compile_stages
from symgrad.backends.render.languages import C_OPENMP, CUDA

from golden_files import check_golden

# Small sizes (the structure, not the sizes, sets the number of kernels): one block, 2 heads of 16.
GPT_SIZES = dict(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=32)
# A CI machine of each kind, as symgrad could see it: compiler flags, OpenMP threads, cores.
MACHINES = {
    "zen3-avx2": dict(flags="-O3 -march=x86-64-v3 -fopenmp -std=c11", threads="2", cores=2),
    "zen4-avx512": dict(flags="-O3 -march=x86-64-v4 -fopenmp -std=c11", threads="16", cores=16),
}


def _gpt_graph():
    """One nanoGPT block (examples/gpt.py) trained by its AdamW groups; the graph of its step."""
    gpt = load_example()
    sg.manual_seed(0)
    model = gpt.GPT(gpt.GPTConfig(**GPT_SIZES))
    T, V = GPT_SIZES["block_size"], GPT_SIZES["vocab_size"]
    idx = sg.input("idx", (sg.Dim("B"), T), dtype="int64")
    targets = sg.input("targets", (sg.Dim("B"), T), dtype="int64")
    loss = sg.cross_entropy(model(idx).view(-1, V), targets.view(-1))
    optimizer = model.configure_optimizers(weight_decay=0.1, learning_rate=1e-3, betas=(0.9, 0.95))
    return sg.train_step(loss, optimizer=optimizer, backend="numpy").program.graph


def _cnn_graph():
    """Convolutions that take each implementation decide has for them: a first layer of 3 channels
    (direct rows forward, a narrow product backward), 8 -> 16 (patch GEMM), 16 -> 16 3x3 (Winograd)."""
    sg.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                          nn.Flatten(), nn.Linear(16 * 4 * 4, 10))
    x, y = sg.input("x", (sg.Dim("B"), 3, 8, 8)), sg.input("y", (sg.Dim("B"),), dtype="int64")
    loss = sg.cross_entropy(model(x), y)
    return sg.train_step(loss, optimizer=sg.optim.SGD(model.parameters(), lr=0.1), backend="numpy").program.graph


def _render() -> dict:
    """Golden file name -> text, each graph built afresh and rendered through the stages."""
    gpt, cnn = _gpt_graph(), _cnn_graph()
    gpt_c, cnn_c = compile_stages(gpt, C_OPENMP), compile_stages(cnn, C_OPENMP)
    return {"gpt_block_step.c": gpt_c.source, "gpt_block_decisions.txt": gpt_c.plan.decisions,
            "gpt_block_step.cu": compile_stages(gpt, CUDA).source,
            "cnn_step.c": cnn_c.source, "cnn_decisions.txt": cnn_c.plan.decisions}


@pytest.fixture(scope="module")
def texts():
    return _render()


@pytest.mark.parametrize("name", ["gpt_block_step.c", "gpt_block_decisions.txt", "gpt_block_step.cu",
                                  "cnn_step.c", "cnn_decisions.txt"])
def test_the_text_is_the_golden_one(texts, name):
    check_golden(name, texts[name])


def test_the_golden_steps_show_what_they_are_for(texts):
    """The files hold what they are kept for: a change that drops a kind from them fails here, not
    silently in a regenerated file."""
    for kernel in ("_attention_t", "_attention_grad_t", "_gelu_t", "_take_t"):  # fused attention both ways
        assert kernel in texts["gpt_block_step.c"] and kernel in texts["gpt_block_step.cu"], kernel
    assert "attention statistics stored for their gradient: none" not in texts["gpt_block_decisions.txt"]
    matmuls = next(line for line in texts["cnn_decisions.txt"].splitlines() if line.startswith("matmuls:"))
    for kind in ("direct rows", "patch gemm", "winograd", "narrow", " gemm"):
        assert kind in matmuls, f"the CNN's products no longer include {kind!r}: {matmuls}"
    assert "__global__" in texts["gpt_block_step.cu"] and "__global__" not in texts["gpt_block_step.c"]


@pytest.mark.parametrize("machine", sorted(MACHINES))
def test_the_texts_are_the_same_for_both_machine_kinds(texts, machine, monkeypatch):
    settings = MACHINES[machine]
    monkeypatch.setenv("SYMGRAD_CFLAGS", settings["flags"])
    monkeypatch.setenv("OMP_NUM_THREADS", settings["threads"])
    monkeypatch.setattr(os, "cpu_count", lambda: settings["cores"])
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(settings["cores"])), raising=False)
    assert _render() == texts
