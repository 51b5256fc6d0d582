"""examples/gpt.py's GPT trained beside the same model in torch (benchmarks/gpt_models.py), from the same weights on the same batches.

20 AdamW steps with warmup, cosine decay and clipping: per-step losses agree within 1e-10 relative in
float64 and 1e-4 in float32, and so do the parameters at the end, on every backend.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

import symgrad as sg

from benchmarks.gpt_models import load_example, torch_gpt

gpt = load_example()

CONFIG = gpt.GPTConfig(vocab_size=256, block_size=8, n_layer=2, n_head=2, n_embd=16)
STEPS, BATCH, LR, WARMUP = 20, 3, 3e-3, 5
TEXT = np.frombuffer(Path(gpt.__file__).read_bytes(), dtype=np.uint8)


def _batches():
    rng = np.random.default_rng(3)
    return list(zip(range(STEPS), gpt.batches(TEXT, BATCH, CONFIG.block_size, rng)))


def _train(dtype: str, backend: str):
    sg.manual_seed(0)
    model = gpt.GPT(CONFIG, dtype=dtype)
    twin = torch_gpt(CONFIG, model.state_dict(), dtype)  # loaded strictly: the same names and shapes
    step = gpt.build_step(model, sg.Dim("B"), CONFIG.block_size, lr=LR, backend=backend, dtype=dtype)
    named = list(twin.named_parameters())
    optimizer = torch.optim.AdamW([{"params": [p for _, p in named if p.ndim >= 2], "weight_decay": 0.1},
                                   {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0}],
                                  lr=LR, betas=(0.9, 0.95), eps=1e-8)
    losses = []
    for k, (x, y) in _batches():
        lr = gpt.learning_rate(k, LR, WARMUP, STEPS)
        step.lr = lr
        for group in optimizer.param_groups:
            group["lr"] = lr
        ours = step(idx=x, targets=y)
        optimizer.zero_grad()
        logits = twin(torch.from_numpy(x))
        loss = torch.nn.functional.cross_entropy(logits.view(-1, CONFIG.vocab_size), torch.from_numpy(y).view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
        optimizer.step()
        losses.append((ours, loss.item()))
    return model, step, twin, losses


@pytest.mark.parametrize("dtype, rtol", [("float64", 1e-10), ("float32", 1e-4)])
def test_gpt_trains_as_nanogpt_in_torch(dtype, rtol, backend):
    model, step, twin, losses = _train(dtype, backend)
    assert losses[-1][0] < losses[0][0] - 0.3, "the model did not learn"
    for k, (ours, theirs) in enumerate(losses):
        assert ours == pytest.approx(theirs, rel=rtol), f"step {k}"
    # The trained values, as the module holds them (one owner: the step updated the model's
    # parameters); the tied matrix under both of torch's keys, transformer.wte.weight and lm_head.weight.
    state = model.state_dict()
    assert list(state) == list(twin.state_dict())
    for name, value in twin.state_dict().items():
        np.testing.assert_allclose(state[name], value.numpy(), rtol=100 * rtol, atol=100 * rtol, err_msg=name)


def test_sampling_uses_the_trained_step_and_any_prompt_length():
    sg.manual_seed(0)
    model = gpt.GPT(CONFIG, dtype="float64")
    step = gpt.build_step(model, sg.Dim("B"), sg.Dim("T"), backend="numpy", dtype="float64")
    prompt = b"def f("
    logits = step.predict(idx=np.array([list(prompt)], dtype=np.int64))
    assert logits.shape == (1, CONFIG.vocab_size)
    text = gpt.sample(step, prompt, 12, CONFIG.block_size, np.random.default_rng(0))
    assert len(text) == 12
    with pytest.raises(ValueError, match=r"embedding: input .* reaches 8 with T = 9, outside \[0, 8\): "
                                         r"'(transformer\.)?wpe\.weight' has 8 rows"):
        step.predict(idx=np.zeros((1, CONFIG.block_size + 1), dtype=np.int64))   # longer than wpe


def test_learning_rate_schedule_is_nanogpts():
    assert gpt.learning_rate(0, 1.0, 10, 100) == pytest.approx(0.1)
    assert gpt.learning_rate(9, 1.0, 10, 100) == pytest.approx(1.0)
    assert gpt.learning_rate(10, 1.0, 10, 100) == pytest.approx(1.0)
    assert gpt.learning_rate(55, 1.0, 10, 100) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert gpt.learning_rate(100, 1.0, 10, 100) == pytest.approx(0.1)
