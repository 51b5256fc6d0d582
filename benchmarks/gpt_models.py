"""examples/gpt.py's GPT written again in torch, in JAX, and as llm.c's checkpoint, from the same weights.

Every twin takes symgrad's state_dict (nanoGPT's parameter names and layouts:
transformer.h.{l}.attn.c_attn.weight is (3C, C), ...; the tied output matrix under both
transformer.wte.weight and lm_head.weight), so each system starts from the same numbers and
their first losses agree.
"""

from __future__ import annotations

import importlib.util
import struct
import sys
from pathlib import Path

import numpy as np

_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gpt.py"


def load_example():
    """examples/gpt.py as a module (it is a script, not part of the package)."""
    if "symgrad_gpt_example" in sys.modules:
        return sys.modules["symgrad_gpt_example"]
    spec = importlib.util.spec_from_file_location("symgrad_gpt_example", _EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["symgrad_gpt_example"] = module   # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def torch_gpt(config, state: dict, dtype: str = "float32"):
    """nanoGPT's model in torch with symgrad's parameter names, loaded from `state` (strict)."""
    import torch
    import torch.nn.functional as TF
    T = torch.nn

    class TorchGPT(T.Module):
        def __init__(self, c):
            super().__init__()
            self.c = c
            blocks = T.ModuleList()
            for _ in range(c.n_layer):
                block = T.Module()   # nanoGPT's Block: its modules in its order (state_dict keeps it)
                block.ln_1, block.attn = T.LayerNorm(c.n_embd), T.Module()
                block.attn.c_attn, block.attn.c_proj = T.Linear(c.n_embd, 3 * c.n_embd), T.Linear(c.n_embd, c.n_embd)
                block.ln_2, block.mlp = T.LayerNorm(c.n_embd), T.Module()
                block.mlp.c_fc, block.mlp.c_proj = T.Linear(c.n_embd, 4 * c.n_embd), T.Linear(4 * c.n_embd, c.n_embd)
                blocks.append(block)
            self.transformer = T.ModuleDict(dict(wte=T.Embedding(c.vocab_size, c.n_embd),
                                                 wpe=T.Embedding(c.block_size, c.n_embd),
                                                 h=blocks, ln_f=T.LayerNorm(c.n_embd)))
            self.lm_head = T.Linear(c.n_embd, c.vocab_size, bias=False)
            self.transformer.wte.weight = self.lm_head.weight

        def forward(self, idx):
            B, Tn = idx.shape
            C, nh, t = self.c.n_embd, self.c.n_head, self.transformer
            x = t.wte(idx) + t.wpe(torch.arange(Tn, device=idx.device))
            for b in t.h:
                q, k, v = b.attn.c_attn(b.ln_1(x)).split(C, dim=2)
                q, k, v = (u.view(B, Tn, nh, C // nh).transpose(1, 2) for u in (q, k, v))
                y = TF.scaled_dot_product_attention(q, k, v, is_causal=True)
                x = x + b.attn.c_proj(y.transpose(1, 2).contiguous().view(B, Tn, C))
                x = x + b.mlp.c_proj(TF.gelu(b.mlp.c_fc(b.ln_2(x)), approximate=self.c.gelu))
            return self.lm_head(t.ln_f(x))

    model = TorchGPT(config).to(getattr(torch, dtype))
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()})
    return model


def parameters(state: dict) -> dict:
    """`state` without the tied matrix's second key (lm_head.weight is transformer.wte.weight): the
    parameters a functional twin trains, each once."""
    return {k: v for k, v in state.items() if k != "lm_head.weight"}


def jax_loss(config):
    """The model's mean cross-entropy as a JAX function of (`parameters(state)`, idx, targets)."""
    import jax
    import jax.numpy as jnp

    def layer_norm(x, w, b):
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / jnp.sqrt(var + 1e-5) * w + b

    def linear(x, p, name):
        return x @ p[name + ".weight"].T + p[name + ".bias"]

    def loss(p, idx, targets):
        B, T = idx.shape
        C, nh = config.n_embd, config.n_head
        x = p["transformer.wte.weight"][idx] + p["transformer.wpe.weight"][:T]
        causal = jnp.tril(jnp.ones((T, T), bool))
        for layer in range(config.n_layer):
            pre = f"transformer.h.{layer}."
            h = layer_norm(x, p[pre + "ln_1.weight"], p[pre + "ln_1.bias"])
            q, k, v = jnp.split(linear(h, p, pre + "attn.c_attn"), 3, axis=2)
            q, k, v = (t.reshape(B, T, nh, C // nh).transpose(0, 2, 1, 3) for t in (q, k, v))
            att = jnp.where(causal, q @ k.transpose(0, 1, 3, 2) / np.sqrt(C // nh), -jnp.inf)
            y = (jax.nn.softmax(att, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(B, T, C)
            x = x + linear(y, p, pre + "attn.c_proj")
            h = layer_norm(x, p[pre + "ln_2.weight"], p[pre + "ln_2.bias"])
            h = jax.nn.gelu(linear(h, p, pre + "mlp.c_fc"), approximate=config.gelu == "tanh")
            x = x + linear(h, p, pre + "mlp.c_proj")
        logits = layer_norm(x, p["transformer.ln_f.weight"], p["transformer.ln_f.bias"]) @ p["transformer.wte.weight"].T
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    return loss


# llm.c's checkpoint: 256 int32 header words, then the 16 parameter tensors, layers stacked.
LLMC_MAGIC, LLMC_VERSION = 20240326, 3


def write_llmc_checkpoint(path: Path, config, state: dict) -> None:
    """`state` in the layout llm.c's train_gpt2.c reads (gpt2_build_from_checkpoint): float32,
    vocabulary padded to a multiple of 128 with zero rows."""
    V, C, L, T = config.vocab_size, config.n_embd, config.n_layer, config.block_size
    Vp = -(-V // 128) * 128
    header = np.zeros(256, np.int32)
    header[:8] = [LLMC_MAGIC, LLMC_VERSION, T, V, L, config.n_head, C, Vp]
    wte = np.zeros((Vp, C), np.float32)
    wte[:V] = state["transformer.wte.weight"]

    def stacked(name):
        return np.stack([state[f"transformer.h.{layer}.{name}"] for layer in range(L)])
    tensors = [wte, state["transformer.wpe.weight"], stacked("ln_1.weight"), stacked("ln_1.bias"),
               stacked("attn.c_attn.weight"), stacked("attn.c_attn.bias"),
               stacked("attn.c_proj.weight"), stacked("attn.c_proj.bias"),
               stacked("ln_2.weight"), stacked("ln_2.bias"), stacked("mlp.c_fc.weight"), stacked("mlp.c_fc.bias"),
               stacked("mlp.c_proj.weight"), stacked("mlp.c_proj.bias"), state["transformer.ln_f.weight"],
               state["transformer.ln_f.bias"]]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        for t in tensors:
            f.write(np.ascontiguousarray(t, dtype=np.float32).tobytes())
    assert struct.calcsize("i") == 4
