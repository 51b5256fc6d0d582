"""sg.from_torch on an MLP with BatchNorm1d and Dropout and on a model returning a dict, beside
torch for 10 steps; the refusals: an ATen op symgrad lacks, an optimizer option it lacks, a call
unlike the example; a view read across an in-place write, as torch reads it."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import symgrad as sg
from conftest import BACKENDS
from torch_models import ManyOps, MLPClassifier, Orthogonalize, TwoHeads, ViewAcrossWrite, small_cnn

STEPS, BATCH = 10, 8


def _train_torch(model, optimizer, batches, loss_of):
    losses = []
    for batch in batches:
        loss = loss_of(model, *batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _train_symgrad(imported, initial, loss, optimizer, batches, names, predict=None, eval_input=None):
    """Per backend, from the initial weights: the losses, the state_dict after, and the eval
    forward's output (on numpy only: the C one is one more build, and test_from_torch_resnet
    compiles an imported eval forward already)."""
    out = {}
    for backend in BACKENDS[:2]:
        imported.load_state_dict(initial)
        predicting = predict is not None and backend == "numpy"
        step = sg.train_step(loss, optimizer=optimizer, backend=backend, predict=predict if predicting else None)
        losses = [step(**{n: b.numpy() for n, b in zip(names, batch)}) for batch in batches]
        out[backend] = dict(losses=losses, state=imported.state_dict(),
                            eval=step.predict(x=eval_input) if predicting else None)
    return out


@pytest.fixture(scope="module")
def mlp():
    """MLPClassifier (BatchNorm1d, Dropout at p=0 so the masks agree) with Adam and weight decay."""
    torch.manual_seed(0)
    model = MLPClassifier()
    untrained = copy.deepcopy(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-3)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(BATCH, 12, generator=g), torch.randint(0, 5, (BATCH,), generator=g))
               for _ in range(STEPS)]
    imported = sg.from_torch(model, (batches[0][0],), dynamic_shapes=({0: torch.export.Dim("B")},))
    sg_optimizer, initial = sg.optim.from_torch(optimizer), imported.state_dict()
    B = sg.Dim("B")
    x, y = sg.input("x", (B, 12)), sg.input("y", (B,), dtype="int64")
    loss = sg.cross_entropy(imported(x), y)
    imported.eval()
    logits = imported(x)
    imported.train()
    torch_losses = _train_torch(model, optimizer, batches, lambda m, xb, yb: TF.cross_entropy(m(xb), yb))
    model.eval()
    with torch.no_grad():
        torch_eval = model(batches[0][0]).numpy()
    trained = _train_symgrad(imported, initial, loss, sg_optimizer, batches, ("x", "y"), logits,
                             batches[0][0].numpy())
    return dict(model=model, untrained=untrained, torch_losses=torch_losses, torch_eval=torch_eval,
                trained=trained, imported=imported)


@pytest.mark.parametrize("backend", BACKENDS[:2])
def test_mlp_ten_steps_beside_torch(mlp, backend):
    trained = mlp["trained"][backend]
    np.testing.assert_allclose(trained["losses"], mlp["torch_losses"], rtol=1e-4)
    torch_state = mlp["model"].state_dict()
    for name in ("net.1.running_mean", "net.1.running_var"):
        # On the scale of the whole array: a running mean near 0 (0.012 beside 0.11) is the difference
        # of float32 sums, whose last bits follow the summation order (torch's thread count), not a
        # relative tolerance of its own.
        want = torch_state[name].numpy()
        np.testing.assert_allclose(trained["state"][name].numpy(), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    if trained["eval"] is not None:
        np.testing.assert_allclose(trained["eval"], mlp["torch_eval"], rtol=1e-4, atol=1e-5)


def test_dropout_masks_are_symgrads_and_eval_is_torchs():
    """With p > 0 the training masks come from symgrad's generator (not torch's); the evaluation
    forward, where dropout is the identity, is torch's own."""
    torch.manual_seed(1)
    model = MLPClassifier(p=0.4).eval()
    xb = torch.randn(6, 12)
    imported = sg.from_torch(model, (xb,))  # exported in eval mode: the torch model's own mode
    assert not imported.training
    x = sg.input("x", (6, 12))
    got = sg.function([x], [imported(x)], backend="numpy")(xb.numpy())[0]
    with torch.no_grad():
        np.testing.assert_allclose(got, model(xb).numpy(), rtol=1e-5, atol=1e-6)
    imported.train()
    train_out = sg.function([x], [imported(x)], backend="numpy")(xb.numpy())[0]
    assert train_out.shape == (6, 5) and np.all(np.isfinite(train_out))


@pytest.fixture(scope="module")
def two_heads():
    torch.manual_seed(3)
    model = TwoHeads()
    optimizer = torch.optim.SGD([{"params": model.trunk.parameters(), "lr": 0.02},
                                 {"params": list(model.classify.parameters()) + list(model.regress.parameters())}],
                                lr=0.05, momentum=0.5)
    g = torch.Generator().manual_seed(4)
    batches = [(torch.randn(BATCH, 10, generator=g), torch.randint(0, 4, (BATCH,), generator=g),
                torch.randn(BATCH, generator=g)) for _ in range(STEPS)]
    B = torch.export.Dim("B")
    imported = sg.from_torch(model, batches[0], dynamic_shapes={"x": {0: B}, "labels": {0: B}, "target": {0: B}})
    sg_optimizer, initial = sg.optim.from_torch(optimizer), imported.state_dict()
    Bs = sg.Dim("B")
    out = imported(sg.input("x", (Bs, 10)), sg.input("labels", (Bs,), dtype="int64"), sg.input("target", (Bs,)))
    torch_losses = _train_torch(model, optimizer, batches, lambda m, *b: m(*b)["loss"])
    trained = _train_symgrad(imported, initial, out["loss"], sg_optimizer, batches, ("x", "labels", "target"))
    return dict(out=out, torch_losses=torch_losses, trained=trained)


def test_a_dict_comes_back_as_a_dict(two_heads):
    out = two_heads["out"]
    assert isinstance(out, dict) and list(out) == ["logits", "value", "loss"]
    assert out["logits"].shape[1] == 4 and out["loss"].shape == ()


@pytest.mark.parametrize("backend", BACKENDS[:2])
def test_dict_model_ten_steps_beside_torch(two_heads, backend):
    np.testing.assert_allclose(two_heads["trained"][backend]["losses"], two_heads["torch_losses"], rtol=1e-4)


def test_an_op_symgrad_lacks_is_refused_with_its_module_and_line():
    with pytest.raises(sg.tools.torch_import.UnsupportedTorchOp,
                       match=r"aten\.linalg_qr in Orthogonalize\.forward \(torch_models\.py:\d+\)"):
        sg.from_torch(Orthogonalize(), (torch.randn(3, 4),))


def test_an_argument_symgrad_lacks_is_refused_while_importing():
    """An op symgrad has, with an argument it does not implement: refused at import, naming the op,
    the module's class, its source line and where it sits in the model."""
    class Tagger(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = torch.nn.Embedding(7, 3, padding_idx=0)

        def forward(self, ids):
            return self.tok(ids)

    with pytest.raises(sg.tools.torch_import.UnsupportedTorchOp,
                       match=r"aten\.embedding in Embedding\.forward \(sparse\.py:\d+\) at tok: .*padding_idx=0"):
        sg.from_torch(Tagger(), (torch.tensor([1, 2]),))


def test_optimizer_options_symgrad_lacks_are_refused(mlp):
    params = list(mlp["untrained"].parameters())  # never imported
    with pytest.raises(ValueError, match="belongs to no model imported"):
        sg.optim.from_torch(torch.optim.SGD(params, lr=0.1))
    with pytest.raises(ValueError, match="amsgrad=True"):
        sg.optim.from_torch(torch.optim.Adam(mlp["model"].parameters(), amsgrad=True))
    with pytest.raises(TypeError, match="expected torch.optim.SGD, Adam or AdamW, got RMSprop"):
        sg.optim.from_torch(torch.optim.RMSprop(mlp["model"].parameters()))


def test_a_call_unlike_the_example_is_refused(mlp):
    with pytest.raises(ValueError, match=r"argument .x. is f32\[4,13\]; the model was exported for \[B, 12\]"):
        mlp["imported"](sg.input("x", (4, 13)))
    with pytest.raises(TypeError, match="argument .x. is int64, the example was float32"):
        mlp["imported"](sg.input("x", (4, 12), dtype="int64"))


def test_every_table_entry_names_a_real_aten_overload():
    """The table's keys are printed overload names: a typo would never match a node."""
    from symgrad.tools.torch_import.aten_table import KEEP_WHOLE, TABLE
    for name in TABLE:
        namespace, op, overload = name.split(".")
        assert hasattr(getattr(getattr(torch.ops, namespace), op), overload), name
    assert set(KEEP_WHOLE) <= set(TABLE)


def test_float64_model_trains_as_torchs_to_1e_10():
    """In float64 the imported dict model and torch agree to rounding: 1e-10 after 3 steps."""
    torch.manual_seed(5)
    model = TwoHeads().double()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(6)
    batches = [(torch.randn(4, 10, generator=g, dtype=torch.float64), torch.randint(0, 4, (4,), generator=g),
                torch.randn(4, generator=g, dtype=torch.float64)) for _ in range(3)]
    imported = sg.from_torch(model, batches[0])
    out = imported(sg.input("x", (4, 10), dtype="float64"), sg.input("labels", (4,), dtype="int64"),
                   sg.input("target", (4,), dtype="float64"))
    step = sg.train_step(out["loss"], optimizer=sg.optim.from_torch(optimizer), backend="numpy")
    ours = [step(x=x.numpy(), labels=l.numpy(), target=t.numpy()) for x, l, t in batches]
    theirs = _train_torch(model, optimizer, batches, lambda m, *b: m(*b)["loss"])
    np.testing.assert_allclose(ours, theirs, rtol=1e-10)


def test_torch_is_imported_only_when_a_model_is():
    """`import symgrad` needs no torch: the import modules reach torch inside functions only, so
    steps, exported C and checkpoints built from an imported model run without it."""
    import ast
    from pathlib import Path
    root = Path(sg.__file__).parent
    paths = [*sorted((root / "tools" / "torch_import").glob("*.py")), root / "optim" / "from_torch.py"]
    assert len(paths) > 4 and all(path.exists() for path in paths)  # the modules moved: follow them
    for path in paths:
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level only
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n == "torch" or n.startswith("torch.") for n in names), f"{path.name}: {names}"


def test_many_table_entries_forward_and_gradient_as_torchs():
    """One forward through many table entries: its value and its gradients as torch's (numpy)."""
    torch.manual_seed(7)
    model = ManyOps()
    img, v = torch.randn(3, 2, 8, 8), torch.randn(3, 5)
    imported = sg.from_torch(model, (img, v))
    x1, x2 = sg.input("img", (3, 2, 8, 8)), sg.input("v", (3, 5))
    out = imported(x1, x2)
    grads = sg.grad(sg.sum(out * out), [imported.conv.weight, imported.lin.weight])
    got = sg.function([x1, x2], [out, *grads], backend="numpy")(img.numpy(), v.numpy())
    expected = model(img, v)
    (expected * expected).sum().backward()
    np.testing.assert_allclose(got[0], expected.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1], model.conv.weight.grad.numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got[2], model.lin.weight.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_the_imported_graph_is_the_hand_written_one():
    """The same network through sg.from_torch and written with sg.nn: after the passes, the same
    graph line for line, so the same fusions, layouts and kernels apply to both."""
    torch.manual_seed(8)
    twin = small_cnn(torch.nn)
    hand = small_cnn(sg.nn).load_state_dict(twin.state_dict())
    imported = sg.from_torch(twin, (torch.randn(2, 1, 8, 8),))
    graphs = []
    for model in (hand, imported):
        x, y = sg.input("x", (2, 1, 8, 8)), sg.input("y", (2,), dtype="int64")
        step = sg.train_step(sg.cross_entropy(model(x), y), optimizer=sg.optim.SGD(model.parameters(), lr=0.1),
                             backend="numpy")
        graphs.append(str(step.optimized_graph))
    assert graphs[0] == graphs[1]


def test_a_view_read_across_a_write_is_torchs():
    """A view read after its base was written in place sees the write, as in torch: that graph
    goes through torch's functionalisation, not the direct reading, which would read the old value."""
    torch.manual_seed(10)
    model, x = ViewAcrossWrite(), torch.randn(3, 6)
    imported = sg.from_torch(model, (x,))
    assert imported._exported().decomposed and imported._exported().writes == {}
    xs = sg.input("x", (3, 6))
    got = sg.function([xs], [imported(xs)], backend="numpy")(x.numpy())[0]
    with torch.no_grad():
        np.testing.assert_allclose(got, model(x).numpy(), rtol=1e-6, atol=1e-6)
