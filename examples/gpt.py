"""A GPT trained end to end with symgrad: nanoGPT's model on bytes of text.

    python examples/gpt.py                      # the running Python's standard library as text
    python examples/gpt.py --text input.txt     # any file, e.g. tinyshakespeare
    python examples/gpt.py --steps 300 --layers 4 --heads 4 --channels 128 --context 64

The model is nanoGPT's: token and position embeddings, pre-LayerNorm blocks of
causal self-attention and a GELU MLP, a final LayerNorm, and the output layer
tied to the token embedding. The vocabulary is the 256 byte values. Training
is AdamW (weight decay on matrices only) with linear warmup, cosine decay and
gradient clipping at norm 1, all inside one compiled step per batch; the
learning rate is a runtime value of the step (`step.lr`), which a torch
scheduler (sg.optim.lr_scheduler.LambdaLR) sets after each step. Every
`--eval-every` steps it prints the train and validation loss; at the end it
samples text from the trained model with the step's compiled forward program.
"""

from __future__ import annotations

import argparse
import math
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import symgrad as sg
from symgrad import nn
from symgrad.nn import functional as F


@dataclass(frozen=True)
class GPTConfig:
    """The model's sizes, as nanoGPT's GPTConfig (bias=True, dropout 0)."""

    vocab_size: int = 256
    block_size: int = 64      # the longest context
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    gelu: str = "none"        # "tanh": GPT-2's (and llm.c's) approximation


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees positions <= t (nanoGPT's, line for line)."""

    def __init__(self, config: GPTConfig, dtype: str):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, dtype=dtype)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, dtype=dtype)
        self.n_head, self.n_embd = config.n_head, config.n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)    # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)       # one fused kernel
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig, dtype: str):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, dtype=dtype)
        self.gelu = nn.GELU(approximate=config.gelu)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, dtype=dtype)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, dtype: str):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, dtype=dtype)
        self.attn = CausalSelfAttention(config, dtype)
        self.ln_2 = nn.LayerNorm(config.n_embd, dtype=dtype)
        self.mlp = MLP(config, dtype)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's GPT: `model(idx)` gives the logits (B, T, vocab) of integer tokens idx (B, T)."""

    def __init__(self, config: GPTConfig, dtype: str = "float32"):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd, dtype=dtype),
            wpe=nn.Embedding(config.block_size, config.n_embd, dtype=dtype),
            h=nn.ModuleList([Block(config, dtype) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, dtype=dtype),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False, dtype=dtype)
        # Weight tying, as nanoGPT writes it: one matrix, trained once, listed once by
        # named_parameters() (as transformer.wte.weight) and under both keys by state_dict().
        self.transformer.wte.weight = self.lm_head.weight
        # nanoGPT's init: N(0, 0.02) matrices and embeddings, zero biases, residual projections
        # scaled down by depth (drawn from the generator sg.manual_seed seeds).
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        B, T = idx.size()
        pos = sg.arange(0, T, dtype="int64")
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))

    def configure_optimizers(self, weight_decay: float, learning_rate: float, betas) -> sg.optim.AdamW:
        """nanoGPT's AdamW: matrices (2-D and up) decay, biases and LayerNorm weights do not."""
        params = [p for _, p in self.named_parameters()]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return sg.optim.AdamW(groups, lr=learning_rate, betas=betas, eps=1e-8)


def learning_rate(step: int, peak: float, warmup: int, total: int, floor_ratio: float = 0.1) -> float:
    """Linear warmup to `peak`, then cosine decay to floor_ratio * peak at `total` (nanoGPT's)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor_ratio + (1 - floor_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def build_step(model: GPT, batch, context, lr: float = 1e-3, weight_decay: float = 0.1,
               backend: str | None = None, dtype: str = "float32", betas=(0.9, 0.95), clip: float | None = 1.0,
               autocast: str | None = None):
    """The compiled training step (AdamW, gradients clipped at norm `clip`) and, as its predict
    program, the logits of the last position for sampling. `batch` and `context` may be sg.Dims.
    `autocast` ("bfloat16"): the step's forward under torch's CPU autocast policy (matmuls and
    attention in bfloat16, float32 master weights); the predict program stays float32."""
    idx = sg.input("idx", (batch, context), dtype="int64")
    targets = sg.input("targets", (batch, context), dtype="int64")
    logits = model(idx)
    V = model.config.vocab_size
    loss = F.cross_entropy(logits.view(-1, V), targets.view(-1))
    optimizer = model.configure_optimizers(weight_decay, lr, betas)
    return sg.train_step(loss, optimizer=optimizer, backend=backend, clip_grad_norm=clip, predict=logits[:, -1],
                         autocast=autocast)


def standard_library_text(limit: int = 4_000_000) -> bytes:
    """The running Python's standard-library sources, sorted by path: text every machine has."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= limit:
            break
    return b"".join(chunks)


def batches(data: np.ndarray, batch: int, context: int, rng: np.random.Generator):
    """Random windows of `context` bytes and the same windows shifted by one (the targets)."""
    while True:
        starts = rng.integers(0, len(data) - context - 1, batch)
        x = np.stack([data[s:s + context] for s in starts]).astype(np.int64)
        y = np.stack([data[s + 1:s + 1 + context] for s in starts]).astype(np.int64)
        yield x, y


def sample(step, prompt: bytes, length: int, block_size: int, rng: np.random.Generator,
           temperature: float = 0.8) -> bytes:
    """`length` bytes after `prompt`, each drawn from the softmax of the last position's logits."""
    tokens = list(prompt)
    for _ in range(length):
        context = np.array([tokens[-block_size:]], dtype=np.int64)
        logits = np.asarray(step.predict(idx=context), dtype=np.float64)[0] / temperature
        p = np.exp(logits - logits.max())
        tokens.append(int(rng.choice(len(p), p=p / p.sum())))
    return bytes(tokens[len(prompt):])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--text", type=Path,
                        help="a text file to train on; None: the Python standard library's sources")
    parser.add_argument("--backend", default="c", choices=["numpy", "c"],
                        help="compile the step to C (OpenMP), or run the numpy reference")
    parser.add_argument("--steps", type=int, default=200, help="training steps")
    parser.add_argument("--batch", type=int, default=8, help="windows of text per step")
    parser.add_argument("--context", type=int, default=64, help="bytes per window (the block size)")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks")
    parser.add_argument("--heads", type=int, default=4, help="attention heads per block")
    parser.add_argument("--channels", type=int, default=128, help="embedding width (n_embd)")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=20, help="steps of linear warmup")
    parser.add_argument("--eval-every", type=int, default=50, help="steps between loss reports")
    parser.add_argument("--sample", type=int, default=200, help="bytes to sample at the end")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches")
    parser.add_argument("--autocast", choices=["bfloat16", "float16"],
                        help="train under torch's CPU autocast policy in this dtype (sg.train_step(autocast=))")
    args = parser.parse_args(argv)

    text = args.text.read_bytes() if args.text else standard_library_text()
    data = np.frombuffer(text, dtype=np.uint8)
    split = int(0.9 * len(data))
    train, val = data[:split], data[split:]
    print(f"text: {len(data):,} bytes ({args.text or 'the standard library'}), "
          f"{len(train):,} train / {len(val):,} val", file=sys.stderr)

    sg.manual_seed(args.seed)
    config = GPTConfig(block_size=args.context, n_layer=args.layers, n_head=args.heads, n_embd=args.channels)
    model = GPT(config)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters", file=sys.stderr)
    step = build_step(model, sg.Dim("B"), sg.Dim("T"), lr=args.lr, backend=args.backend, autocast=args.autocast)
    # step.lr is a runtime value of the compiled step: the scheduler sets it without recompiling.
    scheduler = sg.optim.lr_scheduler.LambdaLR(step, lambda k: learning_rate(k, 1.0, args.warmup, args.steps))
    rng = np.random.default_rng(args.seed)
    train_batches, val_batches = batches(train, args.batch, args.context, rng), batches(val, args.batch, args.context, rng)
    for k in range(args.steps):
        x, y = next(train_batches)
        loss = step(idx=x, targets=y)
        if k % args.eval_every == 0 or k == args.steps - 1:
            # The validation loss: the same step's forward, without an update (lr 0 would still move Adam's
            # moments), so it is measured with the predict-free evaluation of cross-entropy in NumPy.
            vx, vy = next(val_batches)
            val_loss = evaluate(step, vx, vy, config.block_size)
            print(f"step {k:5d}  train loss {loss:.4f}  val loss {val_loss:.4f}  lr {step.lr:.2e}")
        scheduler.step()
    prompt = val[:32].tobytes()
    print(prompt.decode("utf-8", "replace") + "|" +
          sample(step, prompt, args.sample, config.block_size, rng).decode("utf-8", "replace"))


def evaluate(step, x: np.ndarray, y: np.ndarray, block_size: int) -> float:
    """Mean cross-entropy of the last position's prediction over each window's prefixes of x:
    the validation loss computed with the compiled forward program, no update."""
    losses = []
    for t in range(1, x.shape[1] + 1, max(1, x.shape[1] // 8)):
        logits = np.asarray(step.predict(idx=np.ascontiguousarray(x[:, :t])), dtype=np.float64)
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_p = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        losses.append(-log_p[np.arange(len(y)), y[:, t - 1]].mean())
    return float(np.mean(losses))


if __name__ == "__main__":
    main()
