"""The CNN benchmark's two networks, written once against an nn-like library (symgrad's or torch's),
and again in JAX, so every system trains the same network from the same weights.

LeNet-5 (conv 5x5 6 with padding 2, ReLU, max-pool 2, conv 5x5 16, ReLU, max-pool 2, Linear 400-120-84-10
with ReLU) on 1x28x28; a small residual network (a 3x3 conv stem of 64 channels, two residual blocks of
two 3x3 convs with BatchNorm2d and ReLU, global average pooling, Linear 64-10) on 3x32x32.
"""

from __future__ import annotations

import numpy as np


def lenet(nn):
    """LeNet-5 in `nn` (symgrad.nn or torch.nn): the same parameter names in both."""
    return nn.Sequential(nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10))


def resnet(nn, channels: int = 64):
    """Two residual blocks of 3x3 convs with BatchNorm2d, in `nn`; torch's names in both."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(channels)
            self.relu = nn.ReLU()
            self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(channels)

        def forward(self, x):
            return self.relu(self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x))))) + x)

    class ResNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels),
                                      nn.ReLU())
            self.blocks = nn.Sequential(Block(), Block())
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.flat = nn.Flatten()
            self.fc = nn.Linear(channels, 10)

        def forward(self, x):
            return self.fc(self.flat(self.pool(self.blocks(self.stem(x)))))

    return ResNet()


def jax_forward(name: str):
    """The network as a JAX function of (params by torch's names, x): BatchNorm in training mode."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    def conv(x, w, b=None, padding=0):
        y = lax.conv_general_dilated(x, w, (1, 1), ((padding, padding), (padding, padding)),
                                     dimension_numbers=("NCHW", "OIHW", "NCHW"))
        return y if b is None else y + b[None, :, None, None]

    def bn(x, p, prefix):
        mean = x.mean(axis=(0, 2, 3), keepdims=True)
        var = ((x - mean) ** 2).mean(axis=(0, 2, 3), keepdims=True)
        return (x - mean) / jnp.sqrt(var + 1e-5) * p[prefix + ".weight"][None, :, None, None] \
            + p[prefix + ".bias"][None, :, None, None]

    def pool(x):
        return lax.reduce_window(x, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")

    def linear(x, p, prefix):
        return x @ p[prefix + ".weight"].T + p[prefix + ".bias"]

    def lenet_forward(p, x):
        x = pool(jax.nn.relu(conv(x, p["0.weight"], p["0.bias"], 2)))
        x = pool(jax.nn.relu(conv(x, p["3.weight"], p["3.bias"])))
        x = x.reshape(x.shape[0], -1)
        return linear(jax.nn.relu(linear(jax.nn.relu(linear(x, p, "7")), p, "9")), p, "11")

    def resnet_forward(p, x):
        x = jax.nn.relu(bn(conv(x, p["stem.0.weight"], None, 1), p, "stem.1"))
        for k in range(2):
            pre = f"blocks.{k}."
            h = jax.nn.relu(bn(conv(x, p[pre + "conv1.weight"], None, 1), p, pre + "bn1"))
            x = jax.nn.relu(bn(conv(h, p[pre + "conv2.weight"], None, 1), p, pre + "bn2") + x)
        return linear(x.mean(axis=(2, 3)), p, "fc")

    return {"lenet": lenet_forward, "resnet": resnet_forward}[name]


def trainable(state: dict, names: list[str]) -> dict:
    """The entries of a state_dict that are parameters (not BatchNorm's running statistics)."""
    return {k: np.asarray(state[k]) for k in names}
