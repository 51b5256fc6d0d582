"""The one table from ATen ops to symgrad ops: one entry per ATen overload, with its argument handling.

Each entry takes the node's arguments as torch.export wrote them (graph values where torch had
tensors, ints or sympy expressions of `Dim`s where it had sizes) and returns what the ATen op
returns (a value, or a tuple of them for ops with several outputs). An entry calls symgrad's own
ops, the ones a symgrad user calls, so the imported graph is the graph that user would have
written and every pass, fusion and kernel applies to it. Nothing is emulated here: an op with no
symgrad counterpart has no entry, and the importer refuses it by name (symgrad/tools/torch_import/).

Keys are the overloads' printed names ("aten.linear.default"), so this table needs no torch.
`KEEP_WHOLE` lists the composite ops symgrad has as one op (linear, attention, cross-entropy,
convolution, ...): the importer takes them out of torch's core-ATen decomposition table, so they
reach this table whole instead of as the mm / softmax / gather pieces torch would split them into.
Most graphs need no decomposition at all: torch.export's own graph is read as it is when every op
has an entry here (in_place.py), so the table also has ops of that graph that core ATen splits
(batch_norm, whose running statistics it writes: HIDDEN_WRITES); an in-place op (aten.relu_) is
its functional twin's entry (`functional`).
"""

from __future__ import annotations

import numpy as np
import sympy

from ...api import convolution, factories, indexing, indices, losses, pointwise, pooling, statistics
from ...api import functional as F
from ...api.integer import div as _div
from ...ir import dtypes as D
from ...ir.value import Value
from ...nn import functional as NF

#: Composite ATen ops kept whole through torch's decomposition: symgrad has each as one op.
KEEP_WHOLE = (
    "aten.linear.default", "aten.conv1d.default", "aten.conv2d.default", "aten.layer_norm.default",
    "aten.scaled_dot_product_attention.default", "aten.cross_entropy_loss.default", "aten.mse_loss.default",
    "aten.gelu.default", "aten.dropout.default", "aten.embedding.default", "aten.adaptive_avg_pool2d.default",
    "aten.max_pool2d.default", "aten.avg_pool2d.default", "aten.softmax.int", "aten.log_softmax.int",
    "aten.matmul.default",
)

#: Ops of torch's training IR that write arguments their schema does not mark as written: op ->
#: (the argument that says whether it writes, the arguments it writes). In training, batch_norm
#: updates the running statistics in place; symgrad's batch_norm returns them as effects.
HIDDEN_WRITES = {"aten.batch_norm.default": ("training", ("running_mean", "running_var"))}

#: torch's loss reduction enum (at::Reduction) to the names symgrad's losses take.
_REDUCTION = {0: "none", 1: "mean", 2: "sum"}

#: ATen's "to the end" slice bound (INT64_MAX), which Python spells as None.
_TO_THE_END = 2 ** 62


def dtype_name(torch_dtype) -> str | None:
    """symgrad's name of a torch dtype (torch.float32 -> "float32"); None stays None."""
    if torch_dtype is None:
        return None
    return D.canonical(str(torch_dtype).replace("torch.", ""))


def functional(name: str) -> str:
    """The functional twin of an in-place overload ("aten.add_.Tensor" -> "aten.add.Tensor"),
    which computes the value the in-place op writes; other names as they are."""
    namespace, op, overload = name.split(".")
    return f"{namespace}.{op[:-1]}.{overload}" if op.endswith("_") and not op.endswith("__") else name


def _float_of(x: Value, dtype) -> Value:
    return x if dtype is None else F.cast(x, dtype_name(dtype))


def _dims(dim, ndim: int) -> list:
    """ATen's dim argument (an int, a list, or [] / None for every axis) as a list of axes."""
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(ndim))
    return [dim] if isinstance(dim, int) else list(dim)


def _reduced(fn):
    def entry(x, dim=None, keepdim=False, *, dtype=None):
        return fn(_float_of(x, dtype), axis=tuple(_dims(dim, x.ndim)), keepdims=keepdim)
    return entry


def _whole(fn):
    def entry(x, *, dtype=None):
        return fn(_float_of(x, dtype))
    return entry


def _scaled(op):
    """add / sub with torch's alpha: a op alpha * b."""
    def entry(a, b, alpha=1):
        return op(a, b if alpha == 1 else b * alpha)
    return entry


def _add(a, b):
    return a + b


def _sub(a, b):
    return a - b


def _divide(a, b, rounding_mode=None):
    return a / b if rounding_mode is None else _div(a, b, rounding_mode=rounding_mode)


def _softmax(fn):
    """_softmax / _log_softmax (x, dim, half_to_float)."""
    def entry(x, dim, half_to_float=False):
        if half_to_float:
            raise ValueError(f"{fn.__name__}: half_to_float=True (a float16 input computed in float32) is not supported")
        return fn(x, axis=dim)
    return entry


def _softmax_int(fn):
    """softmax.int / log_softmax.int (x, dim, dtype=None): kept whole, with torch's dtype argument."""
    def entry(x, dim, dtype=None):
        return fn(_float_of(x, dtype), axis=dim)
    return entry


def _slice(x, dim=0, start=None, end=None, step=1):
    if isinstance(end, int) and end >= _TO_THE_END:
        end = None
    if isinstance(start, int) and start <= -_TO_THE_END:
        start = None
    key = [slice(None)] * x.ndim
    key[dim] = slice(start, end, step)
    return x[tuple(key)]


def _select(x, dim, index):
    key = [slice(None)] * x.ndim
    key[dim] = index
    return x[tuple(key)]


def _wrapped(idx: Value, size) -> Value:
    """Index values with torch's negative indices counted from the end (x[:, [-1]]): folded when
    the indices are a constant, a select otherwise."""
    if idx.op.name == "const" and not isinstance(size, sympy.Basic):
        values = np.asarray(idx.attrs["value"])
        return F.constant(np.where(values < 0, values + size, values), dtype=idx.dtype) if (values < 0).any() else idx
    return F.where(idx < 0, idx + F.constant(size, dtype=idx.dtype), idx)


def _index(x, index_list):
    """x[idx] along the one axis that has an index tensor (ATen's advanced indexing)."""
    given = [(axis, idx) for axis, idx in enumerate(index_list) if idx is not None]
    if len(given) != 1:
        raise ValueError(f"index: indexing {x.type_str} with {len(given)} index tensors; only one is supported")
    axis, idx = given[0]
    return F.take(x, _wrapped(idx, x.shape[axis]), axis=axis)


def _layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    return NF.layer_norm(x, tuple(normalized_shape), weight, bias, eps)


def _native_layer_norm(x, normalized_shape, weight, bias, eps):
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    mean = F.mean(x, axis=axes, keepdims=True)
    rstd = 1.0 / F.sqrt(statistics.var(x, axis=axes, correction=0, keepdims=True) + eps)
    return _layer_norm(x, normalized_shape, weight, bias, eps), mean, rstd


def _batch_norm_training(x, weight, bias, running_mean, running_var, training, momentum, eps):
    """_native_batch_norm_legit_functional: (out, batch mean, batch 1/std, new running mean, new
    running var). symgrad's batch_norm attaches the running-statistics updates to its output; the
    new values are read back from there, so the importer's buffer updates are those same values."""
    y = NF.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)
    news = {id(target): new for target, new in y.effects}
    new_mean = news.get(id(running_mean), running_mean)
    new_var = news.get(id(running_var), running_var)
    return y, None, None, new_mean, new_var


def _batch_norm_no_stats(x, weight, bias, training, momentum, eps):
    """_native_batch_norm_legit.no_stats: BatchNorm with track_running_stats=False (batch statistics)."""
    return NF.batch_norm(x, None, None, weight, bias, True, momentum, eps), None, None


def _batch_norm_eval(x, weight, bias, running_mean, running_var, momentum, eps):
    return NF.batch_norm(x, running_mean, running_var, weight, bias, False, momentum, eps), None, None


def _batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled=True):
    """batch_norm as torch's training IR has it (HIDDEN_WRITES): the output, carrying the running
    statistics' updates in training, which the interpreter reads as the buffers' new values."""
    return NF.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)


def _sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    if enable_gqa:
        raise ValueError("scaled_dot_product_attention: enable_gqa=True is not supported")
    return NF.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale)


def _cross_entropy(x, target, weight=None, reduction=1, ignore_index=-100, label_smoothing=0.0):
    return losses.cross_entropy(x, target, weight, ignore_index, _REDUCTION[reduction], label_smoothing)


def _mse_loss(x, target, reduction=1):
    return losses.mse_loss(x, target, _REDUCTION[reduction])


def _embedding(weight, ids, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    if padding_idx not in (-1, None) or scale_grad_by_freq or sparse:
        raise ValueError(f"embedding: padding_idx={padding_idx}, scale_grad_by_freq={scale_grad_by_freq}, "
                         f"sparse={sparse} are not supported (only torch's defaults)")
    return NF.embedding(ids, weight)


def _conv(fn):
    def entry(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
        if isinstance(padding, str):
            raise ValueError(f"{fn.__name__}: padding={padding!r} is not supported; give the padding as sizes")
        return fn(x, weight, bias, stride, padding, dilation, groups)
    return entry


def _max_pool2d(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return pooling.max_pool2d(x, kernel_size, stride or None, padding, dilation, ceil_mode)


def _avg_pool2d(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
                divisor_override=None):
    if divisor_override is not None:
        raise ValueError(f"avg_pool2d: divisor_override={divisor_override} is not supported")
    return pooling.avg_pool2d(x, kernel_size, stride or None, padding, ceil_mode, count_include_pad)


def _factory(fn):
    """full / zeros / ones and their _like forms: torch's layout/device/pin_memory arguments are
    CPU dense by construction here, and dropped."""
    def entry(*args, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
        return fn(*args, dtype=dtype_name(dtype))
    return entry


def _scalar_tensor(value, *, dtype=None, layout=None, device=None, pin_memory=None):
    return factories.full((), value, dtype=dtype_name(dtype) or D.DEFAULT_FLOAT)


def _arange(*args, dtype=None, layout=None, device=None, pin_memory=None):
    return indices.arange(*args, dtype=dtype_name(dtype))


def _to_copy(x, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
             memory_format=None):
    return x if dtype is None else F.cast(x, dtype_name(dtype))


def _identity(x, *rest, **options):
    return x


def _where(cond, a, b):
    return F.where(cond, a, b)


def _max_dim(x, dim, keepdim=False):
    return F.max(x, dim=dim, keepdim=keepdim)


def _min_dim(x, dim, keepdim=False):
    return F.min(x, dim=dim, keepdim=keepdim)


def _var(x, dim=None, *, correction=None, keepdim=False):
    return statistics.var(x, axis=None if dim is None else tuple(_dims(dim, x.ndim)),
                          correction=1 if correction is None else correction, keepdims=keepdim)


def _addmm(bias, a, b, *, beta=1, alpha=1):
    product = F.matmul(a, b)
    product = product if alpha == 1 else product * alpha
    return product + (bias if beta == 1 else bias * beta)


def _clamp(x, min=None, max=None):
    return pointwise.clip(x, min, max)


def _squeeze(x, dim=None):
    if dim is None:
        return F.squeeze(x)
    dims = [dim] if isinstance(dim, int) else list(dim)
    dims = [d % x.ndim for d in dims if x.shape[d] == 1]  # ATen leaves an axis of size != 1 alone
    return F.squeeze(x, tuple(dims)) if dims else x


def _leaky_relu(x, negative_slope=0.01):
    return F.where(x > 0, x, x * negative_slope)


def _hardtanh(x, min_val=-1.0, max_val=1.0):
    return pointwise.clip(x, min_val, max_val)


def _silu(x):
    return x * F.sigmoid(x)


def _pad(x, pad, value=0.0):
    return convolution.pad(x, tuple(pad), "constant", value)


def _pow(a, b):
    return F.pow(a, b)


def _sym_size(x, dim):
    return x.shape[dim]


def _sym_numel(x):
    out = 1
    for size in x.shape:
        out = out * size
    return out


def _nothing(*args, **kwargs):
    """export's runtime assertions on sizes (_assert_scalar, sym_constrain_range_for_size): the
    shapes symgrad checks at every call stand for them."""
    return None


TABLE = {
    # ---- layers symgrad has as one op (kept whole through the decomposition: KEEP_WHOLE)
    "aten.linear.default": lambda x, w, b=None: NF.linear(x, w, b),
    "aten.conv1d.default": _conv(convolution.conv1d),
    "aten.conv2d.default": _conv(convolution.conv2d),
    "aten.layer_norm.default": _layer_norm,
    "aten.native_layer_norm.default": _native_layer_norm,
    "aten.scaled_dot_product_attention.default": _sdpa,
    "aten.cross_entropy_loss.default": _cross_entropy,
    "aten.mse_loss.default": _mse_loss,
    "aten.gelu.default": lambda x, approximate="none": pointwise.gelu(x, approximate),
    "aten.dropout.default": lambda x, p, train: NF.dropout(x, p, train),
    # (output, mask): the mask is only read by torch's backward, which symgrad derives itself
    "aten.native_dropout.default": lambda x, p, train: (NF.dropout(x, p, bool(train)), None),
    "aten.embedding.default": _embedding,
    "aten.adaptive_avg_pool2d.default": lambda x, output_size: pooling.adaptive_avg_pool2d(x, tuple(output_size)),
    "aten.max_pool2d.default": _max_pool2d,
    "aten.avg_pool2d.default": _avg_pool2d,
    "aten.batch_norm.default": _batch_norm,
    "aten._native_batch_norm_legit_functional.default": _batch_norm_training,
    "aten._native_batch_norm_legit_no_training.default": _batch_norm_eval,
    "aten._native_batch_norm_legit.no_stats": _batch_norm_no_stats,
    # ---- matrix products
    "aten.mm.default": F.matmul,
    "aten.bmm.default": F.matmul,
    "aten.matmul.default": F.matmul,
    "aten.addmm.default": _addmm,
    # ---- elementwise arithmetic (Value operators: torch's broadcasting and type promotion)
    "aten.add.Tensor": _scaled(_add),
    "aten.add.Scalar": _scaled(_add),
    "aten.sub.Tensor": _scaled(_sub),
    "aten.sub.Scalar": _scaled(_sub),
    "aten.rsub.Scalar": lambda a, b, alpha=1: F.sub(b * alpha, a),
    "aten.rsub.Tensor": lambda a, b, alpha=1: F.sub(b * alpha, a),
    "aten.mul.Tensor": lambda a, b: a * b,
    "aten.mul.Scalar": lambda a, b: a * b,
    "aten.div.Tensor": _divide,
    "aten.div.Scalar": _divide,
    "aten.div.Tensor_mode": _divide,
    "aten.pow.Tensor_Scalar": _pow,
    "aten.pow.Tensor_Tensor": _pow,
    "aten.pow.Scalar": _pow,
    "aten.neg.default": lambda x: -x,
    "aten.reciprocal.default": lambda x: 1.0 / x,
    "aten.maximum.default": F.maximum,
    "aten.minimum.default": F.minimum,
    "aten.where.self": _where,
    "aten.clamp.default": _clamp,
    "aten.clamp_min.default": lambda x, lo: pointwise.clip(x, lo, None),
    "aten.clamp_max.default": lambda x, hi: pointwise.clip(x, None, hi),
    "aten.masked_fill.Scalar": pointwise.masked_fill,
    "aten.masked_fill.Tensor": pointwise.masked_fill,
    # ---- elementwise functions
    "aten.relu.default": F.relu,
    "aten.exp.default": F.exp,
    "aten.log.default": F.log,
    "aten.log1p.default": pointwise.log1p,
    "aten.tanh.default": F.tanh,
    "aten.sigmoid.default": F.sigmoid,
    "aten.silu.default": _silu,
    "aten.sqrt.default": F.sqrt,
    "aten.rsqrt.default": lambda x: 1.0 / F.sqrt(x),
    "aten.abs.default": F.abs,
    "aten.sin.default": F.sin,
    "aten.cos.default": F.cos,
    "aten.erf.default": pointwise.erf,
    "aten.sign.default": pointwise.sign,
    "aten.floor.default": pointwise.floor,
    "aten.ceil.default": pointwise.ceil,
    "aten.round.default": pointwise.round,
    "aten.trunc.default": pointwise.trunc,
    "aten.leaky_relu.default": _leaky_relu,
    "aten.hardtanh.default": _hardtanh,
    "aten.softplus.default": lambda x, beta=1.0, threshold=20.0: pointwise.softplus(x, beta, threshold),
    # ---- comparisons and logic
    "aten.eq.Tensor": F.equal, "aten.eq.Scalar": F.equal,
    "aten.ne.Tensor": F.not_equal, "aten.ne.Scalar": F.not_equal,
    "aten.lt.Tensor": F.less, "aten.lt.Scalar": F.less,
    "aten.le.Tensor": F.less_equal, "aten.le.Scalar": F.less_equal,
    "aten.gt.Tensor": F.greater, "aten.gt.Scalar": F.greater,
    "aten.ge.Tensor": F.greater_equal, "aten.ge.Scalar": F.greater_equal,
    "aten.logical_not.default": lambda x: F.equal(F.cast(x, "bool"), False),
    "aten.logical_and.default": lambda a, b: F.cast(a, "bool") & F.cast(b, "bool"),
    "aten.logical_or.default": lambda a, b: F.cast(a, "bool") | F.cast(b, "bool"),
    # ---- reductions and normalisations
    "aten.sum.dim_IntList": _reduced(F.sum),
    "aten.sum.default": _whole(F.sum),
    "aten.mean.dim": _reduced(F.mean),
    "aten.mean.default": _whole(F.mean),
    "aten.amax.default": lambda x, dim=(), keepdim=False: F.amax(x, axis=tuple(_dims(dim, x.ndim)), keepdims=keepdim),
    "aten.amin.default": lambda x, dim=(), keepdim=False: F.amin(x, axis=tuple(_dims(dim, x.ndim)), keepdims=keepdim),
    "aten.max.dim": _max_dim,
    "aten.min.dim": _min_dim,
    "aten.argmax.default": lambda x, dim=None, keepdim=False: F.argmax(x, axis=dim, keepdims=keepdim),
    "aten.argmin.default": lambda x, dim=None, keepdim=False: F.argmin(x, axis=dim, keepdims=keepdim),
    "aten.var.correction": _var,
    "aten.logsumexp.default": lambda x, dim, keepdim=False: statistics.logsumexp(
        x, axis=tuple(_dims(dim, x.ndim)), keepdims=keepdim),
    "aten._softmax.default": _softmax(F.softmax),
    "aten._log_softmax.default": _softmax(F.log_softmax),
    "aten.softmax.int": _softmax_int(F.softmax),
    "aten.log_softmax.int": _softmax_int(F.log_softmax),
    # ---- shapes and movement (no data moves in symgrad's IR until the backend decides)
    "aten.view.default": F.reshape,
    "aten._unsafe_view.default": F.reshape,
    "aten.reshape.default": F.reshape,
    "aten.flatten.using_ints": lambda x, start_dim=0, end_dim=-1: pooling.flatten(x, start_dim, end_dim),
    "aten.permute.default": lambda x, dims: indices.permute(x, tuple(dims)),
    "aten.transpose.int": lambda x, d0, d1: F.transpose(x, d0, d1),
    "aten.t.default": lambda x: F.transpose(x, 0, 1) if x.ndim == 2 else x,
    "aten.expand.default": lambda x, sizes, implicit=False: F.expand(x, tuple(sizes)),
    "aten.unsqueeze.default": F.unsqueeze,
    "aten.squeeze.default": _squeeze,
    "aten.squeeze.dim": _squeeze,
    "aten.squeeze.dims": _squeeze,
    "aten.clone.default": _identity,  # values are immutable: a copy is the value itself
    "aten.alias.default": _identity,
    "aten.lift_fresh_copy.default": _identity,
    "aten.detach.default": F.stop_gradient,
    "aten.slice.Tensor": _slice,
    "aten.select.int": _select,
    "aten.index.Tensor": _index,
    "aten.index_select.default": lambda x, dim, idx: F.take(x, _wrapped(idx, x.shape[dim]), axis=dim),
    "aten.split_with_sizes.default": lambda x, sizes, dim=0: indexing.split(x, list(sizes), dim),
    "aten.split.Tensor": lambda x, size, dim=0: indexing.split(x, size, dim),
    "aten.chunk.default": lambda x, chunks, dim=0: indexing.chunk(x, chunks, dim),
    "aten.cat.default": lambda values, dim=0: indexing.cat(list(values), dim),
    "aten.stack.default": lambda values, dim=0: indexing.stack(list(values), dim),
    "aten.constant_pad_nd.default": _pad,
    "aten.tril.default": indices.tril,
    "aten.triu.default": indices.triu,
    # ---- factories and casts
    "aten.arange.default": _arange,
    "aten.arange.start": _arange,
    "aten.arange.start_step": _arange,
    "aten.full.default": _factory(factories.full),
    "aten.zeros.default": _factory(lambda size, dtype=None: factories.zeros(tuple(size), dtype=dtype)),
    "aten.ones.default": _factory(lambda size, dtype=None: factories.ones(tuple(size), dtype=dtype)),
    "aten.full_like.default": _factory(factories.full_like),
    "aten.zeros_like.default": _factory(factories.zeros_like),
    "aten.ones_like.default": _factory(factories.ones_like),
    "aten.scalar_tensor.default": _scalar_tensor,
    "aten._to_copy.default": _to_copy,
    # ---- sizes (ints, or sympy expressions of Dims) and export's size assertions
    "aten.sym_size.int": _sym_size,
    "aten.sym_numel.default": _sym_numel,
    "aten._assert_scalar.default": _nothing,
    "aten.sym_constrain_range_for_size.default": _nothing,
    "aten._assert_tensor_metadata.default": _nothing,
}
