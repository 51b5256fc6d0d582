"""Gradient accumulation (accumulate/apply) and the inference program (predict), on every backend."""

import numpy as np
import pytest
import torch

import symgrad as sg
from symgrad.api.cells import current_value
from symgrad import nn

torch.set_num_threads(1)  # a 2-core machine shared by parallel runs: torch's thread pool only contends

SIZES = (6, 10, 4)
MICRO, BIG = 16, 64


def make_models(seed=0):
    torch.manual_seed(seed)
    reference = torch.nn.Sequential(torch.nn.Linear(SIZES[0], SIZES[1]), torch.nn.ReLU(),
                                    torch.nn.Linear(SIZES[1], SIZES[2])).double()
    model = nn.Sequential(nn.Linear(SIZES[0], SIZES[1]), nn.ReLU(), nn.Linear(SIZES[1], SIZES[2])).double()
    return reference, model.load_state_dict(reference.state_dict())


def compile_step(model, backend, scale=1.0, optimizer=None):
    B = sg.Dim("B")
    x, y = sg.input("x", (B, SIZES[0]), "float64"), sg.input("y", (B,), "int64")
    loss = nn.functional.cross_entropy(model(x), y) * scale
    model.eval()
    logits = model(x)
    model.train()
    optimizer = optimizer or sg.optim.SGD(lr=0.1, momentum=0.9)
    return sg.train_step(loss, model.parameters(), optimizer, backend=backend, predict=logits)


def data(seed=1, rounds=3):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((BIG, SIZES[0])), rng.integers(0, SIZES[2], BIG)) for _ in range(rounds)]


def test_accumulate_sums_gradients_as_torch_backward_does(backend):
    """The same loop in both: four micro-batch backward() calls, then one optimizer step."""
    reference, model = make_models()
    step = compile_step(model, backend)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    before = step.params["0.weight"]
    for xb, yb in data():
        opt.zero_grad()
        for k in range(0, BIG, MICRO):
            torch_loss = torch.nn.functional.cross_entropy(reference(torch.from_numpy(xb[k:k + MICRO])),
                                                           torch.from_numpy(yb[k:k + MICRO]))
            torch_loss.backward()
            loss = step.accumulate(x=xb[k:k + MICRO], y=yb[k:k + MICRO])
            assert loss == pytest.approx(torch_loss.item(), abs=1e-9)
        grads = {n: p.grad.numpy() for n, p in reference.named_parameters()}
        for name, g in grads.items():
            np.testing.assert_allclose(step.state[f"{name}.grad"], g, atol=1e-9, err_msg=name)
        np.testing.assert_array_equal(step.params["0.weight"], before)  # nothing moves before apply()
        opt.step()
        step.apply()
        before = step.params["0.weight"]
        for name in grads:
            assert not step.state[f"{name}.grad"].any(), f"{name}.grad not zeroed by apply()"
    for name, value in reference.state_dict().items():
        np.testing.assert_allclose(step.params[name], value.numpy(), atol=1e-6, err_msg=name)


def test_four_quarter_losses_equal_one_big_batch(backend):
    """Dividing the loss by the number of micro-batches makes accumulation equal the big batch."""
    _, model = make_models()
    small = compile_step(model, backend, scale=1 / (BIG // MICRO), optimizer=sg.optim.Adam(lr=0.01))
    _, model2 = make_models()
    big = compile_step(model2, backend, optimizer=sg.optim.Adam(lr=0.01))
    initial = model2.state_dict()  # state_dict() reads the trained values once big has run
    for xb, yb in data():
        for k in range(0, BIG, MICRO):
            small.accumulate(x=xb[k:k + MICRO], y=yb[k:k + MICRO])
        small.apply()
        big(x=xb, y=yb)
    moved = 0.0
    for name in big.params:
        np.testing.assert_allclose(small.params[name], big.params[name], atol=1e-6, err_msg=name)
        moved = max(moved, np.abs(big.params[name] - initial[name]).max())
    assert moved > 1e-3
    assert small.state["0.weight.step"] == big.state["0.weight.step"] == 3


def test_step_ignores_and_keeps_the_buffers(backend):
    _, model = make_models()
    step = compile_step(model, backend)
    (xb, yb), = data(rounds=1)
    step.accumulate(x=xb, y=yb)
    buffered = step.state["2.bias.grad"]
    step(x=xb, y=yb)
    np.testing.assert_array_equal(step.state["2.bias.grad"], buffered)
    assert buffered.any()


def test_predict_is_the_forward_only(backend, rng):
    reference, model = make_models(3)
    step = compile_step(model, backend)
    xb = rng.standard_normal((5, SIZES[0]))
    expected = reference(torch.from_numpy(xb)).detach().numpy()
    np.testing.assert_allclose(step.predict(x=xb), expected, atol=1e-12)
    # Only the model's input: no labels, no gradient buffers, no updates.
    program = step.program_for("predict")
    assert [v.name for v in program.graph.inputs] == ["x"]
    assert program.graph.updates == ()
    assert {v.attrs["role"] for v in program.graph.variables} == {"param"}
    assert len(program.graph.nodes) < len(step.graph.nodes) / 2
    train_ws = getattr(step.program, "workspace_bytes", None)
    if train_ws is not None:  # compiled backends report their planned arena
        assert program.workspace_bytes < train_ws
    # Predict follows training: after a step it sees the new parameters.
    (xt, yt), = data(rounds=1)
    step(x=xt, y=yt)
    assert not np.allclose(step.predict(x=xb), expected)


def test_call_errors_name_the_inputs():
    _, model = make_models()
    step = compile_step(model, "numpy")
    with pytest.raises(TypeError, match=r"missing \['y'\]"):
        step.accumulate(x=np.zeros((2, SIZES[0])))
    with pytest.raises(TypeError, match=r"unexpected \['y'\]"):
        step.predict(x=np.zeros((2, SIZES[0])), y=np.zeros(2, np.int64))
    bare = sg.train_step(nn.functional.mse_loss(model(sg.input("z", (2, SIZES[0]), "float64")),
                                                np.zeros((2, SIZES[2]))), model.parameters(),
                         sg.optim.SGD(lr=0.1), backend="numpy")
    with pytest.raises(RuntimeError, match="predict="):
        bare.predict(z=np.zeros((2, SIZES[0])))


def test_accumulate_performs_the_layers_own_updates():
    """As in torch, every training-mode forward updates BatchNorm statistics and advances dropout."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    x = sg.input("x", (8, 3))
    step = sg.train_step(sg.sum(model(x)), model.parameters(), sg.optim.SGD(lr=0.1), backend="numpy")
    xb = np.random.default_rng(0).standard_normal((8, 3)).astype(np.float32)
    initial = current_value(model[0].weight)
    counter = int(step.state["rng.counter"])
    step.accumulate(x=xb)
    step.accumulate(x=xb)
    assert int(step.state["1.num_batches_tracked"]) == 2
    assert int(step.state["rng.counter"]) == counter + 2
    assert step.state["1.running_mean"].any()
    np.testing.assert_array_equal(step.params["0.weight"], initial)
    step.apply()
    assert int(step.state["1.num_batches_tracked"]) == 2  # apply() runs no forward
    assert not np.array_equal(step.params["0.weight"], initial)
