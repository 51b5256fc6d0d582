"""Weight tying by assignment, as nanoGPT spells it: `self.transformer.wte.weight = self.lm_head.weight`.

Both attributes hold one parameter; named_parameters() lists it once under its first name and
state_dict() under both keys, as torch's do; a train step trains the one matrix with the sum of
both uses' gradients, step by step equal to the same tied model in torch (float64, AdamW).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import symgrad as sg
from symgrad import nn

torch.set_num_threads(1)  # a small shared machine: torch's thread pool would only contend

V, T, C, B = 11, 4, 6, 3
RNG = np.random.default_rng(21)
BATCHES = [(RNG.integers(0, V, (B, T)), RNG.integers(0, V, (B, T))) for _ in range(5)]
LR, BETAS, EPS, DECAY = 2e-2, (0.9, 0.95), 1e-8, 0.1


class Tied(nn.Module):
    """A nanoGPT in miniature: token and position embeddings, one residual layer, the output
    layer tied to the token embedding by assignment."""

    def __init__(self, dtype="float64"):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(V, C, dtype=dtype), wpe=nn.Embedding(T, C, dtype=dtype),
                                              fc=nn.Linear(C, C, dtype=dtype), ln_f=nn.LayerNorm(C, dtype=dtype)))
        self.lm_head = nn.Linear(C, V, bias=False, dtype=dtype)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx):
        t = self.transformer
        x = t.wte(idx) + t.wpe(sg.arange(idx.shape[1]))
        x = x + sg.tanh(t.fc(x))
        return self.lm_head(t.ln_f(x))


class TorchTied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = torch.nn.ModuleDict(dict(wte=torch.nn.Embedding(V, C), wpe=torch.nn.Embedding(T, C),
                                                    fc=torch.nn.Linear(C, C), ln_f=torch.nn.LayerNorm(C)))
        self.lm_head = torch.nn.Linear(C, V, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx):
        t = self.transformer
        x = t.wte(idx) + t.wpe(torch.arange(idx.shape[1]))
        x = x + torch.tanh(t.fc(x))
        return self.lm_head(t.ln_f(x))


def _models():
    """The symgrad model and its torch twin with the same weights (loaded strictly: every key)."""
    sg.manual_seed(4)
    model = Tied()
    twin = TorchTied().double()
    twin.load_state_dict({k: torch.from_numpy(v) for k, v in model.state_dict().items()})
    return model, twin


def _loss(model, inputs: list | None = None):
    """The mean cross-entropy of next tokens; the inputs idx and targets are appended to `inputs`."""
    idx, targets = sg.input("idx", (B, T), dtype="int64"), sg.input("targets", (B, T), dtype="int64")
    if inputs is not None:
        inputs += [idx, targets]
    return sg.cross_entropy(sg.reshape(model(idx), (B * T, V)), sg.reshape(targets, (B * T,)))


def _torch_loss(twin, idx, targets):
    return torch.nn.functional.cross_entropy(twin(torch.from_numpy(idx)).reshape(B * T, V),
                                             torch.from_numpy(targets).reshape(B * T))


def test_assignment_shares_the_parameter_and_lists_it_as_torch():
    model, twin = _models()
    assert model.transformer.wte.weight is model.lm_head.weight
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in twin.named_parameters()]
    assert [n for n, _ in model.named_parameters(remove_duplicate=False)] == \
           [n for n, _ in twin.named_parameters(remove_duplicate=False)]
    assert list(model.state_dict()) == list(twin.state_dict())  # both keys of the tied matrix
    assert sum(int(np.prod(p.shape)) for p in model.parameters()) == sum(p.numel() for p in twin.parameters())
    state = model.state_dict()
    np.testing.assert_array_equal(state["lm_head.weight"], state["transformer.wte.weight"])
    assert model.lm_head.weight.name == "transformer.wte.weight"  # the graph's name: the first one


def test_the_gradient_of_a_tied_matrix_is_the_sum_of_both_uses():
    model, twin = _models()
    inputs = []
    loss = _loss(model, inputs)
    idx, targets = BATCHES[0]
    grads = sg.function(inputs, [loss, *sg.grad(loss, model.parameters())], backend="numpy")(idx, targets)
    reference = _torch_loss(twin, idx, targets)
    reference.backward()
    np.testing.assert_allclose(grads[0], reference.item(), rtol=1e-12)
    for (name, p), got in zip(twin.named_parameters(), grads[1:]):
        np.testing.assert_allclose(got, p.grad.numpy(), rtol=1e-10, atol=1e-13, err_msg=name)


def test_a_tied_model_trains_one_matrix_step_by_step_as_torch(backend):
    model, twin = _models()
    step = sg.train_step(_loss(model), model.parameters(),
                         sg.optim.AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY), backend=backend)
    assert list(step.params) == [n for n, _ in twin.named_parameters()]  # one matrix, not two
    optimizer = torch.optim.AdamW(twin.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY)
    for idx, targets in BATCHES:
        got = step(idx=idx, targets=targets)
        optimizer.zero_grad()
        want = _torch_loss(twin, idx, targets)
        want.backward()
        optimizer.step()
        assert got == pytest.approx(want.item(), rel=1e-10)
    for name, value in twin.state_dict().items():  # the tied matrix under both keys
        np.testing.assert_allclose(model.state_dict()[name], value.numpy(), rtol=1e-9, atol=1e-12, err_msg=name)
    for name, value in twin.named_parameters():
        np.testing.assert_allclose(step.params[name], value.detach().numpy(), rtol=1e-9, atol=1e-12, err_msg=name)


def test_tying_holds_when_the_tree_is_built_after_it():
    """Tied before either module is attached, then wrapped twice: still one parameter, named by
    the path traversal finds first, as torch names it."""
    emb, head = nn.Embedding(V, C), nn.Linear(C, V, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, nn.Linear(C, C), head)
    outer = nn.ModuleDict({"net": model})
    t_emb, t_head = torch.nn.Embedding(V, C), torch.nn.Linear(C, V, bias=False)
    t_head.weight = t_emb.weight
    t_outer = torch.nn.ModuleDict({"net": torch.nn.Sequential(t_emb, torch.nn.Linear(C, C), t_head)})
    assert outer["net"][0].weight is outer["net"][2].weight
    assert [n for n, _ in outer.named_parameters()] == [n for n, _ in t_outer.named_parameters()]
    assert list(outer.state_dict()) == list(t_outer.state_dict())
    assert outer["net"][2].weight.name == "net.0.weight"
    # The other direction of nanoGPT's assignment names it the same way: by traversal, not by who was assigned.
    model = Tied()
    model.lm_head.weight = model.transformer.wte.weight
    assert model.lm_head.weight is model.transformer.wte.weight and model.lm_head.weight.name == "transformer.wte.weight"


def test_load_state_dict_of_a_tied_model_as_torch():
    model, twin = _models()
    state = {k: v.copy() for k, v in model.state_dict().items()}
    state["transformer.wte.weight"] = np.full((V, C), 1.0)
    state["lm_head.weight"] = np.full((V, C), 2.0)  # comes later in the state_dict: it wins, in torch too
    model.load_state_dict(state)
    twin.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    for name, value in twin.state_dict().items():
        np.testing.assert_array_equal(model.state_dict()[name], value.numpy(), err_msg=name)
    del state["lm_head.weight"]
    with pytest.raises(RuntimeError, match="lm_head.weight"):
        twin.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    with pytest.raises(KeyError, match="lm_head.weight"):
        model.load_state_dict(state)  # strict: every key, as torch asks
    model.load_state_dict(state, strict=False)
    np.testing.assert_array_equal(model.state_dict()["lm_head.weight"], np.ones((V, C)))


def test_double_keeps_the_parameter_tied():
    model = Tied("float32").double()
    assert model.transformer.wte.weight is model.lm_head.weight and model.lm_head.weight.dtype == "float64"
    assert len(model.parameters()) == len(Tied().parameters())
