"""CNN training steps side by side: symgrad, torch eager (oneDNN convolutions), torch.compile and JAX.

System `imported` is the torch twin of the network brought in with sg.from_torch (and its torch
SGD with sg.optim.from_torch), compiled to C: the torch user's path to symgrad-c's step.

    python -m benchmarks.cnn                      # LeNet-5 at batch 64, the residual network at batch 32
    python -m benchmarks.cnn --configs lenet --quick

Issue 17's two networks (benchmarks/cnn_models.py): LeNet-5 on 1x28x28 at
batch 64, and two residual blocks of 3x3 convolutions with 64 channels,
BatchNorm2d and ReLU on 3x32x32 at batch 32. Every system starts from
symgrad's initial weights and takes one plain SGD step per call (lr 1e-3) on
the same random batch, so their first losses agree; the systems are timed in
turns, and the table gives ms per step and symgrad-C over the fastest other.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import numpy as np

from . import THREADS, side_by_side, timing
from .cnn_models import jax_forward, lenet, resnet, trainable
from .systems import Runner, Unavailable

LR = 1e-3
ANCHORS = ("torch-eager", "torch-compile", "jax-jit")


@dataclass(frozen=True)
class Bench:
    """One row: a network, its input shape and batch."""

    name: str
    net: str          # "lenet" | "resnet"
    channels: int
    size: int
    batch: int

    def network(self, nn):
        return lenet(nn) if self.net == "lenet" else resnet(nn)


CONFIGS = {"lenet": Bench("lenet", "lenet", 1, 28, 64), "resnet": Bench("resnet", "resnet", 3, 32, 32),
           "tiny": Bench("tiny", "lenet", 1, 28, 2)}


def setup(bench: Bench, seed: int = 0):
    """(symgrad network, its initial state_dict and parameter names, one batch of images and labels)."""
    import symgrad as sg
    sg.manual_seed(seed)
    net = bench.network(sg.nn)
    rng = np.random.default_rng(seed + 1)
    x = rng.random((bench.batch, bench.channels, bench.size, bench.size), dtype=np.float32)
    y = rng.integers(0, 10, bench.batch)
    return net, net.state_dict(), [name for name, _ in net.named_parameters()], x, y


def symgrad_step(bench: Bench, state, x, y, backend: str):
    """symgrad's train step of `bench` from `state`, for batches shaped as x and y (its inputs)."""
    import symgrad as sg
    # A network of its own: the steps of one network train the same parameters (the network's),
    # and every system must start from the same initial state.
    net = bench.network(sg.nn).load_state_dict(state)
    xs = sg.input("x", x.shape)
    ys = sg.input("y", y.shape, dtype="int64")
    return sg.train_step(sg.cross_entropy(net(xs), ys), net.parameters(), sg.optim.SGD(lr=LR), backend=backend)


def symgrad_runner(backend: str):
    def build(bench: Bench, net, state, names, x, y) -> Runner:
        step = symgrad_step(bench, state, x, y, backend)
        return Runner(lambda: step(x=x, y=y), float, note=f"sg.train_step(backend={backend!r})")
    return build


def torch_runner(compiled: bool, device: str = "cpu"):
    """torch's step (eager or torch.compile) on `device`, its batch already there."""
    def build(bench: Bench, net, state, names, x, y) -> Runner:
        try:
            import torch
        except ImportError as exc:
            raise Unavailable(f"torch is not installed ({exc})") from None
        torch.set_num_threads(THREADS)
        twin = bench.network(torch.nn)
        twin.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in state.items()})
        twin.to(device)
        optimizer = torch.optim.SGD(twin.parameters(), lr=LR)
        xt, yt = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)

        def step():
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(twin(xt), yt)
            loss.backward()
            optimizer.step()
            return loss
        run = torch.compile(step) if compiled else step
        return Runner(run, lambda loss: loss.item(),
                      note="torch.compile of zero_grad + forward + backward + SGD" if compiled
                      else "PyTorch eager (oneDNN convolutions): zero_grad, forward, backward, SGD")
    return build


def imported_runner(bench: Bench, net, state, names, x, y) -> Runner:
    """The torch twin imported with sg.from_torch and its torch SGD with sg.optim.from_torch,
    compiled to C: the torch user's front door to the step symgrad-c times."""
    import symgrad as sg
    try:
        import torch
    except ImportError as exc:
        raise Unavailable(f"torch is not installed ({exc})") from None
    twin = bench.network(torch.nn)
    twin.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in state.items()})
    imported = sg.from_torch(twin, (torch.from_numpy(x),))
    xs, ys = sg.input("x", x.shape), sg.input("y", y.shape, dtype="int64")
    optimizer = sg.optim.from_torch(torch.optim.SGD(twin.parameters(), lr=LR))
    step = sg.train_step(sg.cross_entropy(imported(xs), ys), optimizer=optimizer, backend="c")
    return Runner(lambda: step(x=x, y=y), float, note="sg.from_torch(torch twin), sg.optim.from_torch(SGD), C")


def jax_runner(bench: Bench, net, state, names, x, y) -> Runner:
    try:
        import jax
        import jax.numpy as jnp
    except ImportError as exc:
        raise Unavailable(f"jax is not installed ({exc}); pip install jax jaxlib") from None
    forward = jax_forward(bench.net)

    def loss_fn(params, x, y):
        logp = jax.nn.log_softmax(forward(params, x), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

    def sgd(params, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        return jax.tree.map(lambda p, g: p - LR * g, params, grads), loss

    jitted = jax.jit(sgd, donate_argnums=0)
    box = {"p": {k: jnp.asarray(v) for k, v in trainable(state, names).items()}}
    xj, yj = jnp.asarray(x), jnp.asarray(y.astype(np.int32))

    def step():
        box["p"], loss = jitted(box["p"], xj, yj)
        return loss
    return Runner(step, lambda loss: float(loss.block_until_ready()),
                  note=f"jax {jax.__version__} jit(value_and_grad + SGD), parameters donated")


SYSTEMS = {"symgrad-c": symgrad_runner("c"), "imported": imported_runner, "symgrad-numpy": symgrad_runner("numpy"),
           "torch-eager": torch_runner(False), "torch-compile": torch_runner(True), "jax-jit": jax_runner}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="lenet,resnet", help=f"comma list of {', '.join(CONFIGS)}")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--quick", action="store_true", help="5 blocks of 2 steps: a look, not a result")
    parser.add_argument("--blocks", type=int, default=11)
    args = parser.parse_args(argv)
    benches = [CONFIGS[c] for c in args.configs.split(",")]
    names = args.systems.split(",")
    plan = timing.Plan(blocks=5, steps=2, warmup_steps=1, warmup_s=0.0) if args.quick else \
        timing.Plan(blocks=args.blocks, block_s=0.3, min_steps=1, warmup_steps=2, warmup_s=1.0)
    print(f"CNN step benchmark: {len(benches)} config(s), {THREADS} threads", file=sys.stderr)
    rows = side_by_side.run(benches, names, SYSTEMS, setup, plan, log=lambda s: print(s, file=sys.stderr),
                          preload=("torch",))
    print(side_by_side.render(rows, names, ANCHORS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
