"""The layers: Linear, activations, Dropout, BatchNorm1d, LayerNorm, Flatten (torch.nn's defaults)."""

from __future__ import annotations

import math
import numpy as np

from ..api import effects
from ..api import functional as F
from ..api import pointwise
from ..ir import shapes as S
from ..ir import dtypes as D
from ..ir.value import Value
from ..api.random import Generator
from ..api.sources import param
from . import functional as NF
from . import init as init_fns
from .module import Module


def _initial(init, shape: tuple, dtype: str, default):
    """A layer parameter's initial value: torch's default, `default(array)` filling a fresh array
    with an sg.nn.init function (as torch's reset_parameters), or the user's `init` (a name
    sg.param knows, or a callable taking the shape)."""
    if init is None:
        value = np.empty(shape, D.to_numpy(dtype))
        default(value)  # draws from the generator sg.manual_seed seeds: reproducible
        return value
    if callable(init):
        value = np.asarray(init(shape))
        if value.shape != shape:
            raise ValueError(f"init returned shape {list(value.shape)}, expected {list(shape)}")
        return value
    return init


def _default_weight_and_bias(weight_shape: tuple):
    """torch's Linear / Conv default: kaiming_uniform_(a=sqrt(5)) for the weight, which is
    U(-1/sqrt(fan_in), 1/sqrt(fan_in)), and U of that bound for the bias."""
    fan_in, _ = init_fns._calculate_fan_in_and_fan_out(weight_shape)
    bound = 1.0 / math.sqrt(fan_in)
    return (lambda w: init_fns.kaiming_uniform_(w, a=math.sqrt(5)),
            lambda b: init_fns.uniform_(b, -bound, bound))


class Linear(Module):
    """y = x @ weight.T + bias, weight [out_features, in_features] as in torch.nn.Linear.

    Default initialisation is torch's: kaiming_uniform(a=sqrt(5)) for the
    weight, which is U(-1/sqrt(in), 1/sqrt(in)), and the same bound for the
    bias. `init=` overrides both: "zeros", "ones", "normal", "uniform" (as
    sg.param), or a callable taking the shape and returning an array.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, init=None,
                 dtype: str = "float32"):
        super().__init__()
        for name, n in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"Linear: {name} must be a positive int, got {n!r}")
        self.in_features, self.out_features = in_features, out_features
        shape = (out_features, in_features)
        weight_init, bias_init = _default_weight_and_bias(shape)
        self.weight = param("weight", shape, init=_initial(init, shape, dtype, weight_init), dtype=dtype)
        if bias:
            self.bias = param("bias", (out_features,), init=_initial(init, (out_features,), dtype, bias_init),
                              dtype=dtype)
        else:
            self.bias = None

    def forward(self, x: Value) -> Value:
        return NF.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class ReLU(Module):
    """max(x, 0)."""

    def forward(self, x: Value) -> Value:
        return F.relu(x)


class Tanh(Module):
    """tanh(x)."""

    def forward(self, x: Value) -> Value:
        return F.tanh(x)


class Sigmoid(Module):
    """1 / (1 + exp(-x))."""

    def forward(self, x: Value) -> Value:
        return F.sigmoid(x)


class Identity(Module):
    """x."""

    def forward(self, x: Value) -> Value:
        return x


class Dropout(Module):
    """Zero each element with probability p in training mode, scale the rest by 1/(1-p); identity in eval.

    Masks come from `generator` (default: sg.random.default_generator(),
    seeded by sg.random.manual_seed), identical on every backend.
    """

    def __init__(self, p: float = 0.5, generator: Generator | None = None):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"Dropout: p must be in [0, 1], got {p}")
        self.p, self.generator = p, generator

    def forward(self, x: Value) -> Value:
        return NF.dropout(x, self.p, self.training, self.generator)

    def extra_repr(self) -> str:
        return f"p={self.p}"


class BatchNorm1d(Module):
    """torch.nn.BatchNorm1d: batch statistics and running-statistics updates in training, running ones in eval.

    Buffers `running_mean` (zeros), `running_var` (ones) and
    `num_batches_tracked` are state variables, updated by the training step
    with momentum 0.1 and the unbiased batch variance, as torch does.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1, affine: bool = True,
                 track_running_stats: bool = True, dtype: str = "float32"):
        super().__init__()
        if not isinstance(num_features, int) or num_features < 1:
            raise ValueError(f"BatchNorm1d: num_features must be a positive int, got {num_features!r}")
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.affine, self.track_running_stats = affine, track_running_stats
        np_dtype = D.to_numpy(dtype)
        self.weight = param("weight", (num_features,), init=np.ones(num_features, np_dtype), dtype=dtype) if affine else None
        self.bias = param("bias", (num_features,), init=np.zeros(num_features, np_dtype), dtype=dtype) if affine else None
        if track_running_stats:
            self.register_buffer("running_mean", np.zeros(num_features, np_dtype))
            self.register_buffer("running_var", np.ones(num_features, np_dtype))
            self.register_buffer("num_batches_tracked", np.array(0, np.int64))

    def forward(self, x: Value) -> Value:
        if x.ndim not in (2, 3) or x.shape[1] != self.num_features:
            raise ValueError(f"BatchNorm1d({self.num_features}): expected input [N, {self.num_features}] or "
                             f"[N, {self.num_features}, L], got {x.type_str}")
        return self._normalize(x)

    def _normalize(self, x: Value, sync: bool = False) -> Value:
        stats = self.track_running_stats
        training = self.training or not stats
        y = NF.batch_norm(x, self.running_mean if stats else None, self.running_var if stats else None,
                          self.weight, self.bias, training, self.momentum, self.eps, sync=sync)
        if training and stats:
            y = effects.attach(y, [(self.num_batches_tracked, self.num_batches_tracked + 1)])
        return y

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}"


class GELU(Module):
    """x * Phi(x) (approximate="none") or its tanh approximation (approximate="tanh"), as torch.nn.GELU."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU: approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: Value) -> Value:
        return pointwise.gelu(x, self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class LayerNorm(Module):
    """torch.nn.LayerNorm: normalise over the last len(normalized_shape) axes with the biased
    variance, then scale by `weight` (ones) and shift by `bias` (zeros)."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 dtype: str = "float32"):
        super().__init__()
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        if not shape or any(not isinstance(n, int) or n < 1 for n in shape):
            raise ValueError(f"LayerNorm: normalized_shape must be positive ints, got {normalized_shape!r}")
        self.normalized_shape, self.eps, self.elementwise_affine = shape, eps, elementwise_affine
        np_dtype = D.to_numpy(dtype)
        self.weight = param("weight", shape, init=np.ones(shape, np_dtype), dtype=dtype) if elementwise_affine else None
        self.bias = param("bias", shape, init=np.zeros(shape, np_dtype), dtype=dtype) \
            if elementwise_affine and bias else None

    def forward(self, x: Value) -> Value:
        return NF.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class Flatten(Module):
    """Axes start_dim..end_dim merged into one (torch.nn.Flatten: from axis 1 by default)."""

    def __init__(self, start_dim: int = 1, end_dim: int = -1):
        super().__init__()
        self.start_dim, self.end_dim = start_dim, end_dim

    def forward(self, x: Value) -> Value:
        start, end = (S.normalize_axes(d, x.ndim, "Flatten")[0] for d in (self.start_dim, self.end_dim))
        if start > end:
            raise ValueError(f"Flatten: start_dim {self.start_dim} comes after end_dim {self.end_dim} "
                             f"for an input {x.type_str}")
        merged = S.numel(x.shape[start:end + 1])
        return F.reshape(x, (*x.shape[:start], merged, *x.shape[end + 1:]))

    def extra_repr(self) -> str:
        return f"start_dim={self.start_dim}, end_dim={self.end_dim}"


class Embedding(Module):
    """A table of `num_embeddings` vectors of `embedding_dim`, looked up by integer index, as
    torch.nn.Embedding (initialised N(0, 1), as torch's)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, init=None, dtype: str = "float32"):
        super().__init__()
        for name, n in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"Embedding: {name} must be a positive int, got {n!r}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        shape = (num_embeddings, embedding_dim)
        self.weight = param("weight", shape, init=_initial(init, shape, dtype, init_fns.normal_), dtype=dtype)

    def forward(self, indices) -> Value:
        return NF.embedding(indices, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class BatchNorm2d(BatchNorm1d):
    """torch.nn.BatchNorm2d: BatchNorm1d's statistics per channel of an (N, C, H, W) input."""

    def forward(self, x: Value) -> Value:
        if x.ndim != 4 or x.shape[1] != self.num_features:
            raise ValueError(f"BatchNorm2d({self.num_features}): expected input [N, {self.num_features}, H, W], "
                             f"got {x.type_str}")
        return self._normalize(x)



class SyncBatchNorm(BatchNorm1d):
    """torch.nn.SyncBatchNorm: BatchNorm over the rows of every process of a data-parallel step.

    In training the per-channel sums and the row count are summed over the processes
    (all_reduce in the graph, symgrad.ir.ops_collective), so every rank normalises with the
    statistics of the whole global batch and keeps the same running statistics; the backward
    sums the statistics' gradients over the processes the same way. Under sg.distributed the
    step's hook does the summing; run alone (sg.train_step, one process) it is BatchNorm of the
    process's own rows. Input [N, C, ...] with any number of trailing axes. `process_group`:
    torch's argument, accepted only as None (the step's whole communicator)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group=None, dtype: str = "float32"):
        if process_group is not None:
            raise ValueError("SyncBatchNorm: process_group must be None (the data-parallel step's communicator)")
        super().__init__(num_features, eps, momentum, affine, track_running_stats, dtype)

    def forward(self, x: Value) -> Value:
        if x.ndim < 2 or x.shape[1] != self.num_features:
            raise ValueError(f"SyncBatchNorm({self.num_features}): expected input [N, {self.num_features}, ...], "
                             f"got {x.type_str}")
        return self._normalize(x, sync=True)

    @classmethod
    def convert_sync_batchnorm(cls, module: Module, process_group=None) -> Module:
        """`module` with every BatchNorm1d/2d replaced by a SyncBatchNorm holding its parameters and
        buffers (the same variables), as torch's classmethod of that name."""
        if isinstance(module, BatchNorm1d) and not isinstance(module, cls):
            sync = cls.__new__(cls)
            sync.__dict__.update(module.__dict__)
            return sync
        for name, child in list(module._modules.items()):
            module._modules[name] = cls.convert_sync_batchnorm(child, process_group)
        return module