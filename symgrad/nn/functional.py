"""`sg.nn.functional`: the layer functions and losses, as torch.nn.functional names them.

Losses and activations are the core functions re-exported; `linear`,
`dropout` and `batch_norm` are written here as graph code. `batch_norm` in
training mode attaches its running-statistics updates to its output, and
`dropout` its random-stream advance (symgrad.api.effects), so a training step
that computes them performs them.
"""

from __future__ import annotations

import sympy

from ..api import effects
from ..api import functional as F
from ..api.functional import log_softmax, relu, sigmoid, softmax, tanh  # noqa: F401
from ..api.losses import cross_entropy, mse_loss, nll_loss  # noqa: F401
from ..ir import dtypes as D
from ..ir import shapes as S
from ..ir.ops_attention import attention, refusal
from ..ir.ops_collective import all_reduce
from ..ir.value import Value, make
from ..api.convolution import conv1d, conv2d, pad  # noqa: F401  (torch.nn.functional's names)
from ..api.pointwise import gelu  # noqa: F401  (torch.nn.functional.gelu)
from ..api.pooling import adaptive_avg_pool2d, avg_pool2d, interpolate, max_pool2d  # noqa: F401
from ..api.random import Generator, default_generator

__all__ = ["conv1d", "conv2d", "pad", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "interpolate", "linear", "dropout", "batch_norm", "layer_norm", "embedding", "scaled_dot_product_attention", "gelu", "cross_entropy", "nll_loss", "mse_loss", "relu", "tanh",
           "sigmoid", "softmax", "log_softmax"]


def linear(x: Value, weight: Value, bias: Value | None = None) -> Value:
    """x @ weight.T + bias, with torch's (out_features, in_features) weight layout.

    x may have any number of leading axes; they are flattened around the
    2-D matrix product and restored.
    """
    if not isinstance(x, Value):
        raise TypeError(f"linear: x must be a graph value, got {type(x).__name__}")
    if weight.ndim != 2:
        raise ValueError(f"linear: weight must be [out, in], got {S.format_shape(weight.shape)}")
    if x.ndim == 0 or not S.same_size(x.shape[-1], weight.shape[1]):
        raise ValueError(f"linear: input {S.format_shape(x.shape)} does not end in in_features = "
                         f"{weight.shape[1]} (weight {S.format_shape(weight.shape)})")
    lead = x.shape[:-1]
    flat = x if x.ndim == 2 else F.reshape(x, (S.numel(lead) if lead else 1, x.shape[-1]))
    y = F.matmul(flat, F.transpose(weight))
    if bias is not None:
        y = y + bias
    return y if x.ndim == 2 else F.reshape(y, (*lead, weight.shape[0]))


def dropout(x: Value, p: float = 0.5, training: bool = True, generator: Generator | None = None) -> Value:
    """Zero each element with probability p and scale the rest by 1/(1-p) (F.dropout).

    The mask comes from a counter-based generator (symgrad.api.random): the same
    on every backend for one seed, fresh at every step. Identity when not
    training.
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout: p must be in [0, 1], got {p}")
    if not isinstance(x, Value):
        raise TypeError(f"dropout: x must be a graph value, got {type(x).__name__}")
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return x * 0.0
    keep = (generator or default_generator()).bernoulli(x.shape, 1.0 - p)
    return x * F.cast(keep, x.dtype) * (1.0 / (1.0 - p))


def batch_norm(x: Value, running_mean: Value | None, running_var: Value | None, weight: Value | None = None,
               bias: Value | None = None, training: bool = False, momentum: float = 0.1,
               eps: float = 1e-5, sync: bool = False) -> Value:
    """Batch normalisation over axis 1 of [N, C], [N, C, L] or [N, C, H, W] (F.batch_norm).

    Training: normalise with the batch's mean and biased variance, and (when
    running statistics are given) update them with `momentum` and the
    unbiased variance, as torch does. Otherwise: normalise with the running
    statistics. sync: the batch is every process's rows together (SyncBatchNorm):
    the sums and the count go through all_reduce, whose VJP sums the gradients too.
    """
    if not isinstance(x, Value) or x.ndim < 2 or not D.is_float(x.dtype):
        raise ValueError(f"batch_norm: expects a float [N, C, ...] input, got {x!r}")
    channels = x.shape[1]
    axes = (0, *range(2, x.ndim))                   # every axis but the channels'
    stat_shape = (channels,) + (1,) * (x.ndim - 2)

    def along_channels(v: Value) -> Value:
        if v.shape != (channels,):
            raise ValueError(f"batch_norm: per-channel values must be [{channels}], got {S.format_shape(v.shape)}")
        return F.reshape(F.cast(v, x.dtype), stat_shape)

    if training:
        count = S.numel([x.shape[a] for a in axes])
        if isinstance(count, int) and count < 2 and not sync:  # synced: one row per process may do
            raise ValueError(f"batch_norm: training needs more than one value per channel, got input "
                             f"{S.format_shape(x.shape)}")
        if sync:  # sums over every process's rows: counts may differ between processes
            total = all_reduce(F.constant(sympy.sympify(count), x.dtype))
            mean = all_reduce(F.sum(x, axis=axes)) / total
            centred = x - F.reshape(mean, stat_shape)
            var = all_reduce(F.sum(centred * centred, axis=axes)) / total
        else:
            mean = F.mean(x, axis=axes)
            centred = x - F.reshape(mean, stat_shape)
            var = F.mean(centred * centred, axis=axes)
        y = centred / F.sqrt(F.reshape(var, stat_shape) + eps)
    else:
        if running_mean is None or running_var is None:
            raise ValueError("batch_norm: evaluation mode needs running_mean and running_var")
        y = (x - along_channels(running_mean)) / F.sqrt(along_channels(running_var) + eps)
    if weight is not None:
        y = y * along_channels(weight)
    if bias is not None:
        y = y + along_channels(bias)
    if training and running_mean is not None and running_var is not None:
        # torch updates with the unbiased variance: var * n / (n - 1), n symbolic when the batch is.
        n = sympy.sympify(count)
        unbiased = var * total / (total - 1) if sync else var * F.constant(F.ieee_ratio(n, n - 1), x.dtype)
        new_mean = (1 - momentum) * running_mean + momentum * F.cast(F.stop_gradient(mean), running_mean.dtype)
        new_var = (1 - momentum) * running_var + momentum * F.cast(F.stop_gradient(unbiased), running_var.dtype)
        y = effects.attach(y, [(running_mean, new_mean), (running_var, new_var)])
    return y


def layer_norm(x: Value, normalized_shape, weight: Value | None = None, bias: Value | None = None,
               eps: float = 1e-5) -> Value:
    """(x - mean) / sqrt(var + eps) * weight + bias over the last len(normalized_shape) axes, the
    variance biased, as torch.nn.functional.layer_norm."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if tuple(x.shape[x.ndim - len(shape):]) != shape or len(shape) > x.ndim:
        raise ValueError(f"layer_norm: normalized_shape {list(shape)} is not the trailing shape of the input "
                         f"{x.type_str}")
    axes = tuple(range(x.ndim - len(shape), x.ndim))
    centred = x - F.mean(x, axis=axes, keepdims=True)
    var = F.mean(centred * centred, axis=axes, keepdims=True)
    y = centred / F.sqrt(var + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def embedding(input: Value, weight: Value) -> Value:
    """weight's rows at the integer `input` (torch.nn.functional.embedding): shape input.shape +
    (embedding_dim,). Indices are checked against the table's rows on every call; the weight's
    gradient adds each row's cotangents (repeated indices sum)."""
    if not isinstance(weight, Value) or weight.ndim != 2:
        raise ValueError(f"embedding: weight must be a [num_embeddings, embedding_dim] value, got "
                         f"{getattr(weight, 'type_str', type(weight).__name__)}")
    # The indices' check names the table: an error says whose rows ran out (a context longer than
    # a position embedding's table), not "classes".
    checked = F.class_labels(input, weight.shape[0], op="embedding", arg="input")
    checked = make(checked.op, checked.inputs, **{**checked.attrs, "table": weight.name})
    return F.take(weight, checked, axis=0, checked=True)


def scaled_dot_product_attention(query: Value, key: Value, value: Value, attn_mask: Value | None = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                                 generator: Generator | None = None) -> Value:
    """softmax(query @ key^T * scale + mask) @ value over the last two axes, as torch's: `scale`
    defaults to 1/sqrt(head dim); `is_causal` lets position i see positions <= i only; a boolean
    `attn_mask` marks the positions that may be attended (True: keep), a float one is added;
    `dropout_p` drops attention weights (symgrad's generator: the masks are not torch's).

    Self-attention (query, key and value of one shape and float dtype, no attn_mask, no dropout)
    is one fused op (symgrad.ir.ops_attention) that never stores the T x T weights; anything else
    is written here as graph code."""
    from ..api.indices import arange
    named = [("query", query), ("key", key), ("value", value)]
    for name, v in named:
        if not isinstance(v, Value) or v.ndim < 2:
            raise ValueError(f"scaled_dot_product_attention: {name} must be a value of >= 2 axes, "
                             f"got {getattr(v, 'type_str', type(v).__name__)}")
    if not S.same_size(query.shape[-1], key.shape[-1]) or not S.same_size(key.shape[-2], value.shape[-2]):
        raise ValueError(f"scaled_dot_product_attention: query {query.type_str}, key {key.type_str} and "
                         f"value {value.type_str} do not align (query and key share the last axis, "
                         f"key and value the second last)")
    if is_causal and attn_mask is not None:
        raise ValueError("scaled_dot_product_attention: give attn_mask or is_causal, not both (as torch)")
    head = query.shape[-1]
    factor = scale if scale is not None else 1.0 / sympy.sqrt(head)
    if attn_mask is None and not dropout_p and refusal("attention", named) is None:
        return attention(query, key, value, is_causal, float(factor))
    keys_t = F.transpose(key, tuple(range(key.ndim - 2)) + (key.ndim - 1, key.ndim - 2))
    scores = F.matmul(query, keys_t) * F.constant(float(factor), query.dtype)
    if is_causal:
        rows, cols = scores.shape[-2:]  # torch's: tril(ones(L, S)), key j visible from query i when j <= i
        visible = F.less_equal(F.expand_dims(arange(cols), 0), F.expand_dims(arange(rows), 1))
        scores = F.where(visible, scores, float("-inf"))
    elif attn_mask is not None:
        scores = F.where(attn_mask, scores, float("-inf")) if attn_mask.dtype == "bool" else scores + attn_mask
    # torch's safe softmax: a row whose scores are all -inf (every key masked) gets weights 0, not
    # 0/0; its softmax is taken of zeros instead, so that no NaN reaches the gradient either.
    hidden = F.equal(F.max(scores, axis=-1, keepdims=True), F.constant(float("-inf"), scores.dtype))
    weights = F.where(hidden, 0.0, F.softmax(F.where(hidden, 0.0, scores), axis=-1))
    if dropout_p:
        weights = dropout(weights, dropout_p, True, generator)
    return F.matmul(weights, value)
