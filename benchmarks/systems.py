"""The systems under test: each builds a ready-to-call training step for one model.

A builder returns a `Runner`; it raises `Unavailable` when an optional
dependency (the C backend, JAX) is missing, and lets any other error
propagate so the harness can report its text in the table cell.

Every step is forward, mean cross-entropy, backward and a plain SGD update
(`p -= LR * grad`) from the model's fixed weights on its fixed batch.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from . import THREADS
from .models import LR, Model


class Unavailable(Exception):
    """The system cannot run here (a missing optional dependency); the message says why."""


@dataclass
class Runner:
    """One system's training step for one model, with its data bound."""

    step: Callable[[], object]            # one full training step; returns the loss in the system's type
    to_float: Callable[[object], float]   # the loss as a float; waits for it (JAX dispatches asynchronously)
    note: str = ""                        # how the step was built, for the report


# symgrad ------------------------------------------------------------------------------------


def symgrad_step(model: Model, backend: str, sg=None) -> Runner:
    """symgrad's train_step for `model` on `backend` ("c", "numpy", ...), data bound; `sg` is the
    symgrad package to use (default: the installed one)."""
    if sg is None:
        import symgrad as sg

    # Concrete sizes: torch.compile and jax.jit specialize to the shapes they see too.
    loss, params = model.symgrad_loss(sg)
    step = sg.train_step(loss, params=params, optimizer=sg.optim.SGD(lr=LR), backend=backend)
    xb, yb = model.data()
    return Runner(lambda: step(x=xb, y=yb), float, note=f"sg.train_step(backend={backend!r})")


def build_symgrad_c(model: Model) -> Runner:
    """symgrad compiled to C (OpenMP + cffi)."""
    if importlib.util.find_spec("symgrad.backends.c") is None:
        raise Unavailable("symgrad/backends/c.py does not exist yet (the C backend is not built)")
    return symgrad_step(model, "c")


BASE = "symgrad-c-base"


def load_base(checkout: Path):
    """The symgrad package of another checkout (an earlier commit), imported beside this one as
    `symgrad_base`. symgrad's modules import each other relatively and find their templates
    beside the package, so the two share nothing but the build cache, where their different
    sources give different keys."""
    init = Path(checkout) / "symgrad" / "__init__.py"
    if not init.is_file():
        raise FileNotFoundError(f"--base {checkout}: no symgrad/__init__.py there")
    spec = importlib.util.spec_from_file_location("symgrad_base", init,
                                                  submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["symgrad_base"] = module
    spec.loader.exec_module(module)
    return module


def base_builder(checkout: Path) -> Callable[[Model], Runner]:
    """The builder of system BASE: symgrad-C of `checkout`, to time a change against its parent."""
    package = load_base(checkout)

    def build(model: Model) -> Runner:
        return symgrad_step(model, "c", sg=package)
    build.__doc__ = f"symgrad compiled to C, as of the checkout {checkout}."
    return build


def build_symgrad_numpy(model: Model) -> Runner:
    """symgrad's NumPy reference interpreter."""
    return symgrad_step(model, "numpy")


# PyTorch ------------------------------------------------------------------------------------


def _import_torch():
    try:
        import torch
    except ImportError as exc:
        raise Unavailable(f"torch is not installed ({exc}); pip install torch") from None
    torch.set_num_threads(THREADS)
    return torch


def torch_model(model: Model):
    """(module, x, y) in PyTorch with the model's weights and batch."""
    torch = _import_torch()
    from torch import nn

    layers: list = []
    weights = model.weights()
    for k, (W, b) in enumerate(weights):
        linear = nn.Linear(*W.shape)
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(W.T))   # nn.Linear stores (out, in)
            linear.bias.copy_(torch.from_numpy(b))
        layers.append(linear)
        if k < len(weights) - 1:
            layers.append(nn.ReLU())
    x, y = model.data()
    return nn.Sequential(*layers), torch.from_numpy(x), torch.from_numpy(y)


def torch_step_function(model: Model):
    """(step, x, y): the eager training step a PyTorch user writes, as one function of (x, y)."""
    torch = _import_torch()
    import torch.nn.functional as F

    module, x, y = torch_model(model)
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)

    def step(x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(module(x), y)
        loss.backward()
        optimizer.step()
        return loss

    return step, x, y


def _loss_float(loss) -> float:
    return float(loss.detach())


def build_torch_eager(model: Model) -> Runner:
    """PyTorch eager: zero_grad, forward, backward, step."""
    step, x, y = torch_step_function(model)
    return Runner(lambda: step(x, y), _loss_float, note="eager; torch.optim.SGD")


def build_torch_compile(model: Model) -> Runner:
    """torch.compile of the whole step function (forward, backward and optimizer step)."""
    torch = _import_torch()

    step, x, y = torch_step_function(model)
    # dynamic=False: the same step code serves every model, and Dynamo would
    # otherwise recompile the later ones for dynamic shapes (slower kernels).
    compiled = torch.compile(step, dynamic=False)
    return Runner(lambda: compiled(x, y), _loss_float,
                  note="torch.compile(step) with zero_grad/forward/backward/SGD.step inside; "
                       "Dynamo splits it at backward() and compiles each part")


def build_torch_compile_func(model: Model) -> Runner:
    """torch.compile of a functional step: torch.func.grad_and_value plus an in-place SGD update.

    Nothing in it breaks Dynamo's graph, so forward, backward and update are
    one compiled graph, the closest torch comes to what symgrad compiles.
    """
    torch = _import_torch()
    import torch.nn.functional as F
    from torch.func import functional_call, grad_and_value

    module, x, y = torch_model(model)
    params = {name: p.detach() for name, p in module.named_parameters()}

    def loss_fn(params, x, y):
        return F.cross_entropy(functional_call(module, params, (x,)), y)

    def step(params, x, y):
        grads, loss = grad_and_value(loss_fn)(params, x, y)
        with torch.no_grad():
            for name, p in params.items():
                p.sub_(LR * grads[name])
        return loss

    # dynamic=False: the same step code serves every model, and Dynamo would
    # otherwise recompile the later ones for dynamic shapes (slower kernels).
    compiled = torch.compile(step, dynamic=False)
    return Runner(lambda: compiled(params, x, y), _loss_float,
                  note="torch.compile of torch.func.grad_and_value + in-place SGD: one graph")


# JAX ----------------------------------------------------------------------------------------


def build_jax_jit(model: Model) -> Runner:
    """JAX: jit of value_and_grad plus the SGD update, parameters donated (updated in place)."""
    try:
        import jax
        import jax.numpy as jnp
    except ImportError as exc:
        raise Unavailable(f"jax is not installed ({exc}); pip install jax jaxlib") from None

    weights = [(jnp.asarray(W), jnp.asarray(b)) for W, b in model.weights()]
    x_np, y_np = model.data()
    x, y = jnp.asarray(x_np), jnp.asarray(y_np.astype("int32"))   # JAX runs 32-bit ints by default
    last = len(weights) - 1

    def loss_fn(params, x, y):
        h = x
        for k, (W, b) in enumerate(params):
            h = h @ W + b
            if k < last:
                h = jax.nn.relu(h)
        logp = jax.nn.log_softmax(h, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

    def sgd_step(params, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        return jax.tree.map(lambda p, g: p - LR * g, params, grads), loss

    jitted = jax.jit(sgd_step, donate_argnums=0)
    state = {"params": weights}

    def step():
        state["params"], loss = jitted(state["params"], x, y)
        return loss

    return Runner(step, lambda loss: float(loss.block_until_ready()),
                  note=f"jax {jax.__version__} jit(value_and_grad + update), donate_argnums=0, "
                       f"{jax.default_backend()}")


#: Column order of the table; symgrad-C is compared with the fastest of OTHERS.
SYSTEMS: dict[str, Callable[[Model], Runner]] = {
    "symgrad-c": build_symgrad_c,
    "symgrad-numpy": build_symgrad_numpy,
    "torch-eager": build_torch_eager,
    "torch-compile": build_torch_compile,
    "torch-compile-func": build_torch_compile_func,
    "jax-jit": build_jax_jit,
}
OTHERS = ("torch-eager", "torch-compile", "torch-compile-func", "jax-jit")
