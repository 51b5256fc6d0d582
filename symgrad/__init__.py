"""symgrad: a static-graph symbolic compiler for neural-network training.

Define a model once into an IR, derive its backward graph symbolically,
compile forward, backward and update into one native call.
"""

import sys

from . import ir  # noqa: F401  (registers the ops before anything builds nodes)
from .api import operators  # noqa: F401  (the functions Value's operators and the VJP rules build with)
from . import nn, optim
from .api import random  # noqa: F401  (sg.random: the counter-based generator)
from .tools import distributed
from .autodiff import grad
from .step.compiled import function
from .step.training import train_step
from .backends.cuda import cuda_source  # the .cu text of a graph; needs no GPU
from .tools.gradcheck import GradcheckError, gradcheck
from .api.custom import Context, Function
from .api.functional import (abs, argmax, broadcast_to, cast, constant, cos, elementwise, equal, exp, expand_dims,
                             greater, greater_equal, less, less_equal, log, log_softmax, matmul, max, maximum, mean,
                             minimum, not_equal, one_hot, relu, reshape, sigmoid, sin, softmax, sqrt, squeeze,
                             stop_gradient, sum, tanh, transpose, where)
from .api.losses import cross_entropy, mse_loss, nll_loss
from .api.pointwise import ceil, clip, erf, floor, gelu, log1p, masked_fill, round, sign, softplus, trunc
from .api.functional import acos, arccos, arcsin, arctan, arctan2, asin, atan, atan2
from .api.integer import (bitwise_and, bitwise_left_shift, bitwise_not, bitwise_or, bitwise_right_shift, bitwise_xor,
                          div, floor_divide, fmod, remainder)
from .api.integer import div as divide
from .nn.functional import layer_norm
from .api.statistics import logsumexp, prod, std, var
from .api.functional import amax, amin, argmin, min, unsqueeze
from .api.factories import eye, full, full_like, ones, ones_like, zeros, zeros_like
from .api.pointwise import clip as clamp  # torch.clamp
from .api.indices import arange, permute, swapaxes, tril, triu
from .api.indexing import cat, chunk, concat, concatenate, embedding, narrow, split, stack, take
from .nn.functional import scaled_dot_product_attention
from .api.convolution import conv1d, conv2d, pad
from .api.pooling import adaptive_avg_pool2d, avg_pool2d, flatten, interpolate, max_pool2d
from .nn.functional import batch_norm
from .ir.autocast import autocast
from .ir.graph import Graph
from .ir.printing import backward_chain, print_graph
from .ir.shapes import Dim
from .ir.value import Value
from .api.seeding import manual_seed
from .api.sources import input, param
from .tools.torch_import import from_torch  # torch itself is imported only when a model is

# sg.distributed is a public module (docs/api.md): `import symgrad.distributed` gives the tool's
sys.modules[__name__ + ".distributed"] = distributed
from .version import __version__  # a leaf module: the stages read it there, not from this API
from .ir.registry import seal_builtins as _seal_builtins

_seal_builtins()  # every op registered by now is symgrad's own; sg.elementwise's come later

# The 16-bit float dtypes by torch's names (a dtype is its name in symgrad: sg.bfloat16 == "bfloat16").
bfloat16 = "bfloat16"
float16 = "float16"

__all__ = [
    "Dim", "Graph", "Value", "Function", "Context", "input", "param", "manual_seed", "grad",
    "function", "train_step", "cuda_source", "optim", "print_graph", "backward_chain", "constant", "abs", "argmax",
    "broadcast_to", "cast", "cos", "cross_entropy", "elementwise", "equal", "exp", "expand_dims",
    "greater", "greater_equal", "less", "less_equal", "log", "log_softmax", "matmul", "max",
    "maximum", "mean", "minimum", "mse_loss", "nll_loss", "not_equal", "one_hot", "relu",
    "reshape", "sigmoid", "sin", "softmax", "sqrt", "squeeze", "stop_gradient", "sum", "tanh",
    "transpose", "where", "cat", "chunk", "concat", "concatenate", "embedding", "scaled_dot_product_attention", "conv1d", "conv2d", "pad",
    "adaptive_avg_pool2d", "avg_pool2d", "flatten", "interpolate", "max_pool2d", "batch_norm", "narrow", "split", "stack", "take", "erf", "log1p", "softplus", "gelu", "sign", "floor", "ceil", "round",
    "trunc", "clip", "masked_fill", "layer_norm", "var", "std", "logsumexp", "prod", "arange", "tril", "triu", "permute",
    "swapaxes", "asin", "acos", "atan", "atan2", "arcsin", "arccos", "arctan", "arctan2", "div", "divide",
    "floor_divide", "remainder", "fmod", "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not",
    "bitwise_left_shift", "bitwise_right_shift", "__version__",
    "nn", "random", "distributed", "gradcheck", "GradcheckError",
    "min", "amax", "amin", "argmin", "unsqueeze", "clamp",
    "zeros", "ones", "full", "zeros_like", "ones_like", "full_like", "eye", "from_torch",
    "autocast", "bfloat16", "float16",
]
