"""Dropout's counter-based masks and BatchNorm1d's running statistics, against references."""

import shutil
import subprocess

import numpy as np
import pytest
import torch

import symgrad as sg
from symgrad import nn
from symgrad.backends.render.templates import render
from symgrad.api.random import Generator, philox4x32, philox_bits

torch.set_num_threads(1)  # a 2-core machine shared by parallel runs: torch's thread pool only contends

# Random123's known-answer vectors for Philox4x32-10: counter, key -> output.
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter, key, expected", PHILOX_KAT)
def test_philox_known_answers(counter, key, expected):
    assert tuple(int(w) for w in philox4x32(counter, key)) == expected


def test_c_header_matches_the_numpy_reference(tmp_path):
    """templates/program/random.h.j2 on its own, compiled by gcc, against philox_bits."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler")
    cases = [(5, 0, 1, 0), (5, 0, 1, 5), (-1, 3, 2, 4), (2 ** 62 + 7, 2 ** 33 + 1, 9, 2 ** 40 + 3),
             (-(2 ** 63), 2 ** 63 - 1, 0, 123456789)]
    calls = "\n".join(f'    printf("%lld\\n", (long long)sg_random_bits({s}LL, {t}LL, {r}LL, {i}LL));'
                      .replace("-9223372036854775808LL", "(-9223372036854775807LL - 1)")
                      for s, t, r, i in cases)
    source = (f"#include <stdint.h>\n#include <stdio.h>\n{render('program/random.h.j2')}\n"
              f"int main(void)\n{{\n{calls}\n    return 0;\n}}\n")
    (tmp_path / "kat.c").write_text(source)
    subprocess.run([gcc, "-std=c11", "-O2", "-Wall", "-Werror", "-o", str(tmp_path / "kat"),
                    str(tmp_path / "kat.c")], check=True)
    out = subprocess.run([str(tmp_path / "kat")], check=True, capture_output=True, text=True).stdout.split()
    assert [int(v) for v in out] == [int(philox_bits(*c)) for c in cases]


def dropout_step(backend, shape, p, seed):
    """A step whose predict= value is dropout(x) in training mode: predict returns masks, step advances."""
    generator = Generator(seed)
    x = sg.input("x", shape, "float64")
    w = sg.param("w", (shape[-1],), init="ones", dtype="float64")
    out = nn.functional.dropout(x, p, training=True, generator=generator)
    return sg.train_step(sg.sum(out * w), [w], sg.optim.SGD(lr=0.0), backend=backend, predict=out)


def reference_mask(seed, counter, stream, shape, p):
    bits = philox_bits(seed, counter, stream, np.arange(int(np.prod(shape))).reshape(shape))
    return bits < int(round((1 - p) * 2 ** 32))


def test_dropout_masks_match_the_reference_and_change_every_step(backend):
    shape, p, seed = (64, 50), 0.3, 1234
    step = dropout_step(backend, shape, p, seed)
    ones = np.ones(shape)
    masks = []
    for counter in range(3):
        assert int(step.state["rng.counter"]) == counter
        out = step.predict(x=ones)  # predict computes dropout in training mode here: it draws, and advances
        expected = reference_mask(seed, counter, 0, shape, p)
        np.testing.assert_array_equal(out != 0, expected)
        np.testing.assert_allclose(out[expected], 1 / (1 - p))
        masks.append(expected)
    assert not np.array_equal(masks[0], masks[1]) and not np.array_equal(masks[1], masks[2])
    step(x=ones)  # the training step advances the stream too
    assert int(step.state["rng.counter"]) == 4
    # Reseeding at run time changes the masks without recompiling.
    step.state["rng.seed"] = seed + 1
    np.testing.assert_array_equal(step.predict(x=ones) != 0, reference_mask(seed + 1, 4, 0, shape, p))


def test_dropout_keep_rate_over_a_million_draws(backend):
    shape, p = (1000, 1000), 0.3
    step = dropout_step(backend, shape, p, seed=7)
    kept = np.count_nonzero(step.predict(x=np.ones(shape)))
    n = shape[0] * shape[1]
    sigma = np.sqrt(n * p * (1 - p))
    assert abs(kept - n * (1 - p)) < 3 * sigma, (kept, n * (1 - p), sigma)


def test_dropout_layers_draw_different_masks_and_eval_is_identity():
    generator = Generator(0)
    model = nn.Sequential(nn.Dropout(0.5, generator), nn.Dropout(0.5, generator))
    x = sg.input("x", (4, 100), "float64")
    first, second = model[0](x), model[1](x)
    f = sg.function([x], [first, second], backend="numpy")
    a, b = f(np.ones((4, 100)))
    assert not np.array_equal(a != 0, b != 0)
    model.eval()
    assert model(x) is x
    with pytest.raises(ValueError, match="p must be in"):
        nn.Dropout(1.5)


def test_manual_seed_seeds_dropout_like_torch_manual_seed():
    """sg.manual_seed reseeds the default dropout generator: same seed, same mask; other seed, other mask."""
    x = sg.input("x", (8, 64), "float64")

    def mask(seed):
        sg.manual_seed(seed)
        (out,) = sg.function([x], [nn.Dropout(0.5)(x)], backend="numpy")(np.ones((8, 64)))
        return out != 0

    assert np.array_equal(mask(7), mask(7))
    assert not np.array_equal(mask(7), mask(8))


def test_function_draws_a_fresh_mask_every_call(backend):
    """sg.function of a training-mode Dropout advances the random stream on every call, as a train
    step does: each call's mask is Philox at that call's counter, and the sequence of masks
    depends on sg.manual_seed alone (a second function built the same way repeats it)."""
    shape, p, seed = (6, 40), 0.5, 21
    x = sg.input("x", shape, "float64")
    ones = np.ones(shape)

    def masks():
        sg.manual_seed(seed)
        f = sg.function([x], nn.Dropout(p)(x), backend=backend)
        return [f(ones) != 0 for _ in range(3)]

    first = masks()
    for counter, mask in enumerate(first):
        np.testing.assert_array_equal(mask, reference_mask(seed, counter, 0, shape, p))
    assert not np.array_equal(first[0], first[1]) and not np.array_equal(first[1], first[2])
    for again, mask in zip(masks(), first):
        np.testing.assert_array_equal(again, mask)


def test_batchnorm_matches_torch_after_ten_steps(backend, rng):
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU(),
                                    torch.nn.Linear(6, 3)).double()
    model = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3)).double()
    model.load_state_dict(reference.state_dict())
    B = sg.Dim("B")
    x, y = sg.input("x", (B, 5), "float64"), sg.input("y", (B,), "int64")
    model.train()
    loss = nn.functional.cross_entropy(model(x), y)
    model.eval()
    logits = model(x)
    step = sg.train_step(loss, model.parameters(), sg.optim.SGD(lr=0.1, momentum=0.9), backend=backend,
                         predict=logits)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    reference.train()
    for _ in range(10):
        xb, yb = rng.standard_normal((12, 5)) * 2 + 1, rng.integers(0, 3, 12)
        opt.zero_grad()
        torch_loss = torch.nn.functional.cross_entropy(reference(torch.from_numpy(xb)), torch.from_numpy(yb))
        torch_loss.backward()
        opt.step()
        assert step(x=xb, y=yb) == pytest.approx(torch_loss.item(), abs=1e-9)
    bn = reference[1]
    np.testing.assert_allclose(step.state["1.running_mean"], bn.running_mean.numpy(), atol=1e-9)
    np.testing.assert_allclose(step.state["1.running_var"], bn.running_var.numpy(), atol=1e-9)
    assert int(step.state["1.num_batches_tracked"]) == int(bn.num_batches_tracked) == 10
    assert np.abs(bn.running_var.numpy() - 1).max() > 0.1  # the statistics really moved
    reference.eval()
    xt = rng.standard_normal((7, 5))
    np.testing.assert_allclose(step.predict(x=xt), reference(torch.from_numpy(xt)).detach().numpy(), atol=1e-6)


def test_batchnorm_twice_in_one_step_is_refused():
    bn = nn.BatchNorm1d(3)
    x = sg.input("x", (4, 3))
    with pytest.raises(ValueError, match="running_mean' would be updated twice"):
        sg.train_step(sg.sum(bn(bn(x))), bn.parameters(), sg.optim.SGD(lr=0.1))
    with pytest.raises(ValueError, match=r"\[N, 3\]"):
        bn(sg.input("z", (4, 2)))
