"""`symgrad demo --model gpt`: a small GPT learns to write Python, character by character.

The text is the running Python's own standard library: a few of its modules' source files
(STDLIB_MODULES), read from disk, so the demo needs no download. The model is nanoGPT's,
small: character and position embeddings, pre-LayerNorm blocks of causal self-attention and a
GELU MLP, a final LayerNorm and a linear head over the characters the text uses. It trains
with AdamW (linear warmup, then a cosine decay, gradients clipped at norm 1), all inside one
compiled step per batch; every `eval_every` steps it measures the train and validation loss,
and at the end it samples text after a prompt from the validation split. The defaults train
in about a minute on 2 cores (C backend), the validation loss from 5.2 to about 1.7.

Written as user code, against the public API only: a reader can copy any part of it.
`train()` is what the command runs; tests run it for a handful of steps.
"""

from __future__ import annotations

import math
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

import symgrad as sg
from symgrad.tools.demo import _progress_bar

# The corpus: pure-Python modules every CPython ships, in this order; about 0.5 MB of text.
STDLIB_MODULES = ("textwrap", "string", "fnmatch", "shlex", "bisect", "heapq", "functools", "glob",
                  "pprint", "calendar", "difflib", "dataclasses", "argparse")
VALIDATION = 0.1  # the share of the text, at its end, held out for the validation loss


@dataclass(frozen=True)
class GPTDemoConfig:
    """What `symgrad demo --model gpt` varies. The defaults are sized for about a minute of
    training on 2 cores: 0.12M parameters, 16 windows of 64 characters per step, 500 steps
    (the validation loss then near 1.7 nats, from 5.2; lr 1e-2 chosen over 5e-3 on seed 0)."""

    steps: int = 500
    batch_size: int = 16
    context: int = 64
    layers: int = 2
    heads: int = 4
    channels: int = 64
    lr: float = 1e-2
    warmup: int = 30
    eval_every: int = 50
    eval_batches: int = 4      # batches of windows each loss is measured on
    sample_chars: int = 300
    seed: int = 0
    backend: str = "c"

    def __post_init__(self):
        for name in ("steps", "batch_size", "context", "layers", "heads", "channels", "eval_every", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.channels % self.heads:
            raise ValueError(f"channels ({self.channels}) must be a multiple of heads ({self.heads})")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if self.warmup < 0 or self.sample_chars < 0:
            raise ValueError("warmup and sample_chars must not be negative")


# ---- the text -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Corpus:
    """The text as integer ids of its characters, split into train and validation."""

    chars: str               # the vocabulary: every character the text uses, sorted
    train: np.ndarray        # int64 ids
    val: np.ndarray
    sources: tuple           # the files read

    def encode(self, text: str) -> np.ndarray:
        index = {c: k for k, c in enumerate(self.chars)}
        return np.array([index[c] for c in text], dtype=np.int64)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(k)] for k in ids)


def stdlib_corpus(modules=None, root: Optional[Path] = None) -> Corpus:
    """The source files of `modules` (default STDLIB_MODULES) from the standard library at
    `root` (the running Python's), joined; the last VALIDATION of the text is the validation split."""
    modules = STDLIB_MODULES if modules is None else modules
    root = Path(root or sysconfig.get_paths()["stdlib"])
    paths = [root / f"{name}.py" for name in modules if (root / f"{name}.py").is_file()]
    if not paths:
        raise OSError(f"demo gpt: none of the standard library's modules {', '.join(modules)} is under {root}")
    text = "".join(path.read_text(encoding="utf-8", errors="replace") for path in paths)
    chars = "".join(sorted(set(text)))
    index = {c: k for k, c in enumerate(chars)}
    ids = np.array([index[c] for c in text], dtype=np.int64)
    cut = int(len(ids) * (1 - VALIDATION))
    return Corpus(chars, ids[:cut], ids[cut:], tuple(p.name for p in paths))


def windows(ids: np.ndarray, batch: int, context: int, rng: np.random.Generator) -> tuple:
    """`batch` random windows of `context` ids, and the same windows one character on (the targets)."""
    starts = rng.integers(0, len(ids) - context - 1, batch)
    x = np.stack([ids[s:s + context] for s in starts])
    y = np.stack([ids[s + 1:s + 1 + context] for s in starts])
    return x, y


# ---- the model ----------------------------------------------------------------------------------

class CausalSelfAttention(sg.nn.Module):
    """Multi-head self-attention in which position t sees positions up to t."""

    def __init__(self, channels: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = sg.nn.Linear(channels, 3 * channels)
        self.proj = sg.nn.Linear(channels, channels)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = sg.split(self.qkv(x), C, dim=2)
        q, k, v = (sg.swapaxes(sg.reshape(t, (B, T, self.heads, C // self.heads)), 1, 2) for t in (q, k, v))
        y = sg.scaled_dot_product_attention(q, k, v, is_causal=True)   # (B, heads, T, C / heads)
        return self.proj(sg.reshape(sg.swapaxes(y, 1, 2), (B, T, C)))


class Block(sg.nn.Module):
    """x + attention(LayerNorm(x)), then x + MLP(LayerNorm(x)): nanoGPT's pre-LayerNorm block."""

    def __init__(self, channels: int, heads: int):
        super().__init__()
        self.ln_1, self.ln_2 = sg.nn.LayerNorm(channels), sg.nn.LayerNorm(channels)
        self.attn = CausalSelfAttention(channels, heads)
        self.mlp = sg.nn.Sequential(sg.nn.Linear(channels, 4 * channels), sg.nn.GELU(),
                                    sg.nn.Linear(4 * channels, channels))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(sg.nn.Module):
    """`model(idx)`: the logits (B, T, vocab) of the next character after each of idx (B, T)."""

    def __init__(self, vocab: int, context: int, layers: int, heads: int, channels: int):
        super().__init__()
        self.wte, self.wpe = sg.nn.Embedding(vocab, channels), sg.nn.Embedding(context, channels)
        self.h = sg.nn.ModuleList([Block(channels, heads) for _ in range(layers)])
        self.ln_f = sg.nn.LayerNorm(channels)
        self.head = sg.nn.Linear(channels, vocab)

    def forward(self, idx):
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(sg.arange(T))
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x))


def learning_rate(step: int, config: GPTDemoConfig) -> float:
    """Linear warmup to config.lr over config.warmup steps, then a cosine decay to a tenth of it."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    progress = min(1.0, (step - config.warmup) / max(1, config.steps - config.warmup))
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def build(config: GPTDemoConfig, vocab: int):
    """(model, step): the compiled training step, whose predict program gives the logits
    (B, T, vocab) that the losses and the sampling read. The batch size is a Dim."""
    sg.manual_seed(config.seed)
    model = GPT(vocab, config.context, config.layers, config.heads, config.channels)
    idx = sg.input("idx", (sg.Dim("B"), config.context), dtype="int64")
    targets = sg.input("targets", (sg.Dim("B"), config.context), dtype="int64")
    logits = model(idx)
    loss = sg.cross_entropy(sg.reshape(logits, (-1, vocab)), sg.reshape(targets, (-1,)))
    step = sg.train_step(loss, model.parameters(), sg.optim.AdamW(lr=config.lr, betas=(0.9, 0.99), weight_decay=0.01),
                         backend=config.backend, clip_grad_norm=1.0, predict=logits)
    return model, step


# ---- training -----------------------------------------------------------------------------------

def cross_entropy(logits: np.ndarray, targets: np.ndarray) -> float:
    """Mean cross-entropy of (..., vocab) logits against integer targets, in float64."""
    z = logits.astype(np.float64).reshape(-1, logits.shape[-1])
    z -= z.max(axis=1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return float(-log_p[np.arange(len(z)), targets.reshape(-1)].mean())


def evaluate(step, ids: np.ndarray, config: GPTDemoConfig, rng: np.random.Generator) -> float:
    """The loss on `config.eval_batches` batches of random windows of `ids`: the step's predict
    program (forward only: nothing trained, no optimizer state moved)."""
    losses = []
    for _ in range(config.eval_batches):
        x, y = windows(ids, config.batch_size, config.context, rng)
        losses.append(cross_entropy(step.predict(idx=x), y))
    return float(np.mean(losses))


def sample(step, corpus: Corpus, prompt: np.ndarray, length: int, rng: np.random.Generator,
           temperature: float = 0.8) -> str:
    """`length` characters after `prompt` (at least a context of ids), each drawn from the
    softmax of the last position's logits over the last context characters."""
    tokens = list(prompt)
    context = len(prompt)
    for _ in range(length):
        logits = step.predict(idx=np.array([tokens[-context:]], dtype=np.int64))[0, -1].astype(np.float64)
        p = np.exp((logits - logits.max()) / temperature)
        tokens.append(int(rng.choice(len(p), p=p / p.sum())))
    return corpus.decode(tokens[context:])


@dataclass
class GPTDemoResult:
    """What one run measured."""

    config: GPTDemoConfig
    parameters: int = 0
    compile_s: float = 0.0
    step_losses: list = field(default_factory=list)
    evals: list = field(default_factory=list)       # (step, train loss, validation loss), in order
    step_ns: list = field(default_factory=list)
    prompt: str = ""
    sample: str = ""
    source_path: Optional[str] = None

    @property
    def median_step_ms(self) -> float:
        return float(np.median(self.step_ns)) / 1e6


def train(config: GPTDemoConfig = GPTDemoConfig(), corpus: Optional[Corpus] = None,
          on_eval: Optional[Callable[[int, float, float, float], None]] = None,
          progress: bool = False) -> GPTDemoResult:
    """Compile the step and train it for `config.steps` steps on `corpus` (default: the standard
    library's text). After the first step, every `eval_every` steps and after the last,
    `on_eval(step, train_loss, val_loss, lr)` is called: the train loss is the mean of the
    steps since the last evaluation, the validation loss is measured on held-out windows."""
    corpus = corpus if corpus is not None else stdlib_corpus()
    result = GPTDemoResult(config)
    start = time.perf_counter()
    model, step = build(config, len(corpus.chars))
    step.predict(idx=np.zeros((1, config.context), np.int64))  # compile the predict program now, not mid-run
    result.compile_s = time.perf_counter() - start
    result.parameters = sum(int(np.prod(p.shape)) for p in model.parameters())
    source_path = getattr(step, "source_path", None)
    result.source_path = str(source_path) if source_path else None
    rng = np.random.default_rng(config.seed)
    eval_rng = np.random.default_rng(config.seed + 1)   # the same validation windows whatever the steps
    bar = _progress_bar(config.steps, progress)
    since = 0
    try:
        for k in range(config.steps):
            step.lr = learning_rate(k, config)
            x, y = windows(corpus.train, config.batch_size, config.context, rng)
            started = time.perf_counter_ns()
            loss = step(idx=x, targets=y)
            result.step_ns.append(time.perf_counter_ns() - started)
            result.step_losses.append(loss)
            bar.update()
            bar.set_postfix_str(f"loss {loss:.3f}")
            if k == 0 or (k + 1) % config.eval_every == 0 or k == config.steps - 1:
                train_loss = float(np.mean(result.step_losses[since:]))
                val_loss = evaluate(step, corpus.val, config, eval_rng)
                result.evals.append((k + 1, train_loss, val_loss))
                since = len(result.step_losses)
                if on_eval is not None:
                    on_eval(k + 1, train_loss, val_loss, step.lr)
    finally:
        bar.close()
    prompt = corpus.val[:config.context]
    result.prompt = corpus.decode(prompt)
    result.sample = sample(step, corpus, prompt, config.sample_chars, np.random.default_rng(config.seed))
    return result
