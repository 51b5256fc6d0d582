"""sg.cross_entropy and sg.nll_loss with torch's arguments (issue 35): `ignore_index=` (default
-100), `label_smoothing=`, `reduction=`, `weight=`, inputs [N, C], [C] and [N, C, d], and class
probabilities as targets. Values and gradients equal torch's in float64; "mean" with ignored
targets divides by the count of the others, as torch does.

Every case of a backend is an output of one sg.function (one C build), shared by the module.
The label inputs hold the ignored values, so the label checks (Python's and the C entry's)
must let exactly those through.
"""

from __future__ import annotations

import importlib.util
import itertools
import zlib

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import symgrad as sg

BACKENDS = ["numpy"] + (["c"] if importlib.util.find_spec("symgrad.backends.c") else [])

N, C, D = 6, 5, 3
rng = np.random.default_rng(3535)
LOGITS = rng.standard_normal((N, C)) * 2
LOGITS_3D = rng.standard_normal((N, C, D))
LOGITS_1D = rng.standard_normal(C)
PROBS = rng.dirichlet(np.ones(C), size=N)
WEIGHT = np.array([0.5, 2.0, 1.0, 1.5, 0.25])
# Labels with the ignored values in them: torch's default -100, nanoGPT's -1, and a class (2).
LABELS = {
    -100: np.array([1, -100, 4, 0, -100, 2]),
    -1: np.array([3, 0, -1, 2, 4, -1]),
    2: np.array([2, 1, 0, 2, 4, 3]),
}
LABELS_3D = np.array([[0, 4, -100], [1, 1, 2], [-100, 3, 0], [4, 2, 1], [0, -100, 3], [2, 2, 2]])
ALL_IGNORED = np.full(N, -100)


def _label_name(ignore: int) -> str:
    """The input holding the labels of one ignore_index: y_m100, y_m1, y_2."""
    return f"y_m{-ignore}" if ignore < 0 else f"y_{ignore}"


REDUCTIONS = ("mean", "sum", "none")
CASES = {}  # name -> (symgrad builder, torch builder): each takes (logits, labels: dict name -> tensor)
for reduction, ignore, smoothing, weighted in itertools.product(REDUCTIONS, LABELS, (0.0, 0.1), (False, True)):
    kw = dict(reduction=reduction, ignore_index=ignore, label_smoothing=smoothing)
    name = f"ce-{reduction}-ignore{ignore}-smooth{smoothing}-{'w' if weighted else 'nw'}"
    CASES[name] = (
        lambda v, kw=kw, ig=ignore, w=weighted: sg.cross_entropy(v["logits"], v[_label_name(ig)],
                                                                 weight=WEIGHT if w else None, **kw),
        lambda t, kw=kw, ig=ignore, w=weighted: TF.cross_entropy(t["logits"], t[_label_name(ig)],
                                                                 weight=torch.tensor(WEIGHT) if w else None, **kw))
for reduction, ignore, weighted in itertools.product(REDUCTIONS, LABELS, (False, True)):
    kw = dict(reduction=reduction, ignore_index=ignore)
    CASES[f"nll-{reduction}-ignore{ignore}-{'w' if weighted else 'nw'}"] = (
        lambda v, kw=kw, ig=ignore, w=weighted: sg.nll_loss(sg.log_softmax(v["logits"], dim=1), v[_label_name(ig)],
                                                            weight=WEIGHT if w else None, **kw),
        lambda t, kw=kw, ig=ignore, w=weighted: TF.nll_loss(TF.log_softmax(t["logits"], dim=1), t[_label_name(ig)],
                                                            weight=torch.tensor(WEIGHT) if w else None, **kw))
for reduction, smoothing in itertools.product(REDUCTIONS, (0.0, 0.2)):
    kw = dict(reduction=reduction, label_smoothing=smoothing)
    CASES[f"ce3d-{reduction}-smooth{smoothing}"] = (
        lambda v, kw=kw: sg.cross_entropy(v["logits3"], v["y3"], **kw),
        lambda t, kw=kw: TF.cross_entropy(t["logits3"], t["y3"], **kw))
    CASES[f"ce-probs-{reduction}-smooth{smoothing}"] = (
        lambda v, kw=kw: sg.cross_entropy(v["logits"], v["probs"], weight=WEIGHT, **kw),
        lambda t, kw=kw: TF.cross_entropy(t["logits"], t["probs"], weight=torch.tensor(WEIGHT), **kw))
    CASES[f"ce1d-{reduction}-smooth{smoothing}"] = (
        lambda v, kw=kw: sg.cross_entropy(v["logits1"], v["y1"], **kw),
        lambda t, kw=kw: TF.cross_entropy(t["logits1"], t["y1"], **kw))
CASES["nll3d-mean-ignore"] = (lambda v: sg.nll_loss(v["logits3"], v["y3"]), lambda t: TF.nll_loss(t["logits3"], t["y3"]))
CASES["ce-defaults"] = (lambda v: sg.cross_entropy(v["logits"], v["y_m100"]),
                        lambda t: TF.cross_entropy(t["logits"], t["y_m100"]))
CASES["ce-all-ignored-mean"] = (lambda v: sg.cross_entropy(v["logits"], v["none"]),
                                lambda t: TF.cross_entropy(t["logits"], t["none"]))
CASES["ce-all-ignored-sum"] = (lambda v: sg.cross_entropy(v["logits"], v["none"], reduction="sum"),
                               lambda t: TF.cross_entropy(t["logits"], t["none"], reduction="sum"))

# On C, a set that reaches every path once (both reductions of ignore_index, smoothing, weights,
# the [N,C,d] and [C] forms, probabilities, all targets ignored); numpy checks the whole matrix.
# (The whole matrix in one C build takes as long as this module's every other test together.)
ON_C = ("ce-mean-ignore-100-smooth0.0-nw", "ce-mean-ignore-1-smooth0.1-w", "ce-sum-ignore2-smooth0.1-nw",
        "ce-none-ignore-1-smooth0.0-w", "ce-mean-ignore2-smooth0.0-w", "nll-mean-ignore-1-w",
        "nll-none-ignore2-nw", "ce3d-mean-smooth0.2", "ce-probs-mean-smooth0.2", "ce-probs-none-smooth0.0",
        "ce1d-none-smooth0.0", "ce1d-mean-smooth0.2", "nll3d-mean-ignore", "ce-defaults", "ce-all-ignored-mean",
        "ce-all-ignored-sum")

FLOATS = {"logits": LOGITS, "logits3": LOGITS_3D, "logits1": LOGITS_1D}
ARRAYS = {**FLOATS, "probs": PROBS, **{_label_name(k): v for k, v in LABELS.items()}, "y3": LABELS_3D,
          "y1": np.array(3), "none": ALL_IGNORED}


def _weights(name: str, shape) -> np.ndarray:
    return np.random.default_rng(zlib.crc32(name.encode())).standard_normal(shape)


_BUILT: dict = {}


def _built(backend: str):
    """Every case's loss (ON_C's on C) and its gradients to the float inputs, from one function
    built once per backend for the module: (name -> (loss, gradients), the function)."""
    if backend not in _BUILT:
        _BUILT[backend] = _build(backend)
    return _BUILT[backend]


def _build(backend: str):
    values = {k: sg.input(k, a.shape, dtype="float64" if a.dtype.kind == "f" else "int64") for k, a in ARRAYS.items()}
    wrt = [values[k] for k in FLOATS]
    names = list(CASES) if backend == "numpy" else list(ON_C)
    losses, grads = [], []
    for name in names:
        loss = CASES[name][0](values)
        losses.append(loss)
        grads += sg.grad(sg.sum(loss * _weights(name, loss.shape)), wrt)
    fn = sg.function(list(values.values()), losses + grads, backend=backend)
    results = fn(*ARRAYS.values())
    k = len(FLOATS)
    return {name: (results[i], results[len(names) + k * i: len(names) + k * (i + 1)]) for i, name in enumerate(names)}, fn


@pytest.mark.parametrize("backend, name", [(b, n) for b in BACKENDS for n in (CASES if b == "numpy" else ON_C)])
def test_loss_and_gradients_equal_torch(backend, name):
    got, grads = _built(backend)[0][name]
    tensors = {k: torch.tensor(a, requires_grad=k in FLOATS) for k, a in ARRAYS.items()}
    expected = CASES[name][1](tensors)
    np.testing.assert_allclose(got, expected.detach().numpy(), rtol=1e-12, atol=1e-12, err_msg=name)
    if name == "ce-all-ignored-mean":
        assert np.isnan(got)  # torch: 0 / 0
        return
    loss = (expected * torch.tensor(_weights(name, tuple(expected.shape)))).sum()
    floats = [tensors[k] for k in FLOATS]
    want = torch.autograd.grad(loss, floats, allow_unused=True)
    for key, g, w in zip(FLOATS, grads, want):
        w = np.zeros_like(g) if w is None else w.numpy()
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12, err_msg=f"{name}: d/d{key}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [5, -5, -2])
def test_labels_outside_the_classes_are_refused_unless_ignored(backend, bad):
    """A label outside [0, C) that is not the ignore_index is refused before anything runs, as
    torch refuses it (on C by the compiled entry's own check, too)."""
    fn = _built(backend)[1]
    arrays = dict(ARRAYS)
    arrays["y_m1"] = LABELS[-1].copy()
    arrays["y_m1"][1] = bad
    with pytest.raises(ValueError, match=rf"(cross_entropy|nll_loss): target .*holds {bad}.*ignore_index -1"):
        fn(*arrays.values())


def test_arguments_are_checked_as_torch_checks_them():
    logits, y = sg.input("l", (4, 3)), sg.input("y", (4,), dtype="int64")
    with pytest.raises(ValueError, match="cross_entropy: reduction must be"):
        sg.cross_entropy(logits, y, reduction="avg")
    with pytest.raises(ValueError, match="cross_entropy: label_smoothing must lie in"):
        sg.cross_entropy(logits, y, label_smoothing=1.5)
    with pytest.raises(TypeError, match="nll_loss: ignore_index must be an int"):
        sg.nll_loss(logits, y, ignore_index=0.5)
    with pytest.raises(ValueError, match=r"cross_entropy: weight must hold one number per class \(\[3\]\)"):
        sg.cross_entropy(logits, y, weight=np.ones(4))
    with pytest.raises(ValueError, match=r"cross_entropy: expects input .*\[4,3\] and \[5\]"):
        sg.cross_entropy(logits, sg.input("z", (5,), dtype="int64"))
    with pytest.raises(ValueError, match=r"cross_entropy: class probabilities must have the input's shape"):
        sg.cross_entropy(logits, sg.input("p", (4, 2)))


def test_symbolic_batch_with_ignored_targets():
    """A Dim batch: the mean divides by the count of targets not ignored, found at run time."""
    B = sg.Dim("B")
    logits, y = sg.input("l", (B, C), dtype="float64"), sg.input("y", (B,), dtype="int64")
    loss = sg.cross_entropy(logits, y, ignore_index=-1, label_smoothing=0.05)
    fn = sg.function([logits, y], [loss, sg.grad(loss, [logits])[0]], backend="numpy")
    for n in (2, 6):
        t = torch.tensor(LOGITS[:n], requires_grad=True)
        target = torch.tensor(LABELS[-1][:n])
        want = TF.cross_entropy(t, target, ignore_index=-1, label_smoothing=0.05)
        got, grad = fn(LOGITS[:n], LABELS[-1][:n])
        np.testing.assert_allclose(got, want.item(), rtol=1e-12)
        np.testing.assert_allclose(grad, torch.autograd.grad(want, [t])[0].numpy(), rtol=1e-10, atol=1e-12)
