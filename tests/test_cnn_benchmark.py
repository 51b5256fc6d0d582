"""Smoke test of benchmarks/cnn.py: LeNet at batch 2, two timed steps, symgrad beside torch eager.

Every system starts from the same weights on the same batch, so the first losses must agree.
"""

import pytest

from benchmarks import cnn, side_by_side, timing


def test_tiny_lenet_runs_side_by_side_with_equal_first_losses():
    names = ["symgrad-numpy", "torch-eager"]
    plan = timing.Plan(blocks=2, steps=1, warmup_steps=1, warmup_s=0.0, settle_s=0.0)
    rows = side_by_side.run([cnn.CONFIGS["tiny"]], names, cnn.SYSTEMS, cnn.setup, plan, log=lambda s: None)
    cells = rows[0]["cells"]
    assert all(cells[n]["status"] == "ok" for n in names), cells
    assert cells["symgrad-numpy"]["loss_first"] == pytest.approx(cells["torch-eager"]["loss_first"], rel=1e-5)
    assert "| tiny |" in side_by_side.render(rows, names, cnn.ANCHORS)
