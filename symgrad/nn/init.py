"""`sg.nn.init`: torch.nn.init's functions, setting a parameter's value in place.

Each function takes an `sg.param` (or a module's buffer) and sets its current
value through its cell (symgrad/api/cells.py), the one owner of that value: the
module, every train step, its predict program and every `sg.function` built
from the model see the new value at their next call, whenever they were
built. A NumPy array is filled in place instead (the layers build their
default initial values that way, as torch's `reset_parameters` does). Every
function returns its argument, as torch's do, so `model.apply(fn)` and
`nn.init.normal_(layer.weight, std=0.02)` read as in torch.

Random values come from the NumPy generator `sg.manual_seed` seeds
(sources.host_generator), or from `generator=` (a numpy.random.Generator):
the same seed gives the same values. They are drawn in the target's precision
(float32 draws for float32, bfloat16 and float16, normal ones by Box-Muller as
torch's; float64 for float64), straight into its storage. The numbers are not
torch's (another generator), but the distributions, bounds and fans are
torch's formulas:

    fan_in  = size(1) * prod(size[2:])      fan_out = size(0) * prod(size[2:])
    calculate_gain: linear / conv / sigmoid 1, tanh 5/3, relu sqrt(2),
                    leaky_relu sqrt(2 / (1 + slope**2)), selu 3/4
    xavier:  std = gain * sqrt(2 / (fan_in + fan_out)), uniform bound sqrt(3) * std
    kaiming: std = gain / sqrt(fan),                    uniform bound sqrt(3) * std

so a Linear(in, out) weight [out, in] has fan_in = in, a Conv2d weight
[out, in/groups, kh, kw] fan_in = in/groups * kh * kw.
"""

from __future__ import annotations

import math
import numbers
import statistics
import warnings

import numpy as np

from ..api import sources
from ..api.cells import cell_of
from ..ir import dtypes as D
from ..ir.value import Value

__all__ = ["calculate_gain", "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_",
           "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_"]

_LINEAR_FNS = ("linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
               "conv_transpose3d")


# ---- the target: a parameter (through its cell) or a NumPy array -------------------------

def _shape_and_dtype(tensor, what: str) -> tuple[tuple, np.dtype]:
    """The target's shape and NumPy dtype, refusing anything that cannot be set in place."""
    if isinstance(tensor, Value):
        if cell_of(tensor) is None:
            raise TypeError(f"nn.init.{what}: expected an sg.param or a module's buffer (a value with its own "
                            f"storage), got {tensor!r}")
        return tuple(tensor.shape), np.dtype(D.to_numpy(tensor.dtype))
    if isinstance(tensor, np.ndarray):
        if not tensor.flags.writeable:
            raise ValueError(f"nn.init.{what}: the array is read-only")
        return tensor.shape, tensor.dtype
    raise TypeError(f"nn.init.{what}: expected an sg.param, a module's buffer or a NumPy array, "
                    f"got {type(tensor).__name__}")


def _set(tensor, values):
    """Give `tensor` these values (cast to its dtype); returns `tensor`."""
    if isinstance(tensor, Value):
        shape, dtype = tuple(tensor.shape), D.to_numpy(tensor.dtype)
        # The cell is the one owner: writing it reaches everything built from the parameter.
        cell_of(tensor).write(np.broadcast_to(np.asarray(values), shape).astype(dtype, copy=False))
    else:
        tensor[...] = values
    return tensor


def _random_target(tensor, what: str) -> tuple:
    shape, dtype = _shape_and_dtype(tensor, what)
    if not D.is_float(D.canonical(dtype)):  # np.floating misses ml_dtypes' bfloat16
        raise TypeError(f"nn.init.{what}: random values need a float tensor, got {dtype}")
    return shape, dtype


def _generator(generator) -> np.random.Generator:
    if generator is None:
        return sources.host_generator()  # read afresh: sg.manual_seed replaces it
    if not isinstance(generator, np.random.Generator):
        raise TypeError(f"nn.init: generator must be a numpy.random.Generator or None, "
                        f"got {type(generator).__name__}")
    return generator


def _number(what: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise TypeError(f"nn.init.{what}: {name} must be a real number, got {value!r}")
    return float(value)


# Box-Muller's block: values drawn per pass, few enough that its temporaries stay in L2.
_NORMAL_BLOCK = 1 << 15


def standard_normal_float32(rng: np.random.Generator, out: np.ndarray) -> None:
    """Fill `out` (a float32 array) with N(0, 1) values by Box-Muller over float32 uniforms,
    as torch's CPU normal_ draws them: r = sqrt(-2 log(1 - u1)) and an angle 2 pi u2 give the two
    values r cos and r sin. NumPy's float32 ziggurat took 9 ns a value (0.1 s of a nanoGPT-size
    model's construction); these vectorized float32 functions take 4. The tails end at 5.77,
    where 1 - u1 is a float32 uniform's smallest step, 2**-24."""
    if not out.flags.c_contiguous:  # reshape(-1) would copy it: draw into a copy, then write it
        values = np.empty(out.shape, np.float32)
        standard_normal_float32(rng, values)
        out[...] = values
        return
    flat = out.reshape(-1)
    uniform = np.empty(_NORMAL_BLOCK, np.float32)
    radius = np.empty(_NORMAL_BLOCK // 2, np.float32)
    angle = np.empty(_NORMAL_BLOCK // 2, np.float32)
    for start in range(0, flat.size, _NORMAL_BLOCK):
        count = min(_NORMAL_BLOCK, flat.size - start)
        half = (count + 1) // 2
        u, r, a = uniform[:2 * half], radius[:half], angle[:half]
        rng.random(dtype=np.float32, out=u)
        np.negative(u[:half], out=r)
        np.log1p(r, out=r)
        r *= np.float32(-2.0)
        np.sqrt(r, out=r)
        np.multiply(u[half:], np.float32(2 * math.pi), out=a)
        np.multiply(r, np.cos(a), out=flat[start:start + half])
        np.multiply(r[:count - half], np.sin(a[:count - half]), out=flat[start + half:start + count])


def _drawn(rng: np.random.Generator, kind: str, p: float, q: float, tensor) -> object:
    """`tensor` (as `_set` takes it) given values of U(p, q) (`kind` "uniform") or N(p, q**2)
    ("normal"), drawn straight into its storage where that holds the drawn type (a parameter's cell,
    a C-ordered array): a temporary of a parameter's size costs as much to fault in as to draw.
    A target of at most 4 bytes a value (float32, bfloat16, float16) gets float32 draws, scaled in
    float32: float64 draws cast to float32 cost twice the time (a GPT of 11M parameters took 0.3 s
    to build) for digits the cast drops. A float64 target gets float64 draws."""
    shape, dtype = _random_target(tensor, f"{kind}_")
    drawn = np.float64 if np.dtype(dtype).itemsize > 4 else np.float32

    def fill(out: np.ndarray) -> None:
        if kind == "uniform":
            rng.random(dtype=drawn, out=out)
            out *= drawn(q - p)
        else:
            if drawn is np.float32:
                standard_normal_float32(rng, out)
            else:
                rng.standard_normal(dtype=drawn, out=out)
            out *= drawn(q)
        out += drawn(p)

    cell = cell_of(tensor) if isinstance(tensor, Value) else None
    if cell is not None and cell.array.dtype == drawn:
        cell.fill(fill)
        return tensor
    if isinstance(tensor, np.ndarray) and tensor.dtype == drawn and tensor.flags.c_contiguous:
        fill(tensor)
        return tensor
    values = np.empty(shape, drawn)
    fill(values)
    return _set(tensor, values)


# ---- fans and gains --------------------------------------------------------------------

def _calculate_fan_in_and_fan_out(tensor) -> tuple[int, int]:
    """(fan_in, fan_out) of a weight (a parameter, an array or a shape), as torch's helper of this
    name: size(1) and size(0), each times the receptive field prod(size[2:])."""
    shape = tuple(tensor) if isinstance(tensor, (tuple, list)) else _shape_and_dtype(tensor, "fan")[0]
    if len(shape) < 2:
        raise ValueError("Fan in and fan out can not be computed for tensor with fewer than 2 dimensions "
                         f"(got shape {list(shape)})")
    receptive = math.prod(shape[2:])
    return shape[1] * receptive, shape[0] * receptive


def _calculate_correct_fan(tensor, mode: str) -> int:
    """fan_in or fan_out, by `mode` (torch's helper of this name)."""
    if not isinstance(mode, str) or mode.lower() not in ("fan_in", "fan_out"):
        raise ValueError(f"Mode {mode!r} not supported, please use one of 'fan_in', 'fan_out'")
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    return fan_in if mode.lower() == "fan_in" else fan_out


def calculate_gain(nonlinearity: str, param=None) -> float:
    """The recommended gain of a nonlinearity, as torch.nn.init.calculate_gain: 1 for linear,
    convolutions and sigmoid, 5/3 for tanh, sqrt(2) for relu, sqrt(2 / (1 + slope**2)) for
    leaky_relu (slope `param`, default 0.01), 3/4 for selu."""
    if nonlinearity in _LINEAR_FNS or nonlinearity == "sigmoid":
        return 1.0
    if nonlinearity == "tanh":
        return 5.0 / 3
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        if param is None:
            slope = 0.01
        elif isinstance(param, numbers.Real) and not isinstance(param, bool):
            slope = float(param)
        else:
            raise ValueError(f"negative_slope {param} not a valid number")
        return math.sqrt(2.0 / (1 + slope ** 2))
    if nonlinearity == "selu":
        return 3.0 / 4  # torch's value (self-normalising networks' own init is 1/sqrt(fan_in))
    raise ValueError(f"Unsupported nonlinearity {nonlinearity}")


# ---- the functions -----------------------------------------------------------------------

def uniform_(tensor, a: float = 0.0, b: float = 1.0, generator=None):
    """Values drawn from U(a, b), as torch.nn.init.uniform_."""
    a, b = _number("uniform_", "a", a), _number("uniform_", "b", b)
    if a > b:
        raise ValueError(f"nn.init.uniform_: expects a <= b, got a={a}, b={b}")
    return _drawn(_generator(generator), "uniform", a, b, tensor)


def normal_(tensor, mean: float = 0.0, std: float = 1.0, generator=None):
    """Values drawn from N(mean, std**2), as torch.nn.init.normal_."""
    mean, std = _number("normal_", "mean", mean), _number("normal_", "std", std)
    if std < 0:
        raise ValueError(f"nn.init.normal_: std must be non-negative, got {std}")
    return _drawn(_generator(generator), "normal", mean, std, tensor)


def trunc_normal_(tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0,
                  generator=None):
    """Values drawn from N(mean, std**2) truncated to [a, b] (a and b are values, not numbers of
    standard deviations), as torch.nn.init.trunc_normal_."""
    mean, std = _number("trunc_normal_", "mean", mean), _number("trunc_normal_", "std", std)
    a, b = _number("trunc_normal_", "a", a), _number("trunc_normal_", "b", b)
    if not std > 0 or not a < b:
        raise ValueError(f"nn.init.trunc_normal_: expects std > 0 and a < b, got std={std}, a={a}, b={b}")
    shape, _ = _random_target(tensor, "trunc_normal_")
    if mean < a - 2 * std or mean > b + 2 * std:
        warnings.warn("mean is more than 2 std from [a, b] in nn.init.trunc_normal_. "
                      "The distribution of values may be incorrect.", stacklevel=2)
    rng, n = _generator(generator), math.prod(shape)
    unit = statistics.NormalDist()
    low, high = unit.cdf((a - mean) / std), unit.cdf((b - mean) / std)
    if high - low >= 0.25:
        # Most draws land inside: redraw the rest (exact, and fast in NumPy).
        out = rng.normal(mean, std, size=n)
        outside = (out < a) | (out > b)
        while outside.any():
            out[outside] = rng.normal(mean, std, size=int(outside.sum()))
            outside = (out < a) | (out > b)
    else:
        # A narrow or far interval: torch's method, the inverse CDF of a uniform draw over [cdf(a), cdf(b)].
        inverse = np.frompyfunc(lambda p: unit.inv_cdf(min(max(p, 1e-300), 1 - 2 ** -53)), 1, 1)
        out = mean + std * inverse(rng.uniform(low, high, size=n)).astype(np.float64)
    return _set(tensor, np.clip(out, a, b).reshape(shape))


def constant_(tensor, val: float):
    """Every value `val`, as torch.nn.init.constant_."""
    _shape_and_dtype(tensor, "constant_")
    if not isinstance(val, (numbers.Number, np.generic)):
        raise TypeError(f"nn.init.constant_: val must be a number, got {type(val).__name__}")
    return _set(tensor, val)


def ones_(tensor):
    """Every value 1, as torch.nn.init.ones_."""
    return constant_(tensor, 1)


def zeros_(tensor):
    """Every value 0, as torch.nn.init.zeros_."""
    return constant_(tensor, 0)


def xavier_uniform_(tensor, gain: float = 1.0, generator=None):
    """Glorot's U(-bound, bound), bound = gain * sqrt(6 / (fan_in + fan_out)), as
    torch.nn.init.xavier_uniform_."""
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    std = _number("xavier_uniform_", "gain", gain) * math.sqrt(2.0 / float(fan_in + fan_out))
    bound = math.sqrt(3.0) * std  # the uniform of this bound has standard deviation std
    return uniform_(tensor, -bound, bound, generator)


def xavier_normal_(tensor, gain: float = 1.0, generator=None):
    """Glorot's N(0, std**2), std = gain * sqrt(2 / (fan_in + fan_out)), as torch.nn.init.xavier_normal_."""
    fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
    std = _number("xavier_normal_", "gain", gain) * math.sqrt(2.0 / float(fan_in + fan_out))
    return normal_(tensor, 0.0, std, generator)


def _kaiming_std(tensor, a, mode: str, nonlinearity: str) -> float | None:
    """He's std = gain / sqrt(fan); None for an empty tensor (torch warns and leaves it)."""
    if 0 in _shape_and_dtype(tensor, "kaiming")[0]:
        warnings.warn("Initializing zero-element tensors is a no-op", stacklevel=3)
        return None
    fan = _calculate_correct_fan(tensor, mode)
    return calculate_gain(nonlinearity, a) / math.sqrt(fan)


def kaiming_uniform_(tensor, a: float = 0, mode: str = "fan_in", nonlinearity: str = "leaky_relu",
                     generator=None):
    """He's U(-bound, bound), bound = sqrt(3) * gain / sqrt(fan), as torch.nn.init.kaiming_uniform_
    (`a`: leaky_relu's negative slope; mode "fan_in" keeps the forward's variance, "fan_out" the
    backward's). torch's Linear and Conv default is a=sqrt(5): bound 1 / sqrt(fan_in)."""
    std = _kaiming_std(tensor, a, mode, nonlinearity)
    if std is None:
        return tensor
    bound = math.sqrt(3.0) * std
    return uniform_(tensor, -bound, bound, generator)


def kaiming_normal_(tensor, a: float = 0, mode: str = "fan_in", nonlinearity: str = "leaky_relu",
                    generator=None):
    """He's N(0, std**2), std = gain / sqrt(fan), as torch.nn.init.kaiming_normal_."""
    std = _kaiming_std(tensor, a, mode, nonlinearity)
    if std is None:
        return tensor
    return normal_(tensor, 0.0, std, generator)
