"""Smoke test of benchmarks/gpt.py: the tiny config, two timed steps, symgrad beside torch eager.

Every system starts from the same weights on the same batch, so the first losses must agree:
that checks the harness times the same model everywhere. llm.c's checkpoint writer is checked
against the layout train_gpt2.c reads (header, then 16 tensors with the vocabulary padded).
"""

import numpy as np
import pytest

from benchmarks import gpt, gpt_models, side_by_side, timing


def test_tiny_gpt_runs_side_by_side_with_equal_first_losses(tmp_path):
    names = ["symgrad-numpy", "torch-eager"]
    plan = timing.Plan(blocks=2, steps=1, warmup_steps=1, warmup_s=0.0, settle_s=0.0)
    rows = side_by_side.run([gpt.CONFIGS["tiny"]], names, gpt.systems(None, tmp_path), gpt.setup, plan,
                            log=lambda s: None)
    cells = rows[0]["cells"]
    assert all(cells[n]["status"] == "ok" for n in names), cells
    assert cells["symgrad-numpy"]["loss_first"] == pytest.approx(cells["torch-eager"]["loss_first"], rel=1e-5)
    table = side_by_side.render(rows, names, gpt.ANCHORS, "llm.c")
    assert "| tiny |" in table and "First loss" in table


def test_llmc_checkpoint_has_train_gpt2s_layout(tmp_path):
    bench = gpt.CONFIGS["tiny"]
    _, state, _, _ = gpt.setup(bench)
    config = bench.config()
    path = tmp_path / "tiny.bin"
    gpt_models.write_llmc_checkpoint(path, config, state)
    data = np.fromfile(path, dtype=np.int32, count=256)
    assert list(data[:8]) == [20240326, 3, 8, 256, 1, 2, 16, 256]
    floats = np.fromfile(path, dtype=np.float32, offset=1024)
    C, L, V, T = 16, 1, 256, 8
    sizes = [V * C, T * C, L * C, L * C, L * 3 * C * C, L * 3 * C, L * C * C, L * C, L * C, L * C,
             L * 4 * C * C, L * 4 * C, L * C * 4 * C, L * C, C, C]
    assert floats.size == sum(sizes)
    np.testing.assert_array_equal(floats[:V * C].reshape(V, C), state["transformer.wte.weight"])
    qkv_at = sum(sizes[:4])
    np.testing.assert_array_equal(floats[qkv_at:qkv_at + sizes[4]].reshape(3 * C, C), state["transformer.h.0.attn.c_attn.weight"])
