"""The benchmark models: layer widths, batch, FLOPs, and the fixed weights and data.

Every system trains the same network from the same float32 weights on the
same batch, so a step does the same arithmetic everywhere:

    h = x;  for each layer: h = h @ W + b, then ReLU except after the last
    loss = mean cross-entropy of h against integer labels (the last width is
    the number of classes: 10 for A and B, 1024 for C)

Model C uses cross-entropy over its 1024 outputs as classes rather than MSE,
so all models share one loss; its softmax costs O(B * 1024), negligible
beside the 3 GEMMs of 2 * B * 1024 * 1024 FLOPs each per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: SGD learning rate for every system. Small, so that the repeated batch is not
#: memorized during timing: a saturated softmax yields subnormal gradients,
#: which slow some systems and not others.
LR = 1e-3

WEIGHT_SEED = 0
DATA_SEED = 1


@dataclass(frozen=True)
class Model:
    """One benchmark row: an MLP of `widths` (input first) trained on batches of `batch`."""

    key: str                    # "A64": what --models accepts, besides the group letter
    group: str                  # "A": the model letter
    label: str                  # "A b64": the table's row name
    widths: tuple[int, ...]     # (784, 256, 256, 10): input width, then each layer's output
    batch: int
    target: float | None        # issue 13's bound on symgrad-C / fastest other system

    @property
    def layers(self) -> list[tuple[int, int]]:
        """(in, out) of each Linear layer."""
        return list(zip(self.widths[:-1], self.widths[1:]))

    @property
    def classes(self) -> int:
        """Number of classes: the last layer's width."""
        return self.widths[-1]

    @property
    def flops(self) -> int:
        """FLOPs per step by the issue's convention: 3 GEMMs of 2*B*in*out per Linear.

        (The first layer's input gradient is not needed, but every system is
        charged the same count, so GFLOP/s compare as speeds.)
        """
        return sum(6 * self.batch * n_in * n_out for n_in, n_out in self.layers)

    def weights(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """(W of shape (in, out), b of shape (out,)) per layer, float32, as torch.nn.Linear draws them.

        U(-1/sqrt(in), 1/sqrt(in)) for both, from a fixed seed.
        """
        rng = np.random.default_rng(WEIGHT_SEED)
        out = []
        for n_in, n_out in self.layers:
            bound = 1.0 / np.sqrt(n_in)
            W = rng.uniform(-bound, bound, (n_in, n_out)).astype(np.float32)
            b = rng.uniform(-bound, bound, (n_out,)).astype(np.float32)
            out.append((W, b))
        return out

    def symgrad_loss(self, sg, rows: int | None = None):
        """(loss, params): this MLP in symgrad (`sg`, the package), from these weights, on inputs
        "x" and "y" of `rows` rows (default the batch): cross-entropy of the last layer's output."""
        rows = self.batch if rows is None else rows
        x = sg.input("x", (rows, self.widths[0]))
        y = sg.input("y", (rows,), dtype="int64")
        h, params = x, []
        for k, (W0, b0) in enumerate(self.weights()):
            W, b = sg.param(f"W{k}", W0.shape, init=W0), sg.param(f"b{k}", b0.shape, init=b0)
            params += [W, b]
            h = sg.matmul(h, W) + b
            if k < len(self.layers) - 1:
                h = sg.relu(h)
        return sg.cross_entropy(h, y), params

    def data(self) -> tuple[np.ndarray, np.ndarray]:
        """One MNIST-shaped batch: x in [0, 1) float32 of (batch, in), labels int64 of (batch,)."""
        rng = np.random.default_rng(DATA_SEED)
        x = rng.random((self.batch, self.widths[0]), dtype=np.float32)
        y = rng.integers(0, self.classes, self.batch, dtype=np.int64)
        return x, y


MODELS = {m.key: m for m in [
    Model("A64", "A", "A b64", (784, 10), 64, 0.4),
    Model("A256", "A", "A b256", (784, 10), 256, 0.5),
    Model("B128", "B", "B b128", (784, 256, 256, 10), 128, 0.85),
    Model("C512", "C", "C b512", (1024, 1024, 1024, 1024), 512, 0.95),
]}

#: Tiny models for the harness' own smoke test; never in the default run.
SMOKE = {m.key: m for m in [
    Model("T", "T", "T b8", (16, 12, 12, 4), 8, None),
]}


def select(spec: str) -> list[Model]:
    """Models named by a comma list of group letters or keys: "A,B,C", "A64,C512", "T"."""
    known = {**MODELS, **SMOKE}
    chosen: list[Model] = []
    for name in (part.strip() for part in spec.split(",")):
        if not name:
            continue
        group = [m for m in known.values() if m.group == name.upper()]
        picked = group or ([known[name.upper()]] if name.upper() in known else [])
        if not picked:
            raise ValueError(f"unknown model {name!r}; expected group letters "
                             f"{sorted({m.group for m in known.values()})} or keys {sorted(known)}")
        chosen += [m for m in picked if m not in chosen]
    if not chosen:
        raise ValueError(f"no models selected by {spec!r}")
    return chosen
