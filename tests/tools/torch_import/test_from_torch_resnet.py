"""sg.from_torch on a torchvision-style ResNet: BatchNorm2d running statistics updated inside the
step, SGD with momentum / nesterov / weight decay, 10 steps beside torch, eval outputs as torch's."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import symgrad as sg
from conftest import BACKENDS
from torch_models import BasicBlock, ResNet

STEPS, BATCH = 10, 4


@pytest.fixture(scope="module")
def resnet():
    torch.manual_seed(0)
    model = ResNet(BasicBlock, [1, 1])
    untrained = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(BATCH, 3, 8, 8, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
               for _ in range(STEPS)]
    imported = sg.from_torch(model, (batches[0][0],), dynamic_shapes=({0: torch.export.Dim("B")},))
    sg_optimizer = sg.optim.from_torch(optimizer)
    initial = imported.state_dict()
    B = sg.Dim("B")
    x, y = sg.input("x", (B, 3, 8, 8)), sg.input("y", (B,), dtype="int64")
    loss = sg.cross_entropy(imported(x), y)
    imported.eval()
    eval_logits = imported(x)  # torch's eval forward: running statistics, exported on first use
    imported.train()
    torch_losses = []
    for xb, yb in batches:
        l = TF.cross_entropy(model(xb), yb)
        optimizer.zero_grad()
        l.backward()
        optimizer.step()
        torch_losses.append(l.item())
    model.eval()
    with torch.no_grad():
        torch_eval = model(batches[0][0]).numpy()
    out = {}
    for backend in BACKENDS[:2]:
        imported.load_state_dict(initial)
        # The eval forward on numpy, the oracle: on C it would be one more build of plain symgrad ops.
        predict = eval_logits if backend == "numpy" else None
        step = sg.train_step(loss, optimizer=sg_optimizer, backend=backend, predict=predict)
        losses = [step(x=xb.numpy(), y=yb.numpy()) for xb, yb in batches]
        out[backend] = dict(losses=losses, state=imported.state_dict(),
                            eval=step.predict(x=batches[0][0].numpy()) if predict is not None else None)
    return dict(model=model, untrained=untrained, imported=imported, torch_losses=torch_losses,
                torch_eval=torch_eval, trained=out)


def test_names_and_buffers_are_torchs(resnet):
    imported, model = resnet["imported"], resnet["untrained"]
    assert list(imported.state_dict()) == list(model.state_dict())
    assert [n for n, _ in imported.named_buffers()] == [n for n, _ in model.named_buffers()]
    assert "layer2.0.downsample.1.running_var" in imported.state_dict()


@pytest.mark.parametrize("backend", BACKENDS[:2])
def test_ten_steps_beside_torch(resnet, backend):
    trained = resnet["trained"][backend]
    np.testing.assert_allclose(trained["losses"], resnet["torch_losses"], rtol=1e-4)
    torch_state = resnet["model"].state_dict()
    for name, value in trained["state"].items():
        if "running" in name:
            np.testing.assert_allclose(value.numpy(), torch_state[name].numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
        elif name.endswith("num_batches_tracked"):
            assert value.item() == torch_state[name].item() == STEPS


def test_in_place_writes_are_read_as_exported(resnet):
    """The in-place ReLU, the += and BatchNorm's running statistics (written by batch_norm itself):
    torch's graph is read as exported, each write replayed (torch's functionalisation, a second
    trace of the model, would leave no in-place op); the written buffers are updates of the step,
    compared with torch's in test_ten_steps_beside_torch."""
    exported = resnet["imported"]._exported()
    assert not exported.decomposed
    written = {names[0] for groups in exported.writes.values() for names in groups}
    assert {"b_bn1_running_mean", "b_bn1_running_var", "b_bn1_num_batches_tracked"} <= written
    assert any(str(node.target) == "aten.relu_.default" for node in exported.graph.nodes)


def test_eval_outputs_are_torchs(resnet):
    """The eval forward (running statistics, exported on first use) after 10 steps, as torch's."""
    np.testing.assert_allclose(resnet["trained"]["numpy"]["eval"], resnet["torch_eval"], rtol=1e-4, atol=1e-5)


def test_trained_weights_go_back_into_torch(resnet):
    back = copy.deepcopy(resnet["untrained"])
    state = resnet["trained"][BACKENDS[:2][-1]]["state"]
    back.load_state_dict(state)
    for name, value in back.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), state[name].numpy(), err_msg=name)
