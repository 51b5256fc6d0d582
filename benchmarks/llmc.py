"""llm.c's train_gpt2.c as a library in this process: built from a local checkout given with --llmc DIR.

The checkout's own file is compiled unchanged, with its flags (-Ofast
-march=native -fopenmp -DOMP); a wrapper renames its `main` away and adds
three functions: create a model from a checkpoint, run one step (forward,
zero_grad, backward, AdamW update) and return the loss, free it. The step's
AdamW is llm.c's gpt2_update with betas (0.9, 0.999), eps 1e-8 and the given
weight decay; it has no gradient clipping.
"""

from __future__ import annotations

import ctypes
import hashlib
import subprocess
from pathlib import Path

import numpy as np

WRAPPER = r"""
/* symgrad's benchmark wrapper around llm.c's train_gpt2.c: the file is included as it is. */
#define main llmc_train_gpt2_main
#include "train_gpt2.c"
#undef main

void* sg_llmc_create(const char* checkpoint) {
    GPT2* model = (GPT2*)mallocCheck(sizeof(GPT2));
    gpt2_build_from_checkpoint(model, checkpoint);
    return model;
}

float sg_llmc_step(void* handle, int* inputs, int* targets, int B, int T, float lr, float weight_decay, int t) {
    GPT2* model = (GPT2*)handle;
    gpt2_forward(model, inputs, targets, B, T);
    gpt2_zero_grad(model);
    gpt2_backward(model);
    gpt2_update(model, lr, 0.9f, 0.999f, 1e-8f, weight_decay, t);
    return model->mean_loss;
}

void sg_llmc_free(void* handle) {
    gpt2_free((GPT2*)handle);
    free(handle);
}
"""

FLAGS = ["-Ofast", "-march=native", "-fopenmp", "-DOMP", "-Wno-unused-result", "-shared", "-fPIC"]


def build(checkout: Path, out_dir: Path) -> Path:
    """The shared library of `checkout`'s train_gpt2.c with the wrapper, built once per source."""
    checkout = Path(checkout).resolve()
    source = checkout / "train_gpt2.c"
    if not source.is_file():
        raise FileNotFoundError(f"--llmc {checkout}: no train_gpt2.c there (a clone of karpathy/llm.c)")
    key = hashlib.sha256(source.read_bytes() + WRAPPER.encode() + " ".join(FLAGS).encode()).hexdigest()[:16]
    out_dir.mkdir(parents=True, exist_ok=True)
    library = out_dir / f"libllmc_{key}.so"
    if not library.exists():
        wrapper = out_dir / f"llmc_bench_{key}.c"
        wrapper.write_text(WRAPPER)
        subprocess.run(["gcc", *FLAGS, f"-I{checkout}", str(wrapper), "-o", str(library), "-lm"],
                       check=True, capture_output=True, text=True)
    return library


class LlmcModel:
    """One llm.c GPT-2 model loaded from a checkpoint file; `step(x, y)` trains on one batch."""

    def __init__(self, library: Path, checkpoint: Path, lr: float, weight_decay: float = 0.0):
        self.lib = ctypes.CDLL(str(library))
        self.lib.sg_llmc_create.restype = ctypes.c_void_p
        self.lib.sg_llmc_create.argtypes = [ctypes.c_char_p]
        self.lib.sg_llmc_step.restype = ctypes.c_float
        self.lib.sg_llmc_step.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                          ctypes.c_int, ctypes.c_float, ctypes.c_float, ctypes.c_int]
        self.lib.sg_llmc_free.argtypes = [ctypes.c_void_p]
        self.handle = self.lib.sg_llmc_create(str(checkpoint).encode())
        self.lr, self.weight_decay, self.t = lr, weight_decay, 0

    def step(self, x: np.ndarray, y: np.ndarray) -> float:
        """One training step on int32 token arrays (B, T); returns the loss before the update."""
        self.t += 1
        return self.lib.sg_llmc_step(self.handle, x.ctypes.data, y.ctypes.data, x.shape[0], x.shape[1],
                                     self.lr, self.weight_decay, self.t)

    def close(self) -> None:
        if self.handle:
            self.lib.sg_llmc_free(self.handle)
            self.handle = None
