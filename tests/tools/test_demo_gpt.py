"""`symgrad demo --model gpt` (issue 37): the small GPT on the standard library's own source,
run here for a handful of steps at a tiny size (the command's defaults train for about a minute)."""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest

from symgrad.tools import demo_gpt
from symgrad.tools.cli import main

# One tiny model for every test here: its step compiles once (the caches serve the rest).
TINY = dict(layers=1, heads=2, channels=16, context=16, batch_size=4, eval_every=10, eval_batches=2,
            sample_chars=24, lr=1e-2, warmup=2)


@pytest.fixture(scope="module")
def corpus():
    return demo_gpt.stdlib_corpus(modules=("textwrap", "string"))


@pytest.fixture(scope="module")
def result(corpus):
    return demo_gpt.train(demo_gpt.GPTDemoConfig(steps=30, **TINY), corpus)


def test_the_corpus_is_the_standard_library_split_by_characters(corpus):
    assert corpus.sources == ("textwrap.py", "string.py")
    text = corpus.decode(np.concatenate([corpus.train, corpus.val]))
    assert "def dedent(" in text and "class Template" in text
    assert corpus.chars == "".join(sorted(set(text)))
    assert len(corpus.val) == pytest.approx(0.1 * len(text), abs=1)
    assert np.array_equal(corpus.encode(text[:50]), corpus.train[:50])
    x, y = demo_gpt.windows(corpus.train, 3, 8, np.random.default_rng(0))
    assert x.shape == y.shape == (3, 8) and x.dtype == np.int64 and np.array_equal(x[:, 1:], y[:, :-1])
    with pytest.raises(OSError, match="none of the standard library's modules"):
        demo_gpt.stdlib_corpus(modules=("no_such_module",))


def test_the_schedule_warms_up_then_decays_to_a_tenth():
    config = demo_gpt.GPTDemoConfig(steps=100, warmup=10, lr=1.0)
    rates = [demo_gpt.learning_rate(k, config) for k in range(100)]
    assert rates[0] == pytest.approx(0.1) and rates[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(rates[9:], rates[10:])) and rates[-1] == pytest.approx(0.1, abs=1e-3)
    with pytest.raises(ValueError, match="multiple of heads"):
        demo_gpt.GPTDemoConfig(channels=10, heads=4)


def test_training_lowers_the_loss_and_samples_text(result, corpus):
    assert len(result.step_losses) == 30 and all(np.isfinite(result.step_losses))
    assert [s for s, _, _ in result.evals] == [1, 10, 20, 30]
    (_, first_train, first_val), (_, last_train, last_val) = result.evals[0], result.evals[-1]
    assert first_train == pytest.approx(np.log(len(corpus.chars)), rel=0.25)  # about uniform at first
    assert last_train < first_train - 0.5 and last_val < first_val - 0.5
    assert len(result.sample) == 24 and set(result.sample) <= set(corpus.chars)
    assert result.prompt == corpus.decode(corpus.val[:16]) and result.parameters > 0


def test_the_command(monkeypatch, capsys):
    monkeypatch.setattr(demo_gpt, "GPTDemoConfig", functools.partial(demo_gpt.GPTDemoConfig, **TINY))
    monkeypatch.setattr(demo_gpt, "STDLIB_MODULES", ("textwrap", "string"))
    assert main(["demo", "--model", "gpt", "--steps", "12", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "demo: a GPT (1 layers, 2 heads, 16 channels, context 16)" in out and "textwrap.py, string.py" in out
    steps = re.findall(r"^step +(\d+)/12  train loss (\d+\.\d+)  val loss (\d+\.\d+)  lr ", out, re.M)
    assert [int(s) for s, _, _ in steps] == [1, 10, 12]
    assert "time per step:" in out and "sample (the 24 characters the model writes next):" in out
    assert main(["demo", "--model", "gpt", "--epochs", "2"]) == 1
    assert main(["demo", "--steps", "2"]) == 1
    assert "--steps is the gpt demo's" in capsys.readouterr().err
