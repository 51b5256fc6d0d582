"""What a transformer's training loop needs beyond the MLP: LayerNorm, GELU, Flatten, ModuleList,
ModuleDict, AdamW with parameter groups, clip_grad_norm in the step, checked against torch.

A small residual network with every one of them trains step by step beside the same network in
torch, from the same float64 weights on the same batches; losses and parameters must agree to
1e-10 on every backend. Each backend's step is compiled once for the module.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import symgrad as sg
from symgrad import nn

RNG = np.random.default_rng(11)
BATCHES = [(RNG.standard_normal((6, 2, 4)), RNG.integers(0, 3, 6)) for _ in range(5)]
LR, BETAS, EPS, DECAY, MAX_NORM = 3e-2, (0.9, 0.95), 1e-8, 0.1, 0.5


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = nn.GELU(approximate="tanh")
        self.ln = nn.LayerNorm(8)

    def forward(self, x):
        return x + self.act(self.fc(self.ln(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.flat = nn.Flatten()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.ModuleDict({"ln": nn.LayerNorm(8), "out": nn.Linear(8, 3)})

    def forward(self, x):
        h = self.flat(x)
        for block in self.blocks:
            h = block(h)
        return self.head["out"](self.head["ln"](h))


class TorchBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.act, self.ln = torch.nn.Linear(8, 8), torch.nn.GELU(approximate="tanh"), torch.nn.LayerNorm(8)

    def forward(self, x):
        return x + self.act(self.fc(self.ln(x)))


class TorchNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.flat = torch.nn.Flatten()
        self.blocks = torch.nn.ModuleList([TorchBlock(), TorchBlock()])
        self.head = torch.nn.ModuleDict({"ln": torch.nn.LayerNorm(8), "out": torch.nn.Linear(8, 3)})

    def forward(self, x):
        h = self.flat(x)
        for block in self.blocks:
            h = block(h)
        return self.head["out"](self.head["ln"](h))


def _groups(named):
    """nanoGPT's split: matrices decay, vectors (biases, LayerNorm weights) do not."""
    decay = [p for _, p in named if len(p.shape) >= 2]
    rest = [p for _, p in named if len(p.shape) < 2]
    return [{"params": decay, "weight_decay": DECAY}, {"params": rest, "weight_decay": 0.0}]


def _models():
    sg.manual_seed(5)
    model = Net().double()
    twin = TorchNet().double()
    twin.load_state_dict({k: torch.from_numpy(v) for k, v in model.state_dict().items()})  # strict
    return model, twin


def _symgrad_step(model, backend):
    x = sg.input("x", (sg.Dim("B"), 2, 4), dtype="float64")
    y = sg.input("y", (sg.Dim("B"),), dtype="int64")
    loss = sg.cross_entropy(model(x), y)
    return sg.train_step(loss, _groups(list(model.named_parameters())), sg.optim.AdamW(lr=LR, betas=BETAS, eps=EPS),
                         backend=backend, clip_grad_norm=MAX_NORM)


@pytest.fixture(scope="module")
def trained():
    """Per backend: the symgrad step and the torch model after the same steps, and the losses."""
    runs = {}

    def get(backend):
        if backend not in runs:
            model, twin = _models()
            step = _symgrad_step(model, backend)
            optimizer = torch.optim.AdamW(_groups(list(twin.named_parameters())), lr=LR, betas=BETAS, eps=EPS)
            losses = []
            for k, (xb, yb) in enumerate(BATCHES):
                if k == 3:  # runtime hyperparameters change between steps, in both
                    step.lr, step.state["clip_grad_norm"] = LR / 3, 0.2
                    for group in optimizer.param_groups:
                        group["lr"] = LR / 3
                ours = step(x=xb, y=yb)
                optimizer.zero_grad()
                loss = torch.nn.functional.cross_entropy(twin(torch.from_numpy(xb)), torch.from_numpy(yb))
                loss.backward()
                torch.nn.utils.clip_grad_norm_(twin.parameters(), MAX_NORM if k < 3 else 0.2)
                optimizer.step()
                losses.append((ours, loss.item()))
            runs[backend] = (step, twin, losses)
        return runs[backend]
    return get


def test_adamw_groups_and_clipping_train_as_torch(trained, backend):
    step, twin, losses = trained(backend)
    for k, (ours, theirs) in enumerate(losses):
        assert ours == pytest.approx(theirs, rel=1e-10), f"step {k}"
    for name, value in twin.state_dict().items():
        np.testing.assert_allclose(step.state_dict()[name], value.numpy(), rtol=1e-9, atol=1e-12, err_msg=name)


def test_clipping_changes_the_update(trained):
    """Without clip_grad_norm the same AdamW steps end elsewhere: the clip is in the step."""
    step, _, _ = trained("numpy")
    model, _ = _models()
    x = sg.input("x", (sg.Dim("B"), 2, 4), dtype="float64")
    y = sg.input("y", (sg.Dim("B"),), dtype="int64")
    plain = sg.train_step(sg.cross_entropy(model(x), y), _groups(list(model.named_parameters())),
                          sg.optim.AdamW(lr=LR, betas=BETAS, eps=EPS), backend="numpy")
    for xb, yb in BATCHES[:2]:
        plain(x=xb, y=yb)
    assert not np.allclose(plain.params["blocks.0.fc.weight"], step.params["blocks.0.fc.weight"])


def test_apply_clips_the_accumulated_gradients_as_torch():
    model, twin = _models()
    step = _symgrad_step(model, "numpy")
    optimizer = torch.optim.AdamW(_groups(list(twin.named_parameters())), lr=LR, betas=BETAS, eps=EPS)
    for xb, yb in BATCHES[:2]:  # two micro-batches, then one update
        step.accumulate(x=xb, y=yb)
        torch.nn.functional.cross_entropy(twin(torch.from_numpy(xb)), torch.from_numpy(yb)).backward()
    step.apply()
    torch.nn.utils.clip_grad_norm_(twin.parameters(), MAX_NORM)
    optimizer.step()
    for name, value in twin.state_dict().items():
        np.testing.assert_allclose(step.params[name] if name in step.params else step.state[name],
                                   value.numpy(), rtol=1e-9, atol=1e-12, err_msg=name)


def test_module_names_are_torchs():
    model, twin = _models()
    assert list(model.state_dict()) == list(twin.state_dict())
    assert "blocks.1.ln.weight" in model.state_dict() and "head.out.bias" in model.state_dict()
    assert len(model.blocks) == 2 and "ln" in model.head and list(model.head.keys()) == ["ln", "out"]


def test_layer_norm_gelu_flatten_forward_match_torch():
    x = sg.input("x", (3, 2, 4), dtype="float64")
    w = sg.input("w", (4,), dtype="float64")
    values, weights = RNG.standard_normal((3, 2, 4)) * 3, RNG.standard_normal(4)
    f = sg.function([x, w], [sg.layer_norm(x, 4, w, None, eps=1e-3), sg.layer_norm(x, (2, 4)),
                             nn.GELU()(x), nn.Flatten(0, 1)(x)], backend="numpy")
    t = torch.from_numpy(values)
    want = [torch.nn.functional.layer_norm(t, (4,), torch.from_numpy(weights), None, eps=1e-3),
            torch.nn.functional.layer_norm(t, (2, 4)), torch.nn.functional.gelu(t), torch.flatten(t, 0, 1)]
    for got, expected in zip(f(values, weights), want):
        np.testing.assert_allclose(got, expected.numpy(), rtol=1e-12, atol=1e-12)


def test_bad_groups_and_arguments_are_refused():
    model, _ = _models()
    x = sg.input("x", (2, 2, 4), dtype="float64")
    y = sg.input("y", (2,), dtype="int64")
    loss = sg.cross_entropy(model(x), y)
    params = list(model.parameters())
    # A group's own lr is its runtime value (symgrad/optim/param_groups.py), checked as lr= is.
    with pytest.raises(ValueError, match="AdamW: lr must be a finite non-negative number"):
        sg.train_step(loss, [{"params": params, "lr": -0.1}], sg.optim.AdamW())
    with pytest.raises(ValueError, match=r"unknown parameter-group option\(s\) \['momentum'\]"):
        sg.train_step(loss, [{"params": params, "momentum": 0.9}], sg.optim.AdamW())
    with pytest.raises(ValueError, match="appear more than once"):
        sg.train_step(loss, [{"params": params}, {"params": params[:1]}], sg.optim.AdamW())
    with pytest.raises(ValueError, match="Adam: eps and weight_decay must be non-negative"):
        sg.train_step(loss, [{"params": params, "weight_decay": -1.0}], sg.optim.AdamW())
    with pytest.raises(ValueError, match="clip_grad_norm must be a finite non-negative number"):
        sg.train_step(loss, params, sg.optim.AdamW(), clip_grad_norm=float("nan"))
    with pytest.raises(ValueError, match="layer_norm: normalized_shape \\[3\\] is not the trailing shape"):
        sg.layer_norm(x, 3)
    with pytest.raises(ValueError, match="GELU: approximate must be"):
        nn.GELU("fast")
    with pytest.raises(ValueError, match="masked_fill: mask"):
        sg.masked_fill(sg.input("v", (3,)), sg.input("m", (2, 3), dtype="bool"), 0.0)
